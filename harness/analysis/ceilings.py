"""The yardsticks beside each measurement: probe figures looked up by record position, a
model's ceiling combined over its tensor types, and the per-repetition rates the comparisons
use. Pure functions of the stored records."""

from __future__ import annotations

import math
from itertools import groupby

import numpy as np

from ..core.records import Measurement, Probe
from ..core.stats import (
    WINDOW_TICKS,
    log_median,
    ratio_summary,
    relative_half_width,
    summarize,
    windows,
)


def _samples_key(key: str) -> str:
    """read_gb_s -> read_samples_gb_s; stream_gb_s -> stream_samples_gb_s; ..."""
    name, _, unit = key.partition("_")
    return f"{name}_samples_{unit}"


def probe_figure(probe: Probe | None, threads: int, path: tuple[str, ...]) -> dict | None:
    """One figure of one probe at a thread count: the median of its passes (the statistic a
    repetition is compared with: a best-of would fall with the number of passes), the
    passes, and the layout."""
    node = ((probe.result if probe else None) or {}).get("threads", {}).get(str(threads))
    for part in path[:-1]:
        node = (node or {}).get(part)
    if not node or not node.get(path[-1]):
        return None
    samples = [x for x in node.get(_samples_key(path[-1])) or [] if x and x > 0]
    return {"value": log_median(samples) if samples else node[path[-1]],
            "best": node[path[-1]], "samples": samples, "layout": node.get("layout")}


def span(m: Measurement) -> tuple[int, int]:
    """The records a measurement's repetitions lie between (one point for older runs)."""
    return (m.span_seq or [m.seq])[0], m.seq


def ceiling_near(probes: list[Probe], seq: int | tuple[int, int], threads: int,
                 path: tuple[str, ...]) -> dict:
    """The figure from the probes that measured it nearest a record (or a span of records:
    the nearest before, every one inside, the nearest after): the median of their pooled
    passes, and its spread (the wider side of that median's 95% interval, relative)."""
    lo, hi = seq if isinstance(seq, tuple) else (seq, seq)
    before = next((f for p in reversed(probes) if p.seq < lo
                   and (f := probe_figure(p, threads, path))), None)
    inside = [f for p in probes if lo < p.seq < hi and (f := probe_figure(p, threads, path))]
    after = next((f for p in probes if p.seq > hi
                  and (f := probe_figure(p, threads, path))), None)
    found = [f for f in (before, *inside, after) if f]
    out = {"before": before and before["value"], "after": after and after["value"],
           "value": None, "spread": None, "layout": next((f["layout"] for f in found), None),
           "n_probes": len(found)}
    if not found:
        return out
    pooled = [s for f in found for s in f["samples"]]
    out["value"] = log_median(pooled) if pooled else sum(f["value"] for f in found) / len(found)
    out["spread"] = relative_half_width(summarize(pooled)) if pooled else None
    if before and after:
        out["drift"] = (after["value"] - before["value"]) / before["value"]
    return out


def combined_ceiling(weights: dict[str, float], probes: list[Probe],
                     seq: int | tuple[int, int], threads: int, what: str) -> dict:
    """A model's ceiling over its mix of tensor types: total ÷ Σ (weight of t ÷ ceiling of t)
    (time adds up over the types); a type without a ceiling leaves it missing, not guessed."""
    weights = {t: w for t, w in (weights or {}).items() if w > 0}
    if not weights:
        return {"value": None, "spread": None, "missing": [], "reason": "no per-type counts "
                "(a run recorded before they existed)"}
    per = {t: ceiling_near(probes, seq, threads, ("ggml", t, what)) for t in weights}
    missing = sorted(t for t, c in per.items() if not c["value"])
    if missing:
        return {"value": None, "spread": None, "missing": missing,
                "reason": f"no ggml ceiling for {', '.join(missing)} at {threads} threads"}
    times = {t: w / per[t]["value"] for t, w in weights.items()}
    spreads = [(times[t], per[t]["spread"]) for t in weights if per[t]["spread"] is not None]
    spread = (sum(w * s for w, s in spreads) / sum(w for w, _ in spreads)) if spreads else None
    return {"value": mixed_ceiling(weights, {t: per[t]["value"] for t in weights}),
            "spread": spread, "missing": [],
            "by_type": {t: per[t]["value"] for t in weights},
            "layouts": {t: per[t]["layout"] for t in weights}}


