import pytest
from conftest import measurement_record, probe_record

from harness.analysis import ceilings
from harness.analysis.phases import fit_through_origin, fit_verdicts
from harness.core.costs import (
    decode_weight_n_bytes,
    kv_n_bytes_per_token,
    mean_decode_context,
    prefill_flops,
    weights_n_bytes,
)
from harness.core.dtypes import DTYPES
from harness.core.specs import resolve_spec
from harness.core.stats import center, log_median, relative_half_width, summarize
from harness.engine.probe import plan_array_n_bytes, probe
from harness.weights.gguf_build import table_from_plan


def test_qwen_half_b_bytes_per_token_with_tied_embedding():
    spec = resolve_spec("qwen2.5-0.5b")
    table = table_from_plan(spec, DTYPES["f32"])
    # tied: no output.weight, the embedding is read whole as the LM head
    assert decode_weight_n_bytes(table) == 494_032_768 * 4 == weights_n_bytes(table)
    assert kv_n_bytes_per_token(spec) == 24 * 2 * 64 * 2 * 2  # layers x kv_heads x d x (K,V) x 2B
    f16 = table_from_plan(spec, DTYPES["f16"])
    norms_and_biases = 24 * (2 * 896 + 896 + 128 + 128) + 896
    assert decode_weight_n_bytes(f16) == (494_032_768 - norms_and_biases) * 2 + norms_and_biases * 4


def test_tiny_llama_untied_embedding_is_one_row():
    spec = resolve_spec("tiny-llama")
    table = table_from_plan(spec, DTYPES["f32"])
    assert weights_n_bytes(table) == 164_160 * 4
    assert decode_weight_n_bytes(table) == 164_160 * 4 - 512 * 64 * 4 + 64 * 4
    assert kv_n_bytes_per_token(spec) == 2 * 32 * 4
    assert kv_n_bytes_per_token(spec, "q8_0", "q8_0") == 2 * 32 * 2 * 34 / 32


def test_prefill_flops_hand_computed():
    spec = resolve_spec("qwen2.5-0.5b")
    matmul = 24 * (896 * 896 * 2 + 896 * 128 * 2 + 3 * 896 * 4864)
    assert prefill_flops(spec, 128) == 2 * matmul * 128 + 4 * 24 * 896 * 128 * 129 / 2 \
        + 2 * 896 * 151936 == 92_586_016_768
    tiny = resolve_spec("tiny-qwen2")
    per_token = 2 * 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)
    assert prefill_flops(tiny, 1) == per_token + 4 * 2 * 64 + 2 * 64 * 512


def test_mean_decode_context():
    # steps at positions 16..79 read 17..80 cells: mean 48.5
    assert mean_decode_context(16, 64) == sum(p + 1 for p in range(16, 80)) / 64 == 48.5
    assert mean_decode_context(0, 1) == 1


def test_fit_recovers_a_known_bandwidth():
    n_bytes = [1e9, 2e9, 4e9]
    exact = fit_through_origin(n_bytes, [30e9 / b for b in n_bytes])
    assert exact.gb_s == pytest.approx(30.0) and exact.r2 == pytest.approx(1.0)
    noisy = fit_through_origin(n_bytes, [30, 16, 7])
    assert noisy.gb_s == pytest.approx(39.75 / 1.3125)
    ss_res = sum((y - noisy.gb_s * x) ** 2 for x, y in zip([1, .5, .25], [30, 16, 7], strict=True))
    ss_tot = sum((y - 53 / 3) ** 2 for y in [30, 16, 7])
    assert noisy.r2 == pytest.approx(1 - ss_res / ss_tot)


def _row(model, n_bytes, tok_s, dtype="f32", ceiling=40.0, cv=0.01, flags=()):
    effective = tok_s * n_bytes / 1e9
    return {"id": f"{model}|{dtype}", "model": model, "dtype": dtype, "threads": 2,
            "n_gen": 64, "bytes_per_token": n_bytes,
            "tok_s": {"n": 5, "median": tok_s, "cv": cv}, "effective_gb_s": effective,
            "share_of_stream": effective / ceiling, "flags": list(flags)}


