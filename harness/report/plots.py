"""Plots of a run, written as PNG and SVG beside the report (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path

from ..analysis.ceilings import is_plain
from ..analysis.phases import MEMORY_BOUND_R2, longest_decodes
from ..core.stats import center
from ..levers import write_lever_plots
from ..render.plotkit import ci_errors, plain_log2, plain_log_y, plt, save


def decode_vs_bytes(analysis: dict, out_dir: Path) -> str | None:
    rows = sorted(longest_decodes(analysis["decode"]),
                  key=lambda r: (r["bytes_per_token"], r["dtype"]))
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    xs = [r["bytes_per_token"] / 1e9 for r in rows]
    ys = [center(r["tok_s"]) for r in rows]
    ax.errorbar(xs, ys, yerr=ci_errors([r["tok_s"] for r in rows]), fmt="o", capsize=4,
                color="black", label="measured median (95% CI)", zorder=3)
    for i, (r, x, y) in enumerate(zip(rows, xs, ys, strict=True)):
        # alternate sides and stagger vertically so neighbouring labels never overlap
        ax.annotate(f"{r['model']} {r['dtype']}", (x, y), textcoords="offset points",
                    xytext=(8, 10 + 12 * (i % 3)) if i % 2 == 0 else (8, -14 - 12 * (i % 3)),
                    fontsize=8, arrowprops={"arrowstyle": "-", "color": "0.6", "lw": 0.5})
    grid = [min(xs) * 0.8 + (max(xs) * 1.2 - min(xs) * 0.8) * i / 99 for i in range(100)]
    title = "Decode speed against bytes read per token"
    for f in analysis["fits"]:
        b = f["fit"]["gb_s"]
        ax.plot(grid, [b / x for x in grid], lw=2, alpha=0.8,
                label=f"fit: {b:.1f} GB/s ÷ GB per token ({f['threads']} threads)")
        r2 = f["fit"]["r2"]
        fits_well = r2 is not None and r2 >= MEMORY_BOUND_R2
        title = ((f"Decode speed falls as 1/size: tok/s ≈ {b:.0f} GB/s ÷ GB read per token "
                  f"(R² = {r2:.2f})") if fits_well else
                 f"Decode tok/s against GB read per token: the fit {b:.0f} GB/s ÷ GB"
                 + (f" explains little (R² = {r2:.2f})" if r2 is not None else
                    " (two sizes: R² needs three)"))
    fitted = {i for f in analysis["fits"] for i in f.get("ids") or []}
    ceilings = [r["stream_ceiling"]["value"] for r in rows if r["stream_ceiling"]["value"]
                and (not fitted or r["id"] in fitted)]
    if ceilings:
        c = sum(ceilings) / len(ceilings)
        ax.plot(grid, [c / x for x in grid], "--", color="tab:red", lw=1.2,
                label=f"streaming ceiling (llama.cpp's kernel): {c:.1f} GB/s ÷ GB")
    ax.set_xlabel("GB read per decode step (10⁹ bytes)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, out_dir, "decode_vs_bytes")


def prefill_vs_prompt(measurements: list[dict], out_dir: Path) -> str | None:
    """Time per token of prefill at each prompt length, with the same model's decode as a
    line: both phases on one log-log axis, error bars from the medians' CIs."""
    rows = [m for m in measurements if m["n_gen"] == 0 and m.get("prefill_tok_s") and is_plain(m)]
    if len({m["n_prompt"] for m in rows}) < 2:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ratios = []
    for key in sorted({(m["model"], m["dtype"], m["threads"]) for m in rows}):
        group = sorted((m for m in rows if (m["model"], m["dtype"], m["threads"]) == key),
                       key=lambda m: m["n_prompt"])
        if len(group) < 2:
            continue
        n = [m["n_prompt"] for m in group]
        ms = [1000 / center(m["prefill_tok_s"]) for m in group]
        err = [[1000 / c[1] for c in _cis(group)], [1000 / c[0] for c in _cis(group)]]
        line = ax.errorbar(n, ms, yerr=[[m - lo for m, lo in zip(ms, err[0], strict=True)],
                                        [hi - m for m, hi in zip(ms, err[1], strict=True)]],
                           fmt="o-", capsize=4, label=f"{key[0]} {key[1]}: prefill")[0]
        dec = [m for m in measurements if m["n_gen"] and is_plain(m) and m.get("decode_tok_s")
               and (m["model"], m["dtype"], m["threads"]) == key]
        if dec:
            d_ms = 1000 / center(dec[0]["decode_tok_s"])
            ax.axhline(d_ms, ls="--", color=line.get_color(),
                       label=f"{key[0]} {key[1]}: decode, {d_ms:.0f} ms per token")
            ratios.append(d_ms / ms[0])
    plain_log2(ax)
    plain_log_y(ax)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms per token (log scale)")
    title = "Prefill against prompt length, beside decode"
    if ratios:
        title = f"A decoded token costs {min(ratios):.0f}× a prompt token's time"
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save(fig, out_dir, "prefill_vs_prompt")


def _cis(group: list[dict]) -> list[list[float]]:
    out = []
    for m in group:
        s = m["prefill_tok_s"]
        out.append(s.get("median_ci95") or [center(s), center(s)])
    return out


def decode_per_token(measurements: list[dict], out_dir: Path, limit: int = 6) -> str | None:
    rows = [m for m in measurements if m["n_gen"]][:limit]
    if not rows:
        return None
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 2.2 * len(rows)), squeeze=False)
    for ax, m in zip(axes[:, 0], rows, strict=True):
        step = 0
        for warm in m["warmup_samples"]["decode_s"]:
            ax.plot(range(step, step + len(warm)), [1000 * t for t in warm], color="0.7", lw=1)
            step += len(warm)
        for rep in m["samples"]["decode_s"]:
            ax.plot(range(step, step + len(rep)), [1000 * t for t in rep], lw=1)
            ax.axvline(step, color="0.85", lw=0.5)
            step += len(rep)
        ax.set_title(f"{m['model']} {m['dtype']}, {m['threads']} threads, "
                     f"{m['n_gen']} tokens after {m['n_prompt']}" + _levers_label(m), fontsize=9)
        ax.set_ylabel("ms/step" if m.get("parallel", 1) > 1 else "ms/token")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("decode step (warm-ups grey, then each repetition)")
    fig.tight_layout()
    return save(fig, out_dir, "decode_per_token")


def _levers_label(m: dict) -> str:
    parts = [f"depth {m['depth']:,}" if m.get("depth") else "",
             f"KV {m['kv_type']}" if m.get("kv_type", "f16") != "f16" else "",
             f"{m['parallel']} sequences" if m.get("parallel", 1) > 1 else ""]
    parts = [p for p in parts if p]
    return f" ({', '.join(parts)})" if parts else ""


def write_plots(measurements: list[dict], analysis: dict, out_dir: Path) -> list[str]:
    """Write every plot the data supports; return the PNG names, relative to out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    made = [decode_vs_bytes(analysis, out_dir), prefill_vs_prompt(measurements, out_dir),
            decode_per_token(measurements, out_dir)]

    made += write_lever_plots(analysis, out_dir)
    return [m for m in made if m]
