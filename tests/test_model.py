"""The model of the machine (harness.analysis.model) and the estimates derived from it, on
synthetic points whose true fixed cost, bandwidths and rates are known."""

import dataclasses

import numpy as np
import pytest
from conftest import probe_record

from harness.analysis import estimates, model
from harness.analysis.model import int_keys
from harness.core.costs import attention_flops, decode_n_bytes_by_row_width, prefill_flops
from harness.core.dtypes import DTYPES
from harness.core.records import typed
from harness.core.specs import resolve_spec
from harness.weights.gguf_build import table_from_plan

SPEC = resolve_spec("qwen2.5-0.5b")
LM_HEAD = 2 * SPEC.hidden_size * SPEC.vocab_size  # FLOPs of the last token's logits


def _full_probe(threads=2, stream=None, compute=None, attention=None, fixed=None,
                decode_attention=None, short_rows=None):
    """A full probe record holding the given medians (three equal passes each)."""
    node = {"ggml": {}, "attention": {}, "fixed_cost": {}, "decode_attention": {}}
    for t, v in (short_rows or {}).items():
        node["ggml"].setdefault(t, {}).update(shortrows_gb_s=v, shortrows_samples_gb_s=[v] * 3)
    for shape, v in (decode_attention or {}).items():
        node["decode_attention"][shape] = {"attention_gflop_s": v,
                                           "attention_samples_gflop_s": [v] * 3}
    for t, v in (stream or {}).items():
        node["ggml"].setdefault(t, {}).update(stream_gb_s=v, stream_samples_gb_s=[v] * 3)
    for t, v in (compute or {}).items():
        node["ggml"].setdefault(t, {}).update(compute_gflop_s=v,
                                              compute_samples_gflop_s=[v] * 3)
    for shape, v in (attention or {}).items():
        node["attention"][shape] = {"attention_gflop_s": v,
                                    "attention_samples_gflop_s": [v] * 3}
    for arch, by_layers in (fixed or {}).items():
        node["fixed_cost"][arch] = {str(n): {"seconds": s, "samples_seconds": [s] * 3}
                                    for n, s in by_layers.items()}
    return probe_record(seq=0, result={"threads": {str(threads): node}})


def _decode_row(name, n_bytes, seconds_by_round, dtype="f32", threads=2):
    rates = [[[0, r], 1 / s] for r, s in enumerate(seconds_by_round)]
    median = float(np.median([1 / s for s in seconds_by_round]))
    return {"id": f"{name}|{dtype}", "model": name, "model_key": f"{name}|{dtype}",
            "dtype": dtype, "threads": threads,
            "n_prompt": 16, "n_gen": 64, "bytes_per_token": n_bytes, "moe": False,
            "tok_s": {"n": len(rates), "median": median}, "round_rates": rates,
            "stream_ceiling": {"value": 40.0}}


def _models(*names, dtype="f32"):
    return {f"{n}|{dtype}": typed({"type": "model", "key": f"{n}|{dtype}", "model": n,
                                   "spec": dataclasses.asdict(dataclasses.replace(SPEC, name=n)),
                                   "decode_weight_n_bytes": 10**9, "weights_n_bytes": 12 * 10**8})
            for n in names}


def test_the_line_recovers_a_known_fixed_cost_and_bandwidth():
    rng = np.random.default_rng(0)
    true_ms, true_gb_s = 4.0, 30.0
    rows = []
    for name, gb in (("a", 1.0), ("b", 2.5), ("c", 6.0)):
        seconds = [(true_ms / 1e3 + gb / true_gb_s) * rng.lognormal(0, 0.01) for _ in range(8)]
        rows.append(_decode_row(name, gb * 1e9, seconds))
    line = model.line_fit(rows)
    assert line["intercept_ci_ms"][0] < true_ms < line["intercept_ci_ms"][1]
    assert line["intercept_ms"] == pytest.approx(true_ms, abs=1.5)
    assert line["gb_s_ci"][0] < true_gb_s < line["gb_s_ci"][1]
    assert line["gb_s"] == pytest.approx(true_gb_s, rel=0.02) and line["r2"] > 0.99
    assert model.line_fit(rows[:2]) is None  # two sizes cannot place an intercept


