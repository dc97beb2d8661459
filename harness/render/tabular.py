"""Tables as data and their markdown cells: the one place a number's format is decided, and
what every flag means in words. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.stats import UNSTABLE_CV, center
from ..engine.noise import NOISY_CORES

GIB = 2**30


@dataclass(frozen=True)
class Column:
    header: str
    key: str
    kind: str = "str"  # str, int, f1, f2, f3, pct, gib, stat


@dataclass
class Table:
    name: str
    title: str
    columns: list[Column]
    rows: list[dict]
    notes: list[str] = field(default_factory=list)


FLAG_WORDS = {
    "noisy": "other processes used the CPU during the measurement",
    "perf-mismatch": "llama.cpp's own timers differ from the wall clock by more than 5%",
    "above-ceiling": "faster than the ceiling measured beside it",
    "cache-evicted": ("its bytes per step fit in the last-level cache, which the other cells' "
                      "steps between its own evict: slower than it would decode alone"),
}


def notes_for(record: dict, phases: tuple[str, ...] = ("prefill", "decode")) -> str:
    """Each flag with its reason in words, for the notes column (only the phases shown)."""
    out = []
    for flag in record.get("flags", []):
        if flag.startswith("unstable-"):
            phase = flag.split("-", 1)[1]
            if phase not in phases:
                continue
            cv = (record.get(f"{phase}_tok_s") or {}).get("cv") or 0
            out.append(f"⚠ {phase} unsteady: repetitions varied by {cv:.1%} (CV), more than "
                       f"{UNSTABLE_CV:.0%}")
        elif flag == "noisy" and record.get("noise"):
            n = record["noise"]
            worst = max(n["idle_other_cores"] or 0, n.get("during_other_cores") or 0)
            out.append(f"⚠ noisy: other processes used {worst:.2f} cores (> {NOISY_CORES})")
        else:
            out.append(f"⚠ {flag}: {FLAG_WORDS.get(flag, flag)}")
    return "; ".join(out)


ABOVE_CEILING_NOTE = (
    "A share above 100% is flagged above-ceiling when its whole 95% interval lies above 100% "
    "(a share is taken round by round, against the probe of the same round): the model ran "
    "faster than ggml's kernel did on the probe matrix, either because llama.cpp's "
    "own kernels for these shapes are faster than the probe's, or because caches held part of "
    "the weights. The ceiling is what was measured, not a physical bound.")


def ceiling_share_notes(shares: list[tuple[float | None, float | None, bool]]) -> list[str]:
    """The notes a table of shares of a ceiling needs, from (share, the ceiling's spread,
    flagged above-ceiling) per row: why a flagged share exceeds 100%, and that an unflagged
    one above 100% lies within what the ceiling's own probes varied by."""
    out = [ABOVE_CEILING_NOTE] if any(flagged for _, _, flagged in shares) else []
    within = sorted({round(s * 100, 1) for s, spread, flagged in shares
                     if s and round(s * 100, 1) > 100 and not flagged})
    if within:
        out.append(f"Shares of {', '.join(f'{x:.1f}%' for x in within)} exceed 100% but their "
                   "95% intervals (or, without one, the ceiling's own spread) reach down to "
                   "100%: within what the ceiling can tell apart, so not flagged above-ceiling.")
    return out


_FORMATS = {
    "int": lambda v: f"{v:,}",
    "f0": lambda v: f"{v:,.0f}", "f1": lambda v: f"{v:,.1f}", "f2": lambda v: f"{v:,.2f}",
    "f3": lambda v: f"{v:,.3f}",
    "pct": lambda v: f"{v:.0%}", "pct1": lambda v: f"{v:.1%}", "spct": lambda v: f"{v:+.1%}",
    "x": lambda v: f"{v:.2f}×",
    "gib": lambda v: f"{v / GIB:.2f}", "gib3": lambda v: f"{v / GIB:.3f}",
    "gb": lambda v: f"{v / 1e9:.2f}",
    "mib": lambda v: f"{v / 2**20:,.1f}", "kib": lambda v: f"{v / 2**10:,.1f}",
}


def cell(value, kind: str) -> str:
    if value is None or value == "":
        return "–" if kind != "str" else ""
    if kind == "pctci":  # a share with its interval, in percent
        ci = value.get("median_ci95")
        interval = f" ({ci[0]:.0%}–{ci[1]:.0%})" if ci else ""
        return f"{center(value):.0%}{interval}"
    if kind.startswith("stat"):
        digits = int(kind[4:] or 2)
        ci = value.get("median_ci95")
        interval = f" ({ci[0]:.{digits}f}–{ci[1]:.{digits}f})" if ci else ""
        return f"{center(value):.{digits}f}{interval}"
    if kind in _FORMATS:
        return _FORMATS[kind](value)
    return str(value).replace("|", "\\|")


def markdown_table(t: Table) -> str:
    head = "| " + " | ".join(c.header for c in t.columns) + " |"
    align = "|" + "|".join("---" if c.kind == "str" else "---:" for c in t.columns) + "|"
    body = ["| " + " | ".join(cell(r.get(c.key), c.kind) for c in t.columns) + " |"
            for r in t.rows]
    notes = [f"\n{n}" for n in t.notes]
    return "\n".join([f"### {t.title}", "", head, align, *body]) + "\n" + "\n".join(notes)
