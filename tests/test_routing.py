"""Which experts tokens pick: the metrics on known selections, and the recorder on a tiny
mixture of experts."""

from dataclasses import replace

import numpy as np

from harness.core.costs import (
    consecutive_overlap,
    experts_touched,
    repeat_share,
    uniform_overlap,
    uniform_repeat_share,
    window_sizes,
    window_touched,
)
from harness.core.dtypes import DTYPES
from harness.core.records import typed
from harness.core.specs import resolve_spec
from harness.engine.build import build
from harness.engine.llama import Model
from harness.engine.routing import expert_selections, routing_stats


def test_overlap_and_union_on_known_selections():
    steps = [[0, 1], [1, 2], [2, 1], [3, 4]]
    assert consecutive_overlap(steps) == (1 + 2 + 0) / 3
    assert consecutive_overlap([[0, 1]]) is None
    assert experts_touched(steps) == 5
    assert uniform_overlap(8, 2) == 0.5 and uniform_overlap(32, 8) == 2.0
    assert repeat_share(steps) == 2 / 3 and repeat_share([[0, 1]]) is None
    # Mixtral's 2 of 8: 1 − (6/8)(5/7), the paper's 46%; one of E picks share 1/E
    assert abs(uniform_repeat_share(8, 2) - (1 - 6 / 8 * 5 / 7)) < 1e-12
    assert abs(uniform_repeat_share(8, 1) - 1 / 8) < 1e-12
    assert uniform_repeat_share(4, 3) == 1.0  # two picks of 3 among 4 always meet


def test_the_experts_section_shows_repetitions_only_where_recorded():
    from harness.levers.experts import _routing_summary
    from harness.render.tabular import markdown_table

    row = {"model": "m", "dtype": "f16", "experts": "2 of 8", "n_prompt": 8, "touched": "8",
           "touched_uniform": 7.2, "n_full": 3, "n_layers": 3, "n_decode": 4, "overlap": "0.5",
           "overlap_uniform": 0.5, "decode_touched": "5"}
    older = markdown_table(_routing_summary([row | {"repeat": "", "repeat_uniform": None}])[0])
    assert "sharing any" not in older
    newer = markdown_table(_routing_summary([row | {"repeat": "33%–67%",
                                                    "repeat_uniform": 0.464}])[0])
    assert "| 33%–67% | 46% |" in newer and "Table 5" in newer


def test_the_recorder_reads_every_layers_choices_from_the_graph():
    spec = resolve_spec("tiny-granitemoe")
    path = build(spec, DTYPES["f32"]).path
    with Model(path) as model:
        chosen = expert_selections(model, n_prompt=16, n_decode=5, threads=1)
    layers = list(range(spec.num_hidden_layers))
    assert sorted(chosen["decode"]) == layers and sorted(chosen["prefill"]) == layers
    for layer in layers:
        assert len(chosen["decode"][layer]) == 5
        assert len(chosen["prefill"][layer]) in (1, 16)  # the last layer keeps the last token
        for picked in chosen["prefill"][layer] + chosen["decode"][layer]:
            assert len(set(picked)) == spec.num_experts_per_tok
            assert all(0 <= e < spec.num_experts for e in picked)
    rows = routing_stats(chosen, spec)
    assert [r["layer"] for r in rows] == layers
    assert all(0 <= r["decode_overlap"] <= spec.num_experts_per_tok for r in rows)
    assert all(0 <= r["decode_repeat"] <= 1 for r in rows)
    assert all(r["decode_repeat"] == repeat_share(chosen["decode"][r["layer"]]) for r in rows)


def test_routing_of_a_dense_model_is_refused_in_one_line(run_cli):
    result = run_cli("routing", "tiny-llama")
    assert result.exit_code == 2 and "has no experts" in result.stderr


def test_a_prefill_ubatch_reads_the_union_of_its_tokens_experts():
    from harness.core.costs import expert_union_fraction, prefill_weight_n_bytes

    spec = resolve_spec("granite-3.0-1b-a400m")
    k_of_e = spec.num_experts_per_tok / spec.num_experts
    model = typed({"type": "model", "key": "m", "decode_weight_n_bytes": 1000,
                   "expert_n_bytes": 3200})
    assert prefill_weight_n_bytes(model, spec, 1, 512) == 1000.0  # one token: k of E
    union = expert_union_fraction(spec.num_experts, spec.num_experts_per_tok, 512)
    full = 1000.0 + 3200.0 * (union - k_of_e)
    assert prefill_weight_n_bytes(model, spec, 512, 512) == full
    assert full > 3200.0 * 0.99  # a 512-token ubatch reads nearly every expert
    two = prefill_weight_n_bytes(model, spec, 600, 512)  # a full ubatch and one of 88
    assert two == full + 1000.0 + 3200.0 * (expert_union_fraction(
        spec.num_experts, spec.num_experts_per_tok, 88) - k_of_e)


