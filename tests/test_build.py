import hashlib
import math
import os

import numpy as np
import pytest
from gguf import GGUFReader

from harness.core.dtypes import DTYPES
from harness.core.errors import HarnessError
from harness.core.specs import n_params, resolve_spec, tensor_plan
from harness.engine import build as build_mod
from harness.engine.build import build, cache_dir, valid_cache_entry
from harness.engine.llama import Context, ContextParams, Model
from harness.weights import gguf_build, locality
from harness.weights.gguf_build import WEIGHT_STD, file_n_bytes, write_gguf
from harness.weights.gguf_inspect import identical_weights, tensor_data_span

TINY = ["tiny-qwen2", "tiny-llama", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3", "tiny-phi3",
        "tiny-mixtral", "tiny-granitemoe", "tiny-olmoe", "tiny-qwen2moe", "tiny-qwen3moe"]


# tiny-llama, F16, seed 0: the tensor data written by builder version 1
DENSE_V1_TENSOR_SHA256 = "c0ad71425bc1427fcb39bda424a73d06617943a267edcbf580a3028727f9413a"


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0", "q4_k_m", "iq4_nl"])
def test_tiny_builds_load_and_give_finite_logits(name, dtype):
    spec = resolve_spec(name)
    built = build(spec, DTYPES[dtype])
    with Model(built.path) as model:
        info = model.info()
        assert info.n_params == n_params(spec)
        assert info.n_vocab == spec.vocab_size
        ctx = Context(model, ContextParams(n_ctx=64, n_batch=64, n_ubatch=64, n_threads=1))
        try:
            ctx.prefill(list(range(3, 35)))
            ctx.decode([7, 8])
            logits = ctx.last_logits()
        finally:
            ctx.close()
    assert len(logits) == spec.vocab_size
    assert all(math.isfinite(x) for x in logits)
    assert max(logits) != min(logits)  # a real forward pass, not zeros


@pytest.mark.parametrize("name", TINY)
def test_gguf_reader_sees_the_planned_tensors(name):
    spec = resolve_spec(name)
    built = build(spec, DTYPES["f32"])
    reader = GGUFReader(built.path)
    tensors = {t.name: t for t in reader.tensors}
    plan = tensor_plan(spec)
    assert list(tensors) == [t.name for t in plan]
    for t in plan:
        assert tuple(int(x) for x in reversed(tensors[t.name].shape)) == t.shape
    assert sum(int(t.n_elements) for t in reader.tensors) == n_params(spec)
    assert built.n_bytes == file_n_bytes(spec, DTYPES["f32"]) == built.path.stat().st_size
    fields = reader.fields
    arch = spec.architecture
    assert int(fields[f"{arch}.block_count"].parts[-1][0]) == spec.num_hidden_layers
    assert len(fields["tokenizer.ggml.tokens"].data) == spec.vocab_size
    assert int(fields["general.file_type"].parts[-1][0]) == 0


def test_weights_have_realistic_scale():
    built = build(resolve_spec("tiny-llama"), DTYPES["f32"])
    reader = GGUFReader(built.path)
    data = {t.name: np.asarray(t.data) for t in reader.tensors}
    q = data["blk.0.attn_q.weight"]
    assert abs(float(q.std()) - WEIGHT_STD) < 0.002 and abs(float(q.mean())) < 0.002
    assert np.all(data["blk.1.ffn_norm.weight"] == 1.0)
    assert not np.array_equal(data["blk.0.attn_q.weight"], data["blk.1.attn_q.weight"])


@pytest.mark.parametrize("name", ["tiny-olmoe", "tiny-mixtral"])
def test_moe_weights_keep_each_tokens_own_state_in_charge_and_attend_nearby(name):
    spec = resolve_spec(name)
    reader = GGUFReader(build(spec, DTYPES["f32"]).path)
    data = {t.name: np.asarray(t.data, dtype=np.float64) for t in reader.tensors}
    c = locality.common_direction(spec, 0)
    # every embedding row shares COMMON_SHARE of its RMS along c, and only that
    embeddings = data["token_embd.weight"]
    shift = embeddings.mean(axis=0)
    assert shift @ c / np.linalg.norm(shift) > 0.98
    assert abs(np.linalg.norm(shift) / math.sqrt(spec.hidden_size) - locality.COMMON_SHARE) < 0.03
    assert abs(float((embeddings - shift).std()) - gguf_build.MOE_EMBEDDING_STD) < 0.05
    # values and routers are blind to it
    for tensor in ("blk.0.attn_v.weight", "blk.1.ffn_gate_inp.weight"):
        assert np.abs(data[tensor] @ c).max() < 1e-5 * np.abs(data[tensor]).max()
    # q and k map it to the kernel vector, the same in every head, over a small random part
    along = locality.COMMON_SHARE * math.sqrt(spec.hidden_size / (1 + locality.COMMON_SHARE ** 2))
    want = (locality.kernel_vector(spec) * locality.kernel_length(spec, WEIGHT_STD) / along)
    for tensor in ("blk.0.attn_q.weight", "blk.1.attn_k.weight"):
        heads = (data[tensor] @ c).reshape(-1, spec.head_dim)
        assert np.allclose(heads.mean(axis=0), want, atol=4 * locality.qk_std(spec, WEIGHT_STD))
        random_part = data[tensor] - np.outer(np.tile(want, len(heads)), c)
        assert abs(random_part.std() / locality.qk_std(spec, WEIGHT_STD) - 1) < 0.1
    output = locality.output_std(spec, WEIGHT_STD, gguf_build.MOE_EMBEDDING_STD)
    assert abs(data["blk.0.attn_output.weight"].std() / output - 1) < 0.1
    residual_std = WEIGHT_STD / math.sqrt(2 * spec.num_hidden_layers)
    assert abs(data["blk.1.ffn_down_exps.weight"].std() / residual_std - 1) < 0.1
    assert abs(data["output.weight"].std() / WEIGHT_STD - 1) < 0.1
    dense = GGUFReader(build(resolve_spec("tiny-llama"), DTYPES["f32"]).path)
    assert abs(float(np.asarray(dense.tensors[0].data).std()) - WEIGHT_STD) < 0.002


