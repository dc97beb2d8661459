import json
import math
from pathlib import Path

import msgspec
import pytest
from conftest import assert_user_error

from harness import runner
from harness.core.errors import HarnessError
from harness.core.records import Grouping
from harness.engine.measure import Cell
from harness.engine.results import SCHEMA_VERSION, RunWriter, read_records
from harness.engine.scenario import load_scenario
from harness.runner import Console, run_scenario
from harness.study.analyze import analyze_records

SCENARIO = Path(__file__).resolve().parent / "scenarios" / "tiny.yaml"
QUIET = Console(warn=lambda msg: None, info=lambda msg: None)


def fast_noise(monkeypatch):
    """The idle noise probe sleeps 0.3 s; tests only need its structure."""
    monkeypatch.setattr(runner.noise, "idle_reading", lambda seconds=0.3: 0.0)


def run(tmp_path, scenario=SCENARIO, console=QUIET, resume=False):
    plan = load_scenario(scenario, physical_cores=1)
    with RunWriter(tmp_path / "run", resume=resume) as writer:
        run_scenario(plan, writer, {"test": True}, console=console)
    return plan, read_records(tmp_path / "run" / "results.jsonl")


def test_end_to_end_records_are_complete_and_consistent(tmp_path, monkeypatch):
    fast_noise(monkeypatch)
    plan, records = run(tmp_path)
    assert records.header.schema_version == SCHEMA_VERSION
    assert records.header.kind == "measurement"
    assert records.header.scenario["text"] == SCENARIO.read_text()
    assert records.header.plan == [m.id for m in plan.measurements]
    assert set(records.models) == {"tiny-qwen2|f32", "tiny-qwen2|q8_0", "tiny-llama|f32",
                                   "tiny-llama|q8_0"}
    for model in records.models.values():
        assert model.n_params > 0 and len(model.sha256) == 64
        assert model.file_n_bytes > model.model_n_bytes > 0
    assert sorted(m.id for m in records.measurements) == sorted(m.id for m in plan.measurements)
    for m in records.measurements:
        assert m.n_params > 0 and m.model_bytes > 0 and m.samples and m.noise and m.ttft_s
        reps = m.repetitions
        prefill = m.samples["prefill_s"]
        assert len(prefill) == reps and all(s > 0 for s in prefill)
        assert m.prefill_tok_s["median"] > 0
        # tokens / seconds, sample by sample
        assert m.prefill_tok_s["max"] == pytest.approx(m.n_prompt / min(prefill))
        assert m.ttft_s["min"] == pytest.approx(min(prefill))
        assert len(m.warmup_samples["prefill_s"]) == m.warmup == 1
        if m.n_gen:
            decode = m.samples["decode_s"]
            assert [len(d) for d in decode] == [m.n_gen] * reps
            rates = sorted(m.n_gen / sum(d) for d in decode)
            assert m.decode_tok_s["min"] == pytest.approx(rates[0])
            # ms per token: the exact inverse of the rate, interval included
            ms, tok = m.decode_ms_per_token, m.decode_tok_s
            assert ms["median"] == pytest.approx(1000 / tok["median"])
            assert ms["median_ci95"] == pytest.approx([1000 / x for x in
                                                       reversed(tok["median_ci95"])])
            perf = m.samples["perf"][0]
            assert perf["n_eval"] == m.n_gen and perf["n_p_eval"] == m.n_prompt
        else:
            assert m.decode_tok_s is None
        lo, hi = m.prefill_tok_s["median_ci95"]
        assert lo <= m.prefill_tok_s["median"] <= hi
        assert math.isfinite(m.noise["idle_other_cores"])
    # the full set at both ends, and before every round the figures its cells need
    whens = [p.when for p in records.probes]
    assert whens[0] == "before" and whens[-1] == "after"
    assert set(whens[1:-1]) == {"beside", "rotation"}
    # a rotation probe per round: one streaming pass per type after each of the 16 ticks
    rotation = [p for p in records.probes if p.when == "rotation"]
    assert len(rotation) == 3
    for p in rotation:
        ggml = p.result["threads"]["1"]["ggml"]
        assert {len(e["stream_samples_gb_s"]) for e in ggml.values()} == {16}
    n_rounds = 3  # tiny.yaml: repetitions: 3
    assert [r.round for r in records.rounds] == list(range(n_rounds))
    assert [p.round for p in records.probes[1:-1]] == [r for r in range(n_rounds) for _ in "ab"]
    for probe in records.probes[1:-1]:
        ggml = probe.result["threads"]["1"]["ggml"]
        assert set(ggml) == {"f32", "q8_0"}  # the types of the models in the run
        assert all("stream_gb_s" in e for e in ggml.values())
        assert all("compute_gflop_s" in e for e in ggml.values()) == (probe.when == "beside")
    # every round: each cell once, in the round record's shuffled order
    for rnd in records.rounds:
        reps = [r for r in records.repetitions if r.round == rnd.round]
        assert [r.id for r in sorted(reps, key=lambda r: r.position)] == rnd.order
        assert sorted(rnd.order) == sorted(m.id for m in plan.measurements)
    assert len({tuple(r.order) for r in records.rounds}) > 1
    for m in records.measurements:
        assert m.samples["rounds"] == list(range(n_rounds)) and m.stopped_by == "fixed"
        reads = m.samples["read_gb_s"]
        assert all((r is not None and len(r) == 2) == bool(m.n_gen) for r in reads)
    analysis = analyze_records(records)  # never stored: computed from the records
    assert len(analysis["decode"]) == 4 and len(analysis["prefill"]) == 12
    for row in analysis["decode"]:
        assert row["read_ceiling"]["value"] > 0 and row["share_of_read"] > 0
        assert row["stream_ceiling"]["value"] > 0 and row["share_of_stream"] > 0
        assert row["effective_gb_s"] == pytest.approx(row["tok_s"]["median"]
                                                      * row["bytes_per_token"] / 1e9)
    for row in analysis["prefill"]:
        assert row["compute_peak"]["value"] > 0 and row["share_of_peak"] > 0
    for m in records.measurements:
        assert m.flash_attn_used in (True, False)
        assert m.samples["n_cached"] == [m.n_prompt + m.n_gen] * m.repetitions
    assert {f["threads"] for f in analysis["fits"]} == {1}
    assert analysis["predictions"]["estimate"] is True


