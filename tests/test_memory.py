"""`harness memory`: the formulas against llama.cpp's own buffers for every built-in
architecture and cache type, the users-that-fit arithmetic, the JSON, and bad input."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import assert_user_error

from harness.analysis.memory import KvCheck, load_of
from harness.core.dtypes import DTYPES, kv_block_size
from harness.core.memory import MIB, fit, kv_n_bytes_per_sequence, kv_plan, swa_layers
from harness.core.specs import all_specs, resolve_spec
from harness.engine.build import build
from harness.engine.footprint import (
    Footprint,
    LoggedBuffer,
    RssStage,
    measure,
    parse_buffers,
    parse_caches,
)
from harness.engine.llama import ContextParams
from harness.weights.gguf_inspect import tensor_table

TINY = sorted(name for name in all_specs() if name.startswith("tiny-"))


def _params(n_ctx: int, n_seq: int = 1, kv: str = "f16", **kw) -> ContextParams:
    return ContextParams(n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=1, type_k=kv,
                         type_v=kv, n_seq_max=n_seq,
                         flash_attn=True if kv != "f16" else None, **kw)


def _check(spec, path, n_ctx, n_seq=1, kv="f16", unified=False, swa_full=True) -> KvCheck:
    f = measure(path, _params(n_ctx, n_seq, kv, kv_unified=unified, swa_full=swa_full),
                use_mmap=True, fill=False, prefill=False)
    plan = kv_plan(spec, n_ctx, n_seq, kv, kv, unified=unified, swa_full=swa_full)
    assert (f.n_ctx, f.n_ctx_seq) == (plan.n_ctx, plan.n_ctx_seq)
    return KvCheck(plan, f.caches)


@pytest.mark.parametrize("name", TINY)
def test_the_kv_formula_equals_llama_cpps_buffer_for_every_architecture(name, tmp_path):
    spec = resolve_spec(name)
    path = build(spec, DTYPES["f32"], directory=tmp_path).path
    for kv in ("f16", "q8_0", "q4_0"):
        if spec.head_dim % kv_block_size(kv):
            continue
        check = _check(spec, path, 1000, 1, kv)
        assert check.equal, (kv, check)


@pytest.mark.parametrize("n_ctx, n_seq, unified, swa_full", [
    (100, 1, False, True),  # padded up to 256
    (1000, 3, False, True),  # each sequence's share padded: 3 × 512
    (1000, 3, True, True),  # one stream for all three
    (1000, 1, False, False),  # the window plus a ubatch, padded
    (1000, 3, True, False),  # the window of every sequence sharing the stream
    (600, 2, False, False),
])
@pytest.mark.parametrize("name", ["tiny-gemma2", "tiny-gemma3", "tiny-qwen2"])
def test_padding_sequences_and_sliding_windows_as_llama_cpp_allocates(name, n_ctx, n_seq,
                                                                      unified, swa_full,
                                                                      tmp_path):
    spec = resolve_spec(name)
    path = build(spec, DTYPES["f32"], directory=tmp_path).path
    check = _check(spec, path, n_ctx, n_seq, "f16", unified, swa_full)
    assert check.equal, check


def test_sliding_window_layers_follow_llama_cpps_pattern():
    g2, g3 = resolve_spec("tiny-gemma2"), resolve_spec("tiny-gemma3")
    assert swa_layers(replace(g2, num_hidden_layers=5)) == [True, False, True, False, True]
    assert swa_layers(replace(g3, num_hidden_layers=7)) == [True] * 5 + [False, True]
    assert swa_layers(resolve_spec("tiny-qwen2")) == [False, False]
    plan = kv_plan(replace(g3, num_hidden_layers=7), 1000, swa_full=False)
    assert [(c.kind, c.n_layers, c.n_cells) for c in plan.caches] == [
        ("full", 1, 1024), ("sliding window", 6, 768)]


def test_the_issues_known_values_per_token():
    """qwen2.5-0.5b 12,288 (F16) and 6,528 (Q8_0) bytes per token; llama-3.2-1b 32,768;
    qwen2.5-1.5b 28,672."""
    q05, l1, q15 = (resolve_spec(n) for n in ("qwen2.5-0.5b", "llama-3.2-1b", "qwen2.5-1.5b"))
    assert kv_n_bytes_per_sequence(q05, 256) == 12_288 * 256
    assert kv_n_bytes_per_sequence(q05, 256, "q8_0", "q8_0") == 6_528 * 256
    assert kv_n_bytes_per_sequence(l1, 256) == 32_768 * 256
    assert kv_n_bytes_per_sequence(q15, 256) == 28_672 * 256


def test_weights_formula_gives_the_files_tensor_bytes_per_type(tmp_path):
    from harness.core.memory import weight_types

    spec = resolve_spec("tiny-qwen2")
    for dtype in ("f32", "q8_0", "q4_0"):
        table = tensor_table(build(spec, DTYPES[dtype], directory=tmp_path).path)
        types = weight_types(table)
        assert all(w.formula_n_bytes == w.file_n_bytes for w in types), types
        assert sum(w.n_params for w in types) == sum(t.n_elements for t in table)
    q4 = {w.type_name: w for w in types}["q4_0"]
    assert (q4.block_size, q4.block_n_bytes, q4.bytes_per_weight) == (32, 18, 0.5625)


def test_users_that_fit_at_the_boundary():
    spec = resolve_spec("qwen2.5-0.5b")
    per_seq = 12_288 * 4096
    fixed = 700 * MIB
    exact = fit(spec, fixed + 5 * per_seq, fixed, 4096)
    assert (exact.n_sequences, exact.per_sequence_n_bytes) == (5, per_seq)
    assert fit(spec, fixed + 5 * per_seq - 1, fixed, 4096).n_sequences == 4
    assert fit(spec, fixed - 1, fixed, 4096).n_sequences == 0
    logits = 151_936 * 4
    with_logits = fit(spec, fixed + 5 * (per_seq + logits), fixed, 4096,
                      output_n_bytes_per_sequence=logits)
    assert with_logits.n_sequences == 5
    assert fit(spec, fixed + 5 * (per_seq + logits) - 1, fixed, 4096,
               output_n_bytes_per_sequence=logits).n_sequences == 4
    # the longest context: whole steps of 256 cells, or the trained context
    short = fit(spec, fixed + 12_288 * 1000, fixed, 4096)
    assert (short.longest_context, short.longest_capped) == (768, False)
    assert fit(spec, 1 << 40, fixed, 4096).longest_context == spec.max_position_embeddings


def test_a_sliding_window_model_fits_longer_contexts_without_a_full_size_window():
    g3 = replace(resolve_spec("tiny-gemma3"), num_hidden_layers=12, max_position_embeddings=1 << 20)
    per_full_token = kv_n_bytes_per_sequence(g3, 256) / 256
    ram = int(per_full_token * 40_000)
    full = fit(g3, ram, 0, 4096)
    windowed = fit(g3, ram, 0, 4096, swa_full=False)
    assert full.longest_context == 39_936
    assert windowed.longest_context > 4 * full.longest_context


def test_llama_cpps_log_lines_are_read():
    lines = ["load_tensors:   CPU_Mapped model buffer size =   327.83 MiB",
             "load_tensors:   CPU_REPACK model buffer size =   191.95 MiB",
             "llama_context:        CPU  output buffer size =     0.58 MiB",
             "llama_kv_cache:        CPU KV buffer size =    25.50 MiB",
             "llama_kv_cache: size =   25.50 MiB (  1024 cells,  24 layers,  4/4 seqs), "
             "K (q8_0):   12.75 MiB, V (q8_0):   12.75 MiB",
             "sched_reserve:        CPU compute buffer size =   300.25 MiB"]
    assert [(b.holds, b.where, b.mib) for b in parse_buffers(lines)] == [
        ("model", "CPU_Mapped", 327.83), ("model", "CPU_REPACK", 191.95),
        ("output", "CPU", 0.58), ("KV", "CPU", 25.5), ("compute", "CPU", 300.25)]
    (cache,) = parse_caches(lines)
    assert (cache.n_cells, cache.n_layers, cache.n_streams, cache.type_k) == (1024, 24, 4, "q8_0")


def _footprint(rss_mib: list[float], compute: float = 300.0) -> Footprint:
    names = ["before loading", "model loaded", "context created", "first token decoded"]
    stages = tuple(RssStage(n, int(r * MIB), None, None, 0.0)
                   for n, r in zip(names, rss_mib, strict=True))
    buffers = (LoggedBuffer("model", "CPU", 300.0), LoggedBuffer("KV", "CPU", 48.0),
               LoggedBuffer("output", "CPU", 1.0), LoggedBuffer("compute", "CPU", compute))
    return Footprint(False, _params(4096), 4096, 4096, 0, 0, 0, buffers, (), stages, 512)


def test_rss_is_explained_by_the_parts_or_the_gap_is_named():
    # every buffer touched: RSS within 10% of the parts
    assert load_of(_footprint([50, 352, 402, 700])).explained
    # the compute buffer barely touched: 40% below the parts, explained once it is counted
    # at what the prefill touched
    ld = load_of(_footprint([50, 352, 402, 440]))
    assert not ld.explained and ld.gap < -0.1
    assert ld.compute_touched_mib == pytest.approx(38.0)
    assert abs(ld.gap_without_untouched) < 0.02
    assert ld.kv_resident_at_creation is True
    assert load_of(_footprint([50, 352, 360, 400])).kv_resident_at_creation is False


def test_memory_command_reports_formula_and_measurement(run_cli):
    r = run_cli("memory", "tiny-qwen2", "--context", "300", "--parallel", "2", "--mmap", "on",
                "--ram", "1GB", "--json")
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["schema"] == "harness.memory/1"
    assert d["context"] == {"asked": 300, "n_seq": 2, "n_ctx": 1024, "n_ctx_seq": 512}
    assert d["kv_cache"]["equal"] is True
    assert d["kv_cache"]["n_bytes_per_token"] == 2 * 2 * 32 * 2
    assert d["weights"]["formula_n_bytes"] == d["weights"]["file_n_bytes"]
    (load,) = d["loads"]
    assert [s["stage"] for s in load["stages"]] == [
        "before loading", "model loaded", "context created", "first token decoded"]
    assert load["model_n_bytes"] == d["weights"]["file_n_bytes"]
    f16 = d["fit"]["rows"][0]
    assert d["fit"]["ram_n_bytes"] == 10**9 and d["fit"]["ram_from"] == "--ram"
    per_seq = 256 * 512 + d["fit"]["output_n_bytes_per_sequence"]
    assert f16["n_sequences"] == (10**9 - d["fit"]["fixed_n_bytes"]) // per_seq
    assert d["fit"]["output_n_bytes_per_sequence"] == 512 * 4  # a row of f32 logits
    text = run_cli("memory", "tiny-qwen2", "--context", "256", "--mmap", "off",
                   "--fill").stdout
    assert "The formula equals llama.cpp's KV buffer" in text
    assert "cache filled" in text and "not filled" not in text


@pytest.mark.parametrize("args, needles", [
    (["--parallel", "0"], ["--parallel", "give 1 or more"]),
    (["--context", "4096"], ["--context", "trained for 2,048"]),
    (["--kv-type", "q8_0", "tiny-llama"], ["--kv-type", "head size 16"]),
    (["--kv-type", "q5_9"], ["--kv-type", "unknown KV cache type"]),
    (["--ram", "lots"], ["--ram", "memory size"]),
    (["--hardware", "abacus"], ["--hardware", "unknown hardware"]),
])
def test_bad_input_is_refused_before_anything_is_built(args, needles, run_cli,
                                                        isolated_cache):
    model = [a for a in args if a.startswith("tiny-")] or ["tiny-qwen2"]
    args = [a for a in args if not a.startswith("tiny-")]
    args += [] if "--context" in args else ["--context", "256"]
    assert_user_error(run_cli("memory", *model, *args), *needles)
    assert not any(isolated_cache.rglob("*.gguf"))


def test_a_parallel_count_that_does_not_fit_is_refused_before_it_is_allocated(run_cli):
    ok = json.loads(run_cli("memory", "tiny-qwen2", "--context", "2048", "--mmap", "on",
                            "--ram", "64MB", "--json").stdout)
    most = ok["fit"]["rows"][0]["n_sequences"]
    assert 1 < most < 1000
    r = run_cli("memory", "tiny-qwen2", "--context", "2048", "--mmap", "on", "--ram", "64MB",
                "--parallel", str(most + 1))
    assert_user_error(r, "--parallel", "fit; give --parallel")
    # the count it names comes from a fresh process, whose own RSS moves by a page or so
    named = int(r.stderr.split("at most ")[1].split()[0])
    assert most - 1 <= named <= most
    fits = run_cli("memory", "tiny-qwen2", "--context", "2048", "--mmap", "on", "--ram",
                   "64MB", "--parallel", str(most - 1), "--json")
    assert fits.exit_code == 0, fits.stderr
    assert json.loads(fits.stdout)["context"]["n_seq"] == most - 1


def test_the_page_names_the_sliding_window_and_the_resident_cache(run_cli):
    text = run_cli("memory", "tiny-gemma2", "--context", "1000", "--mmap", "on").stdout
    assert "slides a window of 64 tokens over 1 of its 2 layers" in text
    assert "at the full context (swa_full, its default)" in text
    assert "1,024 cells for the 1,000 asked (it rounds" in text
    assert "| sliding window | 1 | 1,024 | 1 |" in text


def test_a_catalogue_machines_fit_is_called_modelled(run_cli):
    args = ("memory", "tiny-qwen2", "--context", "256", "--mmap", "off")
    modelled = run_cli(*args, "--hardware", "nvidia-rtx-4090")
    assert modelled.exit_code == 0, modelled.stderr
    assert "Modelled: that machine's memory" in modelled.stdout
    here = run_cli(*args, "--ram", "2GB", "--json")
    assert json.loads(here.stdout)["fit"]["modelled"] is False
    assert "Modelled" not in run_cli(*args, "--ram", "2GB").stdout
