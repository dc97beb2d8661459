"""The rule of thumb, checked on a run: decode tok/s ~ bandwidth / bytes per token.

Pure functions of the stored records (and the model specs, for predictions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .costs import decode_n_bytes_per_token, mean_decode_context, prefill_flops
from .specs import ModelSpec

# Spec-sheet peak memory bandwidths, GB/s (vendors' data sheets; DDR = channels x MT/s x 8 B).
REFERENCE_HARDWARE = [
    ("DDR4-3200 desktop, 2 channels", 51.2),
    ("DDR5-5600 desktop, 2 channels", 89.6),
    ("Apple M2 (unified memory)", 100.0),
    ("Apple M3 Max (unified memory)", 400.0),
    ("Apple M2 Ultra (unified memory)", 800.0),
    ("NVIDIA RTX 4090 (GDDR6X)", 1008.0),
    ("NVIDIA H100 SXM (HBM3)", 3350.0),
]
# Typical requests: (name, prompt tokens, generated tokens).
WORKLOADS = [
    ("chat", 500, 300),
    ("RAG, short context", 3000, 300),
    ("RAG, long context", 10000, 300),
    ("classification", 500, 1),
    ("long-form generation", 200, 2000),
]
# Bump when the analysis gains or changes fields: reports recompute older stored analyses.
ANALYSIS_VERSION = 3
MEMORY_BOUND_R2 = 0.90
MEMORY_BOUND_SPREAD = 0.25  # every point's effective bandwidth within 25% of the fit
MEMORY_BOUND_SHARE = 0.50  # the fitted bandwidth at least half the measured read ceiling


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


def ceiling_beside(probes: list[dict], seq: int, threads: int, key: str) -> dict:
    """The probes just before and just after a record, at its thread count, and their mean."""
    def value(p: dict | None) -> float | None:
        return ((p or {}).get("result") or {}).get("threads", {}).get(str(threads), {}).get(key)

    before = next((p for p in reversed(probes) if p["seq"] < seq), None)
    after = next((p for p in probes if p["seq"] > seq), None)
    values = [v for v in (value(before), value(after)) if v]
    out = {"before": value(before), "after": value(after),
           "value": sum(values) / len(values) if values else None}
    if len(values) == 2:
        out["drift"] = (values[1] - values[0]) / values[0]
    return out


def is_plain(m: dict) -> bool:
    """One sequence from an empty F16 KV cache: the measurements the rule of thumb fits."""
    return (m.get("kind", "single") == "single" and not m.get("depth")
            and m.get("kv_type", "f16") == "f16")


def decode_rows(measurements: list[dict], models: dict, probes: list[dict]) -> list[dict]:
    """Effective bandwidth of every plain decode measurement and its share of the read ceiling."""
    rows = []
    for m in filter(is_plain, measurements):
        tok = m.get("decode_tok_s")
        model = models.get(m["model_key"])
        if not tok or not model:
            continue
        n_bytes = decode_n_bytes_per_token(model["decode_weight_n_bytes"],
                                           model["kv_n_bytes_per_token_f16"],
                                           mean_decode_context(m["n_prompt"], m["n_gen"]))
        effective = tok["mean"] * n_bytes / 1e9
        ceiling = ceiling_beside(probes, m["seq"], m["threads"], "read_gb_s")
        rows.append({
            "id": m["id"], "model": m["model"], "dtype": m["dtype"], "threads": m["threads"],
            "n_prompt": m["n_prompt"], "n_gen": m["n_gen"], "tok_s": tok,
            "ms_per_token": m["decode_ms_per_token"], "bytes_per_token": n_bytes,
            "file_bytes_per_token": model["weights_n_bytes"], "effective_gb_s": effective,
            "read_ceiling": ceiling,
            "share_of_read": effective / ceiling["value"] if ceiling["value"] else None,
            "flags": m["flags"],
        })
    return rows


def fit_verdicts(rows: list[dict]) -> list[dict]:
    """One fit per thread count across the run's models, with a verdict in words."""
    out = []
    for threads in sorted({r["threads"] for r in rows}):
        group = [r for r in rows if r["threads"] == threads]
        sizes = {r["bytes_per_token"] for r in group}
        if len(sizes) < 2:
            out.append({"threads": threads, "fit": None,
                        "verdict": "no fit: the rule of thumb needs decode of at least two "
                                   "model sizes", "reasons": ["only one model size"]})
            continue
        fit = fit_through_origin([r["bytes_per_token"] for r in group],
                                 [r["tok_s"]["mean"] for r in group])
        out.append({"threads": threads, "fit": fit.__dict__} | _verdict(fit, group))
    return out


