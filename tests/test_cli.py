import json
from pathlib import Path

import pytest
from conftest import FIXTURES, assert_user_error, run_subprocess

from harness.core.specs import load_spec_file, n_params, resolve_spec

HF = FIXTURES / "hf"


def test_models_table_lists_every_spec(run_cli):
    r = run_cli("models")
    assert r.exit_code == 0
    for name in ("qwen2.5-0.5b", "llama-3.1-8b", "tiny-llama"):
        assert name in r.stdout
    assert "494,032,768" in r.stdout and "1.84 GiB" in r.stdout


def test_models_json(run_cli):
    rows = json.loads(run_cli("models", "--json").stdout)
    by_name = {r["name"]: r for r in rows}
    q = by_name["qwen2.5-0.5b"]
    assert q["n_params"] == 494_032_768
    assert q["weights_n_bytes"]["f32"] == 494_032_768 * 4
    assert q["kv_n_bytes_per_token_f16"] == 24 * 2 * 128 * 2  # layers x (K+V) x kv_dim x 2 B
    # tied: the embedding is read whole as the output layer
    assert q["decode_weight_n_bytes_f32"] == 494_032_768 * 4
    l8 = by_name["llama-3.1-8b"]
    embedding = 128256 * 4096 * 4
    assert l8["decode_weight_n_bytes_f32"] == l8["weights_n_bytes"]["f32"] - embedding + 4096 * 4
    # a mixture of experts: total and active parameters, the expert tensors named, and the
    # bytes a decode step reads with 8 of 128 experts
    moe = by_name["qwen3-30b-a3b"]
    assert (moe["n_params"], moe["n_active_params"]) == (30_532_122_624, 3_353_032_704)
    assert moe["experts"] == {"n_experts": 128, "per_token": 8, "width": 768}
    experts = moe["params_by_role"]["expert"]
    assert experts == 48 * 128 * 3 * 2048 * 768
    assert moe["decode_weight_n_bytes_f32"] == 4 * (moe["n_params"] - experts + experts // 16
                                                    - (151936 - 1) * 2048)


def test_build_prints_the_path(run_cli, tmp_path):
    r = run_cli("build", "tiny-qwen2", "--dtype", "f16", "--cache-dir", str(tmp_path))
    assert r.exit_code == 0
    path = r.stdout.strip()
    assert path.startswith(str(tmp_path)) and path.endswith(".gguf")
    again = run_cli("build", "tiny-qwen2", "--dtype", "f16", "--cache-dir", str(tmp_path))
    assert again.stdout.strip() == path and "cached" in again.stderr


def test_build_from_spec_file_with_out(run_cli, tmp_path):
    spec = FIXTURES.parent.parent / "models" / "tiny-llama.yaml"
    out = tmp_path / "m.gguf"
    r = run_cli("build", str(spec), "--dtype", "q8_0", "--out", str(out), "--seed", "5")
    assert r.exit_code == 0 and r.stdout.strip() == str(out) and out.stat().st_size > 0


def test_env_json(run_cli):
    info = json.loads(run_cli("env", "--json").stdout)
    assert info["physical_cores"] >= 1 and info["ram_total_bytes"] > 0
    assert info["llama"]["ggml_commit"] and info["llama"]["llama_cpp_python"]
    assert "AVX" in info["llama"]["system_info"] or info["llama"]["system_info"]


@pytest.mark.parametrize("args,needles", [
    (["build", "nope"], ["unknown model 'nope'", "known models:", "qwen2.5-0.5b"]),
    (["build", "tiny-qwen2", "--dtype", "q9"], ["--dtype", "unknown dtype 'q9'", "q4_k_m"]),
    (["build", "missing.yaml"], ["missing.yaml", "not found"]),
    (["build", "tiny-qwen2", "--cache-dir", "/proc/self/nope"], ["not writable"]),
    (["models", "import", str(HF / "gpt2-config.json"), "-o", "/tmp/x.yaml"],
     ["unsupported model_type 'gpt2'", "llama, qwen2, mistral"]),
    (["models", "import", "not/a/real/thing"], ["neither a local file nor a hub repo id"]),
])
def test_bad_input_is_one_line_and_exit_2(run_cli, args, needles):
    assert_user_error(run_cli(*args), *needles)


