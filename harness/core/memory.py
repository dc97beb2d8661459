"""Memory of a loaded model, by formula: the weights at their types, the KV cache llama.cpp
allocates (its padding, its sliding-window caches), and how many users fit beside them."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .costs import TensorEntry, kv_n_bytes_per_layer_token, kv_n_bytes_per_token
from .specs import ModelSpec

MIB = 1 << 20
# llama.cpp rounds every sequence's context up to a multiple of 256 cells, and so the
# sliding-window cache (llama-context.cpp, llama-kv-cache-iswa.cpp: GGML_PAD(…, 256)).
CTX_PAD = 256
N_UBATCH = 512  # llama_context_default_params().n_ubatch, which the SWA cache's size includes
# Which layers use a sliding window, as llama.cpp sets them (llama-model.cpp:
# hparams.set_swa_pattern(n)): layer il slides when il % n < n - 1. Other architectures with a
# window (phi3) keep one full-size cache for every layer.
SWA_PATTERN = {"gemma2": 2, "gemma3": 6}


def pad(n: int, multiple: int = CTX_PAD) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class WeightType:
    """The weights of one ggml type: how many, at how many bytes each (block scales in)."""

    type_name: str
    n_params: int
    block_size: int
    block_n_bytes: int
    file_n_bytes: int  # what the file's tensor table says these tensors take

    @property
    def bytes_per_weight(self) -> float:
        return self.block_n_bytes / self.block_size

    @property
    def formula_n_bytes(self) -> int:
        return self.n_params // self.block_size * self.block_n_bytes


def weight_types(table: list[TensorEntry]) -> list[WeightType]:
    """The tensor table grouped by type, largest first: parameters × bytes per weight."""
    n_params: dict[str, int] = defaultdict(int)
    n_bytes: dict[str, int] = defaultdict(int)
    for t in table:
        n_params[t.type_name] += t.n_elements
        n_bytes[t.type_name] += t.n_bytes
    out = []
    for name, count in n_params.items():
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]]
        out.append(WeightType(name.lower(), count, block, size, n_bytes[name]))
    return sorted(out, key=lambda w: -w.file_n_bytes)


def swa_layers(spec: ModelSpec) -> list[bool]:
    """Per layer, whether llama.cpp gives it a sliding-window cache."""
    n = SWA_PATTERN.get(spec.architecture)
    if not n or not spec.sliding_window:
        return [False] * spec.num_hidden_layers
    return [il % n < n - 1 for il in range(spec.num_hidden_layers)]


@dataclass(frozen=True)
class KvCache:
    """One KV cache llama.cpp allocates: its layers, cells per stream, and streams."""

    kind: str  # "full" or "sliding window"
    n_layers: int
    n_cells: int
    n_streams: int  # one per sequence, or one shared (kv_unified)
    bytes_per_cell: int  # K and V of every layer of this cache, for one token

    @property
    def n_bytes(self) -> int:
        return self.bytes_per_cell * self.n_cells * self.n_streams


@dataclass(frozen=True)
class KvPlan:
    """The context llama.cpp makes from a request, and its caches."""

    n_ctx: int  # cells in all, as llama_n_ctx reports
    n_ctx_seq: int  # the context each sequence gets
    caches: tuple[KvCache, ...]

    @property
    def n_bytes(self) -> int:
        return sum(c.n_bytes for c in self.caches)


def kv_plan(spec: ModelSpec, n_ctx: int, n_seq: int = 1, type_k: str = "f16",
            type_v: str = "f16", unified: bool = False, swa_full: bool = True,
            n_ubatch: int = N_UBATCH) -> KvPlan:
    """The cells llama.cpp allocates: each sequence's share of n_ctx padded to 256 (one
    stream per sequence), or n_ctx padded for all (unified); sliding-window layers get
    min(that, window × sequences sharing a stream + n_ubatch), padded, unless swa_full."""
    n_ctx_seq = pad(n_ctx) if unified else pad(math.ceil(n_ctx / n_seq))
    n_streams = 1 if unified else n_seq
    per_layer = round(kv_n_bytes_per_layer_token(spec, type_k, type_v))
    sliding = swa_layers(spec)
    n_swa = sum(sliding)
    caches = []
    if n_swa:
        window = spec.sliding_window * (n_seq if unified else 1) + n_ubatch
        swa_cells = n_ctx_seq if swa_full else pad(min(n_ctx_seq, window))
        caches.append(KvCache("full", len(sliding) - n_swa, n_ctx_seq, n_streams,
                              per_layer * (len(sliding) - n_swa)))
        caches.append(KvCache("sliding window", n_swa, swa_cells, n_streams, per_layer * n_swa))
    else:
        caches.append(KvCache("full", len(sliding), n_ctx_seq, n_streams,
                              per_layer * len(sliding)))
    return KvPlan(n_ctx_seq * n_streams, n_ctx_seq, tuple(caches))


def kv_n_bytes_per_sequence(spec: ModelSpec, n_ctx_seq: int, type_k: str = "f16",
                            type_v: str = "f16", swa_full: bool = True) -> int:
    """What one more sequence of n_ctx_seq tokens adds (one stream of its own)."""
    return kv_plan(spec, n_ctx_seq, 1, type_k, type_v, swa_full=swa_full).n_bytes


@dataclass(frozen=True)
class Fit:
    """How many sequences of a context fit in a memory beside the weights, and the longest
    context one sequence can have there."""

    ram_n_bytes: int
    fixed_n_bytes: int  # weights, compute and output buffers, the process itself
    per_sequence_n_bytes: int
    n_sequences: int
    longest_context: int  # in steps of 256 cells, at most the model's trained context
    longest_capped: bool  # the model's trained context, not memory, stops it


def fit(spec: ModelSpec, ram_n_bytes: int, fixed_n_bytes: int, n_ctx_seq: int,
        type_k: str = "f16", type_v: str = "f16", swa_full: bool = True,
        output_n_bytes_per_sequence: int = 0) -> Fit:
    """Sequences that fit: floor((RAM - fixed) / (one sequence's cache and its logits)); the
    longest context is the largest multiple of 256 whose one-sequence cache fits."""
    per_seq = (kv_n_bytes_per_sequence(spec, n_ctx_seq, type_k, type_v, swa_full)
               + output_n_bytes_per_sequence)
    free = ram_n_bytes - fixed_n_bytes
    n_seq = max(0, free // per_seq) if per_seq else 0
    free -= output_n_bytes_per_sequence
    per_token = kv_n_bytes_per_token(spec, type_k, type_v)  # every layer at full size
    limit = spec.max_position_embeddings
    longest = 0 if free <= 0 else int(free // per_token) // CTX_PAD * CTX_PAD
    # a sliding-window cache stops growing: step down from the trained context when it fits
    while longest < limit and kv_n_bytes_per_sequence(
            spec, pad(longest + 1), type_k, type_v, swa_full) <= free:
        longest = pad(longest + 1)
    capped = longest >= limit
    return Fit(ram_n_bytes, fixed_n_bytes, per_seq, int(n_seq), min(longest, limit), capped)
