"""Attention that favours nearby tokens, so that built mixtures of experts route with a
trained model's locality (docs/twins.md, "Routing locality")."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..core.specs import ARCHS, ModelSpec

# A vector shared by every token embedding, its RMS per element this share of theirs. Only
# the attention's q and k read it: each gets one rank-1 term mapping it to a fixed vector
# that RoPE then turns by position, so every head adds a score that depends on distance only
# (the kernel); values and routers are written blind to it.
COMMON_SHARE = 0.3
# The kernel's score at distance 0, in the units softmax sees (after llama.cpp's kq_scale),
# and the band of RoPE pairs that carry it (radians turned per token): the score at distance
# t is LOCAL_SCORE x the mean of cos(t x theta) over the band, so a token's attention spreads
# over about its last four and leaves the rest of a 512-token context 10% or less.
LOCAL_SCORE = 12.0
KERNEL_BAND = (0.05, 0.25)
# The random part of q.k, its standard deviation in the same units: small beside the
# kernel's steps, so that consecutive tokens weigh their shared neighbours alike.
RANDOM_SCORE = 0.2
# What each layer's attention writes into the residual stream, against the embeddings'
# variance there: WRITE_GAIN² / (2 x layers) before its averaging over the window (the GPT-2
# paper's 1/sqrt(2L) residual scaling, with a gain). Fitted so that the built Mixtral 8x7B
# shares an expert between consecutive tokens as often as the trained one does in its middle
# layers (Jiang et al. 2024, Table 5: 61.6-67.0% at layer 15; docs/twins.md).
WRITE_GAIN = 2.6

RowEdit = Callable[[np.ndarray, int], np.ndarray]  # (rows, index of the first) -> rows
EDITED = ("token_embd.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
          "ffn_gate_inp.weight")


def common_direction(spec: ModelSpec, seed: int) -> np.ndarray:
    """The unit vector every token embedding shares a component along."""
    v = np.random.default_rng([seed, 7]).standard_normal(spec.hidden_size)
    return (v / np.linalg.norm(v)).astype(np.float32)


def rope_thetas(spec: ModelSpec) -> np.ndarray:
    """Radians each RoPE pair f turns per token: base^(-2f/head_dim) (RoFormer, eq. 15)."""
    return spec.rope_theta ** (-2.0 * np.arange(spec.head_dim // 2) / spec.head_dim)


def kernel_pairs(spec: ModelSpec) -> np.ndarray:
    """The RoPE pairs in KERNEL_BAND (a head too small to have one: the pair nearest it)."""
    theta, (low, high) = rope_thetas(spec), KERNEL_BAND
    pairs = np.flatnonzero((theta >= low) & (theta <= high))
    if pairs.size:
        return pairs
    return np.array([np.argmin(np.abs(np.log(theta) - math.log(math.sqrt(low * high))))])


def kernel_vector(spec: ModelSpec) -> np.ndarray:
    """A unit head_dim vector with equal energy on both dimensions of every kernel pair,
    where the architecture's RoPE pairs them (neighbours, or i and i + head_dim/2)."""
    pairs = kernel_pairs(spec)
    neox = ARCHS[spec.architecture].rope_neox
    p = np.zeros(spec.head_dim)
    p[pairs if neox else 2 * pairs] = 1.0
    p[pairs + spec.head_dim // 2 if neox else 2 * pairs + 1] = 1.0
    return p / np.linalg.norm(p)


def kernel_scores(spec: ModelSpec, distances: np.ndarray) -> np.ndarray:
    """The kernel's score at each distance, in units of its score at 0."""
    theta = rope_thetas(spec)[kernel_pairs(spec)]
    return np.cos(np.outer(distances, theta)).mean(axis=1)


def kq_scale(spec: ModelSpec) -> float:
    """What llama.cpp multiplies q.k by: Granite's attention scale (the builder writes 1.0
    where unset), else 1/sqrt(head_dim)."""
    if ARCHS[spec.architecture].multipliers:
        return spec.attention_multiplier or 1.0
    return 1.0 / math.sqrt(spec.head_dim)


def _normed(spec: ModelSpec) -> bool:
    arch = ARCHS[spec.architecture]
    return arch.qk_norm or arch.qk_norm_full


def qk_std(spec: ModelSpec, weight_std: float) -> float:
    """The random part of q's and k's weights: a score spread of RANDOM_SCORE, for inputs of
    unit RMS (var q.k x scale² = scale² x head_dim x (std² x hidden)²). Normed q and k keep
    weight_std: their kernel's share sets the spread instead."""
    if _normed(spec):
        return weight_std
    return math.sqrt(RANDOM_SCORE / (kq_scale(spec) * spec.hidden_size
                                     * math.sqrt(spec.head_dim)))


def output_std(spec: ModelSpec, weight_std: float, embedding_std: float) -> float:
    """attn_output's weights: each of its q_dim inputs a mix of values of variance
    weight_std² x hidden, its output variance WRITE_GAIN² / (2L) of the embeddings' (times
    Granite's embedding scale, divided by its residual scale, 1.0 unless a spec sets them)."""
    embedding = embedding_std * (spec.embedding_multiplier or 1.0)
    written = WRITE_GAIN * embedding / (spec.residual_multiplier or 1.0)
    values = weight_std ** 2 * spec.hidden_size
    return written / math.sqrt(2 * spec.num_hidden_layers * spec.q_dim * values)


def kernel_length(spec: ModelSpec, weight_std: float) -> float:
    """|q0| = |k0| per head for an input of unit RMS: sqrt(LOCAL_SCORE / scale); normed, the
    share of q's energy whose random remainder spreads scores by RANDOM_SCORE (the kernel then
    scores about sqrt(head_dim) at distance 0, all a normed head can)."""
    if not _normed(spec):
        return math.sqrt(LOCAL_SCORE / kq_scale(spec))
    # with the random share r of a normed q and k: spread = scale x sqrt(head_dim x (2r - r²))
    r = 1 - math.sqrt(max(1 - RANDOM_SCORE ** 2 / (kq_scale(spec) ** 2 * spec.head_dim), 0.01))
    random_length = weight_std * math.sqrt(spec.hidden_size * spec.head_dim)
    return random_length * math.sqrt((1 - r) / r)


def row_edit(spec: ModelSpec, name: str, seed: int, embedding_std: float,
             weight_std: float) -> RowEdit | None:
    """What the builder adds to a tensor's rows (numpy rows: output features), or None."""
    if not spec.is_moe or not name.endswith(EDITED):
        return None
    c = common_direction(spec, seed)
    if name == "token_embd.weight":
        shift = c * np.float32(COMMON_SHARE * embedding_std * math.sqrt(spec.hidden_size))
        return lambda rows, _first: rows + shift
    if name.endswith(("attn_q.weight", "attn_k.weight")):
        # the common component of a normed input of unit RMS: share x sqrt(hidden / (1 + share²))
        along = COMMON_SHARE * math.sqrt(spec.hidden_size / (1 + COMMON_SHARE ** 2))
        heads = (spec.num_attention_heads if name.endswith("attn_q.weight")
                 else spec.num_key_value_heads)
        a = np.tile(kernel_vector(spec) * kernel_length(spec, weight_std) / along, heads)
        a = a.astype(np.float32)
        return lambda rows, first: rows + np.outer(a[first:first + len(rows)], c)
    if name.endswith(("attn_v.weight", "ffn_gate_inp.weight")):
        return lambda rows, _first: rows - np.outer(rows @ c, c)
    return None