def mixed_ceiling(weights: dict[str, float], ceilings: dict[str, float]) -> float:
    """The ceiling of a mix of types: total ÷ Σ (weight of t ÷ ceiling of t), as the time to
    read (or compute) each type's share adds up."""
    return sum(weights.values()) / sum(w / ceilings[t] for t, w in weights.items())


def round_shares(m: Measurement, phase: str, weights: dict, probes: list[Probe], what: str,
                 per_rate: float) -> dict | None:
    """A measurement's share of its ceiling, round by round: each repetition's figure (its
    rate × per_rate) ÷ the ceiling probed just before that round (the median of the
    probe's passes over the model's tensor types), summarized as a contrast of the run's
    model; None without beside probes. A decode whose steps ran in a rotation with a probe's
    is judged window by window instead: each window's rate ÷ the probe's passes in those ticks,
    a ratio of neighbours."""
    if phase == "decode" and (by_window := window_shares(m, weights, probes, per_rate)):
        return by_window
    beside = {p.round: p for p in probes if p.when == "beside" and p.round is not None
              and m.threads in (p.threads or [m.threads])}
    shares = []
    for (_, rnd), rate in sorted(round_rates(m, phase).items()):
        probe = beside.get(rnd)
        if probe is None:
            continue
        c = combined_ceiling(weights, [probe], (probe.seq + 1, probe.seq + 1), m.threads, what)
        if c["value"]:
            shares.append(rate * per_rate / c["value"])
    return ratio_summary(shares) if shares else None


def window_shares(m: Measurement, weights: dict, probes: list[Probe], per_rate: float
                  ) -> dict | None:
    """Each window's decode GB/s ÷ the streaming ceiling probed in the same ticks (the median
    of the rotation probe's passes there, combined over the model's types); None without a
    rotation probe beside its steps."""
    rotation = {p.round: p for p in probes if p.when == "rotation" and p.result
                and m.threads in p.threads}
    shares = []
    for (_, rnd, w), rate in sorted(window_rates(m).items()):
        if (probe := rotation.get(rnd)) and (ceiling := _ticks_ceiling(probe, weights,
                                                                         m.threads, w)):
            shares.append(rate * per_rate / ceiling)
    return ratio_summary(shares) | {"paired_by": "window"} if shares else None


def _ticks_ceiling(probe: Probe, weights: dict, threads: int, window: int) -> float | None:
    """A window's streaming ceiling over the model's mix of types (time adds up over them)."""
    ggml = probe.result["threads"].get(str(threads), {}).get("ggml", {})
    weights = {t: n for t, n in weights.items() if n > 0}
    ceilings = {}
    for dtype in weights:
        ticks = (ggml.get(dtype) or {}).get("stream_samples_gb_s") or []
        passes = [x for x in ticks[window * WINDOW_TICKS:(window + 1) * WINDOW_TICKS] if x]
        if not passes:
            return None  # a type without a pass there: missing, never guessed
        ceilings[dtype] = log_median(passes)
    return mixed_ceiling(weights, ceilings) if weights else None


STEP_REGIME_GAP = 0.15  # two step speeds at least 15% apart
MIN_STEPS_FOR_REGIMES = 32
REGIME_SEPARATION = 2.5  # centres 2.5 pooled sds apart on the log scale: two speeds


