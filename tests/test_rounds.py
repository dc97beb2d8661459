"""Interleaved rounds: scheduling, adaptive stopping, paired ratios under drift, resume."""

import math
import random
import statistics

import pytest

from harness.core.rounds import (
    Policy,
    group_by_memory,
    relative_ci,
    round_order,
    stop_reason,
)
from harness.core.stats import batch_half_width, median_ci, order_ci, summarize
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
        reason = stop_reason(samples, policy, over_budget=over)
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


def test_relative_ci_needs_enough_samples_for_95_percent():
    assert relative_ci([1.0] * 5) is None  # min-max covers the median with 94% only
    # batch medians 10.5, 9.5, 10: t(0.975, 2)·0.5/√3 = 1.242, wider than min-max's ±1
    assert relative_ci([10, 11, 9, 10, 10, 10]) == pytest.approx(0.1242, abs=1e-4)
    assert relative_ci([9, 11, 10, 10, 11, 9]) == pytest.approx(0.1)  # steady batches: min-max


def _record(rounds: list[int], rates: list[float]) -> dict:
    return {"n_gen": 10, "parallel": 1, "decode_tok_s": {"n": len(rates),
                                                         "median": statistics.median(rates)},
            "samples": {"rounds": rounds, "decode_s": [[10 / r] for r in rates]}}


def test_paired_ratio_recovers_the_true_ratio_under_drift():
    """Two cells, B truly 0.8x A; the machine slows steadily from round to round, and B happens
    to run mostly in the slow half. Unpaired medians are biased; per-round ratios are not."""
    drift = [1.0 - 0.02 * r for r in range(30)]
    a_rounds = list(range(30))
    b_rounds = list(range(10, 30))  # B started late (a resumed or grouped run)
    a = _record(a_rounds, [50 * drift[r] for r in a_rounds])
    b = _record(b_rounds, [40 * drift[r] for r in b_rounds])
    paired = round_ratio(b, a, "decode")
    assert paired["paired"] and paired["median"] == pytest.approx(0.8)
    unpaired = b["decode_tok_s"]["median"] / a["decode_tok_s"]["median"]
    assert abs(unpaired - 0.8) > 0.05
    old = round_ratio({**b, "samples": {}}, {**a, "samples": {}}, "decode")
    assert not old["paired"] and old["median"] == pytest.approx(unpaired)


def test_groups_fit_in_ram_largest_first():
    assert group_by_memory({"a": 5, "b": 4, "c": 3}, None) == [["a", "b", "c"]]
    assert group_by_memory({"a": 5, "b": 4, "c": 3}, 12) == [["a", "b", "c"]]
    assert group_by_memory({"a": 5, "b": 4, "c": 3}, 9) == [["a", "b"], ["c"]]
    assert group_by_memory({"a": 5, "b": 4, "c": 3}, 7) == [["a"], ["b", "c"]]


def _regime_run(rng: random.Random, n: int) -> list[float]:
    """A machine that flips between a fast (100) and a slow (75) spell that lasts many rounds,
    with 5% noise per repetition: what this VM does for minutes at a time."""
    fast, out = rng.random() < 0.5, []
    for _ in range(n):
        if rng.random() < 0.08:
            fast = not fast
        out.append((100.0 if fast else 75.0) * rng.gauss(1.0, 0.05))
    return out


def _two_run_coverage(ci) -> float:
    """How often two runs' difference of medians lies within their combined 95% half-widths."""
    rng, covered = random.Random(7), 0
    for _ in range(300):
        a, b = _regime_run(rng, 20), _regime_run(rng, 20)
        (lo_a, hi_a), (lo_b, hi_b) = ci(a)[0], ci(b)[0]
        half = math.hypot((hi_a - lo_a) / 2, (hi_b - lo_b) / 2)
        covered += abs(statistics.median(a) - statistics.median(b)) <= half
    return covered / 300


def test_batch_medians_widen_the_ci_until_it_covers_two_runs_under_long_regimes():
    assert _two_run_coverage(order_ci) < 0.6  # rounds are not independent: far too narrow
    assert _two_run_coverage(median_ci) >= 0.88


def test_batch_medians_leave_independent_samples_nearly_alone():
    rng = random.Random(3)
    covered, widths = 0, []
    for _ in range(300):
        xs = [rng.gauss(100.0, 5.0) for _ in range(20)]
        (lo, hi), _ = median_ci(xs)
        covered += lo <= 100.0 <= hi
        widths.append((hi - lo) / (order_ci(xs)[0][1] - order_ci(xs)[0][0]))
    assert covered / 300 >= 0.95
    assert statistics.median(widths) < 2.5  # the price of three batches: t(0.975, 2) = 4.3
    assert batch_half_width([1.0] * 5) is None  # under two samples per batch


def test_summaries_keep_the_independent_interval_beside_the_stated_one():
    s = summarize([10.0] * 8 + [20.0] * 5 + [10.0] * 8)
    assert s["median_ci95_independent"] == [10.0, 10.0]
    assert s["median_ci95"][1] > 20.0  # the middle stretch of the run ran at another level
