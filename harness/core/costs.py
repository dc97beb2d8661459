"""Byte counts of a model: file size, KV cache, and what one decode step reads."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .records import Model
from .specs import ModelSpec, tensor_plan

TOKEN_EMBEDDING = "token_embd.weight"
OUTPUT = "output.weight"
EXPERT_SUFFIX = "_exps.weight"  # ffn_{gate,up,down}_exps: E experts stacked in one 3-D tensor


def is_expert(name: str) -> bool:
    """A routed-experts tensor (a shared expert, *_shexp, is read by every token)."""
    return name.endswith(EXPERT_SUFFIX)


def expert_union_fraction(n_experts: int, n_used: int, n_sequences: int = 1) -> float:
    """Expected share of a layer's experts that one step of n_sequences tokens reads, each
    token routed to n_used of n_experts uniformly at random: a given expert is missed by one
    token with probability 1 - k/E, by all B with (1 - k/E)^B, so E(1 - (1 - k/E)^B) experts
    are read. It assumes every token picks independently and uniformly: true of separate
    sequences' tokens in the builder's files, not of one sequence's consecutive tokens, which
    share experts more often (trained routers too), nor of trained routers' hot experts; both
    read fewer distinct experts (window_touched measures them)."""
    return 1 - (1 - n_used / n_experts) ** n_sequences


def _consecutive_shared(steps: list[list[int]], distance: int = 1) -> list[set[int]]:
    """The experts each pair of tokens distance apart (1: consecutive) has in common."""
    return [set(a) & set(b) for a, b in zip(steps, steps[distance:], strict=False)]


def consecutive_overlap(steps: list[list[int]]) -> float | None:
    """Experts two consecutive tokens share, on average: |S_t ∩ S_t+1| over a sequence's
    steps (each the experts one token picked in one layer); None under two steps."""
    shared = _consecutive_shared(steps)
    return sum(map(len, shared)) / len(shared) if shared else None


def uniform_overlap(n_experts: int, n_used: int) -> float:
    """What consecutive tokens share when each picks k of E uniformly at random: each of one
    token's k experts is among the other's with probability k/E, so k²/E."""
    return n_used * n_used / n_experts


def repeat_share(steps: list[list[int]], distance: int = 1) -> float | None:
    """Share of consecutive tokens (or of tokens distance apart) that have at least one expert
    in common: the Mixtral paper's "first or second choice" repetitions (Jiang et al. 2024,
    arXiv 2401.04088, Table 5), for any k; None without a pair."""
    shared = _consecutive_shared(steps, distance)
    return sum(map(bool, shared)) / len(shared) if shared else None


def uniform_repeat_share(n_experts: int, n_used: int) -> float:
    """repeat_share when each token picks k of E uniformly at random: the second token's k
    all miss the first's with probability C(E − k, k) ÷ C(E, k) (Mixtral, 2 of 8: 46%)."""
    return 1 - math.comb(n_experts - n_used, n_used) / math.comb(n_experts, n_used)


def experts_touched(selections: list[list[int]]) -> int:
    """Distinct experts a group of tokens (a prefill's ubatch, a batch) reads in one layer."""
    return len({e for picked in selections for e in picked})


def window_sizes(n_tokens: int) -> list[int]:
    """The window sizes window_touched records: powers of two up to n_tokens, and n_tokens."""
    return sorted({1 << i for i in range(n_tokens.bit_length()) if 1 << i <= n_tokens}
                  | {n_tokens})


def window_touched(selections: list[list[int]], n_experts: int) -> list[list[float]]:
    """[n, mean distinct experts] for windows of n consecutive tokens of one prefill (every
    start), n in window_sizes: what a ubatch of n tokens of one sequence reads in a layer."""
    picked = np.zeros((len(selections) + 1, n_experts), dtype=np.int32)
    for row, experts in enumerate(selections, start=1):
        picked[row, experts] = 1
    counts = np.cumsum(picked, axis=0)
    return [[n, float(((counts[n:] - counts[:-n]) > 0).sum(axis=1).mean())]
            for n in window_sizes(len(selections))]


