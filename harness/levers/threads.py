"""Threads: how prefill and decode scale with cores, beside the ceilings' own scaling.

The lever's analysis (rows from the stored records), its report table and its plot."""

from __future__ import annotations

from pathlib import Path

from ..analysis.ceilings import is_plain
from ..core.records import Measurement, Model, Probe
from ..core.stats import center
from ..render.plotkit import ci_errors, finish, plt
from ..render.tabular import ABOVE_CEILING_NOTE, Column, Table
from .common import (
    Lever,
    group_records,
    group_rows,
    median_of,
    round_ratio,
    threads_label,
    unpaired_note,
)

KNEE_TOLERANCE = 0.02  # the knee: the fewest threads within 2% of the best


# --- analysis

def thread_rows(measurements: list[Measurement], probes: list[Probe], analysis: dict
                ) -> list[dict]:
    """Speed-up with threads of each plain prefill and decode measured at two or more counts,
    and how close each came to its own ceiling (from the decode and prefill rows)."""
    # keyed by (id, phase): a prompt-then-decode measurement has a row of each phase
    rows_by_id = {(r["id"], "decode"): (r, r["share_of_stream"], r["stream_ceiling"])
                  for r in analysis["decode"]}
    rows_by_id |= {(r["id"], "prefill"): (r, r["share_of_peak"], r["compute_peak"])
                   for r in analysis["prefill"]}
    rows = []
    for phase, key in (("prefill", "prefill_tok_s"), ("decode", "decode_tok_s")):
        chosen = [m for m in measurements if is_plain(m) and getattr(m, key)
                  and (m.id, phase) in rows_by_id
                  and (m.n_gen == 0 if phase == "prefill" else m.n_gen > 0)]
        for group in group_records(chosen, lambda m: (m.model_key, m.n_prompt, m.n_gen,
                                                      m.n_batch, m.n_ubatch, m.flash_attn)):
            if len({m.threads for m in group}) >= 2:
                rows += _thread_group(phase, key, group, rows_by_id)
    return rows


def _thread_group(phase: str, key: str, group: list[Measurement], rows_by_id: dict
                  ) -> list[dict]:
    group.sort(key=lambda m: m.threads)
    base = group[0]
    best = max(median_of(getattr(m, key)) for m in group)
    knee = next(m.threads for m in group
                if median_of(getattr(m, key)) >= (1 - KNEE_TOLERANCE) * best)
    base_ceiling = rows_by_id[(base.id, phase)][2]["value"]
    out = []
    for m in group:
        ratio = round_ratio(m, base, phase)
        speedup = center(ratio)
        _, share, ceiling = rows_by_id[(m.id, phase)]
        c = ceiling["value"]
        out.append({"phase": phase, "id": m.id, "model": m.model, "dtype": m.dtype,
                    "n_prompt": m.n_prompt, "n_gen": m.n_gen, "threads": m.threads,
                    "tok_s": getattr(m, key), "speedup": speedup, "speedup_ci": ratio,
                    "base_threads": base.threads,
                    "efficiency": speedup * base.threads / m.threads,
                    "ceiling": "compute_gflop_s" if phase == "prefill" else "stream_gb_s",
                    "ceiling_value": c, "share_of_ceiling": share,
                    "ceiling_speedup": c / base_ceiling if c and base_ceiling else None,
                    "knee": m.threads == knee, "knee_threads": knee,
                    "n_thread_counts": len(group), "flags": m.flags})
    return out


def analyze(measurements: list[Measurement], models: dict[str, Model], probes: list[Probe],
            phases: dict) -> dict:
    return {"threads": thread_rows(measurements, probes, phases)}


# --- table

