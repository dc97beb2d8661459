"""Interleaved rounds: scheduling, adaptive stopping, paired ratios under drift, resume."""

import math
import random
import statistics

import msgspec
import pytest
from conftest import measurement_record

from harness.core.rounds import (
    PAIRING_FIELDS,
    Policy,
    contrast_pairs,
    group_by_memory,
    relative_ci,
    round_order,
    stop_reason,
    widest_ci,
)
from harness.levers.common import round_ratio

IDS = [f"cell{i}" for i in range(6)]


def test_every_cell_once_per_round_shuffled_and_reproducible():
    orders = [round_order(IDS, seed=7, round_index=r) for r in range(20)]
    assert all(sorted(o) == sorted(IDS) for o in orders)
    assert len({tuple(o) for o in orders}) > 10  # shuffled anew each round
    assert orders == [round_order(list(reversed(IDS)), 7, r) for r in range(20)]  # replayable
    assert orders != [round_order(IDS, 8, r) for r in range(20)]  # the seed matters
    firsts = [o[0] for o in orders]
    assert len(set(firsts)) >= 4  # no cell always goes first


def _stream(sd: float, seed: int = 0):
    rng = random.Random(seed)
    while True:
        yield 100 + rng.gauss(0, sd)


def _run(policy: Policy, sd: float, budget_n: int | None = None) -> tuple[int, str]:
    samples, stream = [], _stream(sd)
    while True:
        samples.append(next(stream))
        over = budget_n is not None and len(samples) >= budget_n
        reason = stop_reason(len(samples), relative_ci(samples), policy, over_budget=over)
        if reason:
            return len(samples), reason


def test_adaptive_stops_when_the_ci_is_met():
    n_quiet, why = _run(Policy(None, target_ci=0.03, min_repetitions=6), sd=1.0)
    assert why == "target" and n_quiet == 6  # CV 1%: the first 95% interval is narrow enough
    n_noisy, why = _run(Policy(None, target_ci=0.03, min_repetitions=6), sd=10.0)
    assert why == "target" and n_noisy > 20  # CV 10% needs many more samples
    samples = [x for x, _ in zip(_stream(10.0), range(n_noisy), strict=False)]
    assert relative_ci(samples) <= 0.03 < relative_ci(samples[:-1])


def test_adaptive_never_stops_before_min_repetitions_and_stops_at_max_or_budget():
    n, why = _run(Policy(None, target_ci=0.5, min_repetitions=9), sd=1.0)
    assert (n, why) == (9, "target")
    n, why = _run(Policy(None, target_ci=0.001, min_repetitions=6, max_repetitions=40), 10.0)
    assert (n, why) == (40, "max")
    n, why = _run(Policy(None, target_ci=0.001, min_repetitions=12), 10.0, budget_n=5)
    assert (n, why) == (12, "budget")  # the budget waits for min_repetitions
    assert _run(Policy(5), sd=10.0) == (5, "fixed")
    assert _run(Policy(5), sd=10.0, budget_n=2) == (5, "fixed")  # the budget spares fixed counts


def test_relative_ci_needs_three_samples():
    assert relative_ci([10.0, 11.0]) is None
    assert relative_ci([10.0] * 6) == 0.0


def _key(**changed):
    base = dict(zip(PAIRING_FIELDS, ("m1", "f32", 2, 2048, 512, None, 16, 64, 0, "f16", 1, 0),
                    strict=True))
    return tuple((base | changed).values())


def test_contrasts_pair_cells_that_differ_in_one_setting_on_the_phases_compared():
    both = {"decode", "prefill"}
    cells = {"a": _key(), "b": _key(model="m2"), "c": _key(dtype="q4_0"),
             "d": _key(model="m2", dtype="q4_0"), "e": _key(n_gen=32), "f": _key(n_prompt=128)}
    pairs = contrast_pairs(cells, dict.fromkeys(cells, both))
    assert ("a", "b", "decode") in pairs and ("a", "b", "prefill") not in pairs  # sizes: decode
    assert {("a", "c", "decode"), ("a", "c", "prefill")} <= set(pairs)  # types: both phases
    assert ("a", "f", "prefill") in pairs and ("a", "f", "decode") not in pairs  # prompts
    assert not [p for p in pairs if "e" in p[:2]]  # generation lengths are not compared
    assert not [p for p in pairs if {"a", "d"} == set(p[:2])]  # two settings apart
    prefill_only = contrast_pairs({"a": _key(n_gen=0), "b": _key(n_gen=0, model="m2")},
                                  {"a": {"prefill"}, "b": {"prefill"}})
    assert prefill_only == []  # model sizes on prefill alone: no contrast, min_repetitions
    assert stop_reason(6, None, Policy(None), alone=True) == "alone"
    assert stop_reason(5, None, Policy(None), alone=True) is None


