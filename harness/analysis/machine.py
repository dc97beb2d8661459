"""The machine during a run: its ceilings before, beside and after the measurements, how
steady it was, and what the probes could not measure. Pure functions of the stored probes."""

from __future__ import annotations

from collections import Counter

from ..core.records import Measurement, Probe, Round
from ..core.stats import center, summarize
from .ceilings import probe_figure


def ceilings_summary(probes: list[Probe]) -> list[dict]:
    """Each probed figure before and after the measurements, how far they moved, and the
    range of the probes taken beside the measurements."""
    full = [p for p in probes if p.result and p.when not in ("beside", "rotation")]
    before = next((p for p in full if p.when == "before"), None)
    after = next((p for p in reversed(full) if p.when == "after"), None)
    beside = [p for p in probes if p.result and p.when == "beside"]
    rows = []
    for threads, path in _figures(before, after):
        b, a = (probe_figure(p, threads, path) for p in (before, after))
        near = [f["value"] for p in beside if (f := probe_figure(p, threads, path))]
        rows.append({"threads": threads, "what": path, "before": b and b["value"],
                     "after": a and a["value"], "layout": (b or a or {}).get("layout"),
                     "drift": (a["value"] - b["value"]) / b["value"] if a and b else None,
                     "beside_min": min(near) if near else None,
                     "beside_max": max(near) if near else None, "n_beside": len(near)})
    return rows


def _figures(*probes: Probe | None) -> list[tuple[int, tuple[str, ...]]]:
    """Every (thread count, figure path) the probes hold, in a stable order."""
    out: dict = {}
    for p in probes:
        for t, node in ((p.result if p else None) or {}).get("threads", {}).items():
            for key in ("read_gb_s", "copy_gb_s", "matmul_gflop_s"):
                if node.get(key):
                    out[(int(t), (key,))] = None
            for dtype, entry in (node.get("ggml") or {}).items():
                for key in ("stream_gb_s", "shortrows_gb_s", "compute_gflop_s",
                            "narrow_gflop_s"):
                    if entry.get(key):
                        out[(int(t), ("ggml", dtype, key))] = None
    return sorted(out, key=lambda k: (k[0], len(k[1]), k[1]))


REGIME_GAP = 0.15  # a gap of 15% between sorted page reads splits them into two regimes


def stability(measurements: list[Measurement], rounds: list[Round], noisy_cores: float
              ) -> dict:
    """How steady the machine was: the page reads taken beside every decode repetition (their
    spread, and two regimes when they fall into two clusters), and the rounds in which other
    processes used the CPU."""
    in_order = [v for m in measurements for pair in (m.samples.get("read_gb_s") or [])
                if pair for v in pair]
    reads = sorted(in_order)
    out = {"n_reads": len(reads), "n_rounds": len(rounds),
           "disturbed_rounds": [r.round for r in rounds
                                if (r.idle_other_cores or 0) > noisy_cores]}
    if len(reads) < 2:
        return out
    out |= {"read_min": reads[0], "read_max": reads[-1], "read": summarize(in_order)}
    gaps = [(reads[i + 1] / reads[i] - 1, i) for i in range(len(reads) - 1) if reads[i] > 0]
    gap, i = max(gaps, default=(0.0, 0))
    tenth = max(len(reads) // 10, 1)
    if gap > REGIME_GAP and tenth <= i + 1 <= len(reads) - tenth:
        slow, fast = reads[:i + 1], reads[i + 1:]
        out["regimes"] = [{"median_gb_s": center(summarize(x)), "share": len(x) / len(reads)}
                          for x in (slow, fast)]
    return out


def regime_sentences(rows: list[dict]) -> list[str]:
    """The speeds the decode cells ran at, said once: each cell seen at two speeds, with how
    long the machine kept to one (steps, and seconds of the rotation they ran in)."""
    tick_s = sum(1 / center(r["tok_s"]) for r in rows if r.get("interleave") == "step")
    out = []
    seen = Counter((r["model"], r["dtype"]) for r in rows)
    for r in rows:
        reg = r.get("regimes") or {}
        if reg.get("n") != 2:
            continue
        steps = f" ({r['n_gen']} steps)" if seen[(r["model"], r["dtype"])] > 1 else ""
        step_s = tick_s if r.get("interleave") == "step" else 1 / center(r["tok_s"])
        out.append(f"{r['model']} {r['dtype']}{steps} about {_ms(reg['ms'][0])} and "
                   f"{_ms(reg['ms'][1])} ms per step ({reg['slow_share']:.0%} of its steps at "
                   f"the slower; a speed held ≈{reg['mean_run_steps'] * step_s:.2g} s, "
                   f"{reg['mean_run_steps']:.0f} steps, on average)")
    return out


def _ms(x: float) -> str:
    """Milliseconds to the digit that matters: whole above 10, two figures below."""
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def probe_errors(probes: list[Probe]) -> list[str]:
    """Every probe failure and every weight type a probe could not measure, once each."""
    out = [p.error for p in probes if p.error]
    for p in probes:
        for t, node in ((p.result or {}).get("threads") or {}).items():
            for dtype, entry in (node.get("ggml") or {}).items():
                if entry.get("error"):
                    out.append(f"{dtype} at {t} threads: {entry['error']}")
    return list(dict.fromkeys(out))


