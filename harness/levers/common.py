"""What every lever shares: grouping records, the figure levers compare, and paired ratios
round by round. Pure functions of the stored records."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

from ..analysis.ceilings import round_rates
from ..core.specs import ModelSpec
from ..core.stats import center, summarize


def group_records(records: list[dict], key) -> list[list[dict]]:
    """Records grouped by key(record), in a stable order."""
    ordered = sorted(records, key=lambda r: str(key(r)))
    return [list(g) for _, g in groupby(ordered, key=lambda r: str(key(r)))]


def group_rows(rows: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    """Rows grouped by the values of keys, in first-seen order (for plots)."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def median_of(summary: dict | None) -> float | None:
    """The figure every lever compares: the median per-repetition value."""
    return center(summary)


def threads_label(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"


def spec_of(models: dict, m: dict) -> ModelSpec:
    return ModelSpec(**models[m["model_key"]]["spec"])


def round_ratio(a: dict, b: dict, phase: str) -> dict | None:
    """a's rate ÷ b's, round by round where both ran a repetition (drift between rounds
    cancels), summarized with its own CI; for cells that never shared two rounds (other RAM
    groups, runs without rounds), the ratio of medians, unpaired, without an interval, and
    why."""
    ours, theirs = round_rates(a, phase), round_rates(b, phase)
    ratios = [ours[k] / theirs[k] for k in sorted(ours.keys() & theirs.keys())]
    if len(ratios) >= 2:
        return summarize(ratios) | {"paired": True}
    x, y = center(a.get(f"{phase}_tok_s")), center(b.get(f"{phase}_tok_s"))
    if not x or not y:
        return None
    why = ("the run recorded no rounds" if not ours or not theirs else
           "they shared fewer than 2 rounds (other RAM groups)")
    return {"n": 1, "median": x / y, "mean": x / y, "paired": False, "why": why}


def unpaired_note(pairs: list[tuple[str, str, dict | None]]) -> list[str]:
    """The sentence a table owes (none or one) when some of its ratios could not be paired by
    round: pairs of (what, against what, the ratio)."""
    by_why: dict[str, list[str]] = {}
    for what, base, ratio in pairs:
        if ratio and not ratio.get("paired"):
            by_why.setdefault(ratio.get("why", "they shared no rounds"), []).append(
                f"{what} against {base}")
    if not by_why:
        return []
    reasons = "; ".join(f"{', '.join(dict.fromkeys(named))}: {why}"
                        for why, named in by_why.items())
    return [f"Unpaired ratios ({reasons}): each is the ratio of two medians, so the "
            "machine's drift between them does not cancel, and no interval is given."]


@dataclass(frozen=True)
class Lever:
    """One lever of the report: its analysis, its tables and its plot, in one module."""

    name: str
    analyze: Callable[[list[dict], dict, list[dict], dict], dict[str, list]]
    tables: Callable[[dict], list]  # analysis -> list[Table]
    table_names: tuple[str, ...]
    plot: Callable[[dict, Path], str | None]
    plot_name: str
    caption: str  # the plot's alt text
