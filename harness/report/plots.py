"""Plots of a run, written as PNG and SVG beside the report (matplotlib, no display)."""

from __future__ import annotations

import statistics
from pathlib import Path

from ..analysis.ceilings import is_plain
from ..analysis.phases import longest_decodes
from ..core.records import Measurement
from ..core.reference import published_decode_tok_s
from ..core.stats import center
from ..levers import write_lever_plots
from ..render.plotkit import ci_errors, plain_log2, plain_log_x, plain_log_y, plt, save


def decode_vs_bytes(analysis: dict, out_dir: Path, reference: dict | None = None
                    ) -> str | None:
    """Decode tok/s against GB read per token on log-log axes: the run's points per weight
    type, the run's model of each type as a line (fixed cost + bytes ÷ its bandwidth), and a
    reference block's published points hollow."""
    rows = sorted(longest_decodes(analysis["decode"]),
                  key=lambda r: (r["bytes_per_token"], r["dtype"]))
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = {}
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        group = [r for r in rows if r["dtype"] == dtype]
        xs = [r["bytes_per_token"] / 1e9 for r in group]
        line = ax.errorbar(xs, [center(r["tok_s"]) for r in group],
                           yerr=ci_errors([r["tok_s"] for r in group]), fmt="o", capsize=3,
                           label=f"{dtype.upper()} measured (95% CI)", zorder=3)
        colors[dtype] = line[0].get_color()
        for i, r in enumerate(group):
            ax.annotate(r["model"], (xs[i], center(r["tok_s"])), textcoords="offset points",
                        xytext=(6, 6 if i % 2 == 0 else -12), fontsize=7)
    xs_all = [r["bytes_per_token"] / 1e9 for r in rows]
    published = _published_points(reference)
    xs_all += [x for x, _, _ in published]
    grid = [min(xs_all) * 0.7 * (max(xs_all) * 1.4 / (min(xs_all) * 0.7)) ** (i / 99)
            for i in range(100)]
    for d in analysis["machine_model"]["decode"]:
        # a line through one size states nothing the point does not
        if not d.get("gb_s") or d["dtype"] not in colors or len(d["models"]) < 2:
            continue
        fixed = statistics.median(d["fixed_s"].values())
        gb_s = center(d["gb_s"])
        ax.plot(grid, [1 / (fixed + x / gb_s) for x in grid], color=colors[d["dtype"]], lw=1.5,
                alpha=0.8, label=f"{d['dtype'].upper()} model: {fixed * 1e3:.2f} ms + GB ÷ "
                                 f"{gb_s:.1f} GB/s ({d['threads']} threads)")
    if published:
        ax.scatter([x for x, _, _ in published], [y for _, y, _ in published],
                   facecolors="none", edgecolors="black", s=40, zorder=4,
                   label=f"published ({reference.get('hardware', 'reference')})")
    plain_log_x(ax)
    plain_log_y(ax)
    ax.set_xlabel("GB read per decode step (10⁹ bytes, log scale)")
    ax.set_ylabel("decode tokens/s (log scale)")
    ax.set_title(decode_finding(analysis), fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return save(fig, out_dir, "decode_vs_bytes")


def decode_finding(analysis: dict) -> str:
    """The plot's title: how closely one line (fixed cost + bytes ÷ bandwidth) fits the sizes."""
    fits = [d for d in analysis["machine_model"]["decode"] if d.get("gb_s")
            and len(d["models"]) >= 2]
    if not fits:
        return "Decode speed against bytes read per token"
    d = max(fits, key=lambda d: len(d["models"]))
    worst = max(abs(r["measured_over_model"] - 1) for r in d["residuals"])
    return (f"Decode slows with the bytes read per token: {len(d['models'])} {d['dtype'].upper()} "
            f"models within {worst:.0%} of {statistics.median(d['fixed_s'].values()) * 1e3:.2f} "
            f"ms + GB ÷ {center(d['gb_s']):.1f} GB/s")


def _published_points(reference: dict | None) -> list[tuple[float, float, str]]:
    """(GB per token, tok/s, model) of a reference block's decode figures that give a size."""
    out = []
    for f in (reference or {}).get("figures") or []:
        tok_s = published_decode_tok_s(f)
        gb = (f["effective_gb_s"] / tok_s if f.get("effective_gb_s") and tok_s else
              f["size_gib"] * 2**30 / 1e9 if f.get("size_gib") else None)
        if tok_s and gb:
            out.append((gb, tok_s, f["model"]))
    return out


def prefill_finding(measurements: list[Measurement]) -> str:
    """The plot's title: a decoded token's time in prompt tokens' (the fewest over the models
    drawn, each at its shortest prompt)."""
    rows = [m for m in measurements if m.n_gen == 0 and m.prefill_tok_s and is_plain(m)]
    ratios = []
    for key in sorted({(m.model, m.dtype, m.threads) for m in rows}):
        group = sorted((m for m in rows if (m.model, m.dtype, m.threads) == key),
                       key=lambda m: m.n_prompt)
        dec = [m for m in measurements if m.n_gen and is_plain(m) and m.decode_tok_s
               and (m.model, m.dtype, m.threads) == key]
        if len(group) >= 2 and dec:
            ratios.append((center(group[0].prefill_tok_s) / center(dec[0].decode_tok_s),
                           group[0].n_prompt, center(group[-1].prefill_tok_s)
                           / center(dec[0].decode_tok_s), group[-1].n_prompt))
    if not ratios:
        return "Prefill against prompt length, beside decode"
    short, n_short, long, n_long = min(ratios)
    return (f"A decoded token costs {short:.0f}× a prompt token's time at {n_short:,} tokens, "
            f"{long:.0f}× at {n_long:,}")


def prefill_vs_prompt(measurements: list[Measurement], out_dir: Path) -> str | None:
    """Time per token of prefill at each prompt length, with the same model's decode as a
    line: both phases on one log-log axis, error bars from the medians' CIs."""
    rows = [m for m in measurements if m.n_gen == 0 and m.prefill_tok_s and is_plain(m)]
    if len({m.n_prompt for m in rows}) < 2:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for key in sorted({(m.model, m.dtype, m.threads) for m in rows}):
        group = sorted((m for m in rows if (m.model, m.dtype, m.threads) == key),
                       key=lambda m: m.n_prompt)
        if len(group) < 2:
            continue
        n = [m.n_prompt for m in group]
        ms = [1000 / center(m.prefill_tok_s) for m in group]
        err = [[1000 / c[1] for c in _cis(group)], [1000 / c[0] for c in _cis(group)]]
        line = ax.errorbar(n, ms, yerr=[[m - lo for m, lo in zip(ms, err[0], strict=True)],
                                        [hi - m for m, hi in zip(ms, err[1], strict=True)]],
                           fmt="o-", capsize=4, label=f"{key[0]} {key[1]}: prefill")[0]
        dec = [m for m in measurements if m.n_gen and is_plain(m) and m.decode_tok_s
               and (m.model, m.dtype, m.threads) == key]
        if dec:
            d_ms = 1000 / center(dec[0].decode_tok_s)
            ax.axhline(d_ms, ls="--", color=line.get_color(),
                       label=f"{key[0]} {key[1]}: decode, {d_ms:.0f} ms per token")
    plain_log2(ax)
    plain_log_y(ax)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms per token (log scale)")
    ax.set_title(prefill_finding(measurements), fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save(fig, out_dir, "prefill_vs_prompt")


def _cis(group: list[Measurement]) -> list[list[float]]:
    out = []
    for m in group:
        s = m.prefill_tok_s
        out.append(s.get("median_ci95") or [center(s), center(s)])
    return out


def decode_per_token(measurements: list[Measurement], out_dir: Path, limit: int = 6
                     ) -> str | None:
    rows = [m for m in measurements if m.n_gen][:limit]
    if not rows:
        return None
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 2.2 * len(rows)), squeeze=False)
    for ax, m in zip(axes[:, 0], rows, strict=True):
        step = 0
        for warm in m.warmup_samples["decode_s"]:
            ax.plot(range(step, step + len(warm)), [1000 * t for t in warm], color="0.7", lw=1)
            step += len(warm)
        for rep in m.samples["decode_s"]:
            ax.plot(range(step, step + len(rep)), [1000 * t for t in rep], lw=1)
            ax.axvline(step, color="0.85", lw=0.5)
            step += len(rep)
        ax.set_title(f"{m.model} {m.dtype}, {m.threads} threads, "
                     f"{m.n_gen} tokens after {m.n_prompt}" + _levers_label(m), fontsize=9)
        ax.set_ylabel("ms/step" if m.parallel > 1 else "ms/token")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("decode step (warm-ups grey, then each repetition)")
    fig.tight_layout()
    return save(fig, out_dir, "decode_per_token")


def _levers_label(m: Measurement) -> str:
    parts = [f"depth {m.depth:,}" if m.depth else "",
             f"KV {m.kv_type}" if m.kv_type != "f16" else "",
             f"{m.parallel} sequences" if m.parallel > 1 else ""]
    parts = [p for p in parts if p]
    return f" ({', '.join(parts)})" if parts else ""


def write_plots(measurements: list[Measurement], analysis: dict, out_dir: Path,
                reference: dict | None = None) -> list[str]:
    """Write every plot the data supports; return the PNG names, relative to out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    made = [decode_vs_bytes(analysis, out_dir, reference),
            prefill_vs_prompt(measurements, out_dir),
            decode_per_token(measurements, out_dir)]

    made += write_lever_plots(analysis, out_dir)
    return [m for m in made if m]