def step_regimes(m: Measurement) -> dict | None:
    """The speeds a cell's decode steps ran at: two (a slow and a fast one, 2-means on the log
    step times) when they fall into two clusters at least 15% and REGIME_SEPARATION pooled
    sds apart, each holding a tenth of the steps; with each speed's spread, the share of
    steps at the slower, and how many steps in a row the machine kept to one. None under
    MIN_STEPS_FOR_REGIMES steps."""
    reps = [[s for s in rep if s > 0] for rep in m.samples.get("decode_s") or []]
    logs = np.log([s for rep in reps for s in rep])
    if len(logs) < MIN_STEPS_FOR_REGIMES:
        return None
    lo, hi = np.percentile(logs, [25, 75])
    for _ in range(50):
        split = (lo + hi) / 2
        fast, slow = logs[logs <= split], logs[logs > split]
        if not len(fast) or not len(slow):
            return {"n": 1, "ms": [float(np.exp(np.median(logs))) * 1e3]}
        lo, hi = float(fast.mean()), float(slow.mean())
    sd = float(np.sqrt((fast.var() * len(fast) + slow.var() * len(slow)) / len(logs)))
    share = len(slow) / len(logs)
    if (hi - lo < math.log1p(STEP_REGIME_GAP) or (sd and (hi - lo) / sd < REGIME_SEPARATION)
            or min(share, 1 - share) < 0.1):
        return {"n": 1, "ms": [float(np.exp(np.median(logs))) * 1e3],
                "cv": float(np.std(logs))}
    runs = [len(list(g)) for rep in reps for _, g in groupby(np.log(rep) > split)]
    return {"n": 2, "ms": [float(np.exp(lo)) * 1e3, float(np.exp(hi)) * 1e3],
            "cv": max(float(fast.std()), float(slow.std())), "slow_share": share,
            "mean_run_steps": sum(runs) / len(runs)}


def above_ceiling(share: float | None, ceiling: dict, by_round: dict | None = None) -> bool:
    """A share above 100% beyond its uncertainty: its round-by-round interval wholly above 1,
    or, without one, above 1 by more than the ceiling's own spread."""
    ci = (by_round or {}).get("median_ci95")
    if ci:
        return ci[0] > 1
    return share is not None and share > 1 + (ceiling.get("spread") or 0)


def is_plain(m: Measurement) -> bool:
    """One sequence from an empty F16 KV cache: the measurements the rule of thumb fits."""
    return m.kind == "single" and not m.depth and m.kv_type == "f16"


def rep_rates(m: Measurement, phase: str) -> list[float | None]:
    """Each repetition's tok/s of one phase (decode counts every sequence's tokens), in the
    order of the record's samples; None where a repetition has no such phase."""
    if phase == "decode":
        n = m.parallel * m.n_gen
        return [n / sum(d) if d and sum(d) > 0 else None for d in m.samples.get("decode_s", [])]
    n = m.parallel * (m.shared_prefix + m.n_prompt)
    return [n / t if t else None for t in m.samples.get("prefill_s", [])]


def window_rates(m: Measurement) -> dict[tuple[int, int, int], float]:
    """Each step-interleaved repetition's decode rate per window of adjacent steps, keyed by
    (RAM group, round, window): the finest blocks two cells of one round pair on."""
    s = m.samples
    out = {}
    for rnd, how, steps in zip(s.get("rounds") or [], s.get("interleave") or [],
                               s.get("decode_s") or [], strict=False):
        if how == "step" and rnd is not None:
            out |= {(m.ram_group, rnd, w): x for w, x in enumerate(windows(steps, m.parallel))}
    return out


def round_rates(m: Measurement, phase: str) -> dict[tuple[int, int], float]:
    """Each repetition's rate keyed by its block, (RAM group, round): only cells of one group
    ran side by side, so only they pair (runs before rounds ran on across groups numbered
    each group's rounds from 0)."""
    rounds = m.samples.get("rounds") or []
    return {(m.ram_group, r): x for r, x in zip(rounds, rep_rates(m, phase), strict=False)
            if r is not None and x}
