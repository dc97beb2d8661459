"""Which experts every token picks, read from the graph as llama.cpp computes it."""

from __future__ import annotations

import re

import numpy as np

from ..core.costs import (
    consecutive_overlap,
    expert_union_fraction,
    experts_touched,
    repeat_share,
    uniform_overlap,
    uniform_repeat_share,
    window_touched,
)
from ..core.specs import ModelSpec

# Prefill tokens this far apart stand for "distant": they share experts at chance when the
# routing has locality and no sequence-wide bias (docs/twins.md, "Routing locality").
FAR_DISTANCES = (64, 128, 256)
TOPK_PREFIX = "ffn_moe_topk"  # llama.cpp's name for the chosen experts: [k, n_tokens] of I32
_LAYER = re.compile(r"-(\d+)$")


def expert_selections(model, n_prompt: int, n_decode: int, threads: int,
                      seed: int = 0) -> dict[str, dict[int, list[list[int]]]]:
    """The experts each token of a loaded model picks per layer ({"prefill": {layer: [[e, ...]
    per token]}, "decode": {layer: [[e, ...] per step]}}): one prefill of n_prompt random
    tokens in one ubatch, then n_decode single-token steps (random tokens too), in a context
    of its own that is closed after."""
    from .llama import Context, ContextParams, GraphTrace

    trace = GraphTrace(capture=(TOPK_PREFIX,))
    rng = np.random.default_rng([seed, 4])
    vocab = model.info().n_vocab
    params = ContextParams(n_ctx=256 * -(-(n_prompt + n_decode) // 256), n_batch=n_prompt,
                           n_ubatch=n_prompt, n_threads=threads)
    out: dict[str, dict[int, list[list[int]]]] = {"prefill": {}, "decode": {}}
    context = Context(model, params, trace)
    try:
        context.prefill([int(x) for x in rng.integers(vocab // 4, vocab, n_prompt)])
        _collect(trace, out["prefill"])
        context.decode([int(x) for x in rng.integers(vocab // 4, vocab, n_decode)])
        _collect(trace, out["decode"])
    finally:
        context.close()
    return out


def _collect(trace, into: dict[int, list[list[int]]]) -> None:
    for name, values in trace.captured:
        layer = int(found.group(1)) if (found := _LAYER.search(name)) else -1
        into.setdefault(layer, []).extend(values.reshape(-1, values.shape[-1]).tolist())
    trace.captured.clear()


def routing_stats(selections: dict, spec: ModelSpec) -> list[dict]:
    """Per layer: the experts the prefill touched (and what tokens picking uniformly at random
    would touch), what windows of its consecutive tokens touched ([n, mean] for n in
    window_sizes), how often its neighbouring tokens share any expert and how often tokens
    FAR_DISTANCES apart do (their mean), what consecutive decode steps share (and k²/E, the
    uniform figure), and how often they share any (and its uniform figure)."""
    n_experts, k = spec.num_experts, spec.num_experts_per_tok
    rows = []
    for layer in sorted(set(selections["prefill"]) | set(selections["decode"])):
        prefill, decode = selections["prefill"].get(layer, []), selections["decode"].get(layer, [])
        rows.append({"layer": layer, "n_experts": n_experts, "k": k,
                     "prefill_tokens": len(prefill),
                     "prefill_touched": experts_touched(prefill) if prefill else None,
                     "prefill_uniform": n_experts * expert_union_fraction(
                         n_experts, k, len(prefill)) if prefill else None,
                     "prefill_windows": window_touched(prefill, n_experts) if prefill else None,
                     "prefill_repeat": repeat_share(prefill),
                     "prefill_repeat_far": _far_share(prefill),
                     "decode_steps": len(decode),
                     "decode_overlap": consecutive_overlap(decode),
                     "decode_repeat": repeat_share(decode),
                     "decode_touched": experts_touched(decode) if decode else None,
                     "uniform_overlap": uniform_overlap(n_experts, k),
                     "uniform_repeat": uniform_repeat_share(n_experts, k)})
    return rows


def _far_share(steps: list[list[int]]) -> float | None:
    shares = [repeat_share(steps, d) for d in FAR_DISTANCES if d < len(steps)]
    return sum(shares) / len(shares) if shares else None