def test_a_failed_probe_is_recorded_as_missing(tmp_path, monkeypatch):
    fast_noise(monkeypatch)

    class Broken:
        def __init__(self, dtypes, extras=None):
            pass

        def full(self, threads):
            raise MemoryError("no room")

        def beside(self, threads, dtypes, phases):
            raise MemoryError("no room")

        def tick(self, threads, dtypes):
            raise MemoryError("no room")

        def layout(self, dtype):
            return None

        def close(self):
            pass

    plan = load_scenario(SCENARIO, 1)
    with RunWriter(tmp_path / "run", resume=False) as writer:
        analysis = run_scenario(plan, writer, {}, console=QUIET, prober_factory=Broken)
    assert len(writer.records.measurements) == len(plan.measurements)
    errors = [p.error for p in writer.records.probes]
    # both ends, and before and inside each of 3 rounds (once each, not once per step)
    assert errors == ["MemoryError: no room"] * (2 + 3 + 3)
    assert all(r["read_ceiling"]["value"] is None for r in analysis["decode"])
    assert all(r["stream_ceiling"]["value"] is None and r["share_of_stream"] is None
               for r in analysis["decode"])
    assert analysis["probe_errors"] == ["MemoryError: no room"]


def test_kv_cache_is_cleared_between_repetitions(tmp_path, monkeypatch):
    """Every repetition starts from an empty cache: after each, it holds exactly the prompt
    and the generated tokens."""
    from harness.core.dtypes import DTYPES
    from harness.core.specs import resolve_spec
    from harness.engine.build import build
    from harness.engine.llama import Model

    fast_noise(monkeypatch)
    plan = load_scenario(SCENARIO, 1)
    m = next(x for x in plan.measurements if x.n_gen and x.model.dtype == "f32")
    built = build(resolve_spec(m.model.spec_name), DTYPES["f32"])
    with Model(built.path) as model:
        cell = Cell(model, m, 0)
        try:
            reps = [cell.run(r, 0) for r in range(3)]
        finally:
            cell.close()
    prefill = [r["prefill_s"] for r in reps]
    # no reuse: later repetitions do the full prefill, not ~0
    assert min(prefill[1:]) > 0.2 * prefill[0]
    for rep in reps:
        assert rep["perf"]["n_p_eval"] == m.n_prompt  # counters reset, the prompt each time
        assert rep["n_cached"] == m.n_prompt + m.n_gen
    assert [r["round"] for r in reps] == [0, 1, 2]


