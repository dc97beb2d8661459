"""Random weights against real weights: a real GGUF file measured beside its random-weight
twin (same header, tensor table and block magnitudes; random values), or beside the builder's
file of the spec its header gives (what every run times), round by round.

The lever's analysis (rows from the stored records), its report table and its plot."""

from __future__ import annotations

from pathlib import Path

from ..core.records import Measurement, Model, Probe
from ..core.rounds import PAIRING_FIELDS
from ..core.stats import decide
from ..engine.scenario import RANDOM_KINDS, TWIN_PAIR
from ..render.plotkit import plt, save
from ..render.tabular import Column, Table
from .common import Lever, round_ratio

TOLERANCE = 0.02  # the twin stands in for the real file when twin ÷ real lies within ±2%
PHASES = ("prefill", "decode")
_SETTINGS = tuple(f for f in PAIRING_FIELDS if f != "dtype")  # what a pair shares

# --- analysis


def twin_rows(measurements: list[Measurement], models: dict[str, Model]) -> list[dict]:
    """random ÷ real tok/s per phase for every cell measured on the real file and on a
    random-weight stand-in (its twin, the spec-built file), with its interval and the verdict
    on ±TOLERANCE."""
    by_key: dict[tuple, dict] = {}
    for m in measurements:
        if m.dtype in TWIN_PAIR:
            by_key.setdefault(tuple(getattr(m, k) for k in _SETTINGS), {})[m.dtype] = m
    rows = []
    for pair in by_key.values():
        real = pair.get("real")
        for kind in RANDOM_KINDS:
            if real and kind in pair:
                rows += _pair_rows(real, pair[kind], kind, models)
    return rows


def _pair_rows(real: Measurement, other: Measurement, kind: str, models: dict[str, Model]
               ) -> list[dict]:
    rows = []
    for phase in PHASES:
        ratio = round_ratio(other, real, phase)
        if ratio is None:
            continue
        ci = ratio.get("median_ci95")
        rows.append({"model": real.model, "random": kind, "threads": real.threads,
                     "phase": phase, "n_prompt": real.n_prompt, "n_gen": real.n_gen,
                     "ratio": ratio, "n_pairs": ratio["n"],
                     "per_round": ratio.get("per_round") or [],
                     "verdict": decide(ci, 1 - TOLERANCE, 1 + TOLERANCE),
                     "calibration": _of(models, other, "calibration"),
                     "mmap": {True: "on", False: "off"}.get(_of(models, real, "mmap")),
                     "huge_mapped": [_of(models, x, "huge_mapped_n_bytes")
                                     for x in (real, other)]})
    return rows


def _of(models: dict[str, Model], m: Measurement, field: str):
    """A field of the model record m was measured on (None for a model the run lost)."""
    model = models.get(m.model_key)
    return getattr(model, field) if model else None


def analyze(measurements: list[Measurement], models: dict[str, Model], probes: list[Probe],
            phases: dict) -> dict:
    return {"twins": twin_rows(measurements, models)}


VERDICT_WORDS = {"holds": "within ±2%", "does not hold": "differs by more than 2%",
                 "undecided": "undecided at this precision"}


RANDOM_NAMES = {"twin": "the random-weight twin", "built": "the spec-built file"}
SHORT_NAMES = {"twin": "twin", "built": "spec-built"}


def twin_sentence(row: dict) -> str:
    """One row in words: the ratio, its interval, the pairs and what it means."""
    r = row["ratio"]
    ci = r.get("median_ci95")
    interval = f" (95% interval {ci[0]:.3f}–{ci[1]:.3f})" if ci else ""
    return (f"{row['phase'].capitalize()} of {row['model']}: "
            f"{RANDOM_NAMES[row['random']]} ran "
            f"{r['median']:.3f}× the real file's tok/s{interval} over {row['n_pairs']} paired "
            f"rounds, {VERDICT_WORDS[row['verdict']]}.")


def twin_finding(rows: list[dict]) -> str:
    """The plot's title: each phase's random ÷ real with its interval."""
    parts = []
    both = len({r["random"] for r in rows}) > 1
    for r in rows:
        ci = r["ratio"].get("median_ci95")
        parts.append((f"{SHORT_NAMES[r['random']]} " if both else "")
                     + f"{r['phase']} {r['ratio']['median']:.3f}"
                     + (f" ({ci[0]:.3f}–{ci[1]:.3f})" if ci else ""))
    return "Random ÷ real weights, tok/s: " + "; ".join(parts)


# --- table