def test_the_fixed_cost_is_a_line_in_the_layers_and_is_taken_out_of_the_bandwidth():
    probes = [_full_probe(fixed={"qwen2": {1: 0.0001, 33: 0.0033}})]
    fixed = model.fixed_costs(probes)
    line = fixed[2]["qwen2"]
    assert line["per_layer_s"] == pytest.approx(0.0001) and line["base_s"] == pytest.approx(0)
    seconds, source = model.fixed_seconds(fixed, 2, SPEC)  # 24 layers
    assert seconds == pytest.approx(0.0024) and source == "qwen2"
    llama = resolve_spec("llama-3.2-1b")  # 16 layers, no llama skeleton: qwen2's, said so
    assert model.fixed_seconds(fixed, 2, llama) == (pytest.approx(0.0016), "qwen2")
    assert model.fixed_seconds(fixed, 1, SPEC)[0] is None
    # one size: bandwidth = bytes / (step time - fixed cost), round by round
    row = _decode_row("a", 2e9, [0.0024 + 2 / 25.0] * 6)
    entry = model.decode_model([row], _models("a"), fixed)[0]
    assert entry["gb_s"]["median"] == pytest.approx(25.0)
    assert entry["residuals"][0]["measured_over_model"] == pytest.approx(1.0)
    assert entry["share_of_stream"] == pytest.approx(25 / 40) and "line" not in entry


def _machine(ram_gb=24.0, decode=None):
    probes = [_full_probe(stream={"f32": 30.0, "f16": 25.0, "q8_0": 20.0},
                          compute={"f32": 200.0, "q8_0": 150.0},
                          attention={"64x14x2": 100.0}, decode_attention={"64x14x2": 5.0},
                          fixed={"qwen2": {1: 0.0001, 33: 0.0033}})]
    mm = model.machine_model(decode or [], [], {}, probes, int(ram_gb * 1e9))
    return mm


def test_an_estimate_uses_the_type_streaming_ceiling_when_the_run_did_not_decode_it():
    mm = _machine()
    e = estimates.estimate(mm, SPEC, "q8_0", context=0, n_prompt=512)
    weights = e["decode_weight_n_bytes"]
    attention = attention_flops(SPEC, 1, 0) / 5e9  # slower than its bytes: the roofline's
    assert attention > model.kv_bytes(SPEC, 1) / 25e9
    expected = 1 / (0.0024 + weights / 20e9 + attention)
    assert e["decode_tok_s"] == pytest.approx(expected)
    assert e["decode_tok_s_ci95"][0] <= e["decode_tok_s"] <= e["decode_tok_s_ci95"][1]
    assert "streaming ceiling" in e["decode_gb_s_from"] and e["fits_in_memory"] is True
    attention = attention_flops(SPEC, 512)
    output_s = SPEC.hidden_size * SPEC.vocab_size * 8.5 / 8 / 20e9  # one read, Q8_0 stream
    seconds = ((prefill_flops(SPEC, 512) - attention - LM_HEAD) / 150e9 + attention / 100e9
               + output_s)
    assert e["prefill_tok_s"] == pytest.approx(512 / seconds)
    deeper = estimates.estimate(mm, SPEC, "q8_0", context=4095)
    assert deeper["decode_parts_s"]["attention"] == pytest.approx(
        4 * 24 * SPEC.q_dim * 4096 / 5e9)  # 4 x layers x q_dim x positions, at 5 GFLOP/s
    assert deeper["kv_n_bytes"] == pytest.approx(model.kv_bytes(SPEC, 4096))


