"""`harness estimate`: the run's model of its machine applied to any spec and weight type, as
text or JSON. Pure but for reading the run (load_run)."""

from __future__ import annotations

from ..analysis.estimates import FIT_CONTEXT, HARDWARE, estimate, nominal_n_bytes, on_hardware
from ..analysis.model import kv_bytes
from ..core.dtypes import get_dtype
from ..core.errors import HarnessError
from ..core.specs import ModelSpec, resolve_spec


def hardware_list() -> list[dict]:
    """The names --hardware takes, with what each entry holds."""
    return [{"name": "this", "what": "the run's own machine (its model, fitted in the run)"}] + [
        {"name": k, "what": f"{h['name']}: {h['bandwidth_gb_s']:.0f} GB/s, "
                            f"{h['memory_gb']:.0f} GB, sourced types "
                            + ", ".join(h["figures"])} for k, h in HARDWARE.items()]


def run_estimate(analysis: dict, model: str, dtype: str, context: int, n_prompt: int,
                 threads: int | None, hardware: str) -> dict:
    """The estimate for one spec and type on the run's machine or on named hardware."""
    get_dtype(dtype, key="--dtype")
    spec = _spec(analysis, model)
    mm = analysis["machine_model"]
    here = estimate(mm, spec, dtype, threads=threads, context=context, n_prompt=n_prompt)
    if hardware == "this":
        return here | {"hardware": "this machine"}
    if hardware not in HARDWARE:
        raise HarnessError(f"unknown hardware {hardware!r}", key="--hardware",
                           fix="choose one of " + ", ".join(h["name"] for h in hardware_list())
                           + " (harness estimate --list-hardware)")
    decode_n, file_n, bytes_from = nominal_n_bytes(spec, dtype, mm["models"])
    kv_n = kv_bytes(spec, max(context, FIT_CONTEXT))
    there = on_hardware(HARDWARE[hardware], dtype, decode_n + kv_bytes(spec, context + 1),
                        file_n, kv_n)
    fits = file_n + kv_n <= HARDWARE[hardware]["memory_gb"] * 1e9
    return {"model": spec.name, "dtype": dtype, "hardware": there["hardware"],
            "context": context, "estimate": True, "bytes_from": bytes_from,
            "decode_tok_s": there["tok_s"], "decode_tok_s_ci95": None,
            "fits_in_memory": fits, "why": there.get("why"),
            "source": there.get("source"), "floored": bool(there.get("floored")),
            "prefill_tok_s": None, "prefill_tok_s_ci95": None,
            "prefill_why": "no sourced prefill figures for other hardware"}


def _spec(analysis: dict, model: str) -> ModelSpec:
    for m in analysis["machine_model"]["models"].values():
        if m.get("spec") and m["spec"]["name"] == model:
            return ModelSpec(**m["spec"])
    return resolve_spec(model)


def render_estimate(e: dict) -> str:
    """The estimate in a few lines, every figure labelled an estimate."""
    head = f"{e['model']} {e['dtype'].upper()} on {e['hardware']}"
    lines = [f"{head} (estimated; bytes from the {e['bytes_from']} tensor table)"
             if e["bytes_from"] == "file" else f"{head} (estimated; nominal bytes)"]
    if e.get("fits_in_memory") is False or e.get("decode_tok_s") is None:
        return "\n".join(lines + [f"  no estimate: {e.get('why') or e.get('decode_why')}"])
    ci = e.get("decode_tok_s_ci95")
    lines.append(f"  decode at {e['context']:,} cached tokens: {e['decode_tok_s']:.1f} tok/s"
                 + (f" (95% interval {ci[0]:.1f}–{ci[1]:.1f})" if ci else ""))
    if e.get("decode_gb_s_from"):
        lines.append(f"    bandwidth {e['decode_gb_s']:.1f} GB/s from {e['decode_gb_s_from']}; "
                     f"fixed cost {_ms(e.get('fixed_ms'))} ({e.get('fixed_from')})")
    if e.get("source"):
        lines.append(f"    from {e['source']}" + (" (capped at the sourced small-model rate)"
                                                   if e.get("floored") else ""))
    if e.get("prefill_tok_s"):
        ci = e.get("prefill_tok_s_ci95")
        lines.append(f"  prefill of {e['n_prompt']:,} tokens: {e['prefill_tok_s']:.0f} tok/s, "
                     f"{e['prefill_s']:.2f} s" + (f" (95% interval {ci[0]:.0f}–{ci[1]:.0f} "
                                                   "tok/s)" if ci else ""))
        lines.append(f"    matrices at {e['prefill_matmul_gflop_s']:.0f} GFLOP/s from "
                     f"{e['prefill_matmul_from']}; attention "
                     f"({e['attention_time_share']:.0%} of the time) at "
                     f"{e['attention_gflop_s']:.0f} GFLOP/s, flash attention's probe")
    elif e.get("prefill_why"):
        lines.append(f"  prefill: no estimate ({e['prefill_why']})")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.2f} ms"
