"""The positional kernel of built mixtures of experts, checked against RoPE as llama.cpp
applies it (neighbouring pairs for llama and granitemoe, pairs head_dim/2 apart for the rest)."""

from dataclasses import replace

import numpy as np
import pytest

from harness.core.specs import ARCHS, resolve_spec
from harness.weights import locality


def rope(x: np.ndarray, position: int, thetas: np.ndarray, neox: bool) -> np.ndarray:
    """x turned by RoPE at a position: pair i (dims 2i, 2i+1, or i, i + d/2 for NEOX) by
    position x theta_i (ggml_rope_ext, modes 0 and 2)."""
    half = len(x) // 2
    first = np.arange(half) if neox else 2 * np.arange(half)
    second = first + half if neox else first + 1
    cos, sin = np.cos(position * thetas), np.sin(position * thetas)
    out = x.copy()
    out[first] = x[first] * cos - x[second] * sin
    out[second] = x[first] * sin + x[second] * cos
    return out


@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-granitemoe", "tiny-olmoe",
                                  "tiny-qwen2moe", "tiny-qwen3moe"])
def test_the_kernel_scores_by_distance_alone_and_favours_the_last_few_tokens(name):
    spec = replace(resolve_spec(name), head_dim=128, rope_theta=1e6)
    p, thetas = locality.kernel_vector(spec), locality.rope_thetas(spec)
    neox = ARCHS[spec.architecture].rope_neox
    for start in (0, 100, 3000):
        for distance in (0, 1, 3, 8, 40, 500):
            score = rope(p, start + distance, thetas, neox) @ rope(p, start, thetas, neox)
            assert abs(score - locality.kernel_scores(spec, np.array([distance]))[0]) < 1e-9
    scores = locality.LOCAL_SCORE * locality.kernel_scores(spec, np.arange(512))
    weights = np.exp(scores - scores.max())
    weights /= weights.sum()
    assert weights[:8].sum() > 0.8 and weights[:2].sum() < 0.6  # a few tokens, not one


def test_a_head_too_small_for_the_band_uses_the_pair_nearest_it():
    spec = resolve_spec("tiny-mixtral")  # head_dim 16: thetas 1, 0.18, 0.03, ...
    assert len(locality.kernel_pairs(spec)) >= 1
    theta = locality.rope_thetas(spec)[locality.kernel_pairs(spec)]
    assert np.all((theta > 0.01) & (theta < 1))