def test_short_rows_slow_the_streaming_ceiling_by_each_matrix_row_width():
    # rows of 512 weights stream at half the 4,096-row rate: 896 lies 27% of the way (log)
    probes = [_full_probe(stream={"q8_0": 20.0}, short_rows={"q8_0": 10.0},
                          fixed={"qwen2": {1: 0.0001, 33: 0.0033}})]
    mm = model.machine_model([], [], {}, probes, int(24e9))
    rel = model.row_scale(int_keys(mm["ceilings"]), 2, "q8_0")
    assert rel(512) == pytest.approx(0.5) and rel(4096) == 1.0 and rel(16384) == 1.0
    assert rel(256) == pytest.approx(0.5) and rel(1448) == pytest.approx(0.5 ** 0.5, rel=1e-3)
    e = estimates.estimate(mm, SPEC, "q8_0")
    # qwen2.5-0.5b: every matrix but the FFN's down projection (rows of 4,864) has 896-wide
    # rows, the output layer's 545 MB among them; the rate is their harmonic mean by bytes
    widths = decode_n_bytes_by_row_width(table_from_plan(SPEC, DTYPES["f32"]))
    assert set(widths) == {896, 4864} and widths[896] > 3 * widths[4864]
    harmonic = sum(widths.values()) / (widths[896] / rel(896) + widths[4864])
    assert e["decode_gb_s"] == pytest.approx(20.0 * harmonic)
    assert rel(896) < harmonic < 0.7 and "row widths" in e["decode_gb_s_from"]
    wide = estimates.estimate(mm, resolve_spec("llama-3.1-8b"), "q8_0")
    assert wide["decode_gb_s"] == pytest.approx(20.0)  # 4,096 and 14,336-wide rows
    # a measured decode at 12 GB/s: 60% of the long-row ceiling, more of its own rows'
    row = _decode_row("a", 2e9, [0.0024 + 2 / 12.0] * 6, dtype="q8_0") | {
        "stream_ceiling": {"value": 20.0}}
    entry = model.decode_model([row], _models("a", dtype="q8_0"), model.fixed_costs(probes),
                               int_keys(mm["ceilings"]))[0]
    assert entry["share_of_stream"] == pytest.approx(0.6, rel=1e-3)
    assert entry["share_at_row_widths"] == pytest.approx(0.6 / harmonic, rel=1e-3)


def test_an_estimate_refuses_what_does_not_fit_and_says_what_it_lacks():
    big = resolve_spec("llama-3.1-8b")  # 32 GB at F32
    e = estimates.estimate(_machine(ram_gb=23.5), big, "f32")
    assert e["fits_in_memory"] is False and e["decode_tok_s"] is None
    assert "does not fit in memory" in e["why"] and "23.5 GB here" in e["why"]
    q4k = estimates.estimate(_machine(), SPEC, "q4_k_m")  # its type was not probed here
    assert q4k["decode_tok_s"] is None and "q4_k_m" in q4k["decode_why"]
    keys = {"model", "dtype", "decode_tok_s", "decode_tok_s_ci95", "fits_in_memory",
            "prefill_tok_s", "prefill_tok_s_ci95", "n_prompt"}
    assert keys <= set(e) and keys <= set(q4k)


def test_reference_hardware_uses_the_cited_figure_of_each_type():
    hw = estimates.HARDWARE["apple-m2-ultra"]
    tok_s, size_gib, source = hw["figures"]["q4_0"]
    assert (tok_s, size_gib) == (88.54, 3.56) and "PR #2917" in source
    eff, _ = estimates.efficiency(hw, "q4_0")
    assert eff == pytest.approx(88.54 * 3.56 * 2**30 / 1e9 / 800)
    e = estimates.on_hardware(hw, "q4_0", 4e9, 4.2e9, 0.5e9)
    assert e["tok_s"] == pytest.approx(800e9 * eff / 4e9)
    q8, f16 = (estimates.efficiency(hw, d)[0] for d in ("q8_0", "f16"))
    assert q8 != pytest.approx(f16)  # one band per type, not one for all
    gpu = estimates.HARDWARE["nvidia-rtx-4090"]
    assert estimates.on_hardware(gpu, "q4_0", 4e9, 4e9, 0)["why"] == "no sourced Q4_0 figure"
    assert "does not fit" in estimates.on_hardware(gpu, "q8_0", 26e9, 26e9, 1e9)["why"]
    small = estimates.on_hardware(gpu, "q8_0", 0.1e9, 0.1e9, 0)
    assert small["floored"] and small["tok_s"] == gpu["floor"][0]


