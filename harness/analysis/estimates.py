"""Estimates: decode and prefill of any spec and weight type on the run's machine (its model,
harness.analysis.model) and decode on reference hardware with sourced per-type figures, and
how a typical request's time splits between prefill and decode. Pure; every figure is
labelled an estimate where it shows."""

from __future__ import annotations

import math
import statistics

from ..core.costs import attention_flops, mean_decode_context
from ..core.dtypes import DTYPES
from ..core.specs import ModelSpec
from ..core.stats import center, relative_half_width
from ..weights.gguf_build import nominal_decode_n_bytes, nominal_file_n_bytes
from .model import (
    attention_rate,
    column_scale,
    combine_spreads,
    decode_attention_s,
    fixed_seconds,
    ggml_type,
    int_keys,
    kv_bytes,
    log_ci,
    output_seconds,
    prefill_seconds,
    row_width_factor,
)
from .phases import config_key

# Hardware with llama.cpp decode figures measured per weight type (llama-bench tg, a 7B
# llama: file sizes in GiB as llama-bench prints them). A figure's efficiency is
# tok/s x size over the spec-sheet bandwidth; an estimate for another model of that type is
# bandwidth x efficiency / its bytes per token, never faster than the sourced per-token floor
# (a small model's rate on that device: launches and synchronization bound it, not bytes).
HARDWARE = {
    "apple-m2-ultra": {
        "name": "Apple M2 Ultra (76-core GPU, Metal)", "bandwidth_gb_s": 800.0,
        "memory_gb": 192.0, "memory_note": "the largest of its 64, 128 and 192 GB configurations",
        "figures": {
            "f16": (40.53, 12.55, "llama.cpp PR #2891 (2023-08-30), llama 7B F16 tg64"),
            "q8_0": (61.41, 6.67, "llama.cpp PR #2891 (2023-08-30), llama 7B Q8_0 tg64"),
            "q4_0": (88.54, 3.56, "llama.cpp PR #2917 (2023-08-30, master), llama 7B Q4_0 "
                                  "tg128"),
        },
        "floor": None,
    },
    "nvidia-rtx-4090": {
        "name": "NVIDIA RTX 4090 (24 GB GDDR6X, CUDA)", "bandwidth_gb_s": 1008.0,
        "memory_gb": 24.0, "memory_note": "",
        "figures": {
            "f16": (61.03, 12.55, "llama.cpp PR #4766 (2024-01-10), llama 7B F16 tg128"),
            "q8_0": (98.13, 6.67, "llama.cpp PR #4766 (2024-01-10), llama 7B Q8_0 tg128"),
        },
        "floor": (762.37, "geerlingguy/ai-benchmarks issue #43 (2025-12-09), llama 1B Q4_K_M "
                          "(636 MiB) tg128 on Vulkan"),
    },
}
GIB = 1 << 30
# Without a sourced small-model rate, no estimate for a model under this share of the bytes
# the source measured: there, per-token overheads rather than bandwidth set the speed.
SMALLEST_SHARE = 0.25
# Typical requests: (name, prompt tokens, generated tokens).
WORKLOADS = [
    ("chat", 500, 300),
    ("RAG, short context", 3000, 300),
    ("RAG, long context", 10000, 300),
    ("classification", 500, 1),
    ("long-form generation", 200, 2000),
]
FIT_CONTEXT = 4096  # a model fits where its weights and a cache of this many tokens do
ESTIMATE_MODELS = ("llama-3.1-8b", "qwen2.5-7b", "mixtral-8x7b", "qwen3-30b-a3b")
ESTIMATE_DTYPES = ("f16", "q8_0", "q4_0")


def efficiency(hw: dict, dtype: str) -> tuple[float, str] | None:
    """The share of spec-sheet bandwidth a sourced figure of this type reached."""
    figure = hw["figures"].get(dtype)
    if figure is None:
        return None
    tok_s, size_gib, source = figure
    return tok_s * size_gib * GIB / 1e9 / hw["bandwidth_gb_s"], source


