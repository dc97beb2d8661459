"""Prefix caching: time to first token with a shared prefix recomputed or reused.

The lever's analysis (rows from the stored records), its report table and its plot."""

from __future__ import annotations

from pathlib import Path

from ..core.records import Measurement, Model, Probe
from ..core.stats import center, ratio_summary
from ..render.plotkit import ci_errors, plt, save
from ..render.tabular import Column, Table
from .common import Lever, median_of

# --- analysis

def prefix_rows(measurements: list[Measurement]) -> list[dict]:
    """Time to first token with the shared prefix recomputed and reused, and the saving."""
    rows = []
    for m in measurements:
        if m.kind != "prefix_cache" or not m.ttft_s:
            continue
        recompute = median_of(m.ttft_s)
        row = {"model": m.model, "dtype": m.dtype, "threads": m.threads,
               "shared_prefix": m.shared_prefix, "n_prompt": m.n_prompt,
               "kv_type": m.kv_type, "recompute_s": m.ttft_s,
               "state_n_bytes": (m.setup or {}).get("state_n_bytes"),
               "flags": m.flags}
        for method, summary in (m.ttft_reuse_s or {}).items():
            row[f"{method}_s"] = summary
            # both timed inside each repetition: paired, so the saving is a contrast
            paired = ratio_summary([a / b for a, b in zip(m.samples["prefill_s"],
                                                           m.samples["reuse_s"][method],
                                                           strict=False) if a > 0 and b > 0])
            speedup = paired["ratio"] if paired else recompute / median_of(summary)
            row[f"{method}_saving"] = 1 - 1 / speedup
            row[f"{method}_speedup"] = speedup
            row[f"{method}_speedup_ci"] = paired and paired | {
                "numerator": m.id, "denominator": f"{m.id} ({method.replace('_', ' ')})",
                "metric": "seconds", "name": f"time to first token of {m.model} "
                f"{m.dtype} after {m.shared_prefix:,} shared tokens: recomputed ÷ "
                f"{method.replace('_', ' ')}, in the same repetition"}
        rows.append(row)
    return rows


def analyze(measurements: list[Measurement], models: dict[str, Model], probes: list[Probe],
            phases: dict) -> dict:
    return {"prefix": prefix_rows(measurements)}


# --- table

def prefix_table(analysis: dict) -> list[Table]:
    rows = analysis["prefix"]
    if not rows:
        return []
    return [Table("prefix", "Prefix caching: time to first token", [
        Column("model", "model"), Column("dtype", "dtype"), Column("threads", "threads", "int"),
        Column("shared prefix", "shared_prefix", "int"), Column("question", "n_prompt", "int"),
        Column("recomputed (s)", "recompute_s", "stat3"),
        Column("sequence copy (s)", "seq_copy_s", "stat3"),
        Column("saving", "seq_copy_saving", "pct"),
        Column("state restore (s)", "state_restore_s", "stat3"),
        Column("saving", "state_restore_saving", "pct"),
        Column("saved state (MiB)", "state_n_bytes", "mib")], rows,
        ["Recomputed: prefill of prefix + question from an empty cache. Sequence copy: the "
         "prefix stays cached in sequence 0 and a new sequence shares its cells "
         "(llama_memory_seq_cp in a unified cache, no data moved), then only the question is "
         "prefilled. State restore: the prefix's cache was saved once "
         "(llama_state_seq_get_data) and is copied back in before the question, as a server "
         "restoring a cached prompt from RAM does. Each time ends at the last token's logits."])]


# --- plot

def prefix_finding(rows: list[dict]) -> str:
    """The plot's title: the best measured saving in time to first token."""
    best = max(((r[f"{m}_saving"], m, r) for r in rows for m in ("seq_copy", "state_restore")
                if r.get(f"{m}_saving") is not None), key=lambda x: x[0], default=None)
    if not best:
        return "Prefix caching: time to first token"
    saving, method, r = best
    return (f"Reusing a {r['shared_prefix']:,}-token prefix ({method.replace('_', ' ')}) cut "
            f"time to first token by {saving:.0%}")


def prefix_cache(analysis: dict, out_dir: Path) -> str | None:
    rows = analysis["prefix"]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 1.2 + 1.1 * len(rows)))
    methods = [("recompute_s", "recomputed"), ("state_restore_s", "state restore"),
               ("seq_copy_s", "sequence copy")]
    height = 0.8 / len(methods)
    for j, (key, label) in enumerate(methods):
        ys = [i + j * height for i in range(len(rows))]
        summaries = [r.get(key) or {} for r in rows]
        values = [center(s) or 0.0 for s in summaries]
        err = ci_errors(summaries)
        ax.barh(ys, values, height, xerr=err, capsize=3, label=label)
        for y, v, hi in zip(ys, values, err[1], strict=True):
            # the label starts past the error bar so the two never overlap
            ax.annotate(f"{v:.2f} s", (v + hi, y), textcoords="offset points",
                        xytext=(6, -3), fontsize=8)
    ax.set_yticks([i + height for i in range(len(rows))],
                  [f"{r['model']} {r['dtype']}\n{r['shared_prefix']} + {r['n_prompt']} tokens"
                   for r in rows], fontsize=8)
    ax.set_xlabel("time to first token (s), bars: 95% CI")
    ax.set_xlim(right=max(center(r["recompute_s"]) for r in rows) * 1.3)
    ax.set_title(prefix_finding(rows), fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8)
    return save(fig, out_dir, "prefix_cache")


LEVER = Lever("prefix", analyze, prefix_table, ("prefix",),
              prefix_cache, "prefix_cache",
              "Time to first token with the shared prefix recomputed or reused")
