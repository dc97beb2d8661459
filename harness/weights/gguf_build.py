"""Write random-weight GGUF files with the exact tensor shapes of a ModelSpec."""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, TokenType
from gguf.quants import quant_shape_to_byte_shape

from .. import __version__
from ..core.costs import TensorEntry, active_expert_fraction, decode_weight_n_bytes
from ..core.dtypes import DTYPES, DType
from ..core.specs import ARCHS, ModelSpec, TensorPlan, tensor_plan
from .locality import WRITE_GAIN, RowEdit, output_std, qk_std, row_edit

# Bump when the bytes the builder writes change: it is part of every cache key. One version
# per family, so that a change to how mixtures of experts are written leaves dense files (and
# the runs made on them) as they were.
BUILDER_VERSIONS = {"dense": 1, "moe": 3}
# The F16 file quantized builds are made from (block spread, below): its own versions, so that
# direct files keep their bytes.
SPREAD_VERSIONS = {"dense": 2, "moe": 4}
WEIGHT_STD = 0.02  # the init scale of GPT-2/Llama-style models: keeps logits finite
# Mixtures of experts only (docs/twins.md, "Expert routing"): with every tensor at N(0, 0.02),
# attention builds a per-sequence average that dominates the hidden state, so a sequence's
# tokens keep picking the same experts. Token embeddings at unit RMS (as Gemma 3 270M's enter
# its residual stream, 1.03 measured) and residual output projections scaled by 1/sqrt(2L) (the
# GPT-2 paper's init, as nanoGPT writes it) keep each token's own state in charge of routing.
# Since builder version 3 their attention also favours nearby tokens (weights/locality.py), so
# that consecutive tokens share experts as often as in a trained model, and its output
# projection is sized by that module.
MOE_EMBEDDING_STD = 1.0
RESIDUAL_OUTPUTS = ("ffn_down_exps.weight", "ffn_down_shexp.weight")
# Quantized builds only (docs/twins.md, "Quantized builds get trained weights' spread"). ggml's
# quantized dot products look each block's F16 scale up in a 256 KiB table; how many of its
# cache lines a matrix touches moved one kernel by 4% on an EPYC (a real Q8_0 matrix against
# normal weights of its shape). So each tensor role gets the spread of block maxima trained
# weights have: (Student-t degrees of freedom, 0 for normal; sigma of a lognormal factor on
# each block of 32), fitted to the 1st, 50th and 99th percentiles of log2(block max / tensor
# RMS) in Gemma 3 270M's tensors (medians over its 18 layers). Each role keeps its RMS. F32,
# F16 and BF16 weights have no block scales: direct files keep N(0, std) and their bytes.
BLOCK = 32  # weights per block of ggml's 32-wide types, and per sub-block of the K-quants
BLOCK_SPREAD = {"token_embd": (5, 0.1), "output": (5, 0.1), "attn_q": (6, 0.5),
                "attn_k": (0, 0.4), "attn_v": (12, 0.0), "attn_output": (0, 0.3),
                "ffn_gate": (8, 0.3), "ffn_up": (0, 0.2), "ffn_down": (12, 0.1)}