def on_hardware(hw: dict, dtype: str, decode_n_bytes: float, file_n_bytes: float,
                kv_fit_n_bytes: float) -> dict:
    """Estimated decode tok/s of a model on reference hardware, or why there is none."""
    out = {"hardware": hw["name"], "dtype": dtype, "memory_gb": hw["memory_gb"]}
    if file_n_bytes + kv_fit_n_bytes > hw["memory_gb"] * 1e9:
        return out | {"tok_s": None, "why": f"does not fit in {hw['memory_gb']:.0f} GB"}
    eff = efficiency(hw, dtype)
    if eff is None:
        return out | {"tok_s": None, "why": f"no sourced {dtype.upper()} figure"}
    smallest = SMALLEST_SHARE * hw["figures"][dtype][1] * GIB
    if hw["floor"] is None and decode_n_bytes < smallest:
        return out | {"tok_s": None, "why": f"no estimate under {smallest / 1e9:.1f} GB"}
    tok_s = hw["bandwidth_gb_s"] * 1e9 * eff[0] / decode_n_bytes
    out |= {"tok_s": tok_s, "efficiency": eff[0], "source": eff[1]}
    if hw["floor"] and tok_s > hw["floor"][0]:
        out |= {"tok_s": hw["floor"][0], "floored": True, "floor_source": hw["floor"][1]}
    return out


def nominal_n_bytes(spec: ModelSpec, dtype: str, models: dict) -> tuple[float, float, str]:
    """(bytes per decode step, bytes of the whole file, where from): the run's own file where
    it built one, every matrix at the type's nominal bits otherwise."""
    model = models.get(f"{spec.name}|{dtype}")
    if model and model.get("decode_weight_n_bytes"):
        return model["decode_weight_n_bytes"], model["weights_n_bytes"], "file"
    return (nominal_decode_n_bytes(spec, DTYPES[dtype]), nominal_file_n_bytes(spec, DTYPES[dtype]),
            "nominal")


def estimate(mm: dict, spec: ModelSpec, dtype: str, *, threads: int | None = None,
             context: int = 0, n_prompt: int = 512) -> dict:
    """Decode tok/s at `context` cached tokens and prefill of `n_prompt` tokens for any spec
    and weight type on the run's machine, from its model (harness.analysis.model), with 95%
    intervals and where each part came from; or why it cannot (it does not fit in memory)."""
    ceil, fixed = int_keys(mm["ceilings"]), int_keys(mm["fixed"])
    threads = threads or max(ceil, default=None)
    decode_n, file_n, bytes_from = nominal_n_bytes(spec, dtype, mm["models"])
    fit_n = file_n + kv_bytes(spec, max(context, FIT_CONTEXT))
    out = {"model": spec.name, "dtype": dtype, "threads": threads, "context": context,
           "n_prompt": n_prompt, "estimate": True, "bytes_from": bytes_from,
           "decode_weight_n_bytes": decode_n, "file_n_bytes": file_n,
           "memory_needed_n_bytes": fit_n, "ram_n_bytes": mm["ram_bytes"],
           "fits_in_memory": None if not mm["ram_bytes"] else fit_n <= mm["ram_bytes"]}
    if threads not in ceil:
        return out | {"why": "the run probed no ceilings"} | _no_rates()
    if out["fits_in_memory"] is False:
        return out | {"why": f"does not fit in memory: {fit_n / 1e9:.1f} GB needed (weights "
                             f"and a {max(context, FIT_CONTEXT):,}-token cache), "
                             f"{mm['ram_bytes'] / 1e9:.1f} GB here"} | _no_rates()
    return out | _decode_estimate(mm, ceil[threads], fixed, threads, spec, dtype, decode_n,
                                  context) | _prefill_estimate(mm, ceil[threads], threads,
                                                               spec, dtype, n_prompt)


def _no_rates() -> dict:
    return {"decode_tok_s": None, "decode_tok_s_ci95": None, "prefill_tok_s": None,
            "prefill_tok_s_ci95": None}


