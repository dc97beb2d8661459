from pathlib import Path

import pytest

from harness.core.errors import HarnessError
from harness.core.specs import (
    all_specs,
    load_spec_file,
    n_active_params,
    n_params,
    resolve_spec,
    tensor_plan,
)

REAL_PARAMS = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-3b": 3_085_938_688,
    "qwen2.5-7b": 7_615_616_512,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    # issue 14's published totals: Qwen3 (q/k norms, head_dim 128) and Mistral 7B v0.3
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-4b": 4_022_468_096,
    "mistral-7b-v0.3": 7_248_023_552,
    "gemma-2-2b": 2_614_341_888,
    "gemma-3-1b": 999_885_952,
    "phi-3-mini-4k": 3_821_079_552,
    # mixtures of experts: total (every expert) and active (k experts) below
    "granite-3.0-1b-a400m": 1_334_625_280,
    "olmoe-1b-7b": 6_919_161_856,
    "qwen1.5-moe-a2.7b": 14_315_784_192,
    "qwen3-30b-a3b": 30_532_122_624,
    "mixtral-8x7b": 46_702_792_704,
}
ACTIVE_PARAMS = {
    "granite-3.0-1b-a400m": 428_655_616,
    "olmoe-1b-7b": 1_282_017_280,
    "qwen1.5-moe-a2.7b": 2_689_173_504,
    "qwen3-30b-a3b": 3_353_032_704,
    "mixtral-8x7b": 12_879_925_248,
}


@pytest.mark.parametrize("name,expected", REAL_PARAMS.items())
def test_real_parameter_counts(name, expected):
    assert n_params(resolve_spec(name)) == expected


@pytest.mark.parametrize("name,expected", ACTIVE_PARAMS.items())
def test_real_active_parameter_counts(name, expected):
    assert n_active_params(resolve_spec(name)) == expected


def test_dense_models_use_every_parameter():
    spec = resolve_spec("qwen3-4b")
    assert n_active_params(spec) == n_params(spec) and not spec.is_moe


def test_moe_tensors_are_3d_experts_a_router_and_a_shared_expert():
    spec = resolve_spec("qwen1.5-moe-a2.7b")
    plan = {t.name: t for t in tensor_plan(spec)}
    assert plan["blk.0.ffn_gate_inp.weight"].shape == (60, 2048)
    assert plan["blk.0.ffn_up_exps.weight"].shape == (60, 1408, 2048)
    assert plan["blk.0.ffn_down_exps.weight"].shape == (60, 2048, 1408)
    assert plan["blk.0.ffn_gate_inp_shexp.weight"].shape == (2048,)
    assert plan["blk.0.ffn_down_shexp.weight"].shape == (2048, 5632)
    assert plan["blk.0.ffn_up_exps.weight"].role == "expert"
    assert "blk.0.ffn_up.weight" not in plan
    olmoe = {t.name: t.shape for t in tensor_plan(resolve_spec("olmoe-1b-7b"))}
    assert olmoe["blk.0.attn_q_norm.weight"] == (2048,)  # full width, not per head


MOE_BAD = [
    ("tiny-qwen3moe", "num_experts_per_tok: 9", "num_experts_per_tok", "exceed the 8 experts"),
    ("tiny-qwen3moe", "moe_intermediate_size: 0", "moe_intermediate_size", "too small"),
    ("tiny-qwen3moe", "num_experts: null", "num_experts", "is a mixture of experts"),
    ("tiny-qwen3", "num_experts: 4", "num_experts", "reads no experts"),
    ("tiny-qwen2moe", "shared_expert_intermediate_size: null",
     "shared_expert_intermediate_size", "needs a shared expert"),
    ("tiny-qwen3moe", "shared_expert_intermediate_size: 64",
     "shared_expert_intermediate_size", "reads no shared expert"),
    ("tiny-llama", "logits_scaling: 6.0", "logits_scaling", "granitemoe"),
    ("tiny-llama", "architecture: deepseek2", "architecture", "granitemoe"),
]


@pytest.mark.parametrize("base,line,key,words", MOE_BAD)
def test_bad_moe_specs_name_file_key_and_fix(tmp_path, base, line, key, words):
    src = Path(__file__).resolve().parent.parent / "models" / f"{base}.yaml"
    kept = [x for x in src.read_text().splitlines() if not x.startswith(line.split(":")[0] + ":")]
    p = tmp_path / "bad.yaml"
    p.write_text("\n".join(kept + [line]) + "\n")
    with pytest.raises(HarnessError) as info:
        load_spec_file(p)
    message = info.value.render()
    assert str(p) in message and key in message and words in message


def test_course_f32_sizes():
    gib = {name: n_params(resolve_spec(name)) * 4 / 2**30 for name in REAL_PARAMS}
    assert round(gib["qwen2.5-0.5b"], 2) == 1.84
    assert round(gib["llama-3.2-1b"], 2) == 4.60
    assert round(gib["qwen2.5-1.5b"], 2) == 5.75


def test_bundled_specs_include_tiny_models_of_each_architecture():
    specs = all_specs()
    tiny = [s for s in specs.values() if s.name.startswith("tiny-")]
    assert {s.architecture for s in tiny} == {"llama", "qwen2", "qwen3", "gemma2", "gemma3",
                                              "phi3", "granitemoe", "olmoe", "qwen2moe",
                                              "qwen3moe"}
    assert any(s.is_moe and s.architecture == "llama" for s in tiny)  # Mixtral's form
    assert all(s.hidden_size == 64 for s in tiny)


