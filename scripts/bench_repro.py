#!/usr/bin/env python3
"""Benchmark: does a scenario reproduce? Two runs back to back, compared cell by cell.

For every cell: the ratio of the two runs' median tok/s and of their median paired read ratio
(decode's effective bandwidth over the page reads right beside it), whether each run's stated
95% CIs together cover the difference (|m2 - m1| <= sqrt(h1² + h2²)), and which regimes each
run saw. Goals for
decode_sweep and prefill_sweep: paired read ratios within ±3%, tok/s medians within ±5%.

    python scripts/bench_repro.py scenarios/decode_sweep.yaml --out reports/repro
    python scripts/bench_repro.py --runs reports/repro/run-1 reports/repro/run-2   # no rerun
"""

from __future__ import annotations

import argparse
import math
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
    from harness.report.files import analysis_of, load_run

    _, records = load_run(run)
    analysis = analysis_of(records)
    decode = {r["id"]: r for r in analysis["decode"]}
    return {m["id"]: (m, decode.get(m["id"])) for m in records.measurements}, analysis


def _covers(a: dict, b: dict) -> bool | None:
    """Whether the two medians differ by no more than their stated 95% CIs combined:
    |m2 - m1| <= sqrt(h1² + h2²), each h the half-width of a run's interval."""
    from harness.core.stats import center

    ci_a, ci_b = a.get("median_ci95"), b.get("median_ci95")
    if not ci_a or not ci_b:
        return None
    half = math.hypot((ci_a[1] - ci_a[0]) / 2, (ci_b[1] - ci_b[0]) / 2)
    return abs(center(a) - center(b)) <= half


def _half(summary: dict) -> str:
    ci = summary.get("median_ci95")
    return f"±{(ci[1] - ci[0]) / 2 / summary['median']:.1%}" if ci else "-"


def _row(cell_id: str, a: tuple, b: tuple, worst: dict) -> str:
    from harness.core.stats import center

    (ma, da), (mb, db) = a, b
    key = "decode_tok_s" if ma["n_gen"] else "prefill_tok_s"
    ratio = center(mb[key]) / center(ma[key])
    worst["tok_s"].append((abs(ratio - 1), _covers(ma[key], mb[key])))
    cols = [f"{ratio:.3f}", _half(ma[key]), _half(mb[key]), str(_covers(ma[key], mb[key]))]
    pa, pb = (da or {}).get("paired_read_ratio"), (db or {}).get("paired_read_ratio")
    if pa and pb:
        p = center(pb) / center(pa)
        worst["paired"].append((abs(p - 1), _covers(pa, pb)))
        cols += [f"{p:.3f}", _half(pa), _half(pb), str(_covers(pa, pb))]
    else:
        cols += [""] * 4
    cols += [str(ma["repetitions"]), str(mb["repetitions"])]
    return f"{cell_id[:50]:<50} " + " ".join(f"{c:>7}" for c in cols)


def compare(runs: list[Path]) -> int:
    """Print the per-cell table, the largest differences and how many the CIs covered."""
    from harness.report.page import stability_lines

    (a, analysis_a), (b, analysis_b) = cells(runs[0]), cells(runs[1])
    heads = ["tok 2/1", "CI 1", "CI 2", "covered", "pair2/1", "CI 1", "CI 2", "covered", "n1",
             "n2"]
    print(f"{'cell':<50} " + " ".join(f"{h:>7}" for h in heads))
    worst: dict[str, list] = {"tok_s": [], "paired": []}
    for cell_id in a:
        if cell_id in b:
            print(_row(cell_id, a[cell_id], b[cell_id], worst))
    for name, label in (("tok_s", "tok/s medians"), ("paired", "paired read ratios")):
        diffs = worst[name]
        if diffs:
            print(f"{label}: largest difference {max(d for d, _ in diffs):.1%}; the two runs' "
                  f"stated 95% CIs covered {sum(bool(c) for _, c in diffs)} of {len(diffs)}")
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