def test_resume_completes_an_interrupted_run(tmp_path, monkeypatch):
    fast_noise(monkeypatch)
    count = {"n": 0}

    def stop_after_three(record):
        count["n"] += 1
        if count["n"] == 3:
            raise KeyboardInterrupt

    plan = load_scenario(SCENARIO, 1)
    with pytest.raises(KeyboardInterrupt), RunWriter(tmp_path / "run", resume=False) as w:
        run_scenario(plan, w, {}, console=Console(lambda m: None, lambda m: None,
                                                  stop_after_three))
    partial = read_records(tmp_path / "run" / "results.jsonl")
    assert len(partial.measurements) == 3
    _, records = run(tmp_path, resume=True)
    ids = [m.id for m in records.measurements]
    assert sorted(ids) == sorted(m.id for m in plan.measurements)
    assert len(ids) == len(set(ids))
    assert [type(r).__name__ for r in records.other] == ["Resume"]
    whens = [p.when for p in records.probes if p.when in ("before", "after")]
    assert whens == ["before", "before", "after"]
    # the interrupted cells kept their three repetitions: none ran a fourth; those written on
    # resume state the setup their context was made with, as the others do
    assert all(m.repetitions == 3 for m in records.measurements)
    assert all("flash_attn_used" in m.setup for m in records.measurements)
    assert len(records.repetitions) == 3 * len(plan.measurements)


@pytest.mark.parametrize("interleave", ["step", "round"])
def test_resume_mid_round_keeps_the_shuffle_and_the_repetitions(tmp_path, monkeypatch,
                                                                interleave):
    fast_noise(monkeypatch)
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(SCENARIO.read_text() + f"interleave: {interleave}\n")
    plan = load_scenario(scenario, 1)
    real = runner._Rounds._start

    def stop_in_round_two(self, m, round_index, position, how):
        if round_index == 1 and position == 5:  # cells 0-4 begun, the decode ones unfinished
            raise KeyboardInterrupt
        return real(self, m, round_index, position, how)

    monkeypatch.setattr(runner._Rounds, "_start", stop_in_round_two)
    with pytest.raises(KeyboardInterrupt), RunWriter(tmp_path / "run", resume=False) as w:
        run_scenario(plan, w, {}, console=QUIET)
    partial = read_records(tmp_path / "run" / "results.jsonl")
    order = partial.rounds[1].order
    kept = {r.id for r in partial.repetitions if r.round == 1}
    decode = {m.id for m in plan.measurements if m.n_gen}
    # a decode cell begun before the interruption waits for the others' prompts: in step
    # rounds it had not ended, in whole-repetition rounds it had
    begun = set(order[:5])
    assert kept == (begun - decode if interleave == "step" else begun)
    assert partial.measurements == []
    monkeypatch.setattr(runner._Rounds, "_start", real)
    _, records = run(tmp_path, scenario=scenario, resume=True)
    # round 1 was finished in the order it started with (its round record not written again),
    # nothing of it lost or written twice, then round 2 followed
    assert [r.round for r in records.rounds] == [0, 1, 2]
    round1 = sorted((r for r in records.repetitions if r.round == 1), key=lambda r: r.position)
    assert [r.position for r in round1] == list(range(12))
    assert [r.id for r in round1] == records.rounds[1].order
    assert {r.rep["interleave"] for r in records.repetitions if r.id in decode} == {interleave}
    assert all(m.repetitions == 3 and m.samples["rounds"] == [0, 1, 2]
               for m in records.measurements)


def test_truncated_last_line_is_dropped_on_resume(tmp_path, monkeypatch):
    fast_noise(monkeypatch)
    plan = load_scenario(SCENARIO, 1)
    with RunWriter(tmp_path / "run", resume=False) as w:
        w.append({"type": "header", "kind": "measurement", "schema_version": SCHEMA_VERSION,
                  "scenario": {"sha256": plan.sha256}, "plan": []})
    path = tmp_path / "run" / "results.jsonl"
    with path.open("a") as f:
        f.write('{"type": "measurement", "id": "cut sh')
    assert read_records(path).truncated_bytes > 0
    _, records = run(tmp_path, resume=True)
    assert len(records.measurements) == len(plan.measurements)
    for line in path.read_text().splitlines():
        json.loads(line)


def test_no_overwrite_without_consent(tmp_path, monkeypatch):
    fast_noise(monkeypatch)
    run(tmp_path)
    before = (tmp_path / "run" / "results.jsonl").read_bytes()
    with pytest.raises(HarnessError, match="already holds results"):
        RunWriter(tmp_path / "run", resume=False)
    assert (tmp_path / "run" / "results.jsonl").read_bytes() == before


def test_resume_with_a_changed_scenario_is_refused(tmp_path, monkeypatch):
    fast_noise(monkeypatch)
    run(tmp_path)
    changed = tmp_path / "changed.yaml"
    changed.write_text(SCENARIO.read_text().replace("repetitions: 3", "repetitions: 2"))
    with pytest.raises(HarnessError, match="the scenario file changed"):
        run(tmp_path, scenario=changed, resume=True)


