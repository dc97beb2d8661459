import textwrap

import pytest

from harness.core.errors import HarnessError
from harness.engine.scenario import load_scenario

BASE = """\
name: t
models: [tiny-qwen2]
tests:
  - {prompt: 8, generate: 4}
"""


def write(tmp_path, text: str, name: str = "s.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_cross_product_and_defaults(tmp_path):
    p = write(tmp_path, """\
        name: sweep
        models: [tiny-qwen2, tiny-llama]
        dtypes: [f32, q8_0]
        threads: [1, auto]
        repetitions: 4
        tests:
          - {prompt: [8, 16, 32], generate: 0}
          - {prompt: 4, generate: [2, 4], repetitions: 2, threads: 1, n_batch: 64, n_ubatch: 32}
        """)
    s = load_scenario(p, physical_cores=3)
    assert len(s.measurements) == 2 * 2 * 2 * 3 + 2 * 2 * 1 * 2
    first = s.measurements[0]
    assert first.settings.repetitions == 4 and first.settings.warmup == 1
    assert first.settings.n_batch == 2048 and first.settings.n_ubatch == 512
    assert {m.settings.threads for m in s.measurements[:24]} == {1, 3}
    overridden = [m for m in s.measurements if m.n_prompt == 4]
    assert {m.settings.threads for m in overridden} == {1}
    assert {(m.settings.repetitions, m.settings.n_batch, m.settings.n_ubatch)
            for m in overridden} == {(2, 64, 32)}
    assert len({m.id for m in s.measurements}) == len(s.measurements)
    assert s.text == p.read_text() and len(s.sha256) == 64


def test_scalars_are_lists_of_one(tmp_path):
    s = load_scenario(write(tmp_path, BASE.replace("[tiny-qwen2]", "tiny-qwen2")), 2)
    assert len(s.measurements) == 1 and s.measurements[0].n_seq_ctx == 12
    assert s.measurements[0].n_ctx == 256  # rounded up as deployments size contexts


def test_contexts_are_whole_blocks_of_256_per_sequence(tmp_path):
    """Every context is its sequences' tokens rounded up to 256 cells each (a depth test's
    baseline and a batch's sequences each get a share; a prefix test's unified cache holds
    the prefix and two copies of the question); the id names it."""
    from harness.engine.measure import context_params

    s = load_scenario(write(tmp_path, """\
        name: ctx
        models: [tiny-qwen2]
        tests:
          - {prompt: [64, 72, 80, 250, 300], generate: 0}
          - {prompt: 64, generate: 16, depth: 512}
          - {prompt: 64, generate: 16, parallel: 4}
          - {prompt: 64, shared_prefix: 1000}
        """), 2)
    got = {(m.kind, m.n_prompt, m.depth, m.parallel): (m.n_ctx, m.n_ctx_total, m.n_seq_max)
           for m in s.measurements}
    assert got == {("single", 64, 0, 1): (256, 256, 1), ("single", 72, 0, 1): (256, 256, 1),
                   ("single", 80, 0, 1): (256, 256, 1), ("single", 250, 0, 1): (256, 256, 1),
                   ("single", 300, 0, 1): (512, 512, 1),
                   ("single", 64, 512, 1): (768, 1536, 2),
                   ("batched", 64, 0, 4): (256, 1024, 4),
                   ("prefix_cache", 64, 0, 1): (1280, 1280, 2)}
    assert [m.id.split("|")[6] for m in s.measurements[:5]] == ["ctx256"] * 4 + ["ctx512"]
    params = {m.kind: context_params(m) for m in s.measurements}
    assert (params["batched"].n_ctx, params["batched"].n_seq_max,
            params["batched"].kv_unified) == (1024, 4, False)
    assert (params["prefix_cache"].n_ctx, params["prefix_cache"].kv_unified) == (1280, True)


def test_n_ctx_is_set_at_the_top_or_per_test_and_names_the_cell(tmp_path):
    s = load_scenario(write(tmp_path, """\
        name: ctx
        models: [tiny-qwen2]
        n_ctx: 1024
        tests:
          - {prompt: 64, generate: 16}
          - {prompt: 64, generate: 16, n_ctx: 256}
          - {prompt: 64, generate: 16, parallel: 2, n_ctx: 512, name: batch}
        """), 2)
    a, b, c = s.measurements
    assert (a.n_ctx, b.n_ctx, c.n_ctx, c.n_ctx_total) == (1024, 256, 512, 1024)
    assert a.id != b.id and "|ctx1024|" in a.id and "|ctx256|" in b.id  # never paired


@pytest.mark.parametrize("text, words", [
    ("n_ctx: 300", "not a multiple of 256"),
    ("n_ctx: 0", "too small"),
    ("n_ctx: 4096", "exceeds tiny-qwen2's context length 2,048"),
])
def test_bad_n_ctx_is_refused(tmp_path, text, words):
    with pytest.raises(HarnessError) as info:
        load_scenario(write(tmp_path, BASE.replace("tests:", f"{text}\ntests:")), 2)
    assert words in info.value.render() and "n_ctx" in info.value.render()


def test_flash_attn_and_spec_file_models(tmp_path, request):
    spec = request.config.rootpath / "models" / "tiny-llama.yaml"
    s = load_scenario(write(tmp_path, f"""\
        name: t
        models: ["{spec}"]
        flash_attn: true
        tests:
          - {{prompt: 8, flash_attn: false}}
          - {{prompt: 9}}
        """), 2)
    assert [m.settings.flash_attn for m in s.measurements] == [False, True]
    assert s.measurements[0].model.spec_name == "tiny-llama"


BAD = [
    ("name: t\nmodels: [tiny-qwen2]\ntets: []\n", "tets", "did you mean 'tests'", 3),
    (BASE + "repetitons: 3\n", "repetitons", "did you mean 'repetitions'", 5),
    (BASE.replace("prompt: 8", "promt: 8"), "tests[0].promt", "did you mean 'prompt'", 4),
    (BASE + "repetitions: 0\n", "repetitions", "use at least 1", 5),
    (BASE + "repetitions: -2\n", "repetitions", "too small", 5),
    (BASE + "warmup: two\n", "warmup", "expected a whole number", 5),
    (BASE + "threads: [1, many]\n", "threads[1]", "expected a whole number", 5),
    (BASE + "n_batch: 16\nn_ubatch: 64\n", "n_ubatch", "exceeds n_batch", 6),
    (BASE + "dtypes: [f32, f33]\n", "dtypes[1]", "unknown dtype 'f33'", None),
    (BASE + "dtypes: []\n", "dtypes", "empty list", 5),
    (BASE.replace("tiny-qwen2", "tiny-qwen9"), "models[0]", "unknown model 'tiny-qwen9'", 2),
    (BASE.replace("tiny-qwen2", "nowhere/x.gguf"), "models[0]", "not found", 2),
    (BASE.replace("generate: 4", "generate: 4000"), "tests[0].prompt",
     "exceeds tiny-qwen2's context length 2,048", 4),
    (BASE.replace("prompt: 8, generate: 4", "prompt: 0"), "tests[0].prompt",
     "both 0", 4),
    (BASE + "  - {prompt: 8, generate: 4}\n", "tests", "repeats a measurement", 3),
    (BASE.replace("tests:\n  - {prompt: 8, generate: 4}\n", "tests: []\n"), "tests",
     "empty list", 3),
    (BASE + "seed: 1.5\n", "seed", "whole number", 5),
    (BASE + "flash_attn: sometimes\n", "flash_attn", "true, false or auto", 5),
    ("models: [tiny-qwen2]\ntests: [{prompt: 1}]\n", None, "missing required key 'name'", 1),
    ("- just\n- a list\n", None, "expected a mapping", 1),
    ("name: t\nmodels: [tiny-qwen2\n", None, "invalid YAML", 3),
    (BASE + "name: again\n", "name", "duplicate key 'name'", 5),
    (BASE.replace("prompt: 8", "prompt: 99999999999"), "tests[0].prompt", "too large", 4),
]


@pytest.mark.parametrize("text,key,words,line", BAD)
def test_validation_errors_name_file_line_and_key(tmp_path, text, key, words, line):
    p = write(tmp_path, text)
    with pytest.raises(HarnessError) as info:
        load_scenario(p, 2)
    message = info.value.render()
    assert message.startswith(str(p)), message
    assert words in message, message
    if key:
        assert f"{key}:" in message, message
    if line:
        assert info.value.line == line, message


def test_lever_keys_expand_and_ids_name_every_setting(tmp_path):
    s = load_scenario(write(tmp_path, """\
        name: t
        models: [tiny-qwen2]
        threads: ["1..auto"]
        tests:
          - {prompt: 8, generate: 4}
          - {prompt: 0, generate: 4, depth: [0, 64], kv_cache_type: [f16, Q8_0]}
          - {prompt: 4, generate: 4, parallel: [2, 4]}
          - {prompt: 8, shared_prefix: 128}
        """), physical_cores=3)
    assert sorted({m.settings.threads for m in s.measurements}) == [1, 2, 3]
    plain = s.measurements[0]
    assert (plain.id == "tiny-qwen2|f32|t1|b2048|ub512|fa-auto|ctx256|pp8|tg4"
            and plain.kind == "single")
    deep = [m for m in s.measurements if m.depth == 64 and m.kv_type == "q8_0"]
    assert len(deep) == 3 and deep[0].id.endswith("|d64|kv-q8_0")
    assert (deep[0].n_ctx, deep[0].n_ctx_total) == (256, 2 * 256)
    batched = [m for m in s.measurements if m.parallel == 4]
    assert batched[0].kind == "batched" and batched[0].n_ctx_total == 4 * 256
    prefix = [m for m in s.measurements if m.shared_prefix][0]
    assert prefix.kind == "prefix_cache" and prefix.id.endswith("|px128")
    assert prefix.n_seq_ctx == 136
    assert len({m.id for m in s.measurements}) == len(s.measurements) == 3 * (1 + 4 + 2 + 1)


def test_relative_gguf_paths_are_found_beside_the_scenario(tmp_path):
    from harness.core.dtypes import DTYPES
    from harness.core.specs import resolve_spec
    from harness.engine.build import build

    built = build(resolve_spec("tiny-llama"), DTYPES["f32"], out=tmp_path / "sub" / "m.gguf")
    s = load_scenario(write(tmp_path / "sub", BASE.replace("[tiny-qwen2]", "[m.gguf]")), 2)
    assert s.measurements[0].model.gguf_path == built.path


def test_auto_repetitions_and_their_policy(tmp_path):
    path = tmp_path / "auto.yaml"
    path.write_text("name: a\nmodels: [tiny-qwen2]\nrepetitions: auto\ntarget_ci: 0.05\n"
                    "max_seconds: 90\nmin_repetitions: 8\ntests:\n"
                    "  - {prompt: 8, generate: 4}\n"
                    "  - {prompt: 16, generate: 0, repetitions: 4}\n")
    plan = load_scenario(path, physical_cores=2)
    auto, fixed = (m.settings.policy for m in plan.measurements)
    assert auto.auto and auto.target_ci == 0.05 and auto.min_repetitions == 8
    assert auto.max_repetitions == 200 and plan.max_seconds == 90.0
    assert not fixed.auto and fixed.repetitions == 4 and fixed.target_ci == 0.05
