"""The run's statistical model, stated once: every interval a report prints is derived here.

A run is a blocked design. Every round is a block in which each cell still running does one
repetition, so the log rate of cell c in round r is

    log y[c, r] = a[c] + b[r] + e[c, r]

with a the cell effect, b the machine's state in that round (its drift, shared by every cell)
and e the residual. Two quantities are estimated from it:

- a **contrast** (cell c against cell d): exp(a[c] - a[d]), estimated from the rounds both
  ran, as the geometric mean of the per-round ratios (b cancels round by round; it is the
  fixed-effects estimate of the two-cell model), with a Student-t interval of the mean log
  ratio;
- an **absolute** figure (a cell's tok/s, seconds, GB/s): the cell's long-run median, drift
  included, estimated by the median of its repetitions with an interval whose width counts the
  round-to-round variance and its persistence (an effective number of rounds).

Both intervals are computed on the log scale, so tok/s, ms per token and seconds are exact
inverses of one another in every table, and both use the same effective number of rounds:
n (1 - rho) / (1 + rho), rho the lag-1 autocorrelation with Kendall's small-sample bias
correction (rho + (1 + 4 rho) / n; Kendall 1954, Marriott & Pope 1954), kept in [0, 0.9] and
taken as 0 under 6 rounds, where it is noise: slow and fast spells that last several rounds
make consecutive rounds agree, and fewer of them independent. The median's standard error is
sqrt(pi / 2) times the mean's (its asymptotic efficiency under normal errors). The machine's
drift is stated once: exp(b[r]) per round, each cell's log rate minus its own median, the
median over the cells of the round.
scripts/sim_intervals.py measures every interval's coverage and width by simulation.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

import numpy as np
from scipy import stats as sps

UNSTABLE_CV = 0.05  # a measurement whose coefficient of variation exceeds 5% is flagged
CONFIDENCE = 0.95
MAX_RHO = 0.9  # a persistence estimated above this says too few rounds, not 0.99
MEDIAN_SE = math.sqrt(math.pi / 2)  # s.e. of the median over s.e. of the mean (normal errors)
MIN_ROUNDS = 3  # the fewest rounds an interval is computed from
MIN_ROUNDS_FOR_RHO = 6  # under 6 rounds a lag-1 autocorrelation is noise: counted as 0


def t_critical_95(df: float) -> float:
    """t(0.975, df), the two-sided 95% Student-t quantile (df may be fractional)."""
    return float(sps.t.ppf(0.5 + CONFIDENCE / 2, df)) if df >= 1 else math.nan


def effective_n(logs: list[float]) -> float:
    """The number of independent rounds the series is worth: n (1 - rho) / (1 + rho)."""
    n = len(logs)
    if n < MIN_ROUNDS_FOR_RHO:
        return float(n)
    xs = np.asarray(logs, dtype=float) - float(np.mean(logs))
    denom = float(xs @ xs)
    rho = float(xs[1:] @ xs[:-1]) / denom if denom > 0 and n > 2 else 0.0
    rho = min(MAX_RHO, max(0.0, rho + (1 + 4 * rho) / n))
    return n * (1 - rho) / (1 + rho)


def _half_width(logs: list[float], se_factor: float) -> float | None:
    """t(0.975, n_eff - 1) · se_factor · sd / √n_eff on the log scale, n_eff at least 3 (six
    rounds that happen to trend would otherwise count as one and give t(0.975, 1) = 12.7);
    None under 3 rounds."""
    if len(logs) < MIN_ROUNDS:
        return None
    n_eff = max(effective_n(logs), MIN_ROUNDS)
    return t_critical_95(n_eff - 1) * se_factor * statistics.stdev(logs) / math.sqrt(n_eff)


def _logs(values: Iterable[float]) -> list[float]:
    return [math.log(v) for v in values if v and v > 0]


def log_median(values: list[float]) -> float:
    """The median on the log scale: exp(median(log x)), so 1/x has the inverse median."""
    return math.exp(statistics.median(_logs(values)))


def absolute_interval(values: list[float]) -> list[float] | None:
    """95% interval of the long-run median of positive values in measurement order (one per
    round), drift and its persistence included; None under 3 values."""
    logs = _logs(values)
    half = _half_width(logs, MEDIAN_SE)
    if half is None:
        return None
    mid = statistics.median(logs)
    return [math.exp(mid - half), math.exp(mid + half)]


def summarize(samples: list[float]) -> dict:
    """A positive quantity's repetitions: the median (log scale) with the interval of its
    long-run median, and the mean, stdev, min, max and CV of the raw samples."""
    n = len(samples)
    if n == 0:
        return {"n": 0}
    mean = statistics.fmean(samples)
    stdev = statistics.stdev(samples) if n > 1 else 0.0
    return {"n": n, "median": log_median(samples) if min(samples) > 0 else
            statistics.median(samples), "median_ci95": absolute_interval(samples),
            "mean": mean, "stdev": stdev, "min": min(samples), "max": max(samples),
            "cv": stdev / mean if mean else None}


def center(summary: dict | None) -> float | None:
    """The figure tables show: the median (the mean of records that lack one)."""
    if not summary or not summary.get("n"):
        return None
    return summary.get("median", summary.get("mean"))


def inverse(summary: dict | None, scale: float = 1000.0) -> dict | None:
    """scale ÷ a quantity: ms per token from tok/s, its median and interval exactly inverted."""
    mid = center(summary)
    if not mid:
        return None
    ci = summary.get("median_ci95")
    return {"n": summary["n"], "median": scale / mid,
            "median_ci95": [scale / ci[1], scale / ci[0]] if ci and ci[0] > 0 else None}


def scaled(summary: dict | None, factor: float) -> dict | None:
    """A summary multiplied by a positive constant (GB/s from tok/s × bytes per token)."""
    if not summary or not summary.get("n"):
        return None
    ci = summary.get("median_ci95")
    return {"n": summary["n"], "median": center(summary) * factor,
            "median_ci95": [ci[0] * factor, ci[1] * factor] if ci else None}


def log_half_width(summary: dict | None) -> float | None:
    """The wider side of a summary's interval on the log scale (None without one)."""
    mid, ci = center(summary), (summary or {}).get("median_ci95")
    if not mid or not ci or min(ci) <= 0:
        return None
    return max(math.log(ci[1] / mid), math.log(mid / ci[0]))


