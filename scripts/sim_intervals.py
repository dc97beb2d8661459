"""Coverage and width of the run's intervals (harness.core.stats), by simulation.

Each simulated run is a series of rounds on a machine whose speed drifts: independent noise,
AR(1) persistence (phi 0.5 and 0.8), and the regime-switching machine of tests/test_rounds.py
(fast and slow spells 25% apart, a switch with probability 0.08 per round) with AR(1) noise on
top. Runs have a fixed number of rounds (6, 10, 20, 30) or stop as a run does: from 6 rounds
on, once the interval is within ±3%, at 30 at most. Printed per case: how often the interval
covers the true value (the long-run median for an absolute figure, the true ratio for a
contrast), and, on independent samples, its width over the order-statistic interval's.

    python scripts/sim_intervals.py [--runs 1000] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys

from scipy import stats as sps

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

from harness.core.stats import absolute_interval, contrast  # noqa: E402

ROUNDS = (6, 10, 20, 30)
TARGET = 0.03
FAST, SLOW = math.log(100.0), math.log(75.0)


def ar1(rng: random.Random, n: int, phi: float, sd: float) -> list[float]:
    """A stationary AR(1) series with marginal standard deviation sd."""
    x, out = rng.gauss(0.0, sd), []
    for _ in range(n):
        out.append(x)
        x = phi * x + rng.gauss(0.0, sd * math.sqrt(1 - phi * phi))
    return out


def regime(rng: random.Random, n: int) -> list[float]:
    fast, out = rng.random() < 0.5, []
    for _ in range(n):
        if rng.random() < 0.08:
            fast = not fast
        out.append(FAST if fast else SLOW)
    return out


def drift(rng: random.Random, case: str, n: int) -> tuple[list[float], float]:
    """Log speeds of one run and the true long-run median of its log speed."""
    kind, phi = case.split(":")
    noise = ar1(rng, n, float(phi), 0.05)
    if kind == "regime":  # the stationary mixture is symmetric: its median is the midpoint
        return [a + b for a, b in zip(regime(rng, n), noise, strict=True)], (FAST + SLOW) / 2
    return noise, 0.0


def order_width(logs: list[float]) -> float:
    """Width of the order-statistic 95% interval of the median (Hollander & Wolfe 3.6)."""
    xs, n, k = sorted(logs), len(logs), 1
    while k + 1 <= n // 2 and 1 - 2 * sps.binom.cdf(k, n, 0.5) >= 0.95:
        k += 1
    return xs[n - k] - xs[k - 1]


def run_absolute(rng: random.Random, case: str, rounds: int | None) -> tuple[bool, float, int]:
    logs, true = drift(rng, case, rounds or 30)
    n = rounds or 6
    while True:
        values = [math.exp(x) for x in logs[:n]]
        lo, hi = absolute_interval(values)
        mid = math.exp(statistics.median(logs[:n]))
        if rounds or max(mid - lo, hi - mid) / mid <= TARGET or n == 30:
            break
        n += 1
    width = math.log(hi / lo) / order_width(logs[:n]) if case == "ar:0" else math.nan
    return math.log(lo) <= true <= math.log(hi), width, n


def run_contrast(rng: random.Random, case: str, rounds: int | None) -> tuple[bool, float, int]:
    """Two cells sharing the machine's drift (the regime machine) with their own residuals
    (AR(1) with the case's phi, 3%): the true ratio is 0.5."""
    phi = float(case.split(":")[1])
    total = rounds or 30
    shared = [a + b for a, b in zip(regime(rng, total), ar1(rng, total, 0.5, 0.05),
                                    strict=True)]
    a = [s + math.log(0.5) + e for s, e in zip(shared, ar1(rng, total, phi, 0.03), strict=True)]
    b = [s + e for s, e in zip(shared, ar1(rng, total, phi, 0.03), strict=True)]
    n = rounds or 6
    while True:
        c = contrast({i: math.exp(x) for i, x in enumerate(a[:n])},
                     {i: math.exp(x) for i, x in enumerate(b[:n])})
        lo, hi = c["median_ci95"]
        if rounds or max(c["ratio"] - lo, hi - c["ratio"]) / c["ratio"] <= TARGET or n == 30:
            break
        n += 1
    diffs = [x - y for x, y in zip(a[:n], b[:n], strict=True)]
    width = math.log(hi / lo) / order_width(diffs) if phi == 0 else math.nan
    return lo <= 0.5 <= hi, width, n


# --- steps: a machine that switches speed every few seconds, inside a round ---------------

STEP_MS = (50.0, 140.0, 180.0)  # qwen2.5-0.5b, llama-3.2-1b, qwen2.5-1.5b at F32 (issue 43)
N_STEPS = 64  # decode steps per repetition, as decode_sweep's decode test
GAP_MS = 4000.0  # the prompts and probes between two rounds' decodes
SLOW = math.log(1.45)  # 50 against 72 ms per step
HOLD_MS = 3000.0  # a regime's mean holding time: switching every few seconds
WINDOWS = (1, 4, 8, 16)


class Machine:
    """Wall-clock regimes (two speeds, exponential holding times of mean HOLD_MS) and the
    cost of a piece of work started now: its nominal time stretched by the regime(s) it runs
    in; `unequal` makes the slow regime cost the first cell 1.45× and the others 1.3×."""

    def __init__(self, rng: random.Random, unequal: bool) -> None:
        self.rng, self.unequal, self.now = rng, unequal, 0.0
        self.slow, self.until = rng.random() < 0.5, rng.expovariate(1 / HOLD_MS)

    def run(self, ms: float, cell: int) -> float:
        factor = math.exp(SLOW if cell == 0 or not self.unequal else math.log(1.3))
        while self.until <= self.now:  # the regimes that passed during a gap
            self.slow, self.until = not self.slow, self.until + self.rng.expovariate(
                1 / HOLD_MS)
        spent, left = 0.0, ms
        while left > 0:
            rate = factor if self.slow else 1.0
            span = min(left * rate, self.until - self.now)
            spent, self.now, left = spent + span, self.now + span, left - span / rate
            if self.now >= self.until - 1e-9:
                self.slow, self.until = not self.slow, self.until + self.rng.expovariate(
                    1 / HOLD_MS)
        return spent


def step_rounds(rng: random.Random, n_rounds: int, design: str, unequal: bool
                ) -> list[list[list[float]]]:
    """Per round, per cell, its decode steps in ms: interleaved one step of each cell in turn
    (`step`), or each cell's whole decode after the other's (`round`, in a shuffled order);
    every step with its own AR(1) noise (phi 0.5, 3%)."""
    machine, out = Machine(rng, unequal), []
    for _ in range(n_rounds):
        noise = [ar1(rng, N_STEPS, 0.5, 0.03) for _ in STEP_MS]
        steps: list[list[float]] = [[] for _ in STEP_MS]
        order = list(range(len(STEP_MS)))
        rng.shuffle(order)
        if design == "step":
            for k in range(N_STEPS):
                for c in order:
                    steps[c].append(machine.run(STEP_MS[c] * math.exp(noise[c][k]), c))
        else:
            for c in order:
                steps[c] = [machine.run(STEP_MS[c] * math.exp(e), c) for e in noise[c]]
        machine.now += GAP_MS
        out.append(steps)
    return out


def window_rates(rounds: list, cell: int, width: int) -> dict:
    """A cell's steps per second in each window of `width` adjacent ticks, keyed (round, w)."""
    return {(r, w): width / sum(steps[cell][w * width:(w + 1) * width])
            for r, steps in enumerate(rounds) for w in range(N_STEPS // width)}


def step_contrast(rounds: list, width: int | None) -> dict:
    """Cell 0 ÷ cell 2 decode rate: over windows of `width` ticks, or per round (None)."""
    if width is None:
        def rate(r, c):
            return {i: N_STEPS / sum(x[c]) for i, x in enumerate(r)}
        return contrast(rate(rounds, 0), rate(rounds, 2))
    return contrast(window_rates(rounds, 0, width), window_rates(rounds, 2, width))


def run_steps(rng: random.Random, design: str, width: int | None, unequal: bool, true: float
              ) -> tuple[bool, float, int]:
    """One run under the stopping rule (from 6 rounds, until ±3%, at most 30)."""
    rounds = step_rounds(rng, 30, design, unequal)
    for n in range(6, 31):
        c = step_contrast(rounds[:n], width)
        lo, hi = c["median_ci95"]
        if max(c["ratio"] - lo, hi - c["ratio"]) / c["ratio"] <= TARGET:
            break
    return lo <= true <= hi, math.log(hi / lo) / 2, n


def true_ratio(seed: int, design: str, width: int | None, unequal: bool) -> float:
    """The estimand: the ratio with the machine's effect cancelled, or (unequal) the
    estimate of a run of 3,000 rounds."""
    if not unequal:
        return STEP_MS[2] / STEP_MS[0]
    rng = random.Random(f"{seed}:truth:{design}")
    return step_contrast(step_rounds(rng, 3000, design, True), width)["ratio"]


def step_table(runs: int, seed: int) -> list[dict]:
    out = []
    for unequal in (False, True):
        for design, width in [("round", None)] + [("step", w) for w in WINDOWS]:
            true = true_ratio(seed, design, width, unequal)
            rng = random.Random(f"{seed}:steps:{design}:{width}:{unequal}")
            results = [run_steps(rng, design, width, unequal, true) for _ in range(runs)]
            out.append({"kind": "contrast", "case": ("unequal " if unequal else "")
                        + ("round blocks" if width is None else f"step, {width}-tick windows"),
                        "rounds": "stop at ±3%",
                        "coverage": sum(c for c, _, _ in results) / runs,
                        "width_vs_order": None,
                        "median_half_width": statistics.median(h for _, h, _ in results),
                        "median_rounds": statistics.median(n for _, _, n in results)})
    return out


def table(kind: str, runs: int, seed: int) -> list[dict]:
    cases = (["ar:0", "ar:0.5", "ar:0.8", "regime:0", "regime:0.5", "regime:0.8"]
             if kind == "absolute" else ["residual:0", "residual:0.5", "residual:0.8"])
    simulate = run_absolute if kind == "absolute" else run_contrast
    out = []
    for case in cases:
        for rounds in (*ROUNDS, None):
            rng = random.Random(f"{seed}:{kind}:{case}:{rounds}")
            results = [simulate(rng, case, rounds) for _ in range(runs)]
            widths = [w for _, w, _ in results if not math.isnan(w)]
            out.append({"kind": kind, "case": case, "rounds": rounds or "stop at ±3%",
                        "coverage": sum(c for c, _, _ in results) / runs,
                        "width_vs_order": statistics.median(widths) if widths else None,
                        "median_rounds": statistics.median(n for _, _, n in results)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--steps", action="store_true",
                        help="the step-interleaved design under fast regime switching instead")
    args = parser.parse_args()
    if args.steps:
        rows = step_table(args.runs, args.seed)
        print("| machine | design | coverage | median ± | rounds run |")
        print("|---|---|---:|---:|---:|")
        for r in rows:
            print(f"| regimes of ~{HOLD_MS / 1000:g} s | {r['case']} | {r['coverage']:.1%} "
                  f"| {r['median_half_width']:.1%} | {r['median_rounds']:g} |")
    else:
        rows = table("absolute", args.runs, args.seed) + table("contrast", args.runs, args.seed)
        print("| interval | machine | rounds | coverage | width ÷ order-statistic | rounds run |")
        print("|---|---|---|---:|---:|---:|")
        for r in rows:
            width = f"{r['width_vs_order']:.2f}" if r["width_vs_order"] else "–"
            print(f"| {r['kind']} | {r['case']} | {r['rounds']} | {r['coverage']:.1%} "
                  f"| {width} | {r['median_rounds']:g} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
