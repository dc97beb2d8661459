"""Step interleaving (issue 43): a round runs its cells' decode steps in turn, and decode
contrasts pair windows of adjacent steps."""

import math
import random

import pytest
from conftest import measurement_record

from harness import runner
from harness.analysis.ceilings import step_regimes
from harness.analysis.machine import regime_sentences
from harness.core.rounds import PAIRING_FIELDS, group_by_memory, model_links, split_pairs
from harness.core.stats import WINDOW_TICKS, contrast, windows
from harness.engine.llama import Context
from harness.engine.measure import WARMUP_STEPS, Cell
from harness.engine.results import RunWriter, read_records
from harness.engine.scenario import load_scenario
from harness.report.page import method_text
from harness.runner import Console, run_scenario
from harness.study.analyze import analyze_records, flag_cache_evicted

QUIET = Console(warn=lambda msg: None, info=lambda msg: None)
TEXT = """name: steps
models: [tiny-qwen2, tiny-llama]
dtypes: [f32]
threads: [1]
repetitions: 2
warmup: 0
interleave: {how}
tests:
  - {{prompt: 8, generate: 16}}
"""


def _run(tmp_path, monkeypatch, how: str, console=QUIET):
    monkeypatch.setattr(runner.noise, "idle_reading", lambda seconds=0.3: 0.0)
    path = tmp_path / "steps.yaml"
    path.write_text(TEXT.format(how=how))
    calls, cells = [], set()
    real, made = Context.decode, Cell.__init__

    def logged(self, tokens):
        if id(self) in cells:  # a cell's, not a probe's
            calls.append((id(self), len(tokens)))
        return real(self, tokens)

    def make(self, *args, **kwargs):
        made(self, *args, **kwargs)
        cells.add(id(self.ctx))

    monkeypatch.setattr(Context, "decode", logged)
    monkeypatch.setattr(Cell, "__init__", make)
    with RunWriter(tmp_path / "run", resume=False) as writer:
        run_scenario(load_scenario(path, 1), writer, {}, console=console)
    return calls, read_records(tmp_path / "run" / "results.jsonl")


def test_step_rounds_run_one_decode_step_of_each_cell_in_turn(tmp_path, monkeypatch):
    calls, records = _run(tmp_path, monkeypatch, "step")
    assert len(calls) == 2 * 2 * 16 and all(n == 1 for _, n in calls)
    for first in range(0, len(calls), 32):  # a round: A B A B ..., 16 ticks
        ctxs = [c for c, _ in calls[first:first + 32]]
        assert len(set(ctxs)) == 2
        assert all(ctxs[i] != ctxs[i + 1] for i in range(31))
    for m in records.measurements:
        assert m.interleave == "step" and m.samples["interleave"] == ["step", "step"]
        assert [len(d) for d in m.samples["decode_s"]] == [16, 16]
    rows = analyze_records(records)["decode"]
    assert all(len(r["window_rates"]) == 2 * math.ceil(16 / WINDOW_TICKS) for r in rows)
    # the probe ran in the rotation: a share is each window's rate over the passes beside it
    assert all(r["share_of_stream_ci"]["paired_by"] == "window" for r in rows)
    assert all(r["share_of_stream_ci"]["n"] == len(r["window_rates"]) for r in rows)
    assert "one step of each again and again" in method_text(records)


def test_round_interleave_runs_each_decode_whole_as_before(tmp_path, monkeypatch):
    calls, records = _run(tmp_path, monkeypatch, "round")
    ctxs = [c for c, _ in calls]
    assert len(ctxs) == 2 * 2 * 16
    for first in range(0, len(ctxs), 16):  # each cell's 16 steps one after another
        assert len(set(ctxs[first:first + 16])) == 1
    assert all(m.interleave == "round" for m in records.measurements)
    assert all(not r["window_rates"] for r in analyze_records(records)["decode"])
    assert "one step of each" not in method_text(records)


def _machine(rng: random.Random, n_rounds: int, stepped: bool) -> tuple[list, list]:
    """Two cells' decode steps (40 and 100 ms nominal: a ratio of 2.5 in tok/s) on a machine
    that switches between two speeds 1.5x apart every ~1.5 s, 64 steps per round, 3 s between
    rounds; stepped: one step of each in turn, else each cell's decode whole."""
    t, until, slow = 0.0, rng.expovariate(1 / 1.5), False
    out_a, out_b = [], []

    def run(ms: float) -> float:
        nonlocal t, until, slow
        while until <= t:
            slow, until = not slow, until + rng.expovariate(1 / 1.5)
        seconds = ms / 1000 * (1.5 if slow else 1.0) * math.exp(rng.gauss(0, 0.02))
        t += seconds
        return seconds

    for _ in range(n_rounds):
        if stepped:
            pairs = [(run(40), run(100)) for _ in range(64)]
            a, b = [x for x, _ in pairs], [y for _, y in pairs]
        else:
            a, b = [run(40) for _ in range(64)], [run(100) for _ in range(64)]
        out_a.append(a)
        out_b.append(b)
        t += 3.0
    return out_a, out_b