@dataclass(frozen=True)
class TensorEntry:
    """One row of a GGUF tensor table: name, numpy shape, type and bytes."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return self.n_rows * (self.shape[-1] if self.shape else 1)

    @property
    def n_rows(self) -> int:
        rows = 1
        for dim in self.shape[:-1]:
            rows *= dim
        return rows


def weights_n_bytes(table: list[TensorEntry]) -> int:
    """Every tensor's bytes: llama-bench's model_size, the course's "file size" convention."""
    return sum(t.n_bytes for t in table)


def expert_n_bytes(table: list[TensorEntry]) -> int:
    """Bytes of every routed expert in the file."""
    return sum(t.n_bytes for t in table if is_expert(t.name))


def decode_weight_n_bytes(table: list[TensorEntry], expert_fraction: float = 1.0) -> int:
    """Weight bytes one decode step reads (see decode_n_bytes_by_type)."""
    return sum(decode_n_bytes_by_type(table, expert_fraction).values())


def decode_n_bytes_by_type(table: list[TensorEntry],
                           expert_fraction: float = 1.0) -> dict[str, int]:
    """Weight bytes one decode step reads, per tensor type (lower-case ggml names).

    Every matrix is multiplied by the new token's vector, so it is read whole, except the token
    embedding: a lookup of one row (get_rows in llama.cpp), unless there is no output.weight and
    the output layer reuses the embedding (tied), which then is read whole as the LM head; and
    the routed experts, of which ggml's mul_mat_id reads only the chosen ones: expert_fraction
    of them (k/E for one token, expert_union_fraction for several).
    """
    looked_up = _looked_up(table)
    out: dict[str, int] = {}
    for t in table:
        n = t.n_bytes // max(t.n_rows, 1) if t.name in looked_up else t.n_bytes
        if is_expert(t.name):
            n = round(n * expert_fraction)
        out[t.type_name.lower()] = out.get(t.type_name.lower(), 0) + n
    return out


def _looked_up(table: list[TensorEntry]) -> set[str]:
    """The token embedding where it is a lookup of one row (an output layer of its own)."""
    return {TOKEN_EMBEDDING} if any(t.name == OUTPUT for t in table) else set()


def decode_n_bytes_by_row_width(table: list[TensorEntry],
                                expert_fraction: float = 1.0) -> dict[int, int]:
    """The matrix bytes one decode step multiplies by the token's vector (as
    decode_n_bytes_by_type counts them, the embedding's lookup apart), per row width: the
    weights in one row, the matrix-vector product's inner dimension."""
    looked_up = _looked_up(table)
    out: dict[int, int] = {}
    for t in table:
        if len(t.shape) < 2 or t.name in looked_up:
            continue
        n = round(t.n_bytes * expert_fraction) if is_expert(t.name) else t.n_bytes
        out[t.shape[-1]] = out.get(t.shape[-1], 0) + n
    return out


def matmul_n_params_by_type(table: list[TensorEntry],
                            expert_fraction: float = 1.0) -> dict[str, int]:
    """Parameters of the block matrices every prompt token is multiplied by, per tensor type
    (the token embedding is a lookup, the output layer runs for the last token only; a token
    is multiplied by its k of E experts: expert_fraction k/E of the expert tensors)."""
    out: dict[str, int] = {}
    for t in table:
        n = _prompt_matmul_n_params(t.name, len(t.shape), t.n_elements, expert_fraction)
        if n:
            out[t.type_name.lower()] = out.get(t.type_name.lower(), 0) + n
    return out


def _prompt_matmul_n_params(name: str, n_dims: int, n_elements: int,
                            expert_fraction: float) -> int:
    """Of one tensor, the parameters a prompt token is multiplied by: a block matrix whole,
    expert_fraction of the routed experts; nothing of 1-D tensors, the token embedding (a
    lookup) or the output layer (the last token only)."""
    if n_dims < 2 or name in (TOKEN_EMBEDDING, OUTPUT):
        return 0
    return round(n_elements * expert_fraction) if is_expert(name) else n_elements


def active_expert_fraction(spec: ModelSpec) -> float:
    """k/E: the share of the routed experts one token uses (1 for a dense model)."""
    return spec.num_experts_per_tok / spec.num_experts if spec.is_moe else 1.0


