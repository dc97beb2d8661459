"""Summary statistics of raw samples: the numbers every table shows, with their spread."""

from __future__ import annotations

import math
import statistics

UNSTABLE_CV = 0.05  # a measurement whose coefficient of variation exceeds 5% is flagged

# Two-sided 95% Student-t critical values t(0.975, df) for df = 1..30 (any statistics table).
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t_critical_95(df: int) -> float:
    """t(0.975, df); beyond the table, the normal 1.96 plus the first-order t correction."""
    if df < 1:
        return math.nan
    if df <= len(_T975):
        return _T975[df - 1]
    return 1.96 + 2.4 / df  # Cornish-Fisher first term: within 0.002 of t for df > 30


def summarize(samples: list[float]) -> dict:
    """median, mean, stdev, min, max, CV and the 95% CI of the mean (t-distribution)."""
    n = len(samples)
    if n == 0:
        return {"n": 0}
    mean = statistics.fmean(samples)
    stdev = statistics.stdev(samples) if n > 1 else 0.0
    half = t_critical_95(n - 1) * stdev / math.sqrt(n) if n > 1 else math.nan
    return {
        "n": n,
        "median": statistics.median(samples),
        "mean": mean,
        "stdev": stdev,
        "min": min(samples),
        "max": max(samples),
        "cv": stdev / mean if mean else None,
        "ci95": [mean - half, mean + half] if n > 1 else None,
    }


def is_unstable(summary: dict) -> bool:
    cv = summary.get("cv")
    return cv is not None and cv > UNSTABLE_CV


def rates(counts: float, seconds: list[float]) -> list[float]:
    """Tokens per second of each sample."""
    return [counts / s for s in seconds if s > 0]