def test_windows_recover_a_ratio_under_fast_switching_that_defeats_round_blocks():
    rng = random.Random(11)
    a, b = _machine(rng, 8, stepped=True)
    keyed = [{(r, w): x for r, steps in enumerate(cell) for w, x in enumerate(windows(steps))}
             for cell in (a, b)]
    c = contrast(*keyed)
    lo, hi = c["median_ci95"]
    assert lo <= 2.5 <= hi and hi / lo < 1.03 ** 2
    a, b = _machine(rng, 8, stepped=False)  # the same rounds, each decode whole
    rounds = [{r: 64 / sum(steps) for r, steps in enumerate(cell)} for cell in (a, b)]
    whole = contrast(*rounds)
    lo_w, hi_w = whole["median_ci95"]
    assert hi_w / lo_w > 2 * (hi / lo) - 1  # at least twice as wide


def test_windows_of_adjacent_steps():
    steps = [0.1] * WINDOW_TICKS + [0.2] * 4
    assert windows(steps) == pytest.approx([10.0, 5.0])  # the last window shorter
    assert windows([0.1] * 3, n_per_step=4) == pytest.approx([40.0])


def test_ram_groups_keep_compared_models_together_and_name_the_split():
    needs = {"a": 5, "b": 4, "c": 3}
    assert group_by_memory(needs, 9) == [["a", "b"], ["c"]]  # no links: largest first
    links = {frozenset(("a", "c"))}
    assert group_by_memory(needs, 9, links) == [["a", "c"], ["b"]]
    three = {frozenset(p) for p in (("a", "b"), ("a", "c"), ("b", "c"))}
    groups = group_by_memory(needs, 9, three)
    assert groups == [["a", "b"], ["c"]]
    assert split_pairs(groups, three) == [["a", "c"], ["b", "c"]]
    base = dict.fromkeys(PAIRING_FIELDS, 0)
    cells = {"x": base | {"model": "a"}, "y": base | {"model": "b"},
             "z": base | {"model": "c", "threads": 2}}
    links = model_links({k: tuple(v.values()) for k, v in cells.items()},
                        {k: v["model"] for k, v in cells.items()}, {k: {"decode"} for k in cells})
    assert links == {frozenset(("a", "b"))}  # z differs from both in two settings


def test_a_run_split_by_ram_says_which_contrasts_were_not_paired(tmp_path, monkeypatch):
    warnings = []
    monkeypatch.setattr(runner, "available_ram_bytes",
                        lambda: max(n for _, n in runner._memory_by_model(
                            list(load_scenario(tmp_path / "steps.yaml", 1).measurements),
                            all_contexts=True)))
    (tmp_path / "steps.yaml").write_text(TEXT.format(how="step"))
    _, records = _run(tmp_path, monkeypatch, "step",
                      Console(warn=warnings.append, info=lambda m: None))
    grouping = records.other[0]
    assert grouping.split == [["tiny-llama|f32", "tiny-qwen2|f32"]]
    assert any("tiny-llama|f32 and tiny-qwen2|f32" in w for w in warnings)
    assert "Not compared side by side: tiny-llama|f32 and tiny-qwen2|f32" in method_text(records)


def test_two_speeds_are_found_and_said_once():
    rng = random.Random(2)
    steps, slow = [], False
    for k in range(256):  # 50 and 70 ms, switching every 16 steps, 1% noise
        slow = not slow if k % 16 == 0 else slow
        steps.append((0.070 if slow else 0.050) * math.exp(rng.gauss(0, 0.01)))
    m = measurement_record(n_gen=64, samples={"decode_s": [steps[i:i + 64]
                                                           for i in range(0, 256, 64)]})
    reg = step_regimes(m)
    assert reg["n"] == 2 and [round(x) for x in reg["ms"]] == [50, 70]
    assert reg["slow_share"] == pytest.approx(0.5) and reg["mean_run_steps"] == 16
    one = measurement_record(n_gen=64, samples={"decode_s": [[0.05 * math.exp(
        rng.gauss(0, 0.01)) for _ in range(64)] for _ in range(4)]})
    assert step_regimes(one)["n"] == 1
    row = {"model": "m", "dtype": "f32", "interleave": "round", "regimes": reg,
           "tok_s": {"n": 4, "median": 1 / 0.06}}
    assert regime_sentences([row]) == [
        "m f32 about 50 and 70 ms per step (50% of its steps at the slower; a speed held "
        "≈0.96 s, 16 steps, on average)"]


def test_a_decode_in_the_last_level_cache_is_flagged_when_it_ran_in_turn():
    rows = [{"interleave": "step", "bytes_per_token": 10 << 20, "flags": []},
            {"interleave": "round", "bytes_per_token": 10 << 20, "flags": []},
            {"interleave": "step", "bytes_per_token": 2 << 30, "flags": []}]
    flagged = flag_cache_evicted(rows, 32 << 20)
    assert [r["flags"] for r in flagged] == [["cache-evicted"], [], []]
    assert flag_cache_evicted(rows[2:], None)[0]["flags"] == []


def test_a_warm_up_decodes_at_most_its_first_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(runner.noise, "idle_reading", lambda seconds=0.3: 0.0)
    path = tmp_path / "warm.yaml"
    path.write_text(TEXT.format(how="step").replace("warmup: 0", "warmup: 1")
                    .replace("generate: 16", f"generate: {WARMUP_STEPS + 8}"))
    with RunWriter(tmp_path / "run", resume=False) as writer:
        run_scenario(load_scenario(path, 1), writer, {}, console=QUIET)
    records = read_records(tmp_path / "run" / "results.jsonl")
    for m in records.measurements:
        assert [len(d) for d in m.warmup_samples["decode_s"]] == [WARMUP_STEPS]
        assert [len(d) for d in m.samples["decode_s"]] == [WARMUP_STEPS + 8] * 2
    assert f"the first {WARMUP_STEPS} decode steps" in method_text(records)