def test_bad_spec_file_through_the_real_entry_point(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("architecture: llama\nhidden_size: 60\nnum_hidden_layers: 1\n"
                   "num_attention_heads: 7\nintermediate_size: 8\nvocab_size: 300\n")
    r = run_subprocess("build", str(bad))
    assert_user_error(r, str(bad), ":4", "num_attention_heads", "do not divide hidden_size 60")


def test_not_a_yaml_directory(run_cli, tmp_path):
    d = tmp_path / "dir.yaml"
    d.mkdir()
    assert_user_error(run_cli("build", str(d)), "is a directory")


@pytest.mark.parametrize("config,real", [
    ("qwen2-0.5b-config.json", "qwen2.5-0.5b"),
    ("llama-3.2-1b-config.json", "llama-3.2-1b"),
    ("qwen3-0.6b-config.json", "qwen3-0.6b"),
    ("mistral-7b-config.json", "mistral-7b-v0.3"),
    # mixtures of experts (configs with the shapes, in Hugging Face's key names)
    ("qwen3-30b-a3b-config.json", "qwen3-30b-a3b"),
    ("mixtral-8x7b-config.json", "mixtral-8x7b"),
    ("qwen1.5-moe-a2.7b-config.json", "qwen1.5-moe-a2.7b"),
    ("olmoe-1b-7b-config.json", "olmoe-1b-7b"),
    ("granite-3.0-1b-a400m-config.json", "granite-3.0-1b-a400m"),
])
def test_import_reproduces_the_bundled_spec(run_cli, tmp_path, config, real):
    out = tmp_path / "spec.yaml"
    r = run_cli("models", "import", str(HF / config), "-o", str(out), "--name", real)
    assert r.exit_code == 0, r.stderr
    imported, bundled = load_spec_file(out), resolve_spec(real)
    assert imported.to_dict() | {"source": None} == bundled.to_dict() | {"source": None}


def test_import_mistral_maps_to_llama(run_cli, tmp_path):
    out = tmp_path / "mistral.yaml"
    assert run_cli("models", "import", str(HF / "mistral-7b-config.json"), "-o", str(out)
                   ).exit_code == 0
    spec = load_spec_file(out)
    assert spec.architecture == "llama" and n_params(spec) == 7_248_023_552


def test_import_copies_granite_scales_and_refuses_mixed_dense_layers(run_cli, tmp_path):
    config = json.loads((HF / "granite-3.0-1b-a400m-config.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config | {"logits_scaling": 6.0}))
    out = tmp_path / "g.yaml"
    assert run_cli("models", "import", str(path), "-o", str(out)).exit_code == 0
    assert load_spec_file(out).logits_scaling == 6.0
    qwen = json.loads((HF / "qwen3-30b-a3b-config.json").read_text())
    path.write_text(json.dumps(qwen | {"mlp_only_layers": [0, 1]}))
    r = run_cli("models", "import", str(path), "-o", str(tmp_path / "q.yaml"))
    assert_user_error(r, "mlp_only_layers", "every layer")


def test_import_refuses_to_overwrite(run_cli, tmp_path):
    out = tmp_path / "s.yaml"
    out.write_text("keep me")
    r = run_cli("models", "import", str(HF / "qwen2-0.5b-config.json"), "-o", str(out))
    assert_user_error(r, "exists already", "--force")
    assert out.read_text() == "keep me"


def test_an_internal_error_is_one_line_not_a_traceback(run_cli, monkeypatch):
    import harness.core.specs

    def broken(directory=None):
        raise TypeError("simulated bug")

    monkeypatch.setattr(harness.core.specs, "all_specs", broken)
    monkeypatch.delenv("HARNESS_DEBUG", raising=False)
    r = run_cli("models")
    assert r.exit_code == 1 and "Traceback" not in r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.strip()]
    assert "internal error (TypeError: simulated bug)" in line and "HARNESS_DEBUG=1" in line


def test_check_lists_the_plan_without_running(run_cli, tmp_path):
    scenario = Path(__file__).resolve().parent / "scenarios" / "levers.yaml"
    r = run_cli("check", str(scenario), "--cache-dir", str(tmp_path / "cache"))
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 20 and "tg8@d64 kv=q8_0" in r.stdout and "pp8" in r.stdout
    assert "20 measurements of 2 model file(s)" in r.stderr and "still to build. OK." in r.stderr
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*.gguf"))


def test_import_maps_gemma3_text_and_keeps_its_window_but_not_qwen2s(run_cli, tmp_path):
    config = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
              "intermediate_size": 128, "vocab_size": 512, "sliding_window": 32,
              "tie_word_embeddings": True}
    src = tmp_path / "config.json"
    src.write_text(json.dumps(config))
    out = tmp_path / "g.yaml"
    assert run_cli("models", "import", str(src), "-o", str(out)).exit_code == 0
    spec = load_spec_file(out)
    assert spec.architecture == "gemma3" and spec.sliding_window == 32
    out2 = tmp_path / "q.yaml"
    assert run_cli("models", "import", str(HF / "qwen2-0.5b-config.json"), "-o", str(out2)
                   ).exit_code == 0
    assert load_spec_file(out2).sliding_window is None  # Qwen2 does not use its window


RUN = FIXTURES / "runs" / "tiny_lesson"


def test_estimate_json_for_a_spec_the_run_never_measured(run_cli):
    r = run_cli("estimate", str(RUN), "tiny-qwen2", "--dtype", "q4_0", "--context", "64",
                "--json")
    assert r.exit_code == 0, r.stderr
    e = json.loads(r.stdout)
    assert {"model", "dtype", "decode_tok_s", "decode_tok_s_ci95", "fits_in_memory",
            "prefill_tok_s", "prefill_tok_s_ci95", "n_prompt"} <= set(e)
    assert e["model"] == "tiny-qwen2" and e["dtype"] == "q4_0" and e["fits_in_memory"]
    assert e["decode_tok_s"] > 0 and e["context"] == 64 and e["estimate"] is True
    assert "streaming ceiling" in e["decode_gb_s_from"]  # the run decoded no q4_0
    text = run_cli("estimate", str(RUN), "tiny-qwen2", "--dtype", "q4_0").stdout
    assert "estimated" in text and "decode at 0 cached tokens" in text


def test_estimate_says_a_model_does_not_fit_and_lists_hardware(run_cli):
    e = json.loads(run_cli("estimate", str(RUN), "mixtral-8x7b", "--json").stdout)
    assert e["fits_in_memory"] is False and e["decode_tok_s"] is None
    assert "does not fit in memory" in e["why"]
    names = [h["name"] for h in json.loads(run_cli("estimate", "--list-hardware",
                                                   "--json").stdout)]
    assert names[0] == "this" and "nvidia-rtx-4090" in names
    gpu = json.loads(run_cli("estimate", str(RUN), "llama-3.1-8b", "--dtype", "q8_0",
                             "--hardware", "nvidia-rtx-4090", "--json").stdout)
    assert gpu["fits_in_memory"] and gpu["decode_tok_s"] > 0 and "PR #4766" in gpu["source"]


@pytest.mark.parametrize("args,needles", [
    (["estimate", str(RUN), "tiny-qwen2", "--hardware", "tpu"],
     ["--hardware", "unknown hardware 'tpu'", "nvidia-rtx-4090"]),
    (["estimate", str(RUN), "nope"], ["unknown model 'nope'"]),
    (["estimate", str(RUN), "tiny-qwen2", "--dtype", "q9"], ["--dtype", "unknown dtype"]),
    (["estimate", str(RUN)], ["estimate needs a run and a model"]),
])
def test_estimate_bad_input_is_one_line(run_cli, args, needles):
    assert_user_error(run_cli(*args), *needles)


TINY_ARCHS = ["tiny-qwen2", "tiny-llama", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3",
              "tiny-phi3", "tiny-granitemoe", "tiny-olmoe", "tiny-qwen2moe", "tiny-qwen3moe",
              "tiny-mixtral"]


@pytest.mark.parametrize("name", TINY_ARCHS)
def test_import_of_a_gguf_header_gives_back_the_spec_it_was_built_from(run_cli, tmp_path,
                                                                       name):
    from harness.core.dtypes import DTYPES
    from harness.engine.build import build
    from harness.weights.gguf_build import table_from_plan
    from harness.weights.gguf_inspect import tensor_table

    spec = resolve_spec(name)
    path = build(spec, DTYPES["f32"], 0, directory=tmp_path).path
    out = tmp_path / "spec.yaml"
    r = run_cli("models", "import", str(path), "-o", str(out), "--name", name)
    assert r.exit_code == 0, r.stderr
    imported = load_spec_file(out)
    # the same tensors (names, shapes, types, bytes) and every hyper-parameter the file holds
    assert table_from_plan(imported, DTYPES["f32"]) == tensor_table(path)
    for field in ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping",
                  "num_experts", "num_experts_per_tok", "shared_expert_intermediate_size",
                  "head_dim", "rope_theta", "tie_word_embeddings", "attention_bias"):
        assert getattr(imported, field) == getattr(spec, field), field
    assert imported.expert_width == spec.expert_width
    for field in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                  "logits_scaling"):  # Granite's scales, 1.0 where a spec leaves them unset
        assert (getattr(imported, field) or 1.0) == (getattr(spec, field) or 1.0), field


def test_import_of_a_gguf_of_an_unknown_architecture_is_one_line(run_cli, tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "mamba.gguf"
    w = GGUFWriter(str(path), "mamba")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    r = run_cli("models", "import", str(path), "-o", str(tmp_path / "m.yaml"))
    assert_user_error(r, "'mamba' is not supported", "supported: qwen2")
    assert not (tmp_path / "m.yaml").exists()
    r = run_cli("models", "import", str(tmp_path / "absent.gguf"), "-o", str(tmp_path / "m.yaml"))
    assert_user_error(r, "absent.gguf", "cannot read the GGUF file")