def _decode_estimate(mm: dict, ceil: dict, fixed: dict, threads: int, spec: ModelSpec,
                     dtype: str, weight_n: float, context: int) -> dict:
    measured = next((d for d in mm["decode"] if d["threads"] == threads
                     and d["dtype"] == dtype and d.get("gb_s")), None)
    stream = ceil["stream"].get(ggml_type(dtype))
    width = row_width_factor(spec, dtype, ceil, threads)
    if measured:
        gb_s = center(measured["gb_s"]) * width / measured.get("row_width_factor", 1.0)
        spread = relative_half_width(measured["gb_s"])
        source = (f"{dtype} decode measured in the run ({', '.join(measured['models'])}), "
                  "fixed cost taken out, carried to this model's row widths")
    elif stream:
        gb_s, spread = stream["value"] * width, stream["spread"]
        source = (f"{ggml_type(dtype)}'s streaming ceiling at this model's row widths (the "
                  f"run did not decode {dtype})")
    else:
        return {"decode_tok_s": None, "decode_tok_s_ci95": None,
                "decode_why": f"the run neither decoded {dtype} nor probed its streaming "
                              "ceiling"}
    kv_stream = ceil["stream"].get("f16") or {"value": gb_s, "spread": spread}
    fixed_s, fixed_from = fixed_seconds(fixed, threads, spec)
    kv_n = kv_bytes(spec, context + 1)
    weights_s = weight_n / (gb_s * 1e9)
    # attention over the cache: the slower of its bytes and its arithmetic (a roofline)
    kv_s = max(kv_n / (kv_stream["value"] * 1e9),
               decode_attention_s({threads: ceil}, threads, spec, context + 1))
    seconds = (fixed_s or 0.0) + weights_s + kv_s
    # each part within its own interval: the weights' bandwidth, the cache's yardstick
    s_w, s_kv = spread, kv_stream.get("spread")
    ci = None if s_w is None else [
        1 / ((fixed_s or 0) + weights_s * (1 + s_w) + kv_s * (1 + (s_kv or 0))),
        1 / ((fixed_s or 0) + weights_s / (1 + s_w) + kv_s / (1 + (s_kv or 0)))]
    return {"decode_tok_s": 1 / seconds, "decode_tok_s_ci95": ci, "decode_gb_s": gb_s,
            "decode_gb_s_from": source, "fixed_ms": None if fixed_s is None else fixed_s * 1e3,
            "fixed_from": fixed_from, "kv_n_bytes": kv_n,
            "decode_parts_s": {"fixed": fixed_s, "weights": weights_s, "attention": kv_s}}


def _prefill_estimate(mm: dict, ceil: dict, threads: int, spec: ModelSpec, dtype: str,
                      n_prompt: int) -> dict:
    attn_gflop_s, shape = attention_rate({threads: ceil}, threads, spec)
    fits = [p for p in mm["prefill"] if p["threads"] == threads
            and p["dtype"] == dtype]
    peak = ceil["compute"].get(ggml_type(dtype))
    if fits:
        mm_gflop_s = statistics.median(p["matmul_gflop_s"] for p in fits)
        source, spread = f"{dtype} prefill measured in the run, attention taken out", None
    elif peak:
        mm_gflop_s, spread = peak["value"], peak["spread"]
        source = f"{ggml_type(dtype)}'s compute peak (the run did not prefill {dtype})"
    else:
        return {"prefill_tok_s": None, "prefill_tok_s_ci95": None,
                "prefill_why": f"the run neither prefilled {dtype} nor probed its peak"}
    if not attn_gflop_s:
        return {"prefill_tok_s": None, "prefill_tok_s_ci95": None, "prefill_why": shape}
    attention = attention_flops(spec, n_prompt)
    n_ubatch = fits[0]["n_ubatch"] if fits else 512
    seconds = prefill_seconds(spec, n_prompt, n_ubatch, mm_gflop_s, attn_gflop_s,
                              column_scale({threads: ceil}, threads, dtype),
                              output_seconds(spec, dtype, {threads: ceil}, threads))
    ci = log_ci(n_prompt / seconds, spread)
    return {"prefill_tok_s": n_prompt / seconds, "prefill_tok_s_ci95": ci,
            "prefill_s": seconds, "prefill_matmul_gflop_s": mm_gflop_s,
            "prefill_matmul_from": source, "attention_gflop_s": attn_gflop_s,
            "attention_shape": shape,
            "attention_time_share": attention / (attn_gflop_s * 1e9) / seconds}


def predictions(mm: dict, specs: dict[str, ModelSpec], run_models: list[str],
                run_dtypes: list[str]) -> dict:
    """The estimates table: the run's models at its types and a few common sizes at the
    common types, on this machine (from its model) and on the reference hardware."""
    names = list(dict.fromkeys([*run_models, *(m for m in ESTIMATE_MODELS if m in specs)]))
    dtypes = list(dict.fromkeys([*run_dtypes, *ESTIMATE_DTYPES]))
    rows = []
    for name in names:
        spec = specs.get(name)
        if spec is None:
            continue
        for dtype in dtypes:
            if dtype not in DTYPES and f"{name}|{dtype}" not in mm["models"]:
                continue  # a given file's own type ("file", "real", "twin", "built"): one model
            here = estimate(mm, spec, dtype, context=0)
            kv_fit = kv_bytes(spec, FIT_CONTEXT)
            rows.append(here | {"moe": spec.is_moe, "measured": any(
                d["dtype"] == dtype and name in d["models"] for d in mm["decode"]),
                "elsewhere": {k: on_hardware(hw, dtype, here["decode_weight_n_bytes"],
                                             here["file_n_bytes"], kv_fit)
                              for k, hw in HARDWARE.items()}})
    return {"estimate": True, "rows": rows,
            "hardware": {k: {f: hw[f] for f in ("name", "bandwidth_gb_s", "memory_gb",
                                                "memory_note")} for k, hw in HARDWARE.items()}}