def test_no_two_experts_hold_the_same_bytes(tmp_path, monkeypatch):
    # A pool smaller than an expert tensor: laid cyclically from one start, experts i and i + 2
    # of tiny-olmoe (2,048 elements each) would repeat; each expert has its own start now.
    monkeypatch.setattr(gguf_build, "POOL_ELEMENTS", 4096)
    for name in ("tiny-olmoe", "tiny-qwen2moe", "tiny-mixtral"):
        path = tmp_path / f"{name}.gguf"
        write_gguf(resolve_spec(name), DTYPES["f16"], 0, path)
        assert identical_weights(path) == []
    dup = tmp_path / "dup.gguf"
    monkeypatch.setattr(gguf_build, "pool_starts", lambda spec, tensors, seed, n, spread: [
        [0] * (t.plan.shape[0] if t.plan.role == "expert" else 1) for t in tensors])
    write_gguf(resolve_spec("tiny-olmoe"), DTYPES["f16"], 0, dup)
    assert ("blk.0.ffn_gate_exps.weight[0]", "blk.0.ffn_gate_exps.weight[1]") in (
        identical_weights(dup))


def _log2_block_max(path, role: str) -> np.ndarray:
    """log2 of every 32-block's largest magnitude over a role's 2-D tensors, per tensor RMS."""
    out = []
    for t in GGUFReader(path).tensors:
        if t.name.endswith(f"{role}.weight") and len(t.shape) > 1:
            values = np.asarray(t.data, dtype=np.float32)
            rms = np.sqrt(np.mean(np.square(values)))
            out.append(np.log2(np.abs(values.reshape(-1, 32)).max(axis=1) / rms))
    return np.concatenate(out)


def test_the_source_of_quantized_builds_spreads_block_maxima_as_trained_weights(tmp_path):
    spec = resolve_spec("tiny-llama")
    plain, spread = tmp_path / "plain.gguf", tmp_path / "spread.gguf"
    write_gguf(spec, DTYPES["f16"], 0, plain)
    assert write_gguf(spec, DTYPES["f16"], 0, spread, spread=True) == file_n_bytes(
        spec, DTYPES["f16"], spread=True)
    normal = _log2_block_max(plain, "attn_q").std()
    # attn_q: Student-t with 6 degrees of freedom, blocks scaled by exp(0.5 x a normal); the
    # 1st to 99th percentile of Gemma 3 270M's attn_q block maxima span 4.1 binades
    q = _log2_block_max(spread, "attn_q")
    assert normal < 0.35 and q.std() > 0.7 and np.ptp(np.percentile(q, [1, 99])) > 3.5
    # attn_v: nearly normal in the real model, and so here (t with 12, no block factor)
    assert _log2_block_max(spread, "attn_v").std() < 0.45
    for t in GGUFReader(spread).tensors:  # each role keeps its RMS
        if len(t.shape) > 1:
            rms = float(np.sqrt(np.mean(np.square(np.asarray(t.data, dtype=np.float32)))))
            assert abs(rms - WEIGHT_STD) < 0.15 * WEIGHT_STD, t.name


def test_quantized_builds_are_made_from_the_spread_source_and_direct_ones_are_not(tmp_path):
    spec = resolve_spec("tiny-llama")
    q8 = build(spec, DTYPES["q8_0"], directory=tmp_path)
    sources = sorted(p.name for p in tmp_path.glob("*.gguf") if "-f16" in p.name)
    assert len(sources) == 1 and "-f16-spread-" in sources[0]
    assert build_mod.read_manifest(tmp_path / sources[0])["builder_version"] == 2
    assert build_mod.read_manifest(q8.path)["spread"] is True
    f16 = build(spec, DTYPES["f16"], directory=tmp_path)
    assert "-spread-" not in f16.path.name and not build_mod.read_manifest(f16.path)["spread"]
    reader = GGUFReader(q8.path)
    scales = np.concatenate([np.asarray(t.data).reshape(-1, 34)[:, :2].copy().view(np.float16)
                             for t in reader.tensors if t.name.endswith("attn_q.weight")])
    assert np.log2(np.abs(scales.astype(np.float32))).std() > 0.7  # the spread survives