def test_the_prefill_model_splits_matrices_from_attention():
    spec = SPEC
    mm_rate, attn_rate = 200.0, 50.0

    def seconds(n):  # no streaming ceiling in these probes: the output layer costs nothing
        a = attention_flops(spec, n)
        return (prefill_flops(spec, n) - a - LM_HEAD) / (mm_rate * 1e9) + a / (attn_rate * 1e9)

    rows = [{"id": f"pp{n}", "model": "m", "model_key": "m|f32", "dtype": "f32", "threads": 2,
             "n_prompt": n,
             "n_gen": 0, "n_ubatch": 512, "seconds": seconds(n), "gflop_s": prefill_flops(spec, n) /
             seconds(n) / 1e9, "compute_peak": {"value": 300.0}} for n in (128, 1024, 4096)]
    ceil = {2: {"attention": {"64x14x2": {"value": attn_rate}}}}
    fit = model.prefill_model(rows, _models("m"), ceil)[0]
    assert fit["matmul_gflop_s"] == pytest.approx(mm_rate)
    long = fit["points"][-1]
    assert long["measured_over_predicted"] == pytest.approx(1.0)
    assert long["attention_time_share"] > long["attention_flop_share"] > 0.15


def test_decode_attention_is_taken_out_before_the_bandwidth():
    probes = [_full_probe(decode_attention={"64x14x2": 5.0})]
    ceil = model.ceilings(probes)
    attention = model.decode_attention_s(ceil, 2, SPEC, 48.5)  # 64 steps after 16: mean context
    assert attention == pytest.approx(4 * 24 * SPEC.q_dim * 48.5 / 5e9)
    row = _decode_row("a", 2e9, [attention + 2 / 25.0] * 6)
    entry = model.decode_model([row], _models("a"), {}, ceil)[0]
    assert entry["gb_s"]["median"] == pytest.approx(25.0)
    assert entry["attention_s"]["a"] == pytest.approx(attention)


def test_a_narrow_ubatch_runs_the_matrices_at_the_probed_narrow_rate():
    spec, wide, narrow, attn = SPEC, 200.0, 160.0, 50.0  # 128 columns: 0.8 of 512's rate

    def seconds(n):
        matrices = prefill_flops(spec, n) - attention_flops(spec, n) - LM_HEAD
        rate = narrow if n <= 128 else wide  # 1,024 tokens: two ubatches of 512
        return matrices / (rate * 1e9) + attention_flops(spec, n) / (attn * 1e9)

    rows = [{"id": f"pp{n}", "model": "m", "model_key": "m|f32", "dtype": "f32", "threads": 2,
             "n_prompt": n,
             "n_gen": 0, "n_ubatch": 512, "seconds": seconds(n), "gflop_s": 1.0,
             "compute_peak": {"value": 300.0}} for n in (128, 1024)]
    ceil = {2: {"attention": {"64x14x2": {"value": attn}}, "compute": {"f32": {"value": 300.0}},
                "narrow": {"f32": {"value": 240.0}}}}
    fit = model.prefill_model(rows, _models("m"), ceil)[0]
    assert fit["narrow_over_wide"] == pytest.approx(0.8)
    assert fit["matmul_gflop_s"] == pytest.approx(wide)  # as a 512-column rate
    assert fit["points"][1]["measured_over_predicted"] == pytest.approx(1.0)
    rel = model.column_scale(ceil, 2, "f32")
    assert rel(512) == pytest.approx(1.0) and rel(256) == pytest.approx(0.8 ** 0.5)
