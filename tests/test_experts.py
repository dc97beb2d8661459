"""Mixture of experts: active bytes, the expert union at B sequences, and the report's two
predictions, on a tiny dense model and a tiny MoE model run end to end."""

import math
from pathlib import Path

import pytest
from conftest import measure_scenario

from harness.core.costs import (
    TensorEntry,
    decode_weight_n_bytes,
    expert_union_fraction,
    matmul_params_per_token,
    step_weight_n_bytes,
)
from harness.core.specs import resolve_spec
from harness.core.stats import center
from harness.report.page import render_markdown, report_data
from harness.runner import Console
from harness.study.analyze import analyze_records

SCENARIO = Path(__file__).resolve().parent / "scenarios" / "moe.yaml"
QUIET = Console(warn=lambda msg: None, info=lambda msg: None)


def test_union_of_experts_follows_the_formula():
    assert expert_union_fraction(8, 2, 1) == pytest.approx(0.25)
    assert expert_union_fraction(8, 2, 2) == pytest.approx(1 - 0.75 ** 2)
    assert expert_union_fraction(128, 8, 16) == pytest.approx(1 - (120 / 128) ** 16)
    assert expert_union_fraction(4, 4, 3) == 1.0  # every expert used: all read


def test_decode_reads_k_of_e_experts_and_the_rest_whole():
    table = [TensorEntry("token_embd.weight", (10, 4), "F32", 160),
             TensorEntry("output.weight", (10, 4), "F32", 160),
             TensorEntry("blk.0.ffn_gate_inp.weight", (8, 4), "F32", 128),
             TensorEntry("blk.0.ffn_up_exps.weight", (8, 6, 4), "F32", 768),
             TensorEntry("blk.0.ffn_down_shexp.weight", (4, 6), "F32", 96)]
    # one embedding row + output + router + shared expert + 2 of 8 experts
    assert decode_weight_n_bytes(table, 2 / 8) == 16 + 160 + 128 + 96 + 192
    spec = resolve_spec("tiny-qwen3moe")
    solo = decode_weight_n_bytes(table, 2 / 8)
    assert step_weight_n_bytes(solo, 768, spec, 1) == pytest.approx(solo)
    assert step_weight_n_bytes(solo, 768, spec, 3) == pytest.approx(
        solo - 192 + 768 * (1 - 0.75 ** 3))
    dense = resolve_spec("tiny-qwen2")
    assert step_weight_n_bytes(1000, 0, dense, 4) == 1000


def test_prefill_flops_count_the_active_experts_only():
    spec = resolve_spec("tiny-qwen3moe")
    e, f = spec.hidden_size, spec.expert_width
    attention = e * spec.q_dim * 2 + 2 * e * spec.kv_dim
    per_layer = attention + spec.num_experts * e + spec.num_experts_per_tok * 3 * e * f
    assert matmul_params_per_token(spec) == spec.num_hidden_layers * per_layer


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    return measure_scenario(SCENARIO, tmp_path_factory.mktemp("moe"))[1]


def test_the_moe_model_record_holds_its_experts_and_active_bytes(moe_run):
    model = moe_run.models["tiny-qwen3moe|f32"]
    spec = resolve_spec("tiny-qwen3moe")
    experts = model.expert_n_bytes
    assert experts == 3 * spec.num_hidden_layers * spec.num_experts * 64 * 32 * 4
    embedding_but_one_row = (spec.vocab_size - 1) * spec.hidden_size * 4  # untied: a lookup
    assert model.decode_weight_n_bytes == pytest.approx(
        model.weights_n_bytes - embedding_but_one_row - experts + experts * 2 / 8, abs=8)
    assert moe_run.models["tiny-qwen2|f32"].expert_n_bytes == 0


