"""Summary statistics of raw samples: the numbers every table shows, with their spread.

Convention: tables show the median of the per-repetition values with a 95% confidence interval
of the median, and the mean with its Student-t interval stays in the records. Samples come in
the order they were measured. The interval is the wider of two: the distribution-free
order-statistic interval, which assumes repetitions independent, and a batch-medians interval
from three consecutive stretches of the run, which widens it when the machine's slow and fast
spells last longer than a round (they do: minutes on a shared VM) and a whole stretch of the run
sits in one of them.
"""

from __future__ import annotations

import itertools
import math
import statistics

from scipy import stats as sps

UNSTABLE_CV = 0.05  # a measurement whose coefficient of variation exceeds 5% is flagged
CONFIDENCE = 0.95


def t_critical_95(df: int) -> float:
    """t(0.975, df), the two-sided 95% Student-t quantile."""
    return float(sps.t.ppf(0.5 + CONFIDENCE / 2, df)) if df >= 1 else math.nan


def order_ci(samples: list[float]) -> tuple[list[float], float]:
    """95% CI of the median from order statistics: [x(k), x(n+1-k)] with the largest k whose
    coverage 1 - 2 P(Binomial(n, 1/2) < k) is at least 95% (Hollander & Wolfe, Nonparametric
    Statistical Methods, 3.6). Under 6 samples no k reaches 95%: [min, max] and its coverage."""
    xs, n = sorted(samples), len(samples)
    k = 1
    while k + 1 <= n // 2 and 1 - 2 * sps.binom.cdf(k, n, 0.5) >= CONFIDENCE:
        k += 1
    coverage = 1 - 2 * sps.binom.cdf(k - 1, n, 0.5)
    return [xs[k - 1], xs[n - k]], float(coverage)


BATCHES = 3  # consecutive stretches of the run for the batch-medians interval


def batch_half_width(samples: list[float]) -> float | None:
    """Half-width t(0.975, K-1)·sd(batch medians)/√K over K=3 consecutive batches of the samples
    in measurement order: nonoverlapping batch means (Law, Simulation Modeling and Analysis,
    5th ed., 9.5.3), with medians; None under 2 samples per batch."""
    if len(samples) < 2 * BATCHES:
        return None
    size, extra = divmod(len(samples), BATCHES)
    bounds = [i * size + min(i, extra) for i in range(BATCHES + 1)]
    medians = [statistics.median(samples[a:b]) for a, b in itertools.pairwise(bounds)]
    return t_critical_95(BATCHES - 1) * statistics.stdev(medians) / math.sqrt(BATCHES)


def median_ci(samples: list[float]) -> tuple[list[float], float]:
    """The 95% CI of the median the tables show: the order-statistic interval widened to
    median ± the batch-medians half-width where that is wider (samples in measurement order).
    The coverage returned is the order-statistic interval's, a lower bound for the union."""
    independent, coverage = order_ci(samples)
    return widened(independent, samples), coverage


def widened(ci: list[float], samples: list[float]) -> list[float]:
    """An interval of the median widened to median ± the batch-medians half-width where that
    is wider."""
    half = batch_half_width(samples)
    if half is None:
        return list(ci)
    mid = statistics.median(samples)
    return [min(ci[0], mid - half), max(ci[1], mid + half)]


def summarize(samples: list[float]) -> dict:
    """median with its 95% CI, mean with its 95% CI (t), stdev, min, max and CV."""
    n = len(samples)
    if n == 0:
        return {"n": 0}
    mean = statistics.fmean(samples)
    stdev = statistics.stdev(samples) if n > 1 else 0.0
    half = t_critical_95(n - 1) * stdev / math.sqrt(n) if n > 1 else math.nan
    out = {
        "n": n,
        "median": statistics.median(samples),
        "mean": mean,
        "stdev": stdev,
        "min": min(samples),
        "max": max(samples),
        "cv": stdev / mean if mean else None,
        "ci95": [mean - half, mean + half] if n > 1 else None,
    }
    if n > 1:
        # one order-statistic interval: kept alone, and widened for the tables
        independent, out["median_ci_coverage"] = order_ci(samples)
        out["median_ci95"] = widened(independent, samples)
        out["median_ci95_independent"] = independent
    return out


def center(summary: dict | None) -> float | None:
    """The figure tables show: the median (the mean of records that lack one)."""
    if not summary or not summary.get("n"):
        return None
    return summary.get("median", summary.get("mean"))


def inverse(summary: dict | None, scale: float = 1000.0) -> dict | None:
    """scale ÷ a rate: ms per token from the same samples' median tok/s and its interval."""
    mid = center(summary)
    if not mid:
        return None
    ci = summary.get("median_ci95")
    return {"n": summary["n"], "median": scale / mid,
            "median_ci95": [scale / ci[1], scale / ci[0]] if ci and ci[0] > 0 else None}


def half_width(samples: list[float]) -> float | None:
    """Half-width of the 95% CI of the samples' mean (None under 2 samples)."""
    if len(samples) < 2:
        return None
    return t_critical_95(len(samples) - 1) * statistics.stdev(samples) / math.sqrt(len(samples))


def is_unstable(summary: dict) -> bool:
    cv = summary.get("cv")
    return cv is not None and cv > UNSTABLE_CV


def rates(counts: float, seconds: list[float]) -> list[float]:
    """Tokens per second of each sample."""
    return [counts / s for s in seconds if s > 0]