OTHER_SPREAD = (12, 0.1)  # roles Gemma 3 has no tensor of (routers, fused QKV): ffn_down's
# 2**24 normal floats (64 MiB at F32), made once per build and laid across the tensors at
# random offsets. Caches and prefetchers work on addresses, not values, so every tensor still
# occupies its own bytes of the file and is read from memory in full: the same traffic and the
# same matrix work as fresh random numbers, at a fraction of the generation time.
POOL_ELEMENTS = 1 << 24
ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
N_SPECIAL = 3  # <unk>, <s>, </s>


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor as it will be written: plan, ggml type and byte count."""

    plan: TensorPlan
    ggml_type: GGMLQuantizationType

    @property
    def n_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.ggml_type]
        return self.plan.n_elements // block * size


def planned_tensors(spec: ModelSpec, dtype: DType) -> list[PlannedTensor]:
    """Tensor types of a directly written file: 1-D tensors stay F32, as convert_hf_to_gguf does."""
    if not dtype.direct:
        raise ValueError(f"{dtype.name} is made by llama.cpp's quantizer, not written directly")
    return [PlannedTensor(t, dtype.ggml_type if len(t.shape) > 1 else GGMLQuantizationType.F32)
            for t in tensor_plan(spec)]


def file_n_bytes(spec: ModelSpec, dtype: DType, spread: bool = False) -> int:
    """Exact size of the directly written file, header and padding included."""
    tensors = planned_tensors(spec, dtype)
    header = _metadata_n_bytes(spec, spread) + sum(_tensor_info_n_bytes(t.plan)
                                                   for t in tensors)
    return _pad(header) + sum(_pad(t.n_bytes) for t in tensors)


@functools.lru_cache(maxsize=64)
def _metadata_n_bytes(spec: ModelSpec, spread: bool) -> int:
    # Every KV has a fixed size whatever the dtype and seed (both are fixed-width integers).
    return _kv_n_bytes(_writer_with_metadata(spec, DTYPES["f32"], seed=0, spread=spread))


def write_gguf(spec: ModelSpec, dtype: DType, seed: int, path: Path,
               progress: Callable[[int], None] | None = None, spread: bool = False) -> int:
    """Write the file at path (the caller renames it into place) and return its size;
    spread: each role's block maxima spread as trained weights' (the source of quantized
    builds)."""
    writer = _writer_with_metadata(spec, dtype, seed, spread)
    tensors = planned_tensors(spec, dtype)
    for t in tensors:
        np_dtype, shape = _info_dtype_shape(t)
        writer.add_tensor_info(t.plan.name, shape, np_dtype, t.n_bytes, raw_dtype=t.ggml_type)
    pool_elements = min(POOL_ELEMENTS, max(t.plan.n_elements for t in tensors))
    if spread:  # whole blocks, each tensor starting at one: its blocks are the pool's
        pool_elements = -(-pool_elements // BLOCK) * BLOCK
    pools = _Pools(seed, pool_elements)
    starts = pool_starts(spec, tensors, seed, pool_elements, spread)
    return write_tensor_data(writer, path, (
        (t.n_bytes, pools.chunks(t, offsets, weight_std(spec, t.plan),
                                 block_spread(t.plan.name) if spread else None,
                                 row_edit(spec, t.plan.name, seed, MOE_EMBEDDING_STD, WEIGHT_STD)))
        for t, offsets in zip(tensors, starts, strict=True)), progress)


def builder_version(spec: ModelSpec, spread: bool = False) -> int:
    """The version of the bytes the builder writes for this spec's family (and for the
    block-spread source of quantized builds)."""
    return (SPREAD_VERSIONS if spread else BUILDER_VERSIONS)["moe" if spec.is_moe else "dense"]


def block_spread(name: str) -> tuple[float, float]:
    """A tensor's (Student-t degrees of freedom, block sigma) by its role: the name without
    its layer, and an expert tensor as its dense counterpart."""
    role = re.sub(r"^blk\.\d+\.", "", name).removesuffix(".weight")
    for suffix in ("_exps", "_shexp"):
        role = role.removesuffix(suffix)
    return BLOCK_SPREAD.get(role, OTHER_SPREAD)


def weight_std(spec: ModelSpec, plan: TensorPlan) -> float:
    """The spread a tensor's weights are drawn with (norms are ones whatever this says)."""
    if not spec.is_moe:
        return WEIGHT_STD
    if plan.role == "embedding":
        return MOE_EMBEDDING_STD
    if plan.name.endswith("attn_output.weight"):
        return output_std(spec, WEIGHT_STD, MOE_EMBEDDING_STD)
    if plan.name.endswith(RESIDUAL_OUTPUTS):
        return WEIGHT_STD / math.sqrt(2 * spec.num_hidden_layers)
    if plan.name.endswith(("attn_q.weight", "attn_k.weight")):
        return qk_std(spec, WEIGHT_STD)
    return WEIGHT_STD