def test_tensor_plan_shapes_qwen():
    spec = resolve_spec("qwen2.5-0.5b")
    shapes = {t.name: t.shape for t in tensor_plan(spec)}
    assert shapes["token_embd.weight"] == (151936, 896)
    assert shapes["blk.0.attn_k.weight"] == (128, 896)  # 2 KV heads x 64
    assert shapes["blk.0.attn_q.bias"] == (896,)
    assert shapes["blk.23.ffn_down.weight"] == (896, 4864)
    assert "output.weight" not in shapes  # tied embeddings


def test_head_dim_differs_from_hidden_over_heads(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("architecture: llama\nhidden_size: 64\nnum_hidden_layers: 1\n"
                 "num_attention_heads: 2\nhead_dim: 16\nintermediate_size: 32\nvocab_size: 300\n")
    spec = load_spec_file(p)
    assert spec.q_dim == 32 and spec.name == "m"
    assert {t.name: t.shape for t in tensor_plan(spec)}["blk.0.attn_output.weight"] == (64, 32)


BAD_SPECS = [
    ("num_attention_heads: 5", "num_attention_heads", "do not divide"),
    ("num_key_value_heads: 3", "num_key_value_heads", "do not divide"),
    ("hidden_size: -4", "hidden_size", "too small"),
    ("hidden_size: big", "hidden_size", "whole number"),
    ("hiden_size: 64", "hiden_size", "did you mean 'hidden_size'"),
    ("architecture: gpt2", "architecture", "supported: qwen2, llama"),
    ("vocab_size: 10", "vocab_size", "too small"),
    ("rms_norm_eps: 0", "rms_norm_eps", "out of range"),
    ("tie_word_embeddings: maybe", "tie_word_embeddings", "true or false"),
    ("attention_bias: false", "attention_bias", "needs q/k/v biases"),
]
TINY = Path(__file__).resolve().parent.parent / "models" / "tiny-qwen2.yaml"


def _with(line: str) -> str:
    key = line.split(":")[0]
    kept = [x for x in TINY.read_text().splitlines() if not x.startswith(key + ":")]
    if key == "hiden_size":
        kept = [x for x in kept if not x.startswith("hidden_size:")]
    return "\n".join(kept + [line]) + "\n"


@pytest.mark.parametrize("line,key,words", BAD_SPECS)
def test_bad_spec_fields_name_file_key_and_reason(tmp_path, line, key, words):
    p = tmp_path / "bad.yaml"
    p.write_text(_with(line))
    with pytest.raises(HarnessError) as info:
        load_spec_file(p)
    message = info.value.render()
    assert str(p) in message and key in message and words in message
    assert info.value.line is not None


def test_missing_required_field(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("architecture: llama\nhidden_size: 64\n")
    with pytest.raises(HarnessError, match="missing required key 'num_hidden_layers'"):
        load_spec_file(p)


def test_unknown_model_lists_known_ones():
    with pytest.raises(HarnessError) as info:
        resolve_spec("qwen2.5-0.6b")
    assert "did you mean 'qwen2.5-0.5b'" in info.value.render()
    assert "llama-3.2-1b" in info.value.render()


def test_qwen3_norms_q_and_k_per_head_and_has_no_biases():
    spec = resolve_spec("qwen3-0.6b")
    shapes = {t.name: t.shape for t in tensor_plan(spec)}
    assert shapes["blk.0.attn_q.weight"] == (2048, 1024)  # 16 heads × 128, wider than hidden
    assert shapes["blk.0.attn_q_norm.weight"] == shapes["blk.27.attn_k_norm.weight"] == (128,)
    assert not any(name.endswith(".bias") for name in shapes)
    assert "output.weight" not in shapes  # tied


def test_qwen3_refuses_biases(tmp_path):
    path = tmp_path / "q3.yaml"
    path.write_text("architecture: qwen3\nhidden_size: 64\nnum_hidden_layers: 1\n"
                    "num_attention_heads: 2\nintermediate_size: 64\nvocab_size: 512\n"
                    "attention_bias: true\n")
    with pytest.raises(HarnessError) as err:
        load_spec_file(path)
    assert "attention_bias" in str(err.value) and "no q/k/v biases" in str(err.value)


def test_gemma_has_four_norms_per_layer_and_phi3_fuses_its_matrices():
    gemma = {t.name: t.shape for t in tensor_plan(resolve_spec("gemma-3-1b"))}
    assert {n.split(".", 2)[2] for n in gemma if n.startswith("blk.0.") and "norm" in n} == {
        "attn_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight",
        "post_attention_norm.weight", "ffn_norm.weight", "post_ffw_norm.weight"}
    phi = {t.name: t.shape for t in tensor_plan(resolve_spec("phi-3-mini-4k"))}
    assert phi["blk.0.attn_qkv.weight"] == (3 * 3072, 3072)
    assert phi["blk.0.ffn_up.weight"] == (2 * 8192, 3072) and "blk.0.ffn_gate.weight" not in phi
    assert resolve_spec("gemma-2-2b").attn_logit_softcapping == 50.0