def test_no_two_experts_of_a_spread_build_hold_the_same_bytes(tmp_path):
    for name in ("tiny-olmoe", "tiny-qwen2moe", "tiny-mixtral"):
        path = tmp_path / f"{name}.gguf"
        write_gguf(resolve_spec(name), DTYPES["f16"], 0, path, spread=True)
        assert identical_weights(path) == []


def test_dense_weights_are_the_bytes_of_builder_version_1(tmp_path):
    # Dense files keep version 1 (BUILDER_VERSIONS): their tensor bytes must not move.
    path = tmp_path / "tiny-llama.gguf"
    write_gguf(resolve_spec("tiny-llama"), DTYPES["f16"], 0, path)
    start, n_bytes = tensor_data_span(path)
    with path.open("rb") as f:
        f.seek(start)
        digest = hashlib.sha256(f.read(n_bytes)).hexdigest()
    assert digest == DENSE_V1_TENSOR_SHA256


@pytest.mark.parametrize("dtype", ["f16", "q4_0"])
def test_rebuild_is_byte_identical(tmp_path, dtype):
    spec = resolve_spec("tiny-qwen2")
    a = build(spec, DTYPES[dtype], seed=3, directory=tmp_path / "a")
    b = build(spec, DTYPES[dtype], seed=3, directory=tmp_path / "b")
    assert a.path.name == b.path.name
    assert sha256(a.path) == sha256(b.path)
    c = build(spec, DTYPES[dtype], seed=4, directory=tmp_path / "c")
    assert sha256(c.path) != sha256(a.path)


def test_second_build_is_a_cache_hit():
    spec = resolve_spec("tiny-llama")
    first = build(spec, DTYPES["f16"])
    second = build(spec, DTYPES["f16"])
    assert not first.cached and second.cached and second.path == first.path
    assert first.path.parent == cache_dir()


def test_cache_hit_checks_size_and_header():
    spec = resolve_spec("tiny-llama")
    first = build(spec, DTYPES["f32"])
    with first.path.open("r+b") as f:
        f.truncate(first.n_bytes - 10)
    assert not valid_cache_entry(first.path)
    again = build(spec, DTYPES["f32"])
    assert not again.cached and again.path.stat().st_size == first.n_bytes
    with again.path.open("r+b") as f:
        f.write(b"XXXX")
    assert not valid_cache_entry(again.path)


def test_interrupted_build_leaves_no_valid_entry(monkeypatch):
    spec = resolve_spec("tiny-qwen2")

    def explode(done, total):
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build(spec, DTYPES["f32"], progress=explode)
    leftovers = [p for p in cache_dir().iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []
    assert not build(spec, DTYPES["f32"]).cached


def test_renamed_file_without_manifest_is_not_a_hit():
    spec = resolve_spec("tiny-qwen2")
    built = build(spec, DTYPES["f16"])
    build_mod.manifest_path(built.path).unlink()
    assert not valid_cache_entry(built.path)


def test_out_path_bypasses_the_cache(tmp_path):
    out = tmp_path / "x" / "model.gguf"
    built = build(resolve_spec("tiny-qwen2"), DTYPES["f32"], out=out)
    assert built.path == out and out.stat().st_size == built.n_bytes
    assert not any(p.suffix == ".gguf" for p in cache_dir().iterdir())


def test_not_enough_disk_is_refused_before_writing(monkeypatch):
    class Usage:
        free = 1000

    monkeypatch.setattr(build_mod.shutil, "disk_usage", lambda path: Usage())
    with pytest.raises(HarnessError, match="not enough free disk: the build needs"):
        build(resolve_spec("tiny-qwen2"), DTYPES["f32"])
    assert not any(p.suffix == ".gguf" for p in cache_dir().iterdir())


def test_read_only_cache_dir_is_refused(tmp_path):
    # chmod does not stop root; /proc refuses new entries to everyone.
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    target = ro if os.geteuid() != 0 else "/proc/self/harness-cache"
    with pytest.raises(HarnessError, match="cache directory is not writable"):
        build(resolve_spec("tiny-qwen2"), DTYPES["f32"], directory=target)


def test_cache_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(HarnessError, match="cache directory is not writable"):
        build(resolve_spec("tiny-qwen2"), DTYPES["f32"], directory=f)


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
def test_the_fast_tensor_header_reads_what_gguf_py_reads(name, tmp_path):
    from harness.weights.gguf_inspect import TensorEntry, tensor_table

    path = build(resolve_spec(name), DTYPES["q8_0"]).path
    reader = GGUFReader(path)
    assert tensor_table(path) == [
        TensorEntry(t.name, tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name,
                    int(t.n_bytes)) for t in reader.tensors]
    assert tensor_data_span(path)[0] == min(int(t.data_offset) for t in reader.tensors)
    cut = tmp_path / "cut.gguf"  # a header that ends inside the vocabulary
    cut.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(HarnessError, match="cannot read the GGUF file"):
        tensor_table(cut)