# --- workloads -----------------------------------------------------------------------------

def workload_balance(prefill: list[dict], decode: list[dict], kv_rows: list[dict],
                     mm: dict) -> list[dict]:
    """Time share of prefill and decode in typical requests, per model, weight type and thread
    count: each phase from the measurement nearest the workload (the prompt length, the
    context depth), carried to the workload's own length by the run's model where they differ
    (marked modelled)."""
    out = []
    for key in sorted({(r["model"], r["dtype"], r["threads"]) for r in decode}):
        pre = [r for r in prefill if config_key(r) == key and r["n_gen"] == 0]
        dec = [(mean_decode_context(r["n_prompt"], r["n_gen"]), r["tok_s"])
               for r in decode if config_key(r) == key]
        dec += [(r["depth"] + mean_decode_context(0, r["n_gen"]), r["tok_s"])
                for r in kv_rows if config_key(r) == key and r["kv_type"] == "f16"]
        model = mm["models"].get(f"{key[0]}|{key[1]}")
        if not pre or not dec or not model:
            continue
        spec = ModelSpec(**model["spec"])
        fit = next((p for p in mm["prefill"] if (p["model"], p["dtype"], p["threads"])
                    == key), None)
        for name, n_prompt, n_gen in WORKLOADS:
            out.append(_workload(mm, spec, key, (name, n_prompt, n_gen), pre, dec, fit))
    return out


def _workload(mm: dict, spec: ModelSpec, key: tuple, workload: tuple, pre: list[dict],
              dec: list[tuple[float, dict]], fit: dict | None) -> dict:
    name, n_prompt, n_gen = workload
    near = min(pre, key=lambda r: abs(math.log(r["n_prompt"] / n_prompt)))
    modelled = []
    prefill_s = near["seconds"] * n_prompt / near["n_prompt"]
    if near["n_prompt"] != n_prompt:
        if fit:
            rel = column_scale(int_keys(mm["ceilings"]), key[2], key[1])
            prefill_s = near["seconds"] * (_prefill_s(spec, fit, n_prompt, rel)
                                           / _prefill_s(spec, fit, near["n_prompt"], rel))
            modelled.append(f"prefill of {n_prompt:,} tokens modelled from "
                            f"{near['n_prompt']:,} (matrices and attention)")
        else:
            modelled.append(f"prefill rate of {near['n_prompt']:,} tokens applied to "
                            f"{n_prompt:,} (no attention probe to model it)")
    context = n_prompt + (n_gen + 1) / 2
    depth, rate = min(dec, key=lambda d: abs(math.log(d[0] / context)))
    # the first generated token comes from the prefill's logits: n_gen - 1 decode steps
    decode_s = (n_gen - 1) / center(rate)
    if abs(math.log(depth / context)) > math.log(1.5):
        here = estimate(mm, spec, key[1], threads=key[2], context=int(context))
        there = estimate(mm, spec, key[1], threads=key[2], context=int(depth))
        if here.get("decode_tok_s") and there.get("decode_tok_s"):
            decode_s *= there["decode_tok_s"] / here["decode_tok_s"]
            modelled.append(f"decode at about {context:,.0f} cached tokens modelled from "
                            f"{depth:,.0f}")
        else:
            modelled.append(f"decode rate at {depth:,.0f} cached tokens applied to about "
                            f"{context:,.0f}")
    share = prefill_s / (prefill_s + decode_s)
    spread = combine_spreads(relative_half_width(near["tok_s"]), relative_half_width(rate))
    return {"model": key[0], "dtype": key[1], "threads": key[2], "workload": name,
            "n_prompt": n_prompt, "n_gen": n_gen, "prefill_s": prefill_s, "decode_s": decode_s,
            "prefill_share": share, "prefill_share_ci": _share_ci(prefill_s, decode_s, spread),
            "prefill_rate_from": near["n_prompt"], "decode_rate_at": depth,
            "modelled": modelled}


def _prefill_s(spec: ModelSpec, fit: dict, n_prompt: int, rel) -> float:
    return prefill_seconds(spec, n_prompt, fit["n_ubatch"], fit["matmul_gflop_s"],
                           fit["attention_gflop_s"], rel, fit.get("output_s", 0.0))


def _share_ci(prefill_s: float, decode_s: float, spread: float | None) -> list[float] | None:
    """The prefill share's interval when each phase's time may be off by its spread."""
    if spread is None:
        return None
    k = 1 + spread
    return [prefill_s / k / (prefill_s / k + decode_s * k),
            prefill_s * k / (prefill_s * k + decode_s / k)]
