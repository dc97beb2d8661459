"""What `harness run` prints when it ends, in 100 columns: the findings first, one line per
cell, and where the full tables are. Pure."""

from __future__ import annotations

import re
import textwrap

from ..core.records import Measurement
from ..core.stats import center
from .findings import findings, main_model

WIDTH = 100


def render_console(measurements: list[Measurement], analysis: dict) -> str:
    """The end of a run: its findings as wrapped sentences, then each cell in one line."""
    if not measurements:
        return "no measurements"
    found = findings({"analysis": analysis, "main": main_model(analysis), "claims": []})
    lines = ["Findings"]
    for sentence in found:
        plain = re.sub(r"\*\*|`", "", sentence)
        lines += textwrap.wrap(plain, WIDTH, initial_indent="- ", subsequent_indent="  ")
    lines += ["", "Cells (median tok/s, [95% interval of this machine's long-run median])"]
    width = max(len(_label(m)) for m in measurements)
    lines += [f"{_label(m):<{width}}  {_figures(m)}" for m in measurements]
    lines += [f"  {e}" for e in _errors(analysis)]
    named = [c for c in analysis.get("contrasts") or [] if c.get("name")]
    if named:
        lines += ["", "Contrasts (ratio [95% interval]; unpaired: never ran together)"]
        for c in named:
            lines += textwrap.wrap(f"{_ratio(c):<22} {c['name']}", WIDTH,
                                   subsequent_indent=" " * 23)
    return "\n".join(line[:WIDTH] for line in lines)


def _label(m: Measurement) -> str:
    return f"{m.model} {m.dtype} t{m.threads} {m.cell.test}"


def _figures(m: Measurement) -> str:
    parts = []
    for name, summary in (("prefill", m.prefill_tok_s), ("decode", m.decode_tok_s)):
        if mid := center(summary):
            ci = summary.get("median_ci95")
            parts.append(f"{name} {_short(mid)}" + (f" [{_short(ci[0])}–{_short(ci[1])}]"
                                                    if ci else ""))
    return "  ".join(parts) + f"  (n {m.repetitions})"


def _ratio(c: dict) -> str:
    ci = c.get("ci95")
    text = f"{c['ratio']:.3f}" + (f" [{ci[0]:.3f}–{ci[1]:.3f}]" if ci else "")
    return text + ("" if c.get("paired", True) else " unpaired")


def _short(x: float) -> str:
    """Three significant figures, no more: a terminal line is for reading, not for digits."""
    return f"{x:.3g}" if x < 1000 else f"{x:,.0f}"


def _errors(analysis: dict) -> list[str]:
    return [f"probe failed: {e}; that ceiling is missing" for e in analysis["probe_errors"]]
