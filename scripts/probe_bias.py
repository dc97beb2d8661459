"""Are the short probes beside the cells biased against the full probes? For every stored run
given: per thread count, weight type and figure, the median over the run's beside probes of
(beside figure ÷ the mean of the full probes before and after), for the statistic the harness
uses (the median of a probe's passes) and for the best-of it used before.

    python scripts/probe_bias.py reports/lesson reports/decode_sweep reports/quant_sweep
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.core.stats import log_median  # noqa: E402
from harness.report.files import load_run  # noqa: E402

FIGURES = (("stream", "gb_s"), ("compute", "gflop_s"))


def figures(probes: list, what: str, unit: str) -> dict:
    """{(when, threads, type): [(median of passes, best pass, passes)]} of one figure."""
    out: dict = {}
    for p in probes:
        for t, node in ((p.result or {}).get("threads") or {}).items():
            for typ, f in (node.get("ggml") or {}).items():
                xs = f.get(f"{what}_samples_{unit}")
                if xs:
                    when = "full" if p["when"] in ("before", "after") else p["when"]
                    out.setdefault((when, t, typ), []).append((log_median(xs), max(xs),
                                                               len(xs)))
    return out


def main(runs: list[str]) -> None:
    print("| run | figure | threads | type | passes full / beside | beside ÷ full, median "
          "of passes | beside ÷ full, best pass |")
    print("|---|---|---:|---|---|---:|---:|")
    for run in runs:
        _, records = load_run(Path(run))
        for what, unit in FIGURES:
            found = figures(records.probes, what, unit)
            for (when, t, typ), beside in sorted(found.items()):
                full = found.get(("full", t, typ))
                if when != "beside" or not full:
                    continue
                med = statistics.fmean(m for m, _, _ in full)
                best = statistics.fmean(b for _, b, _ in full)
                print(f"| {Path(run).name} | {what} | {t} | {typ} | {full[0][2]} / "
                      f"{beside[0][2]} | {statistics.median(m for m, _, _ in beside) / med:.3f} "
                      f"| {statistics.median(b for _, b, _ in beside) / best:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