def test_verdict_clean_only_when_tight_and_unflagged():
    rows = [_row("a", 2e9, 15.0), _row("b", 4e9, 7.6), _row("c", 6e9, 5.0)]
    clean = fit_verdicts(rows)[0]
    assert clean["memory_bound"] and clean["verdict"].startswith("clearly memory-bound")
    assert clean["share_of_stream"] == pytest.approx(sum(r["share_of_stream"] for r in rows) / 3)
    # the same numbers with one unsteady point: the fit is as tight, the verdict is not clean
    unsteady = fit_verdicts([*rows[:2], _row("c", 6e9, 5.0, cv=0.12,
                                             flags=["unstable-decode"])])[0]
    assert not unsteady["memory_bound"] and unsteady["verdict"].startswith("not clean")
    assert any("c f32 decoded unsteadily (CV 12%" in r for r in unsteady["reasons"])
    above = fit_verdicts([*rows[:2], _row("c", 6e9, 5.0, ceiling=25.0,
                                          flags=["above-ceiling"])])[0]
    assert any("c f32 (120%) ran above the streaming ceiling" in r for r in above["reasons"])


def test_verdict_names_types_that_do_not_follow_their_bytes():
    rows = [_row("m", 1.0e9, 53.5, "q4_k_m"), _row("m", 1.33e9, 53.5, "q6_k"),
            _row("m", 4e9, 14.0, "f32")]
    v = fit_verdicts(rows)[0]
    assert not v["memory_bound"]
    same = [r for r in v["reasons"] if "m q4_k_m decodes at 1.00× the speed of m q6_k" in r]
    assert same and "25% fewer bytes" in same[0] and "not limited by bytes" in same[0]
    flat = fit_verdicts([_row("a", 1e9, 10.0), _row("b", 2e9, 9.0), _row("c", 4e9, 8.0)])[0]
    assert any("R²" in r for r in flat["reasons"])
    assert fit_verdicts([_row("a", 1e9, 10.0)]) == []  # one size: no fit, no section


def _probe(seq, threads, extra=None, **ggml):
    node = {"read_gb_s": 20.0 + seq, "read_samples_gb_s": [19.0 + seq, 20.0 + seq],
            "ggml": {t: {"stream_gb_s": v, "stream_samples_gb_s": [v, v * 0.98, v * 0.99],
                         "layout": "CPU"} for t, v in ggml.items()}}
    return probe_record(seq=seq, result={"threads": {str(threads): node}}, **(extra or {}))


def test_ceiling_near_uses_the_nearest_probes_that_measured_the_figure():
    probes = [_probe(2, 2, f32=30.0), _probe(4, 1, f32=99.0), _probe(9, 2, f32=33.0)]
    c = ceilings.ceiling_near(probes, 5, 2, ("ggml", "f32", "stream_gb_s"))
    # each probe's figure is the median of its passes (a best-of falls with fewer passes)
    assert c["before"] == pytest.approx(29.7) and c["after"] == pytest.approx(32.67)
    samples = [30, 29.4, 29.7, 33, 32.34, 32.67]
    assert c["value"] == pytest.approx(log_median(samples))
    assert c["drift"] == pytest.approx(0.1)
    assert c["spread"] == pytest.approx(relative_half_width(summarize(samples)))
    assert ceilings.ceiling_near([], 5, 2, ("read_gb_s",))["value"] is None


def test_combined_ceiling_adds_time_over_the_tensor_types():
    probes = [_probe(1, 2, q4_0=40.0, q8_0=20.0, f32=10.0)]
    bytes_by_type = {"q4_0": 600, "q8_0": 300, "f32": 100}
    c = ceilings.combined_ceiling(bytes_by_type, probes, 5, 2, "stream_gb_s")
    # each type's figure: the median of its passes, 0.99 of the best here
    assert c["value"] == pytest.approx(0.99 * 1000 / (600 / 40 + 300 / 20 + 100 / 10))
    assert c["by_type"] == pytest.approx({"q4_0": 39.6, "q8_0": 19.8, "f32": 9.9})
    missing = ceilings.combined_ceiling({"q6_k": 5, "f32": 1}, probes, 5, 2, "stream_gb_s")
    assert missing["value"] is None and missing["missing"] == ["q6_k"]
    assert "no ggml ceiling for q6_k" in missing["reason"]


