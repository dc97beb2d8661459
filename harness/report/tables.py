"""Pure renderers for the console: model specs and the environment."""

from __future__ import annotations

from tabulate import tabulate

from ..core.costs import (
    active_expert_fraction,
    decode_weight_n_bytes,
    kv_n_bytes_per_token,
    weights_n_bytes,
)
from ..core.dtypes import DTYPES
from ..core.specs import ModelSpec, n_active_params, n_params, tensor_plan
from ..core.stats import center
from ..weights.gguf_build import file_n_bytes, table_from_plan

GIB = 2**30
# Quantized sizes are nominal (every matrix at the base type); real recipes mix in other types.
NOMINAL_DTYPES = ("q8_0", "q4_0")


def model_row(spec: ModelSpec) -> dict:
    """The numbers `harness models` shows for one spec."""
    f32 = DTYPES["f32"]
    n = n_params(spec)
    row = {
        "name": spec.name, "architecture": spec.architecture,
        "layers": spec.num_hidden_layers, "hidden": spec.hidden_size,
        "heads": spec.num_attention_heads, "kv_heads": spec.num_key_value_heads,
        "n_params": n, "n_active_params": n_active_params(spec),
        "experts": ({"n_experts": spec.num_experts, "per_token": spec.num_experts_per_tok,
                     "width": spec.expert_width} if spec.is_moe else None),
        "params_by_role": params_by_role(spec),
        "tied_embeddings": spec.tie_word_embeddings,
        "weights_n_bytes": {d: weights_n_bytes(table_from_plan(spec, DTYPES[d]))
                            for d in ("f32", "f16", "bf16")},
        "file_n_bytes": {d: file_n_bytes(spec, DTYPES[d]) for d in ("f32", "f16", "bf16")},
        "nominal_n_bytes": {d: int(n * DTYPES[d].bits_per_weight / 8) for d in NOMINAL_DTYPES},
        "kv_n_bytes_per_token_f16": int(kv_n_bytes_per_token(spec)),
        "decode_weight_n_bytes_f32": decode_weight_n_bytes(table_from_plan(spec, f32),
                                                           active_expert_fraction(spec)),
        "source": spec.source,
    }
    return row


def params_by_role(spec: ModelSpec) -> dict[str, int]:
    """Parameters per tensor role (embedding, attention, ffn, router, expert, shared, ...):
    which tensors are routed experts and which every token uses."""
    out: dict[str, int] = {}
    for t in tensor_plan(spec):
        out[t.role] = out.get(t.role, 0) + t.n_elements
    return out


def models_rows(specs: dict[str, ModelSpec]) -> list[dict]:
    return [model_row(s) for s in specs.values()]


def render_models_table(rows: list[dict]) -> str:
    headers = ["model", "arch", "layers", "hidden", "heads/kv", "experts", "params",
               "active params", "F32", "F16", "Q8_0*", "Q4_0*", "KV/token (F16)",
               "decode reads/token (F32)"]
    body = [[r["name"], r["architecture"], r["layers"], r["hidden"],
             f"{r['heads']}/{r['kv_heads']}",
             f"{r['experts']['per_token']} of {r['experts']['n_experts']}" if r["experts"]
             else "-", f"{r['n_params']:,}", f"{r['n_active_params']:,}",
             fmt_bytes(r["weights_n_bytes"]["f32"]), fmt_bytes(r["weights_n_bytes"]["f16"]),
             fmt_bytes(r["nominal_n_bytes"]["q8_0"]), fmt_bytes(r["nominal_n_bytes"]["q4_0"]),
             fmt_bytes(r["kv_n_bytes_per_token_f16"]),
             fmt_bytes(r["decode_weight_n_bytes_f32"])] for r in rows]
    note = ("Sizes are tensor bytes (llama-bench's model_size); the file adds a few MB of "
            "metadata.\n* nominal: every matrix at the base type; llama.cpp's recipes keep "
            "some tensors at other types.\nDecode reads every weight once per token, the token "
            "embedding as one row unless tied to the output, and of a mixture of experts only "
            "the k experts each token is routed to (active params; the file holds all E).")
    return tabulate(body, headers, tablefmt="simple", disable_numparse=True) + "\n" + note


def fmt_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _bytes_or_missing(n_bytes: int | None, unit: int, name: str) -> str:
    return f"{n_bytes / unit:.1f} {name}" if n_bytes else "not reported"


