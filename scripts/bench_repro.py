#!/usr/bin/env python3
"""Benchmark: does a scenario reproduce? Two runs back to back, compared with the run's model.

Contrasts (a ratio of two cells of one run, round by round: what the reports compare): how far
each contrast moved between the runs, and how wide each run stated it. Absolute figures (each
cell's median tok/s): whether the unpaired interval of run 2 ÷ run 1, which combines the two
runs' intervals of their long-run medians (drift included), covers 1. And each run's time.
Goals (issue 21): contrasts agree within ±3% between the runs with stated intervals within
±5%; absolute intervals cover the two-run differences.

    python scripts/bench_repro.py scenarios/decode_sweep.yaml --out reports/repro
    python scripts/bench_repro.py --runs reports/repro/run-1 reports/repro/run-2   # no rerun
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path


def run_twice(scenario: Path, out: Path) -> list[Path]:
    dirs = [out / "run-1", out / "run-2"]
    for d in dirs:
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "harness", "run", str(scenario), "--out", str(d)],
                       check=True)
        print(f"{d}: {time.monotonic() - start:.0f} s wall", flush=True)
    return dirs


def load(run: Path) -> tuple[object, dict]:
    from harness.report.files import analysis_of, load_run

    _, records = load_run(run)
    return records, analysis_of(records)


def _half(c: dict | None) -> float | None:
    """The wider side of a figure's or a JSON contrast's 95% interval, on the log scale."""
    from harness.core.stats import log_half_width

    if c and "ratio" in c:  # the JSON report's shape: ratio and ci95
        c = {"n": c.get("n", 1), "median": c["ratio"], "median_ci95": c.get("ci95")}
    return log_half_width(c)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.1%}"


def contrasts(a: dict, b: dict) -> list[tuple]:
    """(name, run 2 ÷ run 1 - 1, stated half-width 1, 2) per contrast both runs drew."""
    theirs = {(c["numerator"], c["denominator"], c["metric"]): c for c in b["contrasts"]}
    out = []
    for c in a["contrasts"]:
        o = theirs.get((c["numerator"], c["denominator"], c["metric"]))
        if o:
            out.append((c["name"], o["ratio"] / c["ratio"] - 1, _half(c), _half(o)))
    return out


def absolutes(ra, rb) -> list[tuple]:
    """(cell, run 2 ÷ run 1, whether the unpaired interval covers 1) per cell of both."""
    from harness.core.stats import unpaired

    theirs = {m.id: m for m in rb.measurements}
    out = []
    for m in ra.measurements:
        o = theirs.get(m.id)
        key = "decode_tok_s" if m.n_gen else "prefill_tok_s"
        if not o or not getattr(m, key) or not getattr(o, key):
            continue
        r = unpaired(getattr(o, key), getattr(m, key))
        ci = r.get("median_ci95")
        out.append((m.id, r["ratio"], None if not ci else ci[0] <= 1 <= ci[1],
                    _half(getattr(m, key)), _half(getattr(o, key)), m.repetitions,
                    o.repetitions))
    return out


def _elapsed(records) -> float | None:
    reps = records.repetitions
    return max((r.elapsed_s for r in reps), default=None)


def compare(runs: list[Path]) -> int:
    """Print both tables and the goals' verdicts."""
    (ra, a), (rb, b) = load(runs[0]), load(runs[1])
    rows = contrasts(a, b)
    print(f"{'contrast':<72} {'2/1-1':>7} {'±CI 1':>7} {'±CI 2':>7}")
    for name, diff, h1, h2 in rows:
        print(f"{name[:72]:<72} {diff:>+7.1%} {_pct(h1):>7} {_pct(h2):>7}")
    cells = absolutes(ra, rb)
    print(f"\n{'cell':<60} {'2/1':>6} {'covered':>8} {'±CI 1':>7} {'±CI 2':>7} n1 n2")
    for cell, ratio, covered, h1, h2, n1, n2 in cells:
        print(f"{cell[:60]:<60} {ratio:>6.3f} {covered!s:>8} {_pct(h1):>7} {_pct(h2):>7} "
              f"{n1} {n2}")
    if rows:
        worst = max(abs(d) for _, d, _, _ in rows)
        widest = max((h for _, _, h1, h2 in rows for h in (h1, h2) if h is not None),
                     default=None)
        within = sum(abs(d) <= 0.03 for _, d, _, _ in rows)
        print(f"\ncontrasts: {within} of {len(rows)} agree within ±3% between the runs "
              f"(largest difference {worst:.1%}); widest stated interval ±{_pct(widest)}")
    if cells:
        covered = sum(bool(c) for _, _, c, *_ in cells)
        print(f"absolute figures: the intervals cover the two-run difference for {covered} of "
              f"{len(cells)} cells")
    for name, records, analysis in (("run 1", ra, a), ("run 2", rb, b)):
        d = analysis.get("machine_drift") or {}
        print(f"{name}: rounds took {_elapsed(records) or 0:.0f} s; machine drift "
              f"{d.get('low', float('nan')):.2f}×–{d.get('high', float('nan')):.2f}× over "
              f"{d.get('n_rounds', 0)} rounds")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", nargs="?", type=Path)
    parser.add_argument("--out", type=Path, default=Path("reports/runs/repro"))
    parser.add_argument("--runs", nargs=2, type=Path, help="compare two existing runs")
    args = parser.parse_args()
    if not args.runs and not args.scenario:
        parser.error("give a scenario to run twice, or --runs RUN_1 RUN_2")
    sys.exit(compare(args.runs or run_twice(args.scenario, args.out)))


if __name__ == "__main__":
    main()
