"""The levers beyond the two phases: quantization, KV cache depth and type, batching, threads
and prefix caching. Pure functions of the stored records, like the rest of the analysis."""

from __future__ import annotations

from itertools import groupby

from .ceilings import combined_ceiling, is_plain, rep_rates, span
from .costs import (
    decode_n_bytes_per_token,
    kv_n_bytes_per_token,
    matmul_params_per_token,
    mean_decode_context,
)
from .specs import ModelSpec
from .stats import center, summarize

KNEE_TOLERANCE = 0.02  # the knee: the fewest threads within 2% of the best
KV_MEMORY_USERS = (1, 8, 32, 128)
KV_MEMORY_CONTEXTS = (2048, 8192, 32768, 131072)


def _groups(records: list[dict], key) -> list[list[dict]]:
    ordered = sorted(records, key=lambda r: str(key(r)))
    return [list(g) for _, g in groupby(ordered, key=lambda r: str(key(r)))]


def _mean(summary: dict | None) -> float | None:
    """The figure every lever compares: the median per-repetition value."""
    return center(summary)


def _spec(models: dict, m: dict) -> ModelSpec:
    return ModelSpec(**models[m["model_key"]]["spec"])


# --- quantization ------------------------------------------------------------------------

def composition(model: dict) -> dict:
    """What a file really holds: bits per weight and each tensor type's share of the weights."""
    params = model.get("tensor_type_n_params") or {}
    n_bytes = model["tensor_type_n_bytes"]
    total_params = sum(params.values())
    shares = ({t: n / total_params for t, n in sorted(params.items(), key=lambda kv: -kv[1])}
              if total_params else {})
    # Runs recorded before the per-type counts existed: llama.cpp's own parameter count.
    n_params = total_params or model.get("n_params")
    return {"bits_per_weight": 8 * sum(n_bytes.values()) / n_params if n_params else None,
            "params_share": shares,
            "bytes_share": {t: n / sum(n_bytes.values()) for t, n in n_bytes.items()}}


def quant_rows(measurements: list[dict], models: dict) -> list[dict]:
    """Per model and thread count with two or more dtypes: bytes, speeds and speed-ups."""
    plain = [m for m in measurements if is_plain(m) and m["model_key"] in models]
    rows = []
    for group in _groups(plain, lambda m: (m["model"], m["threads"])):
        by_dtype: dict[str, dict] = {}
        for m in group:
            row = by_dtype.setdefault(m["dtype"], {"model": m["model"], "dtype": m["dtype"],
                                                   "threads": m["threads"]})
            if m["n_gen"] and "decode_tok_s" not in row:
                row["decode_tok_s"], row["_decode"] = m["decode_tok_s"], m
            if m["n_gen"] == 0 and m.get("prefill_tok_s") and "prefill_tok_s" not in row:
                row["prefill_tok_s"], row["n_prompt"] = m["prefill_tok_s"], m["n_prompt"]
                row["_prefill"] = m
        if len(by_dtype) < 2:
            continue
        for dtype, row in by_dtype.items():
            model = models[f"{row['model']}|{dtype}"]
            row |= {"file_n_bytes": model["weights_n_bytes"],
                    "bytes_per_token": model["decode_weight_n_bytes"]} | composition(model)
        rows += _speedups(list(by_dtype.values()))
    return rows


def _speedups(rows: list[dict]) -> list[dict]:
    """Against the widest type present (F32 normally): byte reduction and speed-ups."""
    base = max(rows, key=lambda r: r["bytes_per_token"])
    for r in rows:
        r["baseline"] = base["dtype"]
        r["byte_reduction"] = base["bytes_per_token"] / r["bytes_per_token"]
        for phase in ("decode", "prefill"):
            ours, theirs = r.get(f"_{phase}"), base.get(f"_{phase}")
            ratio = round_ratio(ours, theirs, phase) if ours and theirs else None
            r[f"{phase}_speedup"] = center(ratio)
            r[f"{phase}_speedup_ci"] = ratio
        r["speedup_per_byte_reduction"] = (r["decode_speedup"] / r["byte_reduction"]
                                           if r["decode_speedup"] else None)
    for r in rows:
        r.pop("_decode", None)
        r.pop("_prefill", None)
    return sorted(rows, key=lambda r: -r["bytes_per_token"])