def render_env(info: dict) -> str:
    """`harness env`: every figure, and "not reported" where this platform lacks one."""
    llama = info.get("llama", {})
    freq = info.get("cpu_freq_mhz") or {}
    rows = [
        ("CPU", info.get("cpu_model") or "not reported"),
        ("cores", f"{info['physical_cores']} physical, {info['logical_cores']} logical"),
        ("clock", ", ".join(f"{k} {v:.0f} MHz" for k, v in freq.items()) or "not reported"),
        ("CPU flags", f"{len(info.get('cpu_flags') or [])} (py-cpuinfo; `--json` lists them)"
         if info.get("cpu_flags") else "not reported"),
        ("RAM", f"{_bytes_or_missing(info.get('ram_total_bytes'), GIB, 'GiB')} total, "
                f"{_bytes_or_missing(info.get('ram_available_bytes'), GIB, 'GiB')} available"),
        ("last-level cache", _bytes_or_missing(info.get("last_level_cache_bytes"), 2**20,
                                               "MiB")),
        ("OS", info["os"]),
        ("Python", info["python"]),
        ("harness", info["harness"]),
        ("llama-cpp-python", llama.get("llama_cpp_python")),
        ("llama.cpp commit", f"{llama.get('ggml_commit')} (ggml {llama.get('ggml_version')})"),
        ("llama.cpp system info", llama.get("system_info")),
        ("gguf", info["gguf"]),
        ("numpy", info["numpy"]),
        ("psutil", info.get("psutil")),
    ]
    return tabulate(rows, tablefmt="plain")


def _with_ci(summary: dict | None, digits: int = 2) -> str:
    """median (95% CI of the median), or the median alone when there is no interval."""
    if not summary or not summary.get("n"):
        return ""
    ci = summary.get("median_ci95")
    if ci is None:
        return f"{center(summary):.{digits}f} (n={summary['n']})"
    return f"{center(summary):.{digits}f} ({ci[0]:.{digits}f}–{ci[1]:.{digits}f})"


def repetitions_label(policy, target: str = "contrasts") -> str:
    """5 repetitions, or auto: until its contrasts' 95% intervals are within ±3% (6–200)."""
    if not policy.auto:
        return f"{policy.repetitions} repetitions"
    what = ("its contrasts' 95% intervals are" if target == "contrasts" else
            "the 95% interval of its median is")
    return (f"auto repetitions: until {what} within ±{policy.target_ci:.0%} "
            f"({policy.min_repetitions}–{policy.max_repetitions})")


def round_line(progress: dict) -> str:
    """One line per round: how many cells go on, and the widest interval left."""
    widest = progress["widest_ci"]
    what = "contrast" if progress.get("target", "contrasts") == "contrasts" else "CI"
    ci = ("" if not progress["active"] or progress["widest_id"] is None else
          f"; widest {what} left ±{widest:.1%} ({progress['widest_id']})"
          if widest != float("inf")
          else f"; {progress['widest_id']} has too few rounds for a 95% interval yet")
    return (f"round {progress['round'] + 1}: {progress['finished']} cell(s) finished, "
            f"{progress['active']} go on{ci} [{progress['elapsed_s']:.0f} s]")


def _pct(x: float | None) -> str:
    return f"{x:.0%}" if x is not None else "missing"


def _num(x: float | None, digits: int = 1) -> str:
    return f"{x:.{digits}f}" if x is not None else "missing"


def render_probe(result: dict) -> str:
    """numpy read and copy, then ggml's streaming and compute figures per weight type."""
    threads = sorted(result["threads"].items(), key=lambda kv: int(kv[0]))
    text = tabulate([[t, _num(v["read_gb_s"]), _num(v.get("copy_gb_s"))] for t, v in threads],
                    ["threads", "numpy read GB/s", "numpy copy GB/s"], tablefmt="simple",
                    disable_numparse=True)
    body = [[t, dtype, e.get("layout", ""), _num(e.get("stream_gb_s")),
             _num(e.get("compute_gflop_s")), e.get("error", "")]
            for t, v in threads for dtype, e in (v.get("ggml") or {}).items()]
    text += "\n\n" + tabulate(body, ["threads", "weights", "layout", "ggml streaming GB/s",
                                     "ggml compute GFLOP/s", "missing because"],
                               tablefmt="simple", disable_numparse=True)
    notes = [f"numpy: best of {result['passes']['read']} passes over "
             f"{result['array_n_bytes'] / 2**20:.0f} MiB arrays (STREAM conventions: copy "
             "counts bytes read + written); the machine's plain memory figures.",
             f"ggml: llama.cpp's own kernels, best of {result['passes']['stream']} passes; "
             f"streaming = a matrix-vector product over {result['stream_n_bytes'] / 2**20:.0f} "
             "MiB of weights (GB/s of weight bytes), compute = weights times a 512-column "
             "activation (GFLOP/s). layout CPU_REPACK: weights repacked as llama.cpp does at "
             "load for this type on this CPU; CPU: the plain layout."] + result["notes"]
    return text + "\n" + "\n".join(notes)