def _verdict(fit: Fit, group: list[dict]) -> dict:
    reasons = []
    effective = [r["effective_gb_s"] for r in group]
    spread = max(abs(e / fit.gb_s - 1) for e in effective)
    if fit.r2 is not None and fit.r2 < MEMORY_BOUND_R2:
        reasons.append(f"R² = {fit.r2:.2f}: tok/s does not fall as 1/bytes")
    if spread > MEMORY_BOUND_SPREAD:
        reasons.append(f"effective bandwidth ranges {min(effective):.1f}–{max(effective):.1f} "
                       f"GB/s around the fitted {fit.gb_s:.1f}")
    ceilings = [r["read_ceiling"]["value"] for r in group if r["read_ceiling"]["value"]]
    share = fit.gb_s / (sum(ceilings) / len(ceilings)) if ceilings else None
    if share is not None and share < MEMORY_BOUND_SHARE:
        reasons.append(f"the fit reaches only {share:.0%} of the measured read ceiling: "
                       "compute or overheads limit decode")
    if fit.r2 is None:
        reasons.append(f"{fit.n_points} points cannot test the fit (R² needs 3 or more)")
    quantized = sorted({r["dtype"] for r in group if r["dtype"] not in ("f32", "f16", "bf16")})
    if quantized and reasons:
        reasons.append(f"quantized types ({', '.join(quantized)}) spend CPU on dequantization "
                       "and can turn partly compute-bound on few cores")
    notes = [] if ceilings else ["no read ceiling was measured beside these runs"]
    clean = not reasons
    verdict = (f"clearly memory-bound: decode tok/s ≈ {fit.gb_s:.1f} GB/s ÷ bytes per token"
               + (f", {share:.0%} of the measured read ceiling" if share else "")
               if clean else "not clean: " + "; ".join(reasons))
    return {"verdict": verdict, "share_of_read": share, "reasons": reasons, "notes": notes,
            "memory_bound": clean}


def prefill_rows(measurements: list[dict], models: dict, probes: list[dict]) -> list[dict]:
    """Achieved GFLOP/s of every plain prefill and its share of the measured matmul peak."""
    rows = []
    for m in filter(is_plain, measurements):
        tok = m.get("prefill_tok_s")
        model = models.get(m["model_key"])
        if not tok or not model:
            continue
        spec = ModelSpec(**model["spec"])
        flops = prefill_flops(spec, m["n_prompt"])
        seconds = m["ttft_s"]["mean"]
        peak = ceiling_beside(probes, m["seq"], m["threads"], "matmul_gflop_s")
        gflop_s = flops / seconds / 1e9
        rows.append({
            "id": m["id"], "model": m["model"], "dtype": m["dtype"], "threads": m["threads"],
            "n_prompt": m["n_prompt"], "n_gen": m["n_gen"], "seconds": m["ttft_s"],
            "tok_s": tok, "flops": flops, "gflop_s": gflop_s, "matmul_peak": peak,
            "share_of_peak": gflop_s / peak["value"] if peak["value"] else None,
            "flags": m["flags"],
        })
    return rows


PREDICTION_DTYPES = ("f32", "f16", "q8_0", "q4_0")


def prediction_table(specs: dict[str, ModelSpec]) -> dict[str, dict[str, float]]:
    """Weight bytes per decode step of every real spec (those with a source repo) per dtype."""
    from .costs import nominal_decode_n_bytes
    from .dtypes import DTYPES

    return {name: {d: nominal_decode_n_bytes(spec, DTYPES[d]) for d in PREDICTION_DTYPES}
            for name, spec in specs.items() if spec.source}