def round_ratio(a: dict, b: dict, phase: str) -> dict | None:
    """a's rate ÷ b's, round by round where both ran a repetition (drift between rounds
    cancels), summarized with its own CI; for runs without rounds, the ratio of medians."""
    pairs = {}
    for m, side in ((a, 0), (b, 1)):
        for rnd, rate in zip((m.get("samples") or {}).get("rounds") or [], rep_rates(m, phase),
                             strict=False):
            if rnd is not None and rate:
                pairs.setdefault(rnd, [None, None])[side] = rate
    ratios = [x / y for _, (x, y) in sorted(pairs.items()) if x and y]
    if len(ratios) >= 2:
        return summarize(ratios) | {"paired": True}
    ours, theirs = center(a.get(f"{phase}_tok_s")), center(b.get(f"{phase}_tok_s"))
    if not ours or not theirs:
        return None
    return {"n": 1, "median": ours / theirs, "mean": ours / theirs, "paired": False}


# --- KV cache depth and type -------------------------------------------------------------

def kv_depth_rows(measurements: list[dict], models: dict) -> list[dict]:
    """Decode at each depth with its measured slowdown (against the paired depth-0 baseline)
    and the slowdown its bytes predict. Only groups that vary depth, or use a non-F16 cache,
    are shown."""
    singles = [m for m in measurements if m.get("kind", "single") == "single" and m["n_gen"]
               and m.get("decode_tok_s") and m["model_key"] in models]
    rows = []
    for group in _groups(singles, lambda m: (m["model_key"], m["threads"], m.get("kv_type", "f16"),
                                             m["n_prompt"], m["n_gen"])):
        depths = {m.get("depth", 0) for m in group}
        if len(depths) < 2 and group[0].get("kv_type", "f16") == "f16":
            continue
        group.sort(key=lambda m: m.get("depth", 0))
        base = group[0]
        for m in group:
            rows.append(_kv_row(m, base, models))
    return rows


def _kv_row(m: dict, base: dict, models: dict) -> dict:
    model, kv = models[m["model_key"]], m.get("kv_type", "f16")
    per_token = kv_n_bytes_per_token(_spec(models, m), kv, kv)

    def context(r: dict) -> float:
        return r.get("depth", 0) + mean_decode_context(r["n_prompt"], r["n_gen"])

    def step_n_bytes(r: dict) -> float:
        return decode_n_bytes_per_token(model["decode_weight_n_bytes"], per_token, context(r))

    ms, base_ms = _mean(m["decode_ms_per_token"]), _mean(base["decode_ms_per_token"])
    paired = m.get("paired_slowdown")
    if paired:  # the same decode at depth 0, timed beside each repetition
        measured, against = paired, "paired depth-0 baseline"
    elif not m.get("depth"):
        measured, against = {"median": 1.0, "mean": 1.0, "n": 1}, "itself"
    else:  # a run from before the paired baseline existed: another measurement at depth 0
        measured = ({"median": ms / base_ms, "mean": ms / base_ms, "n": 1}
                    if ms and base_ms else None)
        against = f"the depth-{base.get('depth', 0)} measurement"
    return {"model": m["model"], "dtype": m["dtype"], "threads": m["threads"], "kv_type": kv,
            "depth": m.get("depth", 0), "n_gen": m["n_gen"], "tok_s": m["decode_tok_s"],
            "baseline_tok_s": m.get("baseline_decode_tok_s"),
            "ms_per_token": m["decode_ms_per_token"], "kv_n_bytes_per_token": per_token,
            "kv_n_bytes": per_token * context(m), "bytes_per_token": step_n_bytes(m),
            "slowdown_against": against, "measured_slowdown": measured,
            "predicted_slowdown": step_n_bytes(m) / step_n_bytes(m | {"depth": 0}),
            "flags": m["flags"], "noise": m["noise"]}