def relative_half_width(summary: dict | None) -> float | None:
    """The wider side of a summary's interval relative to its median (None without one)."""
    mid = center(summary)
    ci = (summary or {}).get("median_ci95") or (summary or {}).get("ci95")
    if not mid or not ci:
        return None
    return max(mid - ci[0], ci[1] - mid) / mid


# --- contrasts: two cells in the rounds they shared ----------------------------------------


def contrast(ours: dict, theirs: dict) -> dict | None:
    """ours ÷ theirs from two cells' per-block rates ({block: rate}): the geometric mean of the
    per-round ratios over the blocks both ran, with its 95% interval (none under 3 blocks);
    None when they share no block."""
    shared = sorted(ours.keys() & theirs.keys())
    logs = [math.log(ours[k] / theirs[k]) for k in shared if ours[k] > 0 and theirs[k] > 0]
    if not logs:
        return None
    mid = statistics.fmean(logs)
    half = _half_width(logs, 1.0)
    return {"n": len(logs), "ratio": math.exp(mid), "median": math.exp(mid),
            "median_ci95": None if half is None else [math.exp(mid - half),
                                                      math.exp(mid + half)],
            "per_round": [math.exp(x) for x in logs], "paired": True}


def unpaired(ours: dict, theirs: dict) -> dict | None:
    """ours ÷ theirs for two figures measured in different rounds (summaries): the ratio of
    their medians, with an interval combining their absolute intervals on the log scale, so
    the machine's drift between them is in it rather than cancelled."""
    x, y = center(ours), center(theirs)
    if not x or not y:
        return None
    h_x, h_y = log_half_width(ours), log_half_width(theirs)
    ci = None
    if h_x is not None and h_y is not None:
        half = math.hypot(h_x, h_y)
        ci = [x / y * math.exp(-half), x / y * math.exp(half)]
    return {"n": 1, "ratio": x / y, "median": x / y, "median_ci95": ci, "paired": False}