def test_report_shows_both_predictions_and_which_one_the_decode_follows(moe_run):
    a = analyze_records(moe_run)
    rows = {r["model"]: r for r in a["experts"]}
    moe, dense = rows["tiny-qwen3moe"], rows["tiny-qwen2"]
    assert moe["experts"] == "2 of 8" and dense["experts"] == "dense"
    assert moe["gb_s"] == pytest.approx(dense["active_n_bytes"] * center(dense["tok_s"]) / 1e9)
    assert moe["by_file_tok_s"] == pytest.approx(moe["gb_s"] * 1e9 / moe["file_n_bytes"])
    assert moe["by_active_tok_s"] == pytest.approx(moe["gb_s"] * 1e9 / moe["active_n_bytes"])
    assert moe["by_file_tok_s"] < moe["by_active_tok_s"]
    closer = min(("active bytes", moe["by_active_tok_s"]), ("file size", moe["by_file_tok_s"]),
                 key=lambda p: abs(math.log(center(moe["tok_s"]) / p[1])))[0]
    assert moe["follows"] == closer and dense["follows"] is None
    text = render_markdown(report_data(moe_run, a))
    assert "Mixture of experts: file size or active bytes?" in text
    assert f"it follows the {closer}" in text


def test_batching_an_moe_model_is_set_against_the_union_of_experts(moe_run):
    a = analyze_records(moe_run)
    rows = sorted((r for r in a["batching"] if r["model"] == "tiny-qwen3moe"),
                  key=lambda r: r["parallel"])
    assert [r["parallel"] for r in rows] == [1, 2, 4]
    for r in rows:
        assert r["experts_read"] == pytest.approx(8 * (1 - 0.75 ** r["parallel"]))
    assert rows[0]["bytes_speedup"] == pytest.approx(1.0)
    assert 1 < rows[2]["bytes_speedup"] < 4  # the union grows with B: less than B-fold
    dense = [r for r in a["batching"] if r["model"] == "tiny-qwen2" and r["parallel"] == 4]
    assert dense[0]["bytes_speedup"] > rows[2]["bytes_speedup"]
    assert "the union of their experts" in render_markdown(report_data(moe_run, a))


def test_the_run_records_which_experts_a_moe_models_tokens_picked(moe_run):
    from harness.core.costs import prefill_weight_n_bytes
    from harness.levers.experts import experts_table, routing_rows

    spec = resolve_spec("tiny-qwen3moe")
    moe = next(m for m in moe_run.models.values() if m.model == "tiny-qwen3moe")
    dense = next(m for m in moe_run.models.values() if m.model == "tiny-qwen2")
    assert dense.routing is None
    layers = moe.routing["layers"]
    assert [r["layer"] for r in layers] == list(range(spec.num_hidden_layers))
    assert all(r["decode_steps"] == moe.routing["n_decode"] for r in layers)
    rows = routing_rows(moe_run.models)
    assert [r["model"] for r in rows] == ["tiny-qwen3moe"]
    assert rows[0]["experts"] == f"{spec.num_experts_per_tok} of {spec.num_experts}"
    tables = experts_table({"experts": [], "routing": rows})
    assert tables == []  # the routing table comes with the experts table only
    # a ubatch the size the run recorded reads the experts it recorded, not the expectation
    n = moe.routing["n_prompt"]
    whole = [r for r in layers if r["prefill_tokens"] == n]
    share = sum(r["prefill_touched"] / r["n_experts"] for r in whole) / len(whole)
    k_of_e = spec.num_experts_per_tok / spec.num_experts
    assert prefill_weight_n_bytes(moe, spec, n, n) == pytest.approx(
        moe.decode_weight_n_bytes + moe.expert_n_bytes * (share - k_of_e))
    # a shorter ubatch reads what windows of that many consecutive prefill tokens touched
    windows = [dict(r["prefill_windows"])[4] / r["n_experts"] for r in whole]
    assert prefill_weight_n_bytes(moe, spec, 4, 4) == pytest.approx(
        moe.decode_weight_n_bytes + moe.expert_n_bytes * (
            sum(windows) / len(windows) - k_of_e))
    # a longer one than the run recorded: the expectation with every token picking uniformly
    expected = step_weight_n_bytes(moe.decode_weight_n_bytes, moe.expert_n_bytes, spec,
                                   n + 7)
    assert prefill_weight_n_bytes(moe, spec, n + 7, n + 7) == pytest.approx(expected)
