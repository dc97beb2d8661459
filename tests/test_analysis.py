import pytest

from harness import analysis
from harness.analysis import fit_through_origin, fit_verdicts
from harness.costs import (
    decode_weight_n_bytes,
    kv_n_bytes_per_token,
    mean_decode_context,
    prefill_flops,
    table_from_plan,
    weights_n_bytes,
)
from harness.dtypes import DTYPES
from harness.probe import plan_array_n_bytes, probe
from harness.specs import resolve_spec


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
    assert mean_decode_context(16, 64) == 16 + 31.5
    assert mean_decode_context(0, 1) == 0


def test_fit_recovers_a_known_bandwidth():
    n_bytes = [1e9, 2e9, 4e9]
    exact = fit_through_origin(n_bytes, [30e9 / b for b in n_bytes])
    assert exact.gb_s == pytest.approx(30.0) and exact.r2 == pytest.approx(1.0)
    noisy = fit_through_origin(n_bytes, [30, 16, 7])
    assert noisy.gb_s == pytest.approx(39.75 / 1.3125)
    ss_res = sum((y - noisy.gb_s * x) ** 2 for x, y in zip([1, .5, .25], [30, 16, 7], strict=True))
    ss_tot = sum((y - 53 / 3) ** 2 for y in [30, 16, 7])
    assert noisy.r2 == pytest.approx(1 - ss_res / ss_tot)


def _row(model, n_bytes, tok_s, dtype="f32", ceiling=40.0):
    return {"model": model, "dtype": dtype, "threads": 2, "bytes_per_token": n_bytes,
            "tok_s": {"mean": tok_s}, "effective_gb_s": tok_s * n_bytes / 1e9,
            "read_ceiling": {"value": ceiling}}


def test_verdict_memory_bound_and_not_clean():
    clean = fit_verdicts([_row("a", 2e9, 15.0), _row("b", 4e9, 7.6), _row("c", 6e9, 5.0)])[0]
    assert clean["memory_bound"] and clean["verdict"].startswith("clearly memory-bound")
    assert clean["share_of_read"] == pytest.approx(clean["fit"]["gb_s"] / 40)
    flat = fit_verdicts([_row("a", 1e9, 10.0, "q4_0"), _row("b", 2e9, 9.0, "q4_0"),
                         _row("c", 4e9, 8.0, "q4_0")])[0]
    assert not flat["memory_bound"] and flat["verdict"].startswith("not clean")
    assert any("R²" in r for r in flat["reasons"])
    assert any("quantized types (q4_0)" in r for r in flat["reasons"])
    single = fit_verdicts([_row("a", 1e9, 10.0)])[0]
    assert single["fit"] is None and single["verdict"].startswith("no fit")


def test_ceiling_beside_uses_the_probes_around_a_record():
    probes = [{"seq": 2, "result": {"threads": {"2": {"read_gb_s": 20.0}}}},
              {"seq": 9, "result": {"threads": {"2": {"read_gb_s": 22.0}}}}]
    c = analysis.ceiling_beside(probes, 5, 2, "read_gb_s")
    assert c["value"] == 21.0 and c["drift"] == pytest.approx(0.1)
    assert analysis.ceiling_beside([], 5, 2, "read_gb_s")["value"] is None


def test_probe_structure_on_tiny_arrays():
    r = probe([1, 2], 4 << 20, 5, matmul_n=32)
    assert r["array_n_bytes"] == 4 << 20 and r["passes"] == 5
    assert set(r["threads"]) == {"1", "2"}
    for v in r["threads"].values():
        assert len(v["read_samples_gb_s"]) == 5 and v["read_gb_s"] == max(v["read_samples_gb_s"])
        assert len(v["copy_samples_gb_s"]) == 5 and v["matmul_gflop_s"] > 0


def test_probe_shrinks_arrays_when_ram_is_short(monkeypatch):
    import harness.probe as p

    monkeypatch.setattr(p, "available_ram_bytes", lambda: 64 << 20)
    n, notes = plan_array_n_bytes(1 << 30)
    assert n == 16 << 20
    assert any("shrunk from 1024 MiB to 16 MiB" in note for note in notes)