def kv_memory_rows(kv_rows: list[dict], models: dict) -> list[dict]:
    """Weights plus every user's KV cache at a context, for each model and KV type measured."""
    rows = []
    for model_key, kv in sorted({(f"{r['model']}|{r['dtype']}", r["kv_type"]) for r in kv_rows}):
        model = models[model_key]
        spec = ModelSpec(**model["spec"])
        per_token = kv_n_bytes_per_token(spec, kv, kv)
        for context in KV_MEMORY_CONTEXTS:
            if context > spec.max_position_embeddings:
                continue
            row = {"model": model["model"], "dtype": model["dtype"], "kv_type": kv,
                   "context": context, "kv_per_user": per_token * context}
            for users in KV_MEMORY_USERS:
                row[f"users_{users}"] = model["weights_n_bytes"] + users * per_token * context
            rows.append(row)
    return rows


# --- batching ----------------------------------------------------------------------------

def batching_rows(measurements: list[dict], models: dict, probes: list[dict]) -> list[dict]:
    """Aggregate and per-sequence decode at each batch size, beside the roofline bound."""
    decodes = [m for m in measurements if m["n_gen"] and m.get("decode_tok_s")
               and m.get("kind", "single") in ("single", "batched") and not m.get("depth")
               and m.get("kv_type", "f16") == "f16" and m["model_key"] in models]
    rows = []
    for group in _groups(decodes, lambda m: (m["model_key"], m["threads"], m["n_prompt"],
                                             m["n_gen"])):
        if max(m.get("parallel", 1) for m in group) < 2:
            continue
        group.sort(key=lambda m: m.get("parallel", 1))
        base = group[0] if group[0].get("parallel", 1) == 1 else None
        rows += [_batch_row(m, base, models, probes) for m in group]
    return rows


def _batch_row(m: dict, base: dict | None, models: dict, probes: list[dict]) -> dict:
    model, b = models[m["model_key"]], m.get("parallel", 1)
    spec = _spec(models, m)
    weight_n_bytes = model["decode_weight_n_bytes"]
    bw = combined_ceiling(model.get("decode_type_n_bytes"), probes, span(m), m["threads"],
                          "stream_gb_s")["value"]
    peak = combined_ceiling(model.get("matmul_type_n_params"), probes, span(m), m["threads"],
                            "compute_gflop_s")["value"]
    # One step multiplies every weight matrix by B vectors (2 FLOPs per weight per sequence,
    # plus each sequence's row of logits) and reads each sequence's own KV cache, attending
    # over it (QK^T and AV: 4 x layers x q_dim FLOPs per cached position).
    context = mean_decode_context(m["n_prompt"], m["n_gen"])
    kv_n_bytes = kv_n_bytes_per_token(spec) * context
    flops_per_token = (2 * matmul_params_per_token(spec) + 2 * spec.hidden_size * spec.vocab_size
                       + 4 * spec.num_hidden_layers * spec.q_dim * context)
    bound = ridge = None
    if bw and peak:
        step_s = max((weight_n_bytes + b * kv_n_bytes) / (bw * 1e9),
                     b * flops_per_token / (peak * 1e9))
        bound = b / step_s
        # memory time = compute time: (W + B kv) / bw = B f / peak
        denominator = flops_per_token / peak - kv_n_bytes / bw
        ridge = weight_n_bytes / bw / denominator if denominator > 0 else None
    agg = _mean(m["decode_tok_s"])
    return {"model": m["model"], "dtype": m["dtype"], "threads": m["threads"], "parallel": b,
            "tok_s": m["decode_tok_s"], "per_sequence_tok_s": m.get("per_sequence_tok_s")
            or m["decode_tok_s"], "ms_per_step": m["decode_ms_per_token"],
            "speedup": center(ratio := round_ratio(m, base, "decode") if base else None),
            "speedup_ci": ratio,
            "weight_n_bytes_per_token": weight_n_bytes / b, "bound_tok_s": bound,
            "share_of_bound": agg / bound if bound else None, "ridge_parallel": ridge,
            "stream_gb_s": bw, "compute_gflop_s": peak, "flags": m["flags"]}


# --- threads -----------------------------------------------------------------------------

