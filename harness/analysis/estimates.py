"""Estimates: decode tok/s of every spec on this machine and on reference hardware, and how a
typical request's time splits between prefill and decode. Pure; every figure is labelled an
estimate where it shows."""

from __future__ import annotations

import math

from ..core.costs import mean_decode_context
from ..core.dtypes import DTYPES
from ..core.specs import ModelSpec
from ..core.stats import center
from ..weights.gguf_build import nominal_decode_n_bytes
from .phases import config_key

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


def moe_names(specs: dict[str, ModelSpec]) -> list[str]:
    """The real specs that are mixtures of experts (their estimates use active bytes)."""
    return sorted(name for name, spec in specs.items() if spec.source and spec.is_moe)


def predictions(fits: list[dict], decode: list[dict], models: dict,
                table: dict[str, dict[str, float]], moe: list[str] | None = None) -> dict:
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
            "moe_models": list(moe or []),
            "reference": ref, "bands": {k: list(v) for k, v in BANDS.items()},
            "share_of_read": sorted(shares)[len(shares) // 2] if shares else None}


# --- workloads -----------------------------------------------------------------------------

def workload_balance(prefill: list[dict], decode: list[dict], kv_rows: list[dict]) -> list[dict]:
    """Time share of prefill and decode in typical requests, from rates measured on the same
    model, weight type and thread count: prefill at the nearest measured prompt length, decode
    at the nearest measured context depth; anything beyond the measured range is marked."""
    out = []
    for key in sorted({(r["model"], r["dtype"], r["threads"]) for r in decode}):
        pre = [r for r in prefill if config_key(r) == key and r["n_gen"] == 0]
        dec = [(mean_decode_context(r["n_prompt"], r["n_gen"]), center(r["tok_s"]))
               for r in decode if config_key(r) == key]
        dec += [(r["depth"] + mean_decode_context(0, r["n_gen"]), center(r["tok_s"]))
                for r in kv_rows if config_key(r) == key and r["kv_type"] == "f16"]
        if not pre or not dec:
            continue
        for name, n_prompt, n_gen in WORKLOADS:
            out.append(_workload(key, name, n_prompt, n_gen, pre, dec))
    return out


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


