"""What every lever shares: grouping records, the figure levers compare, and paired ratios
round by round. Pure functions of the stored records."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

from ..analysis.ceilings import rep_rates
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
    cancels), summarized with its own CI; for runs without rounds, the ratio of medians."""
    pairs = {}
    for m, side in ((a, 0), (b, 1)):
        for rnd, rate in zip((m.get("samples") or {}).get("rounds") or [], rep_rates(m, phase),
                             strict=False):
            if rnd is not None and rate:
                pairs.setdefault(rnd, [None, None])[side] = rate
    ratios = [x / y for _, (x, y) in sorted(pairs.items()) if x and y]
    if len(ratios) >= 2:
        return summarize(ratios) | {"paired": True}
    ours, theirs = center(a.get(f"{phase}_tok_s")), center(b.get(f"{phase}_tok_s"))
    if not ours or not theirs:
        return None
    return {"n": 1, "median": ours / theirs, "mean": ours / theirs, "paired": False}


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
