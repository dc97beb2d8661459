"""The rule of thumb, checked on a run: decode tok/s ~ bandwidth / bytes per token.

Pure functions of the stored records (and the model specs, for estimates). Every rate is the
median per-repetition rate (harness.stats.center); every share is a figure over a ceiling
measured beside it with llama.cpp's own kernels, never capped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .ceilings import (
    above_ceiling,
    ceiling_near,
    combined_ceiling,
    is_plain,
    probe_figure,
    rep_rates,
    span,
)
from .costs import (
    decode_n_bytes_per_token,
    matmul_params_per_token,
    mean_decode_context,
    prefill_flops,
)
from .dtypes import DTYPES
from .errors import HarnessError
from .gguf_build import nominal_decode_n_bytes
from .levers import analyze_levers
from .noise import NOISY_CORES
from .specs import ModelSpec, all_specs
from .stats import center, summarize

# Spec-sheet peak memory bandwidths, GB/s (vendors' data sheets; DDR = channels x MT/s x 8 B),
# with the hardware class whose band of achievable fractions applies.
REFERENCE_HARDWARE = [
    ("DDR4-3200 desktop, 2 channels", 51.2, "cpu"),
    ("DDR5-5600 desktop, 2 channels", 89.6, "cpu"),
    ("Apple M2 (unified memory)", 100.0, "apple"),
    ("Apple M3 Max (unified memory)", 400.0, "apple"),
    ("Apple M2 Ultra (unified memory)", 800.0, "apple"),
    ("NVIDIA RTX 4090 (GDDR6X)", 1008.0, "gpu"),
    ("NVIDIA H100 SXM (HBM3)", 3350.0, "gpu"),
]
# The share of spec-sheet bandwidth llama.cpp's decode reaches, per class, and where it is from.
# Apple and GPU: llama-bench tables in llama.cpp pull requests; effective GB/s = tok/s x size
# (size in GiB x 1.0737 GB/GiB), over the spec-sheet bandwidth.
BANDS = {
    "cpu": (0.50, 0.80, "the course's rule of thumb: real engines reach about 50–80% of the "
                        "memory ceiling"),
    "apple": (0.55, 0.68, "llama.cpp PR #2891 (2023-08-30), M2 Ultra at 800 GB/s, llama2 7B "
                          "tg64: Q8_0 (6.67 GiB) 61.41 tok/s = 440 GB/s (55%), F16 (12.55 GiB) "
                          "40.53 tok/s = 546 GB/s (68%)"),
    "gpu": (0.70, 0.82, "llama.cpp PR #4766 (2024-01-10), RTX 4090 at 1008 GB/s, llama 7B "
                        "tg128: Q8_0 (6.67 GiB) 98.13 tok/s = 703 GB/s (70%), F16 (12.55 GiB) "
                        "61.03 tok/s = 822 GB/s (82%)"),
}
# Typical requests: (name, prompt tokens, generated tokens).
WORKLOADS = [
    ("chat", 500, 300),
    ("RAG, short context", 3000, 300),
    ("RAG, long context", 10000, 300),
    ("classification", 500, 1),
    ("long-form generation", 200, 2000),
]
# Bump when the analysis gains or changes fields: reports recompute older stored analyses.
ANALYSIS_VERSION = 7
MEMORY_BOUND_R2 = 0.90
MEMORY_BOUND_SPREAD = 0.25  # every point's effective bandwidth within 25% of the fit
MEMORY_BOUND_SHARE = 0.50  # the fitted bandwidth at least half the streaming ceiling
SAME_SPEED = 0.05  # two decode rates within 5% ...
FEWER_BYTES = 0.15  # ... although one reads at least 15% fewer bytes: not limited by bytes


@dataclass(frozen=True)
class Fit:
    """decode tok/s = bandwidth / bytes, least squares through the origin."""

    gb_s: float
    r2: float | None
    n_points: int


def fit_through_origin(n_bytes: list[float], tok_s: list[float]) -> Fit:
    """Least squares of y = B x with x = 1/bytes: B = sum(xy) / sum(x^2); R^2 about the mean."""
    xs = [1 / b for b in n_bytes]
    b = sum(x * y for x, y in zip(xs, tok_s, strict=True)) / sum(x * x for x in xs)
    mean = sum(tok_s) / len(tok_s)
    ss_tot = sum((y - mean) ** 2 for y in tok_s)
    ss_res = sum((y - b * x) ** 2 for x, y in zip(xs, tok_s, strict=True))
    r2 = 1 - ss_res / ss_tot if ss_tot > 0 and len(tok_s) > 2 else None
    return Fit(b / 1e9, r2, len(tok_s))


# --- decode and prefill --------------------------------------------------------------------


def decode_rows(measurements: list[dict], models: dict, probes: list[dict]) -> list[dict]:
    """Effective bandwidth of every plain decode, its share of the model's streaming ceiling
    (ggml's matrix-vector kernels over its tensor types) and of numpy's plain read."""
    rows = []
    for m in filter(is_plain, measurements):
        tok, model = m.get("decode_tok_s"), models.get(m["model_key"])
        if not tok or not model:
            continue
        n_bytes = decode_n_bytes_per_token(model["decode_weight_n_bytes"],
                                           model["kv_n_bytes_per_token_f16"],
                                           mean_decode_context(m["n_prompt"], m["n_gen"]))
        effective = center(tok) * n_bytes / 1e9
        stream = combined_ceiling(model.get("decode_type_n_bytes"), probes, span(m),
                                  m["threads"], "stream_gb_s")
        read = ceiling_near(probes, span(m), m["threads"], ("read_gb_s",))
        copy = ceiling_near(probes, span(m), m["threads"], ("copy_gb_s",))
        share = effective / stream["value"] if stream["value"] else None
        flags = list(m["flags"]) + (["above-ceiling"] if above_ceiling(share, stream) else [])
        rows.append({
            "id": m["id"], "model": m["model"], "dtype": m["dtype"], "threads": m["threads"],
            "n_prompt": m["n_prompt"], "n_gen": m["n_gen"], "tok_s": tok,
            "bytes_per_token": n_bytes, "file_bytes_per_token": model["weights_n_bytes"],
            "effective_gb_s": effective, "stream_ceiling": stream, "read_ceiling": read,
            "copy_ceiling": copy,
            "share_of_stream": share,
            "share_of_read": effective / read["value"] if read["value"] else None,
            "paired_read_ratio": paired_read_ratio(m, n_bytes), "flags": flags,
            "noise": m.get("noise"),
        })
    return rows


def paired_read_ratio(m: dict, n_bytes: float) -> dict | None:
    """Effective bandwidth of each repetition ÷ the mean of the page reads taken right before
    and after it: drift of the machine cancels in the ratio (not a share of a ceiling)."""
    reads = m["samples"].get("read_gb_s") or []
    ratios = [rate * n_bytes / 1e9 / (sum(r) / len(r))
              for rate, r in zip(rep_rates(m, "decode"), reads, strict=False) if rate and r]
    return summarize(ratios) if ratios else None


def prefill_rows(measurements: list[dict], models: dict, probes: list[dict]) -> list[dict]:
    """Achieved GFLOP/s of every plain prefill and its share of the model's compute peak
    (ggml's matrix-matrix kernels over its matrices' types, weighted by their FLOPs)."""
    rows = []
    for m in filter(is_plain, measurements):
        tok, model = m.get("prefill_tok_s"), models.get(m["model_key"])
        if not tok or not model:
            continue
        flops = prefill_flops(ModelSpec(**model["spec"]), m["n_prompt"])
        seconds = m["n_prompt"] / center(tok)
        gflop_s = flops / seconds / 1e9
        peak = combined_ceiling(model.get("matmul_type_n_params"), probes, span(m),
                                m["threads"], "compute_gflop_s")
        share = gflop_s / peak["value"] if peak["value"] else None
        flags = list(m["flags"]) + (["above-ceiling"] if above_ceiling(share, peak) else [])
        rows.append({
            "id": m["id"], "model": m["model"], "dtype": m["dtype"], "threads": m["threads"],
            "n_prompt": m["n_prompt"], "n_gen": m["n_gen"], "seconds": seconds,
            "n_ubatch": m.get("n_ubatch", 512),
            "tok_s": tok, "flops": flops, "gflop_s": gflop_s, "compute_peak": peak,
            "share_of_peak": share, "flags": flags, "noise": m.get("noise"),
        })
    return rows


def phase_use(decode: list[dict], prefill: list[dict], models: dict) -> list[dict]:
    """Where each phase spends the machine: prefill and decode of one model each as a share of
    the compute peak and of the streaming bandwidth (prefill reads the weights once per ubatch;
    decode does 2 FLOPs per weight per token), against the ceilings measured in the run."""
    out = []
    for d in decode:
        pre = [p for p in prefill if p["n_gen"] == 0 and _key(p) == _key(d)]
        model = models.get(f"{d['model']}|{d['dtype']}")
        if not pre or not model:
            continue
        p = min(pre, key=lambda r: r["n_prompt"])
        stream, peak = d["stream_ceiling"]["value"], p["compute_peak"]["value"]
        spec = ModelSpec(**model["spec"])
        passes = -(-p["n_prompt"] // p["n_ubatch"])
        prefill_gb_s = model["decode_weight_n_bytes"] * passes / p["seconds"] / 1e9
        decode_gflop_s = (2 * matmul_params_per_token(spec) + 2 * spec.hidden_size
                          * spec.vocab_size) * center(d["tok_s"]) / 1e9
        base = {"model": d["model"], "dtype": d["dtype"], "threads": d["threads"]}
        out.append(base | {"phase": "prefill", "n_prompt": p["n_prompt"],
                           "gflop_s": p["gflop_s"], "gb_s": prefill_gb_s,
                           "compute_share": p["share_of_peak"],
                           "stream_share": prefill_gb_s / stream if stream else None})
        out.append(base | {"phase": "decode", "gflop_s": decode_gflop_s,
                           "gb_s": d["effective_gb_s"],
                           "compute_share": decode_gflop_s / peak if peak else None,
                           "stream_share": d["share_of_stream"]})
    return out


# --- the fit and its verdict ---------------------------------------------------------------

def fit_verdicts(rows: list[dict]) -> list[dict]:
    """One fit per thread count across the run's models, with a verdict that reads the data."""
    out = []
    for threads in sorted({r["threads"] for r in rows}):
        group = [r for r in rows if r["threads"] == threads]
        if len({r["bytes_per_token"] for r in group}) < 2:
            continue  # one size tests nothing: the report leaves the fit out
        fit = fit_through_origin([r["bytes_per_token"] for r in group],
                                 [center(r["tok_s"]) for r in group])
        out.append({"threads": threads, "fit": fit.__dict__} | verdict(fit, group))
    return out


def verdict(fit: Fit, group: list[dict]) -> dict:
    """"clearly memory-bound" only when the fit is tight and no point is unstable or above its
    ceiling; otherwise what is in the way, in words."""
    reasons = _fit_reasons(fit, group) + _point_reasons(group) + same_speed_reasons(group)
    shares = [r["share_of_stream"] for r in group if r.get("share_of_stream")]
    share = sum(shares) / len(shares) if shares else None
    if share is not None and share < MEMORY_BOUND_SHARE:
        reasons.append(f"decode reaches only {share:.0%} of the streaming ceiling on average: "
                       "compute or overheads limit it")
    head = f"decode tok/s ≈ {fit.gb_s:.1f} GB/s ÷ bytes per token"
    if share is not None:
        head += f", {share:.0%} of the streaming ceiling on average"
    text = (f"clearly memory-bound: {head}" if not reasons else
            f"not clean: {head}, but " + "; ".join(reasons))
    return {"verdict": text, "share_of_stream": share, "reasons": reasons,
            "memory_bound": not reasons}


def _fit_reasons(fit: Fit, group: list[dict]) -> list[str]:
    out = []
    if fit.r2 is None:
        out.append(f"{fit.n_points} points cannot test the fit (R² needs 3 or more)")
    elif fit.r2 < MEMORY_BOUND_R2:
        out.append(f"R² = {fit.r2:.2f}: tok/s does not fall as 1/bytes")
    effective = [r["effective_gb_s"] for r in group]
    if max(abs(e / fit.gb_s - 1) for e in effective) > MEMORY_BOUND_SPREAD:
        out.append(f"effective bandwidth ranges {min(effective):.1f}–{max(effective):.1f} "
                   f"GB/s around the fitted {fit.gb_s:.1f}")
    return out


def _point_reasons(group: list[dict]) -> list[str]:
    out = []
    unstable = [r for r in group if "unstable-decode" in r["flags"]]
    if unstable:
        out.append(", ".join(f"{r['model']} {r['dtype']}" for r in unstable)
                   + f" decoded unsteadily (CV {_cv_range(unstable)} over the repetitions)")
    above = [r for r in group if "above-ceiling" in r["flags"]]
    if above:
        out.append(", ".join(f"{r['model']} {r['dtype']} ({r['share_of_stream']:.0%})"
                             for r in above) + " ran above the streaming ceiling")
    return out


def _cv_range(rows: list[dict]) -> str:
    cvs = sorted(r["tok_s"]["cv"] for r in rows)
    return f"{cvs[0]:.0%}" if len(cvs) == 1 else f"{cvs[0]:.0%}–{cvs[-1]:.0%}"


def same_speed_reasons(group: list[dict]) -> list[str]:
    """Pairs that decode at the same speed although one reads clearly fewer bytes."""
    out = []
    rows = sorted(group, key=lambda r: r["bytes_per_token"])
    for i, small in enumerate(rows):
        for big in rows[i + 1:]:
            fewer = 1 - small["bytes_per_token"] / big["bytes_per_token"]
            ratio = center(small["tok_s"]) / center(big["tok_s"])
            if fewer >= FEWER_BYTES and ratio < 1 + SAME_SPEED:
                threads = small["threads"]
                out.append(f"{small['model']} {small['dtype']} decodes at {ratio:.2f}× the "
                           f"speed of {big['model']} {big['dtype']} although it reads "
                           f"{fewer:.0%} fewer bytes: not limited by bytes at these sizes on "
                           f"{threads} thread{'s' if threads != 1 else ''}")
    return out


# --- estimates -----------------------------------------------------------------------------

PREDICTION_DTYPES = ("f32", "f16", "q8_0", "q4_0")


def prediction_table(specs: dict[str, ModelSpec]) -> dict[str, dict[str, float]]:
    """Nominal weight bytes per decode step of every real spec (those with a source repo)."""
    return {name: {d: nominal_decode_n_bytes(spec, DTYPES[d]) for d in PREDICTION_DTYPES}
            for name, spec in specs.items() if spec.source}


def estimate_bytes(table: dict[str, dict[str, float]], models: dict) -> list[dict]:
    """Bytes per decode step of every spec and dtype: from the run's own file where it has
    one (its tensor table), nominal otherwise (marked so)."""
    out = []
    for name, by_dtype in table.items():
        for dtype, nominal in by_dtype.items():
            model = models.get(f"{name}|{dtype}")
            real = model["decode_weight_n_bytes"] if model else None
            out.append({"model": name, "dtype": dtype, "bytes_per_token": real or nominal,
                        "bytes_from": "file" if real else "nominal"})
    return out


def predictions(fits: list[dict], decode: list[dict], models: dict,
                table: dict[str, dict[str, float]]) -> dict:
    """Estimated decode tok/s: every spec on this machine (the fitted bandwidth ÷ its bytes)
    and on reference hardware (spec-sheet bandwidth × its class's band ÷ its bytes)."""
    fit = next((f["fit"] for f in reversed(fits) if f.get("fit")), None)
    gb_s = fit["gb_s"] if fit else None
    source = f"the fit over {fit['n_points']} measured models" if fit else None
    if gb_s is None and decode:
        gb_s = sorted(r["effective_gb_s"] for r in decode)[len(decode) // 2]
        source = "the median effective bandwidth of this run's decode"
    shares = [r["share_of_read"] for r in decode if r.get("share_of_read")]
    rows = estimate_bytes(table, models)
    this = [r | {"tok_s": gb_s * 1e9 / r["bytes_per_token"]} for r in rows] if gb_s else []
    ref = []
    for hw, bw, kind in REFERENCE_HARDWARE:
        low, high, _ = BANDS[kind]
        ref += [r | {"hardware": hw, "bandwidth_gb_s": bw, "class": kind,
                     "tok_s_low": bw * low * 1e9 / r["bytes_per_token"],
                     "tok_s_high": bw * high * 1e9 / r["bytes_per_token"]} for r in rows]
    return {"estimate": True, "gb_s": gb_s, "gb_s_from": source, "this_machine": this,
            "reference": ref, "bands": {k: list(v) for k, v in BANDS.items()},
            "share_of_read": sorted(shares)[len(shares) // 2] if shares else None}


# --- workloads -----------------------------------------------------------------------------

def workload_balance(prefill: list[dict], decode: list[dict], kv_rows: list[dict]) -> list[dict]:
    """Time share of prefill and decode in typical requests, from rates measured on the same
    model, weight type and thread count: prefill at the nearest measured prompt length, decode
    at the nearest measured context depth; anything beyond the measured range is marked."""
    out = []
    for key in sorted({(r["model"], r["dtype"], r["threads"]) for r in decode}):
        pre = [r for r in prefill if _key(r) == key and r["n_gen"] == 0]
        dec = [(mean_decode_context(r["n_prompt"], r["n_gen"]), center(r["tok_s"]))
               for r in decode if _key(r) == key]
        dec += [(r["depth"] + mean_decode_context(0, r["n_gen"]), center(r["tok_s"]))
                for r in kv_rows if _key(r) == key and r["kv_type"] == "f16"]
        if not pre or not dec:
            continue
        for name, n_prompt, n_gen in WORKLOADS:
            out.append(_workload(key, name, n_prompt, n_gen, pre, dec))
    return out


def _key(r: dict) -> tuple:
    return (r["model"], r["dtype"], r["threads"])


def _workload(key: tuple, name: str, n_prompt: int, n_gen: int, pre: list[dict],
              dec: list[tuple[float, float]]) -> dict:
    nearest = min(pre, key=lambda r: abs(math.log(r["n_prompt"] / n_prompt)))
    context = n_prompt + n_gen / 2
    depth, decode_tok_s = min(dec, key=lambda d: abs(d[0] - context))
    prefill_s = n_prompt / center(nearest["tok_s"])
    decode_s = n_gen / decode_tok_s
    beyond = []
    if n_prompt > max(r["n_prompt"] for r in pre):
        beyond.append(f"prefill rate of {nearest['n_prompt']:,} tokens applied to {n_prompt:,}")
    if context > 1.5 * max(d[0] for d in dec):
        beyond.append(f"decode rate at {depth:,.0f} cached tokens applied to about "
                      f"{context:,.0f}")
    return {"model": key[0], "dtype": key[1], "threads": key[2], "workload": name,
            "n_prompt": n_prompt, "n_gen": n_gen, "prefill_s": prefill_s, "decode_s": decode_s,
            "prefill_share": prefill_s / (prefill_s + decode_s),
            "prefill_rate_from": nearest["n_prompt"], "decode_rate_at": depth,
            "extrapolated": beyond}


# --- the ceilings table --------------------------------------------------------------------

def ceilings_summary(probes: list[dict]) -> list[dict]:
    """Each probed figure before and after the measurements, how far they moved, and the
    range of the probes taken beside the measurements."""
    full = [p for p in probes if p.get("result") and p.get("when") != "beside"]
    before = next((p for p in full if p.get("when") == "before"), None)
    after = next((p for p in reversed(full) if p.get("when") == "after"), None)
    beside = [p for p in probes if p.get("result") and p.get("when") == "beside"]
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


def _figures(*probes: dict | None) -> list[tuple[int, tuple[str, ...]]]:
    """Every (thread count, figure path) the probes hold, in a stable order."""
    out: dict = {}
    for p in probes:
        for t, node in ((p or {}).get("result") or {}).get("threads", {}).items():
            for key in ("read_gb_s", "copy_gb_s", "matmul_gflop_s"):
                if node.get(key):
                    out[(int(t), (key,))] = None
            for dtype, entry in (node.get("ggml") or {}).items():
                for key in ("stream_gb_s", "compute_gflop_s"):
                    if entry.get(key):
                        out[(int(t), ("ggml", dtype, key))] = None
    return sorted(out, key=lambda k: (k[0], len(k[1]), k[1]))


REGIME_GAP = 0.15  # a gap of 15% between sorted page reads splits them into two regimes


def stability(measurements: list[dict], rounds: list[dict], noisy_cores: float) -> dict:
    """How steady the machine was: the page reads taken beside every decode repetition (their
    spread, and two regimes when they fall into two clusters), and the rounds in which other
    processes used the CPU."""
    reads = sorted(v for m in measurements for pair in (m["samples"].get("read_gb_s") or [])
                   if pair for v in pair)
    out = {"n_reads": len(reads), "n_rounds": len(rounds),
           "disturbed_rounds": [r["round"] for r in rounds
                                if (r.get("idle_other_cores") or 0) > noisy_cores]}
    if len(reads) < 2:
        return out
    out |= {"read_min": reads[0], "read_max": reads[-1], "read": summarize(reads)}
    gaps = [(reads[i + 1] / reads[i] - 1, i) for i in range(len(reads) - 1) if reads[i] > 0]
    gap, i = max(gaps, default=(0.0, 0))
    tenth = max(len(reads) // 10, 1)
    if gap > REGIME_GAP and tenth <= i + 1 <= len(reads) - tenth:
        slow, fast = reads[:i + 1], reads[i + 1:]
        out["regimes"] = [{"median_gb_s": center(summarize(x)), "share": len(x) / len(reads)}
                          for x in (slow, fast)]
    return out


def probe_errors(probes: list[dict]) -> list[str]:
    """Every probe failure and every weight type a probe could not measure, once each."""
    out = [p["error"] for p in probes if p.get("error")]
    for p in probes:
        for t, node in ((p.get("result") or {}).get("threads") or {}).items():
            for dtype, entry in (node.get("ggml") or {}).items():
                if entry.get("error"):
                    out.append(f"{dtype} at {t} threads: {entry['error']}")
    return list(dict.fromkeys(out))


def analyze(measurements: list[dict], models: dict, probes: list[dict],
            table: dict[str, dict[str, float]], rounds: list[dict] | None = None,
            noisy_cores: float = 0.10) -> dict:
    """Everything the rule-of-thumb section of a report shows."""
    decode = decode_rows(measurements, models, probes)
    prefill = prefill_rows(measurements, models, probes)
    fits = fit_verdicts(decode)
    levers = analyze_levers(measurements, models, probes, {"decode": decode, "prefill": prefill})
    return levers | {
        "type": "analysis", "version": ANALYSIS_VERSION, "ceilings": ceilings_summary(probes),
        "probe_errors": probe_errors(probes),
        "decode": decode, "fits": fits, "prefill": prefill,
        "predictions": predictions(fits, decode, models, table),
        "workloads": workload_balance(prefill, decode, levers.get("kv_depth", [])),
        "stability": stability(measurements, rounds or [], noisy_cores),
        "phase_use": phase_use(decode, prefill, models),
    }


def analyze_records(records) -> dict:
    """The analysis of whatever a results file holds (complete or not)."""
    try:
        table = prediction_table(all_specs())
    except HarnessError:
        table = {}
    return analyze(records.measurements, records.models, records.probes, table,
                   records.rounds, NOISY_CORES)
