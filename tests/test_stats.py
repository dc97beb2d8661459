"""The run's statistical model (harness.core.stats): coverage by simulation, exact inversion
across units, contrasts under drift, drift stated once, and claims decided on intervals."""

import importlib.util
import math
import random
from pathlib import Path

import pytest

from harness.core.stats import (
    absolute_interval,
    contrast,
    decide,
    inverse,
    machine_drift,
    ratio_summary,
    summarize,
    unpaired,
)

SIM = Path(__file__).resolve().parents[1] / "scripts" / "sim_intervals.py"


def _sim():
    spec = importlib.util.spec_from_file_location("sim_intervals", SIM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def coverage() -> dict:
    """Coverage and width of both intervals, 300 simulated runs per case (seeded)."""
    sim = _sim()
    rows = []
    for kind, cases in (("absolute", ("ar:0", "ar:0.5")), ("contrast", ("residual:0",))):
        for case in cases:
            for rounds in (6, 10, 20, 30, None):
                rng = random.Random(f"test:{kind}:{case}:{rounds}")
                run = sim.run_absolute if kind == "absolute" else sim.run_contrast
                results = [run(rng, case, rounds) for _ in range(300)]
                widths = sorted(w for _, w, _ in results if not math.isnan(w))
                rows.append({"kind": kind, "case": case, "rounds": rounds,
                             "coverage": sum(c for c, _, _ in results) / 300,
                             "width": widths[len(widths) // 2] if widths else None})
    return {(r["kind"], r["case"], r["rounds"]): r for r in rows}


def test_absolute_intervals_cover_the_long_run_median_on_independent_rounds(coverage):
    for rounds in (6, 10, 20, 30, None):  # None: the run stops once within ±3%
        assert coverage[("absolute", "ar:0", rounds)]["coverage"] >= 0.93
    for rounds in (10, 20, 30):  # no wider than the order-statistic interval's 1.15x
        assert coverage[("absolute", "ar:0", rounds)]["width"] <= 1.15


def test_absolute_intervals_widen_for_persistent_drift(coverage):
    for rounds in (6, 10, 20, 30):
        assert coverage[("absolute", "ar:0.5", rounds)]["coverage"] >= 0.90


def test_contrast_intervals_cover_the_true_ratio_under_regime_drift(coverage):
    for rounds in (6, 10, 20, 30, None):
        assert coverage[("contrast", "residual:0", rounds)]["coverage"] >= 0.93
        assert coverage[("contrast", "residual:0", rounds)]["width"] <= 1.15


def test_tok_s_and_ms_per_token_are_exact_inverses():
    rng = random.Random(2)
    for n in (3, 6, 7, 10):
        seconds = [0.08 * rng.uniform(0.8, 1.3) for _ in range(n)]
        tok_s = summarize([1 / s for s in seconds])
        ms = inverse(tok_s, 1000.0)
        direct = summarize([1000 * s for s in seconds])
        assert ms["median"] == pytest.approx(direct["median"], rel=1e-12)
        assert ms["median_ci95"] == pytest.approx(direct["median_ci95"], rel=1e-12)


def test_contrasts_recover_a_known_ratio_under_drift_that_biases_unpaired_ones():
    rng = random.Random(4)
    drift = [1.0 - 0.015 * r for r in range(30)]
    a = {r: 100 * drift[r] * rng.gauss(1, 0.01) for r in range(30)}
    b = {r: 50 * drift[r] * rng.gauss(1, 0.01) for r in range(15, 30)}  # b ran late
    c = contrast(b, a)
    assert c["n"] == 15 and c["median_ci95"][0] <= 0.5 <= c["median_ci95"][1]
    apart = unpaired(summarize(list(b.values())), summarize(list(a.values())))
    assert not apart["paired"] and apart["ratio"] < 0.45  # b's slow minutes, not b
    assert contrast({0: 1.0}, {1: 1.0}) is None
    assert contrast({0: 2.0, 1: 2.0}, {0: 1.0, 1: 1.0})["median_ci95"] is None  # under 3


def test_machine_drift_is_the_spread_of_the_round_effects():
    drift = [1.0, 0.7, 1.2, 1.0, 0.9]
    cells = [{r: rate * d for r, d in enumerate(drift)} for rate in (10.0, 55.0, 300.0)]
    d = machine_drift(cells)
    assert d["n_rounds"] == 5
    assert d["low"] == pytest.approx(0.7) and d["high"] == pytest.approx(1.2)


def test_claims_are_undecided_when_the_interval_straddles_the_tolerance():
    assert decide([1.05, 1.15], 0.8, 1.2) == "holds"
    assert decide([1.15, 1.25], 0.8, 1.2) == "undecided"
    assert decide([1.25, 1.35], 0.8, 1.2) == "does not hold"
    assert decide([2.1, 2.4], 2.0) == "holds" and decide([1.9, 2.4], 2.0) == "undecided"
    assert decide(None, 2.0) == "undecided"


def test_summaries_carry_the_interval_of_the_long_run_median():
    s = summarize([10.0, 10.2, 9.9, 10.1, 10.0, 9.8])
    lo, hi = s["median_ci95"]
    assert lo < s["median"] < hi and absolute_interval([10.0, 11.0]) is None
    paired = ratio_summary([1.1, 1.2, 1.15, 1.12])
    assert paired["ratio"] == pytest.approx(math.exp(sum(map(math.log, [1.1, 1.2, 1.15,
                                                                        1.12])) / 4))
