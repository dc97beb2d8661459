"""The levers on a tiny model: depth, KV cache type, batching, threads, prefix caching.
Structure and internal consistency of the records and the analysis; no timing assertions."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import measure_scenario, measurement_record

from harness import runner
from harness.core.costs import kv_n_bytes_per_token
from harness.core.records import typed
from harness.core.specs import ModelSpec
from harness.levers.quant import composition
from harness.levers.threads import _thread_group
from harness.report.page import render_markdown, report_data
from harness.study.analyze import analyze_records

SCENARIO = Path(__file__).resolve().parent / "scenarios" / "levers.yaml"


@pytest.fixture(scope="module")
def levers_run(tmp_path_factory):
    return measure_scenario(SCENARIO, tmp_path_factory.mktemp("levers"))


def _by_kind(records, kind):
    return [m for m in records.measurements if m.kind == kind]


def test_every_planned_measurement_is_recorded_without_failures(levers_run):
    plan, records = levers_run
    assert not records.failures
    assert [m.id for m in records.measurements] == [m.id for m in
                                                       runner.pending(plan, set())]
    assert {m.kind for m in records.measurements} == {"single", "batched", "prefix_cache"}


def test_depth_is_filled_untimed_and_each_repetition_decodes_from_it(levers_run):
    _, records = levers_run
    deep = [m for m in records.measurements if m.depth]
    assert {(m.depth, m.kv_type) for m in deep} == {(64, "f16"), (64, "q8_0")} and \
        all(m.id.split("|")[9] == "d64" for m in deep)
    for m in deep:
        assert m.setup["depth_fill_s"] > 0
        assert [len(d) for d in m.samples["decode_s"]] == [m.n_gen] * m.repetitions
        # the depth-0 baseline decoded beside every repetition, and the paired ratio
        baseline = m.samples["baseline_decode_s"]
        assert [len(b) for b in baseline] == [m.n_gen] * m.repetitions
        ratios = [sum(d) / sum(b) for d, b in zip(m.samples["decode_s"], baseline,
                                                    strict=True)]
        geometric = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        assert m.paired_slowdown["ratio"] == pytest.approx(geometric)
        assert len(m.warmup_samples["baseline_decode_s"]) == m.warmup
        for perf in m.samples["perf"]:
            # the counters were reset after the fill: only the timed decode is in them
            # (llama_perf_context reports a count of 0 as 1)
            assert perf["n_eval"] == m.n_gen and perf["n_p_eval"] <= 1


def test_every_context_is_the_one_its_id_names(levers_run):
    """Each record carries the context its cell ran in, as llama.cpp made it (the cell is
    refused otherwise): cells per sequence in whole blocks of 256, one share per sequence
    (a depth test's baseline too) or one unified cache for a prefix test; llama.cpp clamps
    n_batch and n_ubatch to the whole context, and the record says what they became."""
    plan, records = levers_run
    planned = {m.id: m for m in plan.measurements}
    assert len(records.measurements) == len(planned)
    for r in records.measurements:
        m = planned[r.id]
        assert f"|ctx{r.n_ctx}|" in r.id and r.n_ctx % 256 == 0
        assert r.n_ctx >= m.n_cells_needed and r.n_ctx - m.n_cells_needed < 256
        shares = 1 if r.kind == "prefix_cache" else r.n_seq_max
        assert (r.n_ctx_total, r.n_seq_max) == (r.n_ctx * shares, m.n_seq_max)
        assert r.setup["n_batch_used"] == min(r.n_ctx_total, r.n_batch)
        assert r.setup["n_ubatch_used"] == min(r.setup["n_batch_used"], r.n_ubatch)
    kinds = {(r.kind, bool(r.depth)) for r in records.measurements}
    assert kinds >= {("single", False), ("single", True), ("batched", False),
                     ("prefix_cache", False)}


def test_kv_cache_type_is_in_the_id_only_when_not_the_default(levers_run):
    _, records = levers_run
    for m in records.measurements:
        assert ("kv-q8_0" in m.id) == (m.kv_type == "q8_0")
        assert ("|np" in m.id) == (m.parallel > 1)


def test_batched_decode_counts_every_sequence(levers_run):
    _, records = levers_run
    batched = _by_kind(records, "batched")
    assert sorted({m.parallel for m in batched}) == [2, 4]
    for m in batched:
        b = m.parallel
        assert m.decode_tok_s["mean"] == pytest.approx(b * m.per_sequence_tok_s["mean"])
        assert [len(d) for d in m.samples["decode_s"]] == [m.n_gen] * m.repetitions
        for perf in m.samples["perf"]:
            # every batch of more than one token counts as prompt eval in llama.cpp
            assert perf["n_p_eval"] == b * (m.n_prompt + m.n_gen) and perf["n_eval"] <= 1


def test_prefix_cache_times_three_ways_to_the_first_token(levers_run):
    _, records = levers_run
    (m, *_) = _by_kind(records, "prefix_cache")
    assert set(m.ttft_reuse_s) == {"seq_copy", "state_restore"}
    for samples in m.samples["reuse_s"].values():
        assert len(samples) == m.repetitions and all(s > 0 for s in samples)
    spec = ModelSpec(**records.models[m.model_key].spec)
    kv = kv_n_bytes_per_token(spec) * m.shared_prefix
    assert kv <= m.setup["state_n_bytes"] < 1.5 * kv  # the state is the prefix's K and V
    assert m.prefill_tok_s["max"] == pytest.approx(
        (m.shared_prefix + m.n_prompt) / min(m.samples["prefill_s"]))


def test_lever_analysis_is_consistent(levers_run):
    _, records = levers_run
    a = analyze_records(records)
    assert {r["dtype"] for r in a["quant"]} == {"f32", "q8_0"}
    for r in a["quant"]:
        assert sum(r["params_share"].values()) == pytest.approx(1.0)
        assert (r["byte_reduction"] > 1) == (r["dtype"] == "q8_0")
    for r in a["kv_depth"]:
        assert (r["predicted_slowdown"] > 1) == (r["depth"] > 0)
        assert r["slowdown_against"] == ("paired depth-0 baseline" if r["depth"] else "itself")
        assert r["kv_n_bytes"] == pytest.approx(r["kv_n_bytes_per_token"] * (r["depth"] + 4.5))
    q8, f16 = ([r for r in a["kv_depth"] if r["kv_type"] == t][0]["kv_n_bytes_per_token"]
               for t in ("q8_0", "f16"))
    assert q8 / f16 == pytest.approx(34 / 64)  # Q8_0: 34 bytes per 32 values; F16: 2 bytes
    for r in a["kv_memory"]:
        assert r["users_8"] - r["users_1"] == pytest.approx(7 * r["kv_per_user"])
    for r in a["batching"]:
        model = records.models[f"{r['model']}|{r['dtype']}"]
        assert r["weight_n_bytes_per_token"] * r["parallel"] == model.decode_weight_n_bytes
        assert (r["speedup"] == 1.0) == (r["parallel"] == 1)
    assert {r["parallel"] for r in a["batching"]} == {1, 2, 4}
    assert {(r["phase"], r["threads"]) for r in a["threads"]} == {("prefill", 1),
                                                                   ("prefill", 2)}
    for r in a["threads"]:  # the knee follows from the rates: the fewest within 2% of the best
        group = [x for x in a["threads"] if x["phase"] == r["phase"] and x["dtype"] == r["dtype"]]
        best = max(x["tok_s"]["median"] for x in group)
        assert r["knee_threads"] == min(x["threads"] for x in group
                                        if x["tok_s"]["median"] >= 0.98 * best)
    for r in a["prefix"]:
        assert r["seq_copy_saving"] == pytest.approx(
            1 - r["seq_copy_s"]["median"] / r["recompute_s"]["median"])


def test_report_has_every_lever_section(levers_run):
    _, records = levers_run
    a = analyze_records(records)
    plots = ["quant_speedup.png", "kv_depth.png", "batching.png", "threads.png",
             "prefix_cache.png"]
    text = render_markdown(report_data(records, a), plots)
    for heading in ("## Levers", "### Quantization", "### What each file really holds",
                    "### KV cache: decode at context depth", "### Memory for concurrent users",
                    "### Batching", "### Threads", "### Prefix caching", "meet at B ≈"):
        assert heading in text, heading
    for name in plots:  # each plot right after its own section
        assert f"]({name})" in text
    assert text.index("](batching.png)") < text.index("### Threads")


def test_knee_is_the_fewest_threads_within_two_percent_of_the_best():
    def rec(threads, tok):
        return measurement_record(id=f"t{threads}", threads=threads, seq=threads, n_prompt=8,
                                  prefill_tok_s={"median": tok, "n": 3})

    group = [rec(4, 19.1), rec(1, 10.0), rec(2, 18.9), rec(3, 19.2)]
    peaks = {1: 50.0, 2: 95.0, 3: 140.0, 4: 180.0}
    by_id = {(f"t{t}", "prefill"): ({}, 0.5, {"value": peak}) for t, peak in peaks.items()}
    rows = _thread_group("prefill", "prefill_tok_s", group, by_id)
    assert [r["threads"] for r in rows] == [1, 2, 3, 4]
    assert {r["knee_threads"] for r in rows} == {2} and [r["knee"] for r in rows] == \
        [False, True, False, False]
    assert rows[1]["speedup"] == pytest.approx(1.89) and rows[3]["efficiency"] == \
        pytest.approx(1.91 / 4)
    assert rows[3]["ceiling_speedup"] == pytest.approx(180 / 50)


def test_composition_reads_bits_per_weight_from_the_tensor_table():
    model = typed({"type": "model", "key": "m|q4_k_m",
                   "tensor_type_n_params": {"Q4_K": 900, "Q6_K": 100},
                   "tensor_type_n_bytes": {"Q4_K": 900 * 144 // 256, "Q6_K": 100 * 210 // 256}})
    c = composition(model)
    assert c["bits_per_weight"] == pytest.approx(8 * (506 + 82) / 1000)
    assert c["params_share"] == {"Q4_K": 0.9, "Q6_K": 0.1}


def test_every_lever_is_registered_once_with_its_table_and_plot():
    from harness.levers import LEVERS, PLOT_AFTER, TABLE_NAMES

    assert [lever.name for lever in LEVERS] == ["experts", "quant", "kv_depth", "batching",
                                                "threads", "prefix", "twins"]
    assert len(set(TABLE_NAMES)) == len(TABLE_NAMES)
    assert set(PLOT_AFTER.values()) <= set(TABLE_NAMES)


def test_lever_plot_titles_state_the_measured_finding(levers_run):
    from harness.levers.batching import batching_finding
    from harness.levers.kv_depth import kv_finding
    from harness.levers.prefix import prefix_finding
    from harness.levers.quant import quant_finding

    _, records = levers_run
    a = analyze_records(records)
    deep = max(a["kv_depth"], key=lambda r: (r["depth"], r["measured_slowdown"]["median"]))
    assert kv_finding(a["kv_depth"]).startswith(f"At {deep['depth']:,} cached tokens")
    assert f"{deep['measured_slowdown']['median']:.2f}× slower" in kv_finding(a["kv_depth"])
    top = max(a["batching"], key=lambda r: (r["parallel"], r["tok_s"]["median"]))
    assert batching_finding(a["batching"]).startswith(
        f"{top['parallel']} sequences together ({top['model']} {top['dtype']}): "
        f"{top['speedup']:.2f}×")
    best = max(r["seq_copy_saving"] for r in a["prefix"])
    assert f"{max(best, max(r['state_restore_saving'] for r in a['prefix'])):.0%}" in \
        prefix_finding(a["prefix"])
    rows = [{"dtype": "q8_0", "baseline": "f32", "byte_reduction": 3.76, "decode_speedup": 3.1,
             "prefill_speedup": 1.2}, {"dtype": "f16", "baseline": "f32",
                                       "byte_reduction": 2.0, "decode_speedup": 1.9}]
    assert quant_finding(rows) == ("q8_0 reads 3.8× fewer bytes than f32: decode 3.10× faster, "
                                   "prefill 1.20× faster")