def test_above_ceiling_allows_the_ceilings_own_spread():
    assert not ceilings.above_ceiling(1.04, {"spread": 0.05})
    assert ceilings.above_ceiling(1.06, {"spread": 0.05})
    assert ceilings.above_ceiling(1.01, {"spread": None})
    assert not ceilings.above_ceiling(None, {"spread": None})


def test_probe_structure_on_tiny_matrices():
    r = probe([1, 2], ["f32", "q4_0", "iq2_xxs"], 1 << 20, 5)
    assert r["array_n_bytes"] == 1 << 20 and r["passes"]["read"] == 5
    assert set(r["threads"]) == {"1", "2"}
    for v in r["threads"].values():
        assert len(v["read_samples_gb_s"]) == 5 and v["read_gb_s"] == max(v["read_samples_gb_s"])
        assert len(v["copy_samples_gb_s"]) == 5
        for dtype in ("f32", "q4_0"):
            e = v["ggml"][dtype]
            assert len(e["stream_samples_gb_s"]) == 5
            assert e["stream_gb_s"] == max(e["stream_samples_gb_s"]) > 0
            assert e["compute_gflop_s"] == max(e["compute_samples_gflop_s"]) > 0
            assert e["layout"] in ("CPU", "CPU_REPACK")
        assert "importance matrix" in v["ggml"]["iq2_xxs"]["error"]


def test_kernel_probe_matrix_sizes_and_flops():
    from harness.engine.llama import KernelProbe

    kp = KernelProbe(1 << 20)
    try:
        s = kp.stream("q8_0", 1, 2)
        # 1 MiB of Q8_0 rows of 4096 weights (34 bytes per 32): whole multiples of 64 rows
        row = 4096 // 32 * 34
        assert s["n_bytes"] == (1 << 20) // row // 64 * 64 * row
        c = kp.compute("f32", 1, 2)
        assert len(c["samples_gflop_s"]) == 2
        mm = kp._cache[("f32", "compute", 512, 4096)]
        assert mm.flops == 2.0 * 64 * 4096 * 512  # rows capped by the 1 MiB stream matrix
        kp.compute("f32", 1, 2, kp.NARROW_COLUMNS)
        assert kp._cache[("f32", "compute", 128, 4096)].flops == 2.0 * 64 * 4096 * 128
        short = kp.stream("q8_0", 1, 2, kp.NARROW_ROW)  # as many bytes, in rows of 512
        assert short["n_bytes"] == (1 << 20) // (row // 8) // 64 * 64 * (row // 8)
        assert kp.unsupported("q8_k") and kp.unsupported("nonsense")
    finally:
        kp.close()


def test_probe_shrinks_arrays_when_ram_is_short(monkeypatch):
    import harness.engine.probe as p

    monkeypatch.setattr(p, "available_ram_bytes", lambda: 64 << 20)
    n, notes = plan_array_n_bytes(1 << 30)
    assert n == 16 << 20
    assert any("shrunk from 1024 MiB to 16 MiB" in note for note in notes)


def test_round_fits_cancel_drift_and_give_each_model_its_residual():
    """Three models at a true 30 GB/s; the machine runs 20% slower in odd rounds, and the
    middle model always 10% below the line. Per round the fit follows the drift, and every
    model's measured ÷ fitted ratio stays where it truly is."""
    n_bytes, off = [1e9, 2e9, 4e9], [1.0, 0.9, 1.0]
    rows = []
    for i, (b, k) in enumerate(zip(n_bytes, off, strict=True)):
        rates = [[[0, r], 30e9 / b * k * (0.8 if r % 2 else 1.0)] for r in range(8)]
        rows.append(_row(f"m{i}", b, rates[0][1]) | {"round_rates": rates})
    (f,) = fit_verdicts(rows)
    per_round = f["round_fit_gb_s"]
    assert per_round["n"] == 8 and per_round["min"] < 0.85 * per_round["max"]
    ratios = [center(r["measured_over_fit"]) for r in f["round_residuals"]]
    expected = fit_through_origin(n_bytes, [30e9 / b * k for b, k in zip(n_bytes, off,
                                                                          strict=True)])
    assert ratios == pytest.approx([30e9 / b * k / (expected.gb_s * 1e9 / b)
                                    for b, k in zip(n_bytes, off, strict=True)])
    one = fit_verdicts([r | {"round_rates": r["round_rates"][:1]} for r in rows])[0]
    assert one.get("round_fit_gb_s") is None and one["round_fit_unpaired"] == 1
    # the last model in another RAM group: its blocks are (1, round), so nothing pairs, and
    # the page says why the fit is not redone round by round
    apart = [*rows[:2], rows[2] | {"round_rates": [[[1, r], x] for (_, r), x
                                                   in rows[2]["round_rates"]]}]
    (f,) = fit_verdicts(apart)
    assert "round_fit_gb_s" not in f and f["round_fit_unpaired"] == 0
    from harness.report.page import round_fit_lines

    (line,) = round_fit_lines(f)
    assert "Not redone round by round" in line and "in 0 rounds" in line