WINDOW_TICKS = 16  # steps per window of a step-interleaved decode (scripts/sim_intervals.py)


def windows(steps_s: list[float], n_per_step: int = 1) -> list[float]:
    """Rates over windows of WINDOW_TICKS adjacent decode steps (the last may be shorter):
    the blocks a step-interleaved contrast pairs, each within seconds of its partner's."""
    return [n_per_step * len(w) / sum(w)
            for w in (steps_s[i:i + WINDOW_TICKS] for i in range(0, len(steps_s), WINDOW_TICKS))
            if sum(w) > 0]


def finest(ours: tuple[dict, dict], theirs: tuple[dict, dict]) -> tuple[dict, dict]:
    """Two cells' (windows, rounds) rates as the blocks to pair: their windows where they
    share any (both decoded step by step in the same rounds), else their rounds."""
    if ours[0].keys() & theirs[0].keys():
        return ours[0], theirs[0]
    return ours[1], theirs[1]


def row_pair(ours: dict, theirs: dict) -> tuple[dict, dict]:
    """Two analysis rows' finest shared blocks (harness.core.stats.finest)."""
    return finest((row_windows(ours), row_blocks(ours)), (row_windows(theirs), row_blocks(theirs)))


def row_windows(row: dict) -> dict:
    """An analysis row's per-window rates ([[[RAM group, round, window], rate], ...])."""
    return {tuple(k): x for k, x in row.get("window_rates") or []}


def row_blocks(row: dict) -> dict:
    """An analysis row's per-round rates ([[[RAM group, round], rate], ...] as stored) keyed
    by (RAM group, round), the blocks a contrast pairs."""
    return {tuple(k): x for k, x in row.get("round_rates") or []}


def ratio_summary(values: list[float]) -> dict | None:
    """A contrast already paired inside each repetition (a depth slowdown against its own
    baseline, a share against the probe of its round): the same estimate and interval."""
    return contrast(dict(enumerate(values)), dict.fromkeys(range(len(values)), 1.0))


def decide(ci: list[float] | None, low: float | None = None, high: float | None = None
           ) -> str:
    """A claim that a ratio lies in [low, high], decided on its interval: "holds" when the
    whole interval lies inside, "does not hold" when it lies wholly outside, else "undecided"."""
    if not ci:
        return "undecided"
    lo, hi = ci
    low = -math.inf if low is None else low
    high = math.inf if high is None else high
    if low <= lo and hi <= high:
        return "holds"
    if hi < low or lo > high:
        return "does not hold"
    return "undecided"


def machine_drift(cells: list[dict]) -> dict | None:
    """The round effects: for each round, the median over the cells that ran in it of the
    cell's rate ÷ its own log median. cells: {round: rate} per cell."""
    by_round: dict = {}
    for rates in cells:
        if len(rates) < 2:
            continue
        mid = log_median(list(rates.values()))
        for rnd, x in rates.items():
            by_round.setdefault(rnd, []).append(math.log(x / mid))
    if len(by_round) < 2:
        return None
    effects = {rnd: math.exp(statistics.median(v)) for rnd, v in sorted(by_round.items())}
    return {"n_rounds": len(effects), "low": min(effects.values()),
            "high": max(effects.values()),
            "by_round": [[list(k) if isinstance(k, tuple) else k, x]
                         for k, x in effects.items()]}


def is_unstable(summary: dict) -> bool:
    cv = summary.get("cv")
    return cv is not None and cv > UNSTABLE_CV


def rates(counts: float, seconds: list[float]) -> list[float]:
    """Tokens per second of each sample."""
    return [counts / s for s in seconds if s > 0]