def pool_starts(spec: ModelSpec, tensors: list[PlannedTensor], seed: int,
                pool_elements: int, spread: bool = False) -> list[list[int]]:
    """Where in the pool each tensor starts reading (one start per expert of an expert tensor,
    all distinct, so no two experts are the same bytes; dense files keep one random start per
    tensor, as written since builder version 1; a spread build starts every tensor and expert
    at a block of the pool)."""
    step = BLOCK if spread else 1
    if not spec.is_moe:
        rng = np.random.default_rng([seed, 4] if spread else seed + 1)
        return [[int(x) * step] for x in rng.integers(0, pool_elements // step, len(tensors))]
    counts = [t.plan.shape[0] if t.plan.role == "expert" else 1 for t in tensors]
    drawn = np.random.default_rng([seed, 4] if spread else [seed, 1]).choice(
        pool_elements // step, sum(counts), replace=False) * step
    bounds = np.cumsum([0, *counts])
    return [[int(x) for x in drawn[a:b]] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def write_tensor_data(writer: GGUFWriter, path: Path,
                      tensors: Iterable[tuple[int, Iterable[bytes | memoryview]]],
                      progress: Callable[[int], None] | None = None) -> int:
    """Write writer's header, KVs and tensor infos to path, then each tensor's bytes (given
    as (byte count, chunks), in the infos' order) at the writer's alignment; flush, fsync and
    return the file's size."""
    writer.open_output_file(path)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        for n_bytes, chunks in tensors:
            writer.write_padding(fout, fout.tell())
            for chunk in chunks:
                fout.write(chunk)
            if progress:
                progress(n_bytes)
        writer.write_padding(fout, fout.tell())
        fout.flush()
        os.fsync(fout.fileno())
        return fout.tell()
    finally:
        writer.close()


class _Pools:
    """One random block per tensor type (and spread), made once per build from the seed."""

    def __init__(self, seed: int, n_elements: int) -> None:
        self._seed = seed
        rng = np.random.default_rng(seed)
        self._base = rng.standard_normal(n_elements, dtype=np.float32) * np.float32(WEIGHT_STD)
        self._cache: dict[tuple, memoryview | np.ndarray] = {}  # encoded pools, float values

    def _values(self, std: float, spread: tuple[float, float] | None) -> np.ndarray:
        if ("values", std, spread) not in self._cache:
            if spread:
                values = self._spread(std, *spread)
            else:  # WEIGHT_STD itself keeps the base unscaled: dense files' bytes stay
                values = (self._base if std == WEIGHT_STD
                          else self._base * np.float32(std / WEIGHT_STD))
            self._cache["values", std, spread] = values
        return self._cache["values", std, spread]

    def _pool(self, ggml_type: GGMLQuantizationType, std: float,
              spread: tuple[float, float] | None) -> memoryview:
        if (ggml_type, std, spread) not in self._cache:
            self._cache[ggml_type, std, spread] = memoryview(
                _encode(self._values(std, spread), ggml_type)).cast("B")
        return self._cache[ggml_type, std, spread]

    def _spread(self, std: float, nu: float, sigma: float) -> np.ndarray:
        """The base's normals made Student-t with nu degrees of freedom (0: left normal), each
        block of BLOCK scaled by exp(sigma x a normal), the whole set to RMS std."""
        values = self._base / np.float32(WEIGHT_STD)
        if nu:
            chi2 = np.random.default_rng([self._seed, 5, int(nu)]).chisquare(nu, values.size)
            values = values * np.sqrt(nu / chi2).astype(np.float32)
        if sigma:
            blocks = np.random.default_rng([self._seed, 6]).standard_normal(values.size // BLOCK)
            factor = np.exp(sigma * blocks).astype(np.float32)
            values = (values.reshape(-1, BLOCK) * factor[:, None]).reshape(-1)
        rms = np.sqrt(np.mean(np.square(values, dtype=np.float64)))
        return values * np.float32(std / rms)

    def chunks(self, t: PlannedTensor, starts: list[int], std: float = WEIGHT_STD,
               spread: tuple[float, float] | None = None,
               edit: RowEdit | None = None) -> Iterator[bytes | memoryview]:
        """The tensor's bytes: norms are ones, everything else comes from the random pool, read
        cyclically from each start (one start per equal slice: the experts of a 3-D tensor),
        with edit applied to its rows where given."""
        if t.plan.role == "norm":
            yield np.ones(t.plan.n_elements, dtype=np.float32).tobytes()
            return
        if t.ggml_type == GGMLQuantizationType.F32 or len(t.plan.shape) == 1:
            spread = None  # vectors and F32 tensors are not quantized
        if edit is not None:
            yield from self._edited(t, starts[0], self._values(std, spread), edit)
            return
        pool = self._pool(t.ggml_type, std, spread)
        item = GGML_QUANT_SIZES[t.ggml_type][1]
        for start in starts:
            start, remaining = start * item, t.n_bytes // len(starts)
            while remaining:
                n = min(remaining, len(pool) - start)
                yield pool[start:start + n]
                remaining -= n
                start = 0


    @staticmethod
    def _edited(t: PlannedTensor, start: int, values: np.ndarray,
                edit: RowEdit) -> Iterator[bytes]:
        """A 2-D tensor's pool values from start, edited and encoded a few MiB of rows at a
        time."""
        width = t.plan.shape[-1]
        n_rows = t.plan.n_elements // width
        step = max(1, (1 << 20) // width)
        for first in range(0, n_rows, step):
            at = start + first * width
            rows = np.take(values, np.arange(at, at + min(step, n_rows - first) * width),
                           mode="wrap").reshape(-1, width)
            yield _encode(edit(rows, first).astype(np.float32).reshape(-1), t.ggml_type).tobytes()


def _encode(values: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    if ggml_type == GGMLQuantizationType.F32:
        return values
    if ggml_type == GGMLQuantizationType.F16:
        return values.astype(np.float16)
    if ggml_type == GGMLQuantizationType.BF16:
        bits = values.view(np.uint32)
        # round to nearest even, as gguf.quants and llama.cpp's converter do
        return ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    raise ValueError(f"cannot write {ggml_type.name} directly")


def _info_dtype_shape(t: PlannedTensor) -> tuple[np.dtype, tuple[int, ...]]:
    """gguf-py takes non-F32 raw types as uint8 byte shapes and converts them back."""
    if t.ggml_type == GGMLQuantizationType.F32:
        return np.dtype(np.float32), t.plan.shape
    return np.dtype(np.uint8), quant_shape_to_byte_shape(t.plan.shape, t.ggml_type)


def _pad(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _tensor_info_n_bytes(plan: TensorPlan) -> int:
    """Name (u64 length + bytes), n_dims, dims, type and offset, as GGUF v3 lays them out."""
    return 8 + len(plan.name.encode()) + 4 + 8 * len(plan.shape) + 4 + 8


def _kv_n_bytes(writer: GGUFWriter) -> int:
    """Bytes of magic, counts and KV data, computed without packing long arrays."""
    n = 4 + 4 + 8 + 8
    for key, val in writer.kv_data[0].items():
        n += 8 + len(key.encode())
        if val.type == GGUFValueType.ARRAY and val.value:
            n += 4 + 4 + 8 + _array_items_n_bytes(val.value)
        else:
            n += len(writer._pack_val(val.value, val.type, add_vtype=True, sub_type=val.sub_type))
    return n


def _array_items_n_bytes(items: list) -> int:
    first = items[0]
    if isinstance(first, str):
        return 8 * len(items) + len("".join(items).encode())
    return len(items) * (1 if isinstance(first, bool) else 4)  # gguf-py: INT32 / FLOAT32


def _writer_with_metadata(spec: ModelSpec, dtype: DType, seed: int,
                          spread: bool = False) -> GGUFWriter:
    """A GGUFWriter holding every KV llama.cpp needs to load and describe the model."""
    w = GGUFWriter(None, spec.architecture)
    w.add_name(f"{spec.name} (random weights)")
    values = (f"random weights N(0, {WEIGHT_STD})" if not spec.is_moe else
              f"random weights N(0, {WEIGHT_STD}), token embeddings N(0, {MOE_EMBEDDING_STD}) "
              f"plus a shared vector that q and k map to a RoPE kernel favouring nearby "
              f"tokens (values and routers blind to it), expert outputs "
              f"N(0, {WEIGHT_STD}/sqrt(2 x layers)), attention outputs writing {WRITE_GAIN}^2/"
              f"(2 x layers) of the embeddings' variance")
    if spread:
        values += (" at those RMS, spread per tensor role as trained weights' block maxima "
                   "(Student-t values, lognormal block scales)")
    w.add_description(f"Synthetic model with the shapes of {spec.source or spec.name}; "
                      f"{values}, seed {seed}. Made by harness.")
    w.add_file_type(int(dtype.file_type))
    w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size)
    w.add_block_count(spec.num_hidden_layers)
    w.add_feed_forward_length(_ffn_length(spec))
    w.add_head_count(spec.num_attention_heads)
    w.add_head_count_kv(spec.num_key_value_heads)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_vocab_size(spec.vocab_size)
    if spec.sliding_window:
        w.add_sliding_window(spec.sliding_window)
    if spec.attn_logit_softcapping:
        w.add_attn_logit_softcapping(spec.attn_logit_softcapping)
    if spec.final_logit_softcapping:
        w.add_final_logit_softcapping(spec.final_logit_softcapping)
    _add_experts(w, spec)
    _add_tokenizer(w, spec.vocab_size, ARCH_TOKENS.get(spec.architecture, ()))
    w.add_string("harness.version", __version__)
    w.add_uint32("harness.builder_version", builder_version(spec, spread))
    w.add_uint64("harness.seed", seed)
    w.add_string("harness.spec_sha256", spec.content_hash())
    return w


def _ffn_length(spec: ModelSpec) -> int:
    """feed_forward_length: the experts' width where the loader sizes them by it."""
    moe_by_n_ff = spec.is_moe and not ARCHS[spec.architecture].expert_ff_key
    return spec.expert_width if moe_by_n_ff else spec.intermediate_size


def _add_experts(w: GGUFWriter, spec: ModelSpec) -> None:
    """The MoE keys llama.cpp's loaders read, and Granite's four scales (1.0 where unset)."""
    arch = ARCHS[spec.architecture]
    if spec.is_moe:
        w.add_expert_count(spec.num_experts)
        w.add_expert_used_count(spec.num_experts_per_tok)
        if arch.expert_ff_key:
            w.add_expert_feed_forward_length(spec.expert_width)
        if spec.shared_expert_intermediate_size:
            w.add_expert_shared_feed_forward_length(spec.shared_expert_intermediate_size)
    if arch.multipliers:
        w.add_embedding_scale(spec.embedding_multiplier or 1.0)
        w.add_residual_scale(spec.residual_multiplier or 1.0)
        w.add_attention_scale(spec.attention_multiplier or 1.0)
        w.add_logit_scale(spec.logits_scaling or 1.0)


# Special tokens llama.cpp's vocabulary loader looks up by text for an architecture.
ARCH_TOKENS = {"phi3": ("<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>",
                        "<|system|>")}


def _add_tokenizer(w: GGUFWriter, vocab_size: int, special: tuple[str, ...] = ()) -> None:
    """A SentencePiece-style vocabulary of exactly vocab_size unique tokens."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(special)
    types = ([TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
             + [TokenType.CONTROL] * len(special))
    rest = vocab_size - len(tokens)
    tokens += [f"tok{i}" for i in range(len(tokens), vocab_size)]
    types += [TokenType.NORMAL] * rest
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab_size)
    w.add_token_types([int(t) for t in types])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)


def table_from_plan(spec: ModelSpec, dtype) -> list[TensorEntry]:
    """The tensor table a directly written build of spec has."""
    return [TensorEntry(t.plan.name, t.plan.shape, t.ggml_type.name, t.n_bytes)
            for t in planned_tensors(spec, dtype)]


def nominal_decode_n_bytes(spec: ModelSpec, dtype) -> float:
    """Weight bytes a decode step reads at a dtype: exact for F32/F16/BF16; for quantized types
    every matrix at the base type's bits per weight (recipes keep some tensors at other types).
    A mixture of experts reads k of its E experts."""
    active = active_expert_fraction(spec)
    if dtype.direct:
        return decode_weight_n_bytes(table_from_plan(spec, dtype), active)
    f32 = table_from_plan(spec, DTYPES["f32"])
    scaled = [TensorEntry(t.name, t.shape, t.type_name,
                          t.n_bytes if len(t.shape) == 1 else int(t.n_bytes * dtype.bits_per_weight
                                                                   / 32))
              for t in f32]
    return decode_weight_n_bytes(scaled, active)


def nominal_file_n_bytes(spec: ModelSpec, dtype) -> float:
    """Bytes of every tensor at a dtype (the whole file, every expert): exact for F32/F16/BF16,
    every matrix at the base type's bits per weight for quantized types."""
    table = table_from_plan(spec, dtype if dtype.direct else DTYPES["f32"])
    return float(sum(t.n_bytes if dtype.direct or len(t.shape) == 1
                     else t.n_bytes * dtype.bits_per_weight / 32 for t in table))