def predictions(fits: list[dict], decode: list[dict],
                table: dict[str, dict[str, float]]) -> dict:
    """Estimated decode tok/s: every spec on this machine (the fitted bandwidth) and reference
    hardware (spec-sheet bandwidth x the share of its ceiling this machine's decode reached)."""
    fit = next((f["fit"] for f in reversed(fits) if f.get("fit")), None)
    shares = [r["share_of_read"] for r in decode if r.get("share_of_read")]
    efficiency = min(sum(shares) / len(shares), 1.0) if shares else None
    gb_s = fit["gb_s"] if fit else (
        sum(r["effective_gb_s"] for r in decode) / len(decode) if decode else None)
    if gb_s is None:
        return {"estimate": True, "this_machine": [], "reference": [], "efficiency": None}
    this = [{"model": name, "dtype": dtype, "bytes_per_token": n,
             "tok_s": gb_s * 1e9 / n} for name, by_dtype in table.items()
            for dtype, n in by_dtype.items()]
    ref = []
    for hw, bw in REFERENCE_HARDWARE:
        eff = efficiency if efficiency is not None else 1.0
        for name, by_dtype in table.items():
            for dtype, n in by_dtype.items():
                ref.append({"hardware": hw, "bandwidth_gb_s": bw, "model": name, "dtype": dtype,
                            "tok_s": bw * eff * 1e9 / n})
    return {"estimate": True, "gb_s": gb_s, "efficiency": efficiency,
            "this_machine": this, "reference": ref}


def workload_balance(prefill: list[dict], decode: list[dict]) -> list[dict]:
    """Time share of prefill and decode in typical requests, from the measured rates."""
    out = []
    for model_dtype in sorted({(r["model"], r["dtype"]) for r in decode}):
        pre = [r for r in prefill if (r["model"], r["dtype"]) == model_dtype and r["n_gen"] == 0]
        dec = [r for r in decode if (r["model"], r["dtype"]) == model_dtype]
        if not pre or not dec:
            continue
        decode_tok_s = dec[0]["tok_s"]["mean"]
        for name, n_prompt, n_gen in WORKLOADS:
            nearest = min(pre, key=lambda r: abs(math.log(r["n_prompt"] / n_prompt)))
            prefill_s = n_prompt / nearest["tok_s"]["mean"]
            decode_s = n_gen / decode_tok_s
            total = prefill_s + decode_s
            out.append({"model": model_dtype[0], "dtype": model_dtype[1], "workload": name,
                        "n_prompt": n_prompt, "n_gen": n_gen, "prefill_s": prefill_s,
                        "decode_s": decode_s, "prefill_share": prefill_s / total,
                        "prefill_rate_from": nearest["n_prompt"]})
    return out


def ceilings_summary(probes: list[dict]) -> list[dict]:
    """Each probed figure before and after the measurements, and how far they moved."""
    before = next((p for p in probes if p.get("when") == "before" and p.get("result")), None)
    after = next((p for p in reversed(probes) if p.get("when") == "after" and p.get("result")),
                 None)
    rows = []
    threads = sorted({int(t) for p in (before, after) if p for t in p["result"]["threads"]})
    for t in threads:
        for key in ("read_gb_s", "copy_gb_s", "matmul_gflop_s"):
            b = before["result"]["threads"].get(str(t), {}).get(key) if before else None
            a = after["result"]["threads"].get(str(t), {}).get(key) if after else None
            rows.append({"threads": t, "what": key, "before": b, "after": a,
                         "drift": (a - b) / b if a and b else None})
    return rows


def analyze(measurements: list[dict], models: dict, probes: list[dict],
            table: dict[str, dict[str, float]]) -> dict:
    """Everything the rule-of-thumb section of a report shows."""
    decode = decode_rows(measurements, models, probes)
    prefill = prefill_rows(measurements, models, probes)
    fits = fit_verdicts(decode)
    from .levers import analyze_levers

    levers = analyze_levers(measurements, models, probes, {"decode": decode, "prefill": prefill})
    return levers | {
        "type": "analysis", "version": ANALYSIS_VERSION, "ceilings": ceilings_summary(probes),
        "probe_errors": [p["error"] for p in probes if p.get("error")],
        "decode": decode, "fits": fits, "prefill": prefill,
        "predictions": predictions(fits, decode, table),
        "workloads": workload_balance(prefill, decode),
    }