def test_a_share_is_taken_against_the_probe_of_its_own_round_and_thread_count():
    """Rounds of a threads sweep probe once per thread count: each cell's share uses its own."""
    probes = []
    for rnd in range(3):
        for threads, gb_s in ((1, 10.0 + rnd), (2, 20.0 + rnd)):
            probes.append(_probe(10 * rnd + threads, threads, {
                "when": "beside", "round": rnd, "threads": [threads]}, f32=gb_s))
    m = measurement_record(threads=1, n_gen=10, samples={"rounds": [0, 1, 2],
                                                          "decode_s": [[1.0]] * 3})
    share = ceilings.round_shares(m, "decode", {"f32": 100}, probes, "stream_gb_s", 1.0)
    # 10 tok/s x 1 GB against the median pass (0.99 x) of 10, 11, 12 GB/s at 1 thread
    expected = [10 / (0.99 * v) for v in (10.0, 11.0, 12.0)]
    assert share["n"] == 3 and share["per_round"] == pytest.approx(expected)


def test_a_full_probe_times_attention_and_the_fixed_cost_skeletons(tmp_path):
    from harness.engine.build import build
    from harness.engine.probe import COMMON_DTYPES, Prober, skeleton_spec

    spec = resolve_spec("tiny-qwen2")
    paths = {n: str(build(skeleton_spec(spec, n), DTYPES["f32"], 0, directory=tmp_path).path)
             for n in (1, 3)}
    shape = [spec.head_dim, spec.num_attention_heads, spec.num_key_value_heads]
    with Prober(["f32"], {"attention": [shape], "skeletons": {"qwen2": paths}}) as p:
        r = p.full([1], {"read": 5, "stream": 5, "compute": 5})
    node = r["threads"]["1"]
    assert set(COMMON_DTYPES) | {"f32"} <= set(node["ggml"])  # types the run did not use too
    q8 = node["ggml"]["q8_0"]  # short rows as well as long ones: a small model's widths
    assert (q8["shortrows_n_weights"], q8["row_n_weights"]) == (512, 4096)
    assert len(q8["shortrows_samples_gb_s"]) == 5 and q8["shortrows_gb_s"] > 0
    a = node["attention"]["x".join(map(str, shape))]
    assert len(a["attention_samples_gflop_s"]) == 5 and a["attention_gflop_s"] > 0
    fixed = node["fixed_cost"]["qwen2"]
    assert set(fixed) == {"1", "3"}
    assert all(len(v["samples_seconds"]) == 5 and v["seconds"] > 0 for v in fixed.values())


def test_a_skeleton_keeps_the_graph_and_drops_the_bytes():
    from harness.engine.probe import skeleton_spec

    moe = resolve_spec("olmoe-1b-7b")
    s = skeleton_spec(moe, 4)
    assert (s.architecture, s.num_hidden_layers, s.num_experts, s.num_experts_per_tok) == (
        moe.architecture, 4, moe.num_experts, moe.num_experts_per_tok)
    assert s.hidden_size == 64 and s.vocab_size == 512 and s.source is None
    gqa = skeleton_spec(resolve_spec("qwen2.5-0.5b"), 2)
    assert gqa.num_key_value_heads < gqa.num_attention_heads  # grouped attention kept