def test_a_short_ubatch_reads_what_windows_of_the_recorded_prefill_touched():
    from harness.core.costs import prefill_weight_n_bytes

    assert window_sizes(4) == [1, 2, 4] and window_sizes(6) == [1, 2, 4, 6]
    steps = [[0, 1], [1, 2], [2, 1], [3, 4]]
    # windows of 2: {0, 1, 2}, {1, 2}, {1, 2, 3, 4}
    assert window_touched(steps, 5) == [[1, 2.0], [2, 3.0], [4, 5.0]]
    spec = resolve_spec("granite-3.0-1b-a400m")  # 8 of 32
    k_of_e = spec.num_experts_per_tok / spec.num_experts
    layer = {"n_experts": 32, "prefill_tokens": 512, "prefill_touched": 32,
             "prefill_windows": [[8, 16.0], [16, 20.0], [32, 28.0], [512, 32.0]]}
    model = typed({"type": "model", "key": "m", "decode_weight_n_bytes": 1000,
                   "expert_n_bytes": 3200, "routing": {"layers": [layer, layer | {
                       "prefill_windows": [[8, 16.0], [16, 24.0], [32, 28.0], [512, 32.0]]}]}})
    # 16 tokens: the two layers' windows, 20 and 24 of 32 experts (uniform: 31.7)
    assert prefill_weight_n_bytes(model, spec, 16, 512) == 1000.0 + 3200.0 * (22 / 32 - k_of_e)
    # 24 tokens: halfway from 16 to 32 in log2 n is 22.6 tokens; interpolated, not uniform
    between = prefill_weight_n_bytes(model, spec, 24, 512)
    assert 1000.0 + 3200.0 * (22 / 32 - k_of_e) < between < 1000.0 + 3200.0 * (28 / 32 - k_of_e)
    assert prefill_weight_n_bytes(model, spec, 512, 512) == 1000.0 + 3200.0 * (1 - k_of_e)


def _deep_routing(tmp_path, base: str, n_layers: int, n_experts: int, n_prompt: int,
                  n_decode: int):
    """A tiny mixture of experts made deeper and wider, built at F32, and its routing stats."""
    spec = replace(resolve_spec(base), name=f"deep-{base}", num_hidden_layers=n_layers,
                   num_experts=n_experts)
    path = build(spec, DTYPES["f32"], directory=tmp_path).path
    with Model(path) as model:
        chosen = expert_selections(model, n_prompt=n_prompt, n_decode=n_decode, threads=1)
    return spec, routing_stats(chosen, spec)


def test_a_deep_built_mixture_routes_each_token_on_its_own(tmp_path):
    # 12 layers of tiny OLMoE with 16 experts: with every tensor at N(0, 0.02) its deep layers
    # sent a whole sequence to 8-10 of the 16 experts, consecutive steps sharing about 5x
    # uniform's k^2/E; the builder's MoE init keeps routing near uniform in every layer.
    spec, rows = _deep_routing(tmp_path, "tiny-olmoe", 12, 16, n_prompt=256, n_decode=32)
    whole = [r for r in rows if r["prefill_tokens"] == 256]
    assert len(whole) == spec.num_hidden_layers - 1  # the last layer runs the last token only
    assert all(r["prefill_touched"] >= 0.95 * spec.num_experts for r in whole)
    mean_overlap = sum(r["decode_overlap"] for r in rows) / len(rows)
    assert mean_overlap < 2 * uniform_overlap(spec.num_experts, spec.num_experts_per_tok)


def test_neighbours_and_distant_tokens_are_told_apart_on_known_selections():
    # even tokens pick experts 0 and 1, odd ones 2 and 3: neighbours never share, tokens an
    # even distance apart always do
    steps = [[2 * (t % 2), 2 * (t % 2) + 1] for t in range(300)]
    row = routing_stats({"prefill": {0: steps}, "decode": {0: steps[:3]}},
                        resolve_spec("tiny-mixtral"))[0]
    assert row["prefill_repeat"] == 0.0 and row["prefill_repeat_far"] == 1.0
    assert repeat_share(steps, 2) == 1.0 and repeat_share(steps, 299) == 0.0
    short = routing_stats({"prefill": {0: steps[:100]}, "decode": {0: []}},
                          resolve_spec("tiny-mixtral"))[0]
    assert short["prefill_repeat_far"] == 1.0  # only distance 64 fits in 100 tokens
    assert routing_stats({"prefill": {0: steps[:1]}, "decode": {}},
                         resolve_spec("tiny-mixtral"))[0]["prefill_repeat_far"] is None


def test_a_deep_built_mixture_sends_consecutive_tokens_to_shared_experts(tmp_path):
    # Trained Mixtral shares an expert between consecutive tokens in 62-67% of pairs at its
    # middle layer (46% at chance). The builder's positional kernel makes each token attend
    # to its last few, so neighbours share experts more often than distant tokens, which
    # share them at chance. Measured at this spec: about 0.66 near against 0.48 far (with the
    # kernel off, or laid out for the other RoPE, near fell to 0.49-0.54).
    _, rows = _deep_routing(tmp_path, "tiny-mixtral", 8, 8, n_prompt=512, n_decode=2)
    deep = [rows[layer] for layer in range(3, 7)]
    near = np.mean([r["prefill_repeat"] for r in deep])
    far = np.mean([r["prefill_repeat_far"] for r in deep])
    assert near > far + 0.1
    assert abs(far - uniform_repeat_share(8, 2)) < 0.06
    assert all(r["prefill_touched"] == 8 for r in deep)