def step_weight_n_bytes(active_n_bytes: float, all_experts_n_bytes: float, spec: ModelSpec,
                        n_sequences: int) -> float:
    """Weight bytes one decode step of n_sequences tokens reads: everything outside the routed
    experts once, and the expected union of the tokens' experts (expert_union_fraction)."""
    if not spec.is_moe or not all_experts_n_bytes:
        return active_n_bytes
    union = expert_union_fraction(spec.num_experts, spec.num_experts_per_tok, n_sequences)
    return active_n_bytes + all_experts_n_bytes * (union - active_expert_fraction(spec))


def kv_type_bytes_per_element(type_name: str) -> float:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name.upper()]]
    return size / block


def kv_n_bytes_per_layer_token(spec: ModelSpec, type_k: str = "f16",
                               type_v: str = "f16") -> float:
    """K and V of one layer for one token: kv_heads × head_dim × (k + v bytes per element)."""
    per_element = kv_type_bytes_per_element(type_k) + kv_type_bytes_per_element(type_v)
    return spec.kv_dim * per_element


def kv_n_bytes_per_token(spec: ModelSpec, type_k: str = "f16", type_v: str = "f16") -> float:
    """K and V of every layer for one token: layers × kv_heads × head_dim × (k + v bytes).

    This is what a token adds to the cache and what each later decode step reads back per
    token of context (llama.cpp stores K and V per layer at n_head_kv × head_dim).
    """
    return spec.num_hidden_layers * kv_n_bytes_per_layer_token(spec, type_k, type_v)


def decode_n_bytes_per_token(weight_n_bytes: float, kv_n_bytes_per_token: float,
                             n_context: float) -> float:
    """Bytes one decode step reads: its weights plus the KV cache of n_context tokens."""
    return weight_n_bytes + kv_n_bytes_per_token * n_context


def matmul_params_per_token(spec: ModelSpec) -> int:
    """Weights every prompt token is multiplied by: the blocks' q, k, v, o, gate, up, down
    (for a mixture of experts the router, the shared expert and k of the E experts)."""
    fraction = active_expert_fraction(spec)
    return sum(_prompt_matmul_n_params(t.name, len(t.shape), t.n_elements, fraction)
               for t in tensor_plan(spec))


def prefill_flops(spec: ModelSpec, n_prompt: int) -> float:
    """FLOPs to prefill n_prompt tokens from an empty cache.

    Forward cost per token = 2 x matmul parameters + attention (Kaplan et al. 2020, "Scaling
    Laws for Neural Language Models", table 1: C_forward = 2N + 2 n_layer n_ctx d_attn, with
    QK^T and AV each 2 x d_attn x context). Token t attends to t earlier positions (causal), so
    the attention sum over a prompt is 4 x layers x q_dim x n(n+1)/2. The output layer runs for
    the last token only (llama.cpp computes logits for it alone): 2 x hidden x vocab once.
    """
    lm_head = 2 * spec.hidden_size * spec.vocab_size
    return (2 * matmul_params_per_token(spec) * n_prompt + attention_flops(spec, n_prompt)
            + lm_head)


def attention_flops(spec: ModelSpec, n_prompt: int, n_past: int = 0) -> float:
    """The attention part of prefill_flops: QK^T and AV, 2 x q_dim FLOPs each per pair of a
    prompt token and a position it attends to (causal: token t of the prompt sees n_past + t
    positions, itself included)."""
    pairs = n_prompt * n_past + n_prompt * (n_prompt + 1) / 2
    return 4 * spec.num_hidden_layers * spec.q_dim * pairs


def model_costs(table: list[TensorEntry], spec: ModelSpec) -> dict:
    """What a model's yardsticks need from its tensor table: the bytes of its weights and of
    what one decode token reads (in all and per type), the matrix parameters a prompt token is
    multiplied by per type, the routed experts' bytes, and the KV bytes a token adds."""
    active = active_expert_fraction(spec)
    return {"weights_n_bytes": weights_n_bytes(table),
            "decode_weight_n_bytes": decode_weight_n_bytes(table, active),
            "decode_type_n_bytes": decode_n_bytes_by_type(table, active),
            "matmul_type_n_params": matmul_n_params_by_type(table, active),
            "expert_n_bytes": expert_n_bytes(table),
            "kv_n_bytes_per_token_f16": kv_n_bytes_per_token(spec)}