def test_two_runs_into_one_directory_are_refused(tmp_path):
    with RunWriter(tmp_path / "run", resume=False), \
            pytest.raises(HarnessError, match="another run is writing"):
        RunWriter(tmp_path / "run", resume=False)


def test_ram_check_refuses_before_work(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "available_ram_bytes", lambda: 1000)
    with pytest.raises(HarnessError, match=r"needs about .* GiB of RAM .* is available"):
        run(tmp_path)
    assert read_records(tmp_path / "run" / "results.jsonl").measurements == []


def test_cli_run_writes_results_and_summary(run_cli, tmp_path, monkeypatch):
    fast_noise(monkeypatch)
    out = tmp_path / "cli-run"
    r = run_cli("run", str(SCENARIO), "--out", str(out))
    assert r.exit_code == 0, r.stderr
    # findings first, one line per cell, in 100 columns; the wide tables in the report
    assert r.stdout.startswith("Findings\n") and "tiny-llama f32 t1 pp8+tg16" in r.stdout
    assert "decode of tiny-llama t1: q8_0 ÷ f32" in r.stdout  # its contrasts, one line each
    assert max(len(line) for line in r.stdout.splitlines() if str(tmp_path) not in line) <= 100
    assert r.stdout.strip().endswith(str(out))
    again = run_cli("run", str(SCENARIO), "--out", str(out))
    assert_user_error(again, "already holds results", "--resume")
    resumed = run_cli("run", str(SCENARIO), "--out", str(out), "--resume")
    assert resumed.exit_code == 0 and "(12 done)" in resumed.stderr


def test_strict_aborts_on_noise(tmp_path, monkeypatch, run_cli):
    monkeypatch.setattr(runner.noise, "idle_reading", lambda seconds=0.3: 1.5)
    r = run_cli("run", str(SCENARIO), "--out", str(tmp_path / "r"), "--strict")
    assert r.exit_code == 3
    assert "other processes are using 1.50 cores" in r.stderr and "--resume" in r.stderr


def test_rounds_run_on_across_ram_groups_and_never_pair_across_them(tmp_path, monkeypatch):
    """Models that do not fit in RAM together are measured group after group: the second
    group's rounds number on after the first's, so no comparison pairs a repetition with one
    measured minutes apart in another group; such a comparison is unpaired and says so."""
    from harness.levers.common import round_ratio
    from harness.report.files import analysis_of
    from harness.report.page import render_markdown, report_data
    from harness.study.analyze import with_ram_groups

    fast_noise(monkeypatch)
    plan = load_scenario(SCENARIO, physical_cores=1)
    needs = dict(runner._memory_by_model(list(plan.measurements), all_contexts=True))
    monkeypatch.setattr(runner, "available_ram_bytes", lambda: max(needs.values()) + 1)
    _, records = run(tmp_path)
    (grouping,) = records.of_type(Grouping)
    groups = grouping.groups
    assert len(groups) >= 2
    spans = [sorted({rnd for m in records.measurements if m.model_key in keys
                     for rnd in m.samples["rounds"]}) for keys in groups]
    assert spans == [list(range(3 * i, 3 * i + 3)) for i in range(len(groups))]
    assert [r.round for r in records.rounds] == list(range(3 * len(groups)))
    stamped = with_ram_groups(records.measurements, records.of_type(Grouping))
    first = [m for m in stamped if m.model_key in groups[0] and m.n_gen]
    other = [m for m in stamped if m.model_key in groups[1] and m.n_gen]
    assert {m.ram_group for m in first} == {0} and {m.ram_group for m in other} == {1}
    across = round_ratio(other[0], first[0], "decode")
    assert across["paired"] is False and across["median_ci95"]  # both figures' drift kept
    assert across["why"] == "they shared no rounds (other RAM groups)"
    same = [m for m in stamped if m.model_key == first[0].model_key]
    assert round_ratio(same[0], same[1], "prefill")["paired"] is True
    # an older run numbered every group's rounds from 0: the group still keeps them apart
    old = [msgspec.structs.replace(m, samples=m.samples | {
        "rounds": [r % 3 for r in m.samples["rounds"]]}) for m in stamped]
    assert round_ratio(old[stamped.index(other[0])], old[stamped.index(first[0])],
                       "decode")["paired"] is False
    report = render_markdown(report_data(records, analysis_of(records)))
    for key in ("tiny-qwen2|f32", "tiny-qwen2|q8_0"):
        assert key in needs
    split = next(i for i, keys in enumerate(groups) if "tiny-qwen2|q8_0" in keys) != next(
        i for i, keys in enumerate(groups) if "tiny-qwen2|f32" in keys)
    assert ("shared no rounds (other RAM groups)" in report) == split