def threads_table(analysis: dict) -> list[Table]:
    rows = analysis["threads"]
    if not rows:
        return []
    names = {"compute_gflop_s": "ggml compute peak", "stream_gb_s": "ggml streaming"}
    table_rows = [r | {"test": (f"pp{r['n_prompt']}" if r["phase"] == "prefill"
                                else f"tg{r['n_gen']}"), "ceiling_name": names[r["ceiling"]],
                       "knee_mark": "◀ knee" if r["knee"] else ""} for r in rows]
    knees = sorted({(r["phase"], r["model"], r["dtype"], r["knee_threads"],
                     max(x["threads"] for x in rows if x["phase"] == r["phase"]
                         and x["model"] == r["model"] and x["dtype"] == r["dtype"]))
                    for r in rows})
    notes = [_knee_note(phase, model, dtype, knee, top) for phase, model, dtype, knee, top
             in knees]
    notes.append("Prefill is matrix-matrix work: it scales with cores as the compute peak "
                 "does. Decode reads every weight per token: it scales until it reaches "
                 "the streaming bandwidth of its thread count (share of ceiling: effective GB/s "
                 "÷ ggml's streaming ceiling for decode, achieved GFLOP/s ÷ ggml's compute "
                 "peak for prefill, each over the model's tensor types).")
    notes += _ceiling_notes(rows)
    notes += unpaired_note([(f"{r['phase']} of {r['model']} {r['dtype']} at "
                             f"{threads_label(r['threads'])}", threads_label(r["base_threads"]),
                             r["speedup_ci"]) for r in rows
                            if r["threads"] != r["base_threads"]])
    if any((r["share_of_ceiling"] or 0) > 1 for r in rows):
        notes.append(ABOVE_CEILING_NOTE)
    return [Table("threads", "Threads: how prefill and decode scale", [
        Column("phase", "phase"), Column("model", "model"), Column("dtype", "dtype"),
        Column("test", "test"), Column("threads", "threads", "int"),
        Column("tok/s", "tok_s", "stat"), Column("speed-up (×)", "speedup_ci", "stat2"),
        Column("efficiency", "efficiency", "pct"), Column("ceiling", "ceiling_name"),
        Column("ceiling speed-up", "ceiling_speedup", "x"),
        Column("share of ceiling", "share_of_ceiling", "pct"), Column("", "knee_mark")],
        table_rows, notes)]


def _knee_note(phase: str, model: str, dtype: str, knee: int, top: int) -> str:
    """The knee, said only where the measured thread counts can show one."""
    if knee == top:
        return (f"{phase}, {model} {dtype}: still gaining at {threads_label(top)}, the most "
                "measured; this run cannot show where the gain ends.")
    return (f"{phase}, {model} {dtype}: knee at {threads_label(knee)} of {top} (the fewest within "
            "2% of the best).")


def _ceiling_notes(rows: list[dict]) -> list[str]:
    """Where each phase stood against its ceiling at the fewest and the most threads."""
    out = []
    for phase in ("decode", "prefill"):
        group = [r for r in rows if r["phase"] == phase and r["share_of_ceiling"]]
        if len(group) < 2:
            continue
        lo = min(group, key=lambda r: r["threads"])
        hi = max(group, key=lambda r: r["threads"])
        speedup = hi["speedup"] / lo["speedup"]
        text = (f"Measured here: {phase} reached {lo['share_of_ceiling']:.0%} of its ceiling "
                f"at {threads_label(lo['threads'])} and {hi['share_of_ceiling']:.0%} at "
                f"{threads_label(hi['threads'])}, a {speedup:.2f}× speed-up")
        if phase == "decode" and hi["share_of_ceiling"] >= 0.9:
            text += (f"; at {threads_label(hi['threads'])} it ran at its streaming ceiling, so "
                     "more threads would add compute that waits on memory")
        out.append(text + ".")
    return out


# --- plot

def threads_finding(rows: list[dict]) -> str:
    """The plot's title: each phase's speed-up from the fewest to the most threads measured."""
    parts = []
    for phase in ("prefill", "decode"):
        group = [r for r in rows if r["phase"] == phase and r["speedup"]]
        if group:
            top = max(group, key=lambda r: (r["threads"], r["speedup"]))
            base = min(r["threads"] for r in group)
            parts.append(f"{phase} {top['speedup']:.2f}× from {base} to {top['threads']} "
                         "threads")
    return ", ".join(parts).capitalize()


def threads(analysis: dict, out_dir: Path) -> str | None:
    rows = analysis["threads"]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    top = max(r["threads"] for r in rows)
    ax.plot([1, top], [1, top], ":", color="0.6", label="ideal (speed-up = threads)")
    for key, group in group_rows(rows, "phase", "model", "dtype", "n_prompt", "n_gen").items():
        group = sorted(group, key=lambda r: r["threads"])
        t = [r["threads"] for r in group]
        line = ax.errorbar(t, [r["speedup"] for r in group],
                           yerr=ci_errors([r["speedup_ci"] or {} for r in group]), fmt="o-",
                           capsize=3, label=f"{key[0]}: {key[1]} {key[2]} (95% CI)")[0]
        if all(r["ceiling_speedup"] for r in group):
            ax.plot(t, [r["ceiling_speedup"] for r in group], "--", color=line.get_color(),
                    label=f"{'matmul peak' if key[0] == 'prefill' else 'read bandwidth'} "
                    "(its ceiling)")
    ax.set_xticks(sorted({r["threads"] for r in rows}))
    return finish(ax, fig, out_dir, "threads", "threads", "speed-up over the fewest threads",
                  threads_finding(rows))


LEVER = Lever("threads", analyze, threads_table, ("threads",),
              threads, "threads",
              "Speed-up of prefill and decode with threads, beside the ceilings' own scaling")