def _drifting_cells(rounds: int, seed: int = 5) -> dict:
    """Two cells 0.5x apart on a machine that swings ±25% from round to round (shared), each
    with 1% noise of its own."""
    rng = random.Random(seed)
    drift = [math.exp(rng.gauss(0, 0.25)) for _ in range(rounds)]
    return {"a": {r: 100 * drift[r] * rng.gauss(1, 0.01) for r in range(rounds)},
            "b": {r: 50 * drift[r] * rng.gauss(1, 0.01) for r in range(rounds)}}


def _stop_round(target: str, budget: int = 40) -> tuple[int, str]:
    policy = Policy(None, target_ci=0.03, min_repetitions=6)
    for n in range(1, budget + 1):
        data = _drifting_cells(n)
        width = widest_ci("a", [("b", "decode")], lambda c, _, d=data: ({}, d[c]), target)
        reason = stop_reason(n, width, policy, over_budget=n == budget)
        if reason:
            return n, reason
    raise AssertionError("never stopped")


def test_stopping_on_contrasts_ends_long_before_the_absolute_figures_would():
    """The drift is shared: the contrast is within ±3% at the first rounds, while the cells'
    own figures carry the ±25% swings and run to the budget."""
    assert _stop_round("contrasts") == (6, "target")
    assert _stop_round("absolute") == (40, "budget")


def _record(rounds: list[int], rates: list[float], model: str = "m"):
    return measurement_record(id=f"{model}|f32|t2", model=model, model_key=f"{model}|f32",
                              threads=2, n_gen=10,
                              decode_tok_s={"n": len(rates), "median": statistics.median(rates)},
                              samples={"rounds": rounds, "decode_s": [[10 / r] for r in rates]})


def test_paired_ratio_recovers_the_true_ratio_under_drift():
    """Two cells, B truly 0.8x A; the machine slows steadily from round to round, and B happens
    to run mostly in the slow half. Unpaired medians are biased; per-round ratios are not."""
    drift = [1.0 - 0.02 * r for r in range(30)]
    a_rounds = list(range(30))
    b_rounds = list(range(10, 30))  # B started late (a resumed or grouped run)
    a = _record(a_rounds, [50 * drift[r] for r in a_rounds], "a")
    b = _record(b_rounds, [40 * drift[r] for r in b_rounds], "b")
    paired = round_ratio(b, a, "decode")
    assert paired["paired"] and paired["median"] == pytest.approx(0.8)
    assert paired["name"] == "decode of f32 t2: b ÷ a" and paired["numerator"] == "b|f32|t2"
    unpaired = b.decode_tok_s["median"] / a.decode_tok_s["median"]
    assert abs(unpaired - 0.8) > 0.05
    assert paired["median_ci95"][0] <= 0.8 <= paired["median_ci95"][1]
    old = round_ratio(msgspec.structs.replace(b, samples={}),
                      msgspec.structs.replace(a, samples={}), "decode")
    assert not old["paired"] and old["median"] == pytest.approx(unpaired)
    assert old["why"] == "the run recorded no rounds"


def test_groups_fit_in_ram_largest_first():
    assert group_by_memory({"a": 5, "b": 4, "c": 3}, None) == [["a", "b", "c"]]
    assert group_by_memory({"a": 5, "b": 4, "c": 3}, 12) == [["a", "b", "c"]]
    assert group_by_memory({"a": 5, "b": 4, "c": 3}, 9) == [["a", "b"], ["c"]]
    assert group_by_memory({"a": 5, "b": 4, "c": 3}, 7) == [["a"], ["b", "c"]]