def decode_flops_per_token(spec: ModelSpec, n_context: float) -> float:
    """FLOPs of one decode token: 2 per weight its matrices multiply, its row of logits, and
    attention over n_context cached positions (QK^T and AV, 2 x q_dim each per position and
    layer; Kaplan et al. 2020, table 1)."""
    return (2 * matmul_params_per_token(spec) + 2 * spec.hidden_size * spec.vocab_size
            + 4 * spec.num_hidden_layers * spec.q_dim * n_context)


@dataclass(frozen=True)
class DecodeBound:
    """The roofline of one decode step of n_sequences tokens (Williams, Waterman and Patterson,
    "Roofline", CACM 2009): it takes at least its bytes over the streaming ceiling and at least
    its FLOPs over the compute ceiling, so at most n_sequences ÷ the larger of the two."""

    n_sequences: float
    memory_s: float  # (weights + n_sequences x KV) ÷ bandwidth
    compute_s: float  # n_sequences x FLOPs per token ÷ compute peak
    ridge_sequences: float | None  # where the two meet: beyond it compute bounds the step

    @property
    def step_s(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def tok_s(self) -> float:
        return self.n_sequences / self.step_s

    @property
    def limiter(self) -> str:
        return "memory bandwidth" if self.memory_s >= self.compute_s else "compute"


def decode_bound(weight_n_bytes: float, kv_n_bytes: float, flops_per_token: float,
                 n_sequences: float, stream_gb_s: float, compute_gflop_s: float) -> DecodeBound:
    """The roofline of a decode step reading weight_n_bytes once and kv_n_bytes per sequence."""
    bw, peak = stream_gb_s * 1e9, compute_gflop_s * 1e9
    # memory time = compute time: (W + B kv) / bw = B f / peak
    denominator = flops_per_token / peak - kv_n_bytes / bw
    return DecodeBound(n_sequences, (weight_n_bytes + n_sequences * kv_n_bytes) / bw,
                       n_sequences * flops_per_token / peak,
                       weight_n_bytes / bw / denominator if denominator > 0 else None)


def mean_decode_context(n_prompt: int, n_gen: int) -> float:
    """Average KV cache cells a decode step reads: the step at position p reads p + 1 cells
    (its own K and V included), so steps at n_prompt .. n_prompt + n_gen - 1 average
    n_prompt + (n_gen + 1) / 2."""
    return n_prompt + (n_gen + 1) / 2 if n_gen else float(n_prompt)


def prefill_weight_n_bytes(model: Model, spec: ModelSpec, n_prompt: int, n_ubatch: int
                           ) -> float:
    """Weight bytes a prefill reads (model: a run's model record): every ubatch reads everything
    outside the routed experts once, and the union of the experts its tokens picked: as
    recorded where the run read the picks of a prefill at least that long (the model's
    routing: the prefill itself, or its windows of consecutive tokens), else the expected union
    with every token picking uniformly (expert_union_fraction); one decode token reads k of E."""
    active, experts = model.decode_weight_n_bytes, model.expert_n_bytes or 0
    total = 0.0
    for start in range(0, n_prompt, n_ubatch):
        n = min(n_ubatch, n_prompt - start)
        union = _recorded_union(model, n)
        total += (step_weight_n_bytes(active, experts, spec, n) if union is None or not experts
                  else active + experts * (union - active_expert_fraction(spec)))
    return total


def _recorded_union(model: Model, n_tokens: int) -> float | None:
    """The share of the experts n_tokens of one prefill touched, averaged over the layers that
    ran them all, from the model's recorded routing (None when it covers no such ubatch)."""
    shares = [touched / r["n_experts"] for r in (model.routing or {}).get("layers") or []
              if (touched := _layer_touched(r, n_tokens)) is not None]
    return sum(shares) / len(shares) if shares else None


def _layer_touched(layer: dict, n_tokens: int) -> float | None:
    """Experts a ubatch of n_tokens consecutive tokens touched in one layer: the recorded
    prefill of that size, else its windows of n_tokens (recorded at powers of two, interpolated
    in log n between them; runs made before analysis version 21 recorded none)."""
    if layer["prefill_tokens"] == n_tokens and layer["prefill_touched"] is not None:
        return layer["prefill_touched"]
    windows = layer.get("prefill_windows")
    if not windows or not 1 < n_tokens < layer["prefill_tokens"]:
        return None
    sizes, touched = zip(*windows, strict=True)
    return float(np.interp(math.log2(n_tokens), np.log2(sizes), touched))