def twin_table(analysis: dict) -> list[Table]:
    rows = analysis["twins"]
    if not rows:
        return []
    shown = [r | {"verdict_words": VERDICT_WORDS[r["verdict"]],
                  "random_words": SHORT_NAMES[r["random"]],
                  "worst_rms": (r["calibration"] or {}).get("worst_rms_ratio"),
                  "pairs_range": _range(r["per_round"]),
                  "huge_words": _huge_words(r["huge_mapped"])} for r in rows]
    kinds = {r["random"] for r in rows}
    notes = [_twin_note(kinds)]
    columns = [Column("model", "model"),
               *([Column("random weights", "random_words")] if kinds != {"twin"} else []),
               Column("phase", "phase"),
               Column("threads", "threads", "int"), Column("mmap", "mmap"),
               Column("prompt", "n_prompt", "int"),
               Column("generated", "n_gen", "int"),
               Column("twin ÷ real" if kinds == {"twin"} else "random ÷ real", "ratio", "stat3"),
               Column("rounds", "n_pairs", "int"), Column("per-round range", "pairs_range"),
               Column("verdict", "verdict_words"),
               Column("MiB in 2 MiB pages, real / " + ("twin" if kinds == {"twin"} else
                                                      "random"), "huge_words"),
               *([Column("calibration: worst RMS ratio", "worst_rms", "f2")]
                 if "twin" in kinds else [])]
    return [Table("twins", "Random weights against real weights", columns, shown, notes)]


def _twin_note(kinds: set[str]) -> str:
    """How the ratio is taken and what each random-weight file keeps of the real one."""
    lead = "twin ÷ real" if kinds == {"twin"} else "random ÷ real"
    twin = ("The twin has the real file's header, tensor table and alignment, and every "
            "block of 32 weights keeps the largest magnitude of the real block it replaces "
            "(so the F16 scales ggml looks up have the real spread); the values inside a "
            "block are random, and each matrix is rescaled towards its product's output RMS in "
            "the real model on the same 64-token prompt (at most four passes; the calibration "
            "column gives the worst remaining ratio, either way). ")
    built = ("The spec-built file is what every run times: the builder's file of the spec the "
             "real file's header gives, at its type (same tensor names, shapes and types; the "
             "builder's own order, metadata and values). ")
    return (f"{lead}: the geometric mean of the per-round ratios of tok/s (both files "
            "measured in every round, in an order shuffled per round), with its 95% interval. "
            + (twin if "twin" in kinds else "") + (built if "built" in kinds else "")
            + "Before every round every file's cached pages are dropped and read back and the "
            "models reloaded, in an order that alternates round by round: where the pages "
            "land moved decode by up to 11% between byte-identical files (the MiB of each "
            "file mapped through 2 MiB pages at the first load: 0 without mmap).")


def _huge_words(n_bytes: list[int | None]) -> str:
    """Each file's bytes mapped through 2 MiB page-table entries at its first load."""
    if any(n is None for n in n_bytes):
        return ""
    return " / ".join(f"{n / 2**20:,.0f}" for n in n_bytes)


def _range(values: list[float]) -> str:
    return f"{min(values):.3f}–{max(values):.3f}" if values else ""


# --- plot


def twin_plot(analysis: dict, out_dir: Path) -> str | None:
    rows = analysis["twins"]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.7 * len(rows)))
    for i, r in enumerate(rows):
        ax.scatter(r["per_round"], [i] * len(r["per_round"]), s=12, alpha=0.5, color="grey")
        ci = r["ratio"].get("median_ci95")
        if ci:
            ax.plot(ci, [i, i], color="C0", lw=3)
        ax.plot([r["ratio"]["median"]], [i], "o", color="C0")
    # the band is named in the axis label: a legend inside the axes covered rounds near ±2%
    ax.axvspan(1 - TOLERANCE, 1 + TOLERANCE, color="C2", alpha=0.15)
    ax.axvline(1.0, color="black", lw=0.8)
    kinds = {r["random"] for r in rows}
    ax.set_yticks(range(len(rows)), [
        f"{r['model']}\n" + (f"{SHORT_NAMES[r['random']]} " if kinds != {"twin"}
                             else "") + r["phase"] for r in rows], fontsize=8)
    ax.set_xlabel(("twin" if kinds == {"twin"} else "random")
                  + " ÷ real tok/s (dots: rounds; bar: 95% interval; green: ±2%)")
    ax.set_title(twin_finding(rows), fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    return save(fig, out_dir, "twins")


LEVER = Lever("twins", analyze, twin_table, ("twins",), twin_plot, "twins",
              "Twin ÷ real tok/s per phase, round by round, with the ±2% band")
