#!/usr/bin/env python3
"""Benchmark: does a scenario reproduce? Two runs back to back, compared cell by cell.

For every cell: the ratio of the two runs' median tok/s and of their median paired read ratio
(decode's effective bandwidth over the page reads right beside it), whether each run's stated
95% CI of the median covers the other run's median, and which regimes each run saw. Goals for
decode_sweep and prefill_sweep: paired read ratios within ±3%, tok/s medians within ±5%.

    python scripts/bench_repro.py scenarios/decode_sweep.yaml --out reports/repro
    python scripts/bench_repro.py --runs reports/repro/run-1 reports/repro/run-2   # no rerun
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def run_twice(scenario: Path, out: Path) -> list[Path]:
    dirs = [out / "run-1", out / "run-2"]
    for d in dirs:
        subprocess.run([sys.executable, "-m", "harness", "run", str(scenario), "--out", str(d)],
                       check=True)
    return dirs


def cells(run: Path) -> tuple[dict, dict]:
    from harness.reportio import analysis_of, load_run

    _, records = load_run(run)
    analysis = analysis_of(records)
    decode = {r["id"]: r for r in analysis["decode"]}
    return {m["id"]: (m, decode.get(m["id"])) for m in records.measurements}, analysis


def _covers(summary: dict, value: float) -> bool | None:
    ci = summary.get("median_ci95")
    return None if not ci else ci[0] <= value <= ci[1]


def compare(runs: list[Path]) -> int:
    from harness.report import stability_lines
    from harness.stats import center

    (a, analysis_a), (b, analysis_b) = cells(runs[0]), cells(runs[1])
    print(f"{'cell':<58} {'tok/s 2/1':>9} {'CIs cover':>9} {'paired 2/1':>10} {'n1':>4} "
          f"{'n2':>4}")
    worst = {"tok_s": 0.0, "paired": 0.0}
    for cell_id in a:
        if cell_id not in b:
            continue
        (ma, da), (mb, db) = a[cell_id], b[cell_id]
        key = "decode_tok_s" if ma["n_gen"] else "prefill_tok_s"
        ra, rb = center(ma[key]), center(mb[key])
        covers = _covers(ma[key], rb) and _covers(mb[key], ra)
        paired = ""
        if da and db and da.get("paired_read_ratio") and db.get("paired_read_ratio"):
            p = center(db["paired_read_ratio"]) / center(da["paired_read_ratio"])
            worst["paired"] = max(worst["paired"], abs(p - 1))
            paired = f"{p:.3f}"
        worst["tok_s"] = max(worst["tok_s"], abs(rb / ra - 1))
        print(f"{cell_id[:58]:<58} {rb / ra:>9.3f} {str(covers):>9} {paired:>10} "
              f"{ma['repetitions']:>4} {mb['repetitions']:>4}")
    print(f"\nlargest difference: tok/s medians {worst['tok_s']:.1%}, "
          f"paired read ratios {worst['paired']:.1%}")
    for name, analysis in (("run 1", analysis_a), ("run 2", analysis_b)):
        for line in stability_lines(analysis.get("stability") or {}):
            print(f"{name}: {line}")
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
