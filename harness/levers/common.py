"""What every lever shares: grouping records, the figure levers compare, and paired ratios
round by round. Pure functions of the stored records."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

from ..analysis.ceilings import round_rates, window_rates
from ..core.records import Measurement, Model, Probe
from ..core.specs import ModelSpec
from ..core.stats import center, contrast, finest, unpaired


def group_records(records: list[Measurement], key) -> list[list[Measurement]]:
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


def spec_of(models: dict[str, Model], model_key: str) -> ModelSpec:
    return ModelSpec(**models[model_key].spec)


def round_ratio(a: Measurement, b: Measurement, phase: str) -> dict | None:
    """a's rate ÷ b's, a contrast of the run's model (harness.core.stats): round by round
    where both ran a repetition, so drift between rounds cancels; for cells that never shared
    a round (other RAM groups, runs without rounds), the ratio of medians, unpaired, with an
    interval that keeps the drift, and why. Named by the two cells' ids and the metric."""
    ours, theirs = finest((window_rates(a) if phase == "decode" else {}, round_rates(a, phase)),
                          (window_rates(b) if phase == "decode" else {}, round_rates(b, phase)))
    if a.id == b.id:  # a cell against itself (a table's baseline row): exactly 1
        out = {"n": (getattr(a, f"{phase}_tok_s") or {}).get("n", 1), "ratio": 1.0,
               "median": 1.0,
               "median_ci95": [1.0, 1.0], "paired": True}
    else:
        out = contrast(ours, theirs)
    if out is None:
        out = unpaired(getattr(a, f"{phase}_tok_s"), getattr(b, f"{phase}_tok_s"))
        if out is None:
            return None
        out["why"] = ("the run recorded no rounds" if not ours or not theirs else
                      "they shared no rounds (other RAM groups)")
    return out | {"numerator": a.id, "denominator": b.id,
                  "metric": f"{phase}_tok_s", "name": contrast_name(a, b, phase)}


NAMED = (("model", ""), ("dtype", ""), ("threads", "t"), ("n_prompt", "pp"),
         ("n_gen", "tg"), ("depth", "d"), ("kv_type", "kv "), ("parallel", "np"))


def contrast_name(a: Measurement, b: Measurement, phase: str) -> str:
    """In words: the phase, what both cells share, and what differs (a ÷ b)."""
    same = [f"{p}{getattr(a, k)}" for k, p in NAMED
            if getattr(a, k) == getattr(b, k) and getattr(a, k)]
    differ = [k for k, _ in NAMED if getattr(a, k) != getattr(b, k)]

    def side(m: Measurement) -> str:
        return " ".join(f"{p}{getattr(m, k)}" for k, p in NAMED if k in differ) or m.id

    head = f"{phase} of {' '.join(same[:2])}" if same else phase
    return f"{head}: {side(a)} ÷ {side(b)}"


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
            "machine's drift between them does not cancel; its interval combines the two "
            "figures' own intervals, drift included."]


@dataclass(frozen=True)
class Lever:
    """One lever of the report: its analysis, its tables and its plot, in one module."""

    name: str
    analyze: Callable[[list[Measurement], dict[str, Model], list[Probe], dict], dict[str, list]]
    tables: Callable[[dict], list]  # analysis -> list[Table]
    table_names: tuple[str, ...]
    plot: Callable[[dict, Path], str | None]
    plot_name: str
    caption: str  # the plot's alt text