def thread_rows(measurements: list[dict], probes: list[dict], analysis: dict) -> list[dict]:
    """Speed-up with threads of each plain prefill and decode measured at two or more counts,
    and how close each came to its own ceiling (from the decode and prefill rows)."""
    # keyed by (id, phase): a prompt-then-decode measurement has a row of each phase
    rows_by_id = {(r["id"], "decode"): (r, r.get("share_of_stream"), r["stream_ceiling"])
                  for r in analysis.get("decode", [])}
    rows_by_id |= {(r["id"], "prefill"): (r, r.get("share_of_peak"), r["compute_peak"])
                   for r in analysis.get("prefill", [])}
    rows = []
    for phase, key in (("prefill", "prefill_tok_s"), ("decode", "decode_tok_s")):
        chosen = [m for m in measurements if is_plain(m) and m.get(key)
                  and (m["id"], phase) in rows_by_id
                  and (m["n_gen"] == 0 if phase == "prefill" else m["n_gen"] > 0)]
        for group in _groups(chosen, lambda m: (m["model_key"], m["n_prompt"], m["n_gen"],
                                                m["n_batch"], m["n_ubatch"], m["flash_attn"])):
            if len({m["threads"] for m in group}) >= 2:
                rows += _thread_group(phase, key, group, rows_by_id)
    return rows


def _thread_group(phase: str, key: str, group: list[dict], rows_by_id: dict) -> list[dict]:
    group.sort(key=lambda m: m["threads"])
    base = group[0]
    best = max(_mean(m[key]) for m in group)
    knee = next(m["threads"] for m in group if _mean(m[key]) >= (1 - KNEE_TOLERANCE) * best)
    base_ceiling = rows_by_id[(base["id"], phase)][2]["value"]
    out = []
    for m in group:
        ratio = round_ratio(m, base, phase)
        speedup = center(ratio)
        _, share, ceiling = rows_by_id[(m["id"], phase)]
        c = ceiling["value"]
        out.append({"phase": phase, "id": m.get("id"), "model": m["model"], "dtype": m["dtype"],
                    "n_prompt": m["n_prompt"], "n_gen": m["n_gen"], "threads": m["threads"],
                    "tok_s": m[key], "speedup": speedup, "speedup_ci": ratio,
                    "efficiency": speedup * base["threads"] / m["threads"],
                    "ceiling": "compute_gflop_s" if phase == "prefill" else "stream_gb_s",
                    "ceiling_value": c, "share_of_ceiling": share,
                    "ceiling_speedup": c / base_ceiling if c and base_ceiling else None,
                    "knee": m["threads"] == knee, "knee_threads": knee,
                    "n_thread_counts": len(group), "flags": m["flags"]})
    return out


# --- prefix caching ----------------------------------------------------------------------

def prefix_rows(measurements: list[dict], models: dict) -> list[dict]:
    """Time to first token with the shared prefix recomputed and reused, and the saving."""
    rows = []
    for m in measurements:
        if m.get("kind") != "prefix_cache" or not m.get("ttft_s"):
            continue
        recompute = _mean(m["ttft_s"])
        row = {"model": m["model"], "dtype": m["dtype"], "threads": m["threads"],
               "shared_prefix": m["shared_prefix"], "n_prompt": m["n_prompt"],
               "kv_type": m.get("kv_type", "f16"), "recompute_s": m["ttft_s"],
               "state_n_bytes": (m.get("setup") or {}).get("state_n_bytes"),
               "flags": m["flags"]}
        for method, summary in m["ttft_reuse_s"].items():
            row[f"{method}_s"] = summary
            row[f"{method}_saving"] = 1 - _mean(summary) / recompute
            row[f"{method}_speedup"] = recompute / _mean(summary)
        rows.append(row)
    return rows


def analyze_levers(measurements: list[dict], models: dict, probes: list[dict],
                   analysis: dict) -> dict:
    """Every lever section's rows (empty lists where the run did not measure that lever)."""
    kv = kv_depth_rows(measurements, models)
    return {"quant": quant_rows(measurements, models), "kv_depth": kv,
            "kv_memory": kv_memory_rows(kv, models),
            "batching": batching_rows(measurements, models, probes),
            "threads": thread_rows(measurements, probes, analysis),
            "prefix": prefix_rows(measurements, models)}
