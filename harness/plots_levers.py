"""Plots of the lever sections (matplotlib, no display); each returns its PNG name or None."""

from __future__ import annotations

from pathlib import Path

from .plotkit import ci_errors, finish, log2_pair, plt, save
from .stats import center


def _groups(rows: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def quant_speedup(analysis: dict, out_dir: Path) -> str | None:
    rows = analysis.get("quant") or []
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    top = max(r["byte_reduction"] for r in rows) * 1.1
    ax.plot([1, top], [1, top], "--", color="0.6", label="speed-up = byte reduction")
    for (model, threads), group in _groups(rows, "model", "threads").items():
        for phase, marker in (("decode", "o"), ("prefill", "s")):
            pts = [(r["byte_reduction"], r[f"{phase}_speedup"], r["dtype"]) for r in group
                   if r.get(f"{phase}_speedup")]
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, ls="none",
                    label=f"{phase}: {model} ({threads} threads)")
            for x, y, dtype in pts:
                ax.annotate(dtype, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    return finish(ax, fig, out_dir, "quant_speedup",
                  "byte reduction per decode step (× fewer bytes than the widest type)",
                  "speed-up", "Quantization: speed-up against byte reduction")


def kv_depth(analysis: dict, out_dir: Path) -> str | None:
    rows = [r for r in analysis.get("kv_depth") or [] if r.get("measured_slowdown")]
    if len({r["depth"] for r in rows}) < 2:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, group in _groups(rows, "model", "dtype", "kv_type", "threads").items():
        group = sorted(group, key=lambda r: r["depth"])
        depths = [r["depth"] for r in group]
        err = ci_errors([r["measured_slowdown"] for r in group])
        line = ax.errorbar(depths, [center(r["measured_slowdown"]) for r in group], yerr=err,
                           fmt="o-", capsize=4, label=f"{key[0]} {key[1]}, KV {key[2]}: "
                           "measured (95% CI)")[0]
        ax.plot(depths, [r["predicted_slowdown"] for r in group], "--", color=line.get_color(),
                label=f"KV {key[2]}: predicted from bytes")
    ax.axhline(1, color="0.7", lw=0.8)
    return finish(ax, fig, out_dir, "kv_depth", "context depth (tokens already in the KV cache)",
                  "decode slowdown against depth 0 (×)", "Decode at context depth")


def batching(analysis: dict, out_dir: Path) -> str | None:
    rows = analysis.get("batching") or []
    if not rows:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for key, group in _groups(rows, "model", "dtype", "threads").items():
        group = sorted(group, key=lambda r: r["parallel"])
        b = [r["parallel"] for r in group]
        label = f"{key[0]} {key[1]} ({key[2]} threads)"
        line, = a1.plot(b, [center(r["tok_s"]) for r in group], "o-", label=f"{label}: measured")
        if all(r["bound_tok_s"] for r in group):
            a1.plot(b, [r["bound_tok_s"] for r in group], "--", color=line.get_color(),
                    label="roofline bound from the measured ceilings")
        a2.plot(b, [center(r["per_sequence_tok_s"]) for r in group], "o-", label=label)
    log2_pair(a1, a2, "sequences decoded together", "aggregate tokens/s",
              "tokens/s each sequence sees")
    a1.legend(fontsize=8)
    a2.legend(fontsize=8)
    fig.suptitle("Batching independent sequences")
    return save(fig, out_dir, "batching")


def threads(analysis: dict, out_dir: Path) -> str | None:
    rows = analysis.get("threads") or []
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    top = max(r["threads"] for r in rows)
    ax.plot([1, top], [1, top], ":", color="0.6", label="ideal (speed-up = threads)")
    for key, group in _groups(rows, "phase", "model", "dtype", "n_prompt", "n_gen").items():
        group = sorted(group, key=lambda r: r["threads"])
        t = [r["threads"] for r in group]
        line, = ax.plot(t, [r["speedup"] for r in group], "o-", label=f"{key[0]}: {key[1]} "
                        f"{key[2]}")
        if all(r["ceiling_speedup"] for r in group):
            ax.plot(t, [r["ceiling_speedup"] for r in group], "--", color=line.get_color(),
                    label=f"{'matmul peak' if key[0] == 'prefill' else 'read bandwidth'} "
                    "(its ceiling)")
    return finish(ax, fig, out_dir, "threads", "threads", "speed-up over the fewest threads",
                  "Thread scaling of prefill and decode, beside their ceilings")


def prefix_cache(analysis: dict, out_dir: Path) -> str | None:
    rows = analysis.get("prefix") or []
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 1.2 + 1.1 * len(rows)))
    methods = [("recompute_s", "recomputed"), ("state_restore_s", "state restore"),
               ("seq_copy_s", "sequence copy")]
    height = 0.8 / len(methods)
    for j, (key, label) in enumerate(methods):
        ys = [i + j * height for i in range(len(rows))]
        values = [center(r[key]) for r in rows]
        ax.barh(ys, values, height, label=label)
        for y, v in zip(ys, values, strict=True):
            ax.annotate(f"{v:.2f} s", (v, y), textcoords="offset points", xytext=(4, -3),
                        fontsize=8)
    ax.set_yticks([i + height for i in range(len(rows))],
                  [f"{r['model']} {r['dtype']}\n{r['shared_prefix']} + {r['n_prompt']} tokens"
                   for r in rows], fontsize=8)
    ax.set_xlabel("time to first token (s)")
    ax.set_title("Prefix caching")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8)
    return save(fig, out_dir, "prefix_cache")


def write_lever_plots(analysis: dict, out_dir: Path) -> list[str | None]:
    return [quant_speedup(analysis, out_dir), kv_depth(analysis, out_dir),
            batching(analysis, out_dir), threads(analysis, out_dir),
            prefix_cache(analysis, out_dir)]
