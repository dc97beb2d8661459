"""The rule of thumb, checked on a run: decode tok/s ~ bandwidth / bytes per token.

Pure functions of the stored records (and the model specs, for estimates). Every rate is the
median per-repetition rate (harness.core.stats.center); every share is a figure over a ceiling
measured beside it with llama.cpp's own kernels, never capped.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.costs import (
    decode_n_bytes_per_token,
    matmul_params_per_token,
    mean_decode_context,
    prefill_flops,
    prefill_weight_n_bytes,
)
from ..core.records import Measurement, Model, Probe
from ..core.specs import ModelSpec
from ..core.stats import (
    UNSTABLE_CV,
    center,
    contrast,
    ratio_summary,
    row_blocks,
    row_pair,
    summarize,
    unpaired,
)
from .ceilings import (
    above_ceiling,
    ceiling_near,
    combined_ceiling,
    is_plain,
    round_rates,
    round_shares,
    span,
    step_regimes,
    window_rates,
)

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


def decode_rows(measurements: list[Measurement], models: dict[str, Model],
                probes: list[Probe]) -> list[dict]:
    """Effective bandwidth of every plain decode, its share of the model's streaming ceiling
    (ggml's matrix-vector kernels over its tensor types) and of numpy's plain read."""
    rows = []
    for m in filter(is_plain, measurements):
        tok, model = m.decode_tok_s, models.get(m.model_key)
        if not tok or not model:
            continue
        n_bytes = decode_n_bytes_per_token(model.decode_weight_n_bytes,
                                           model.kv_n_bytes_per_token_f16,
                                           mean_decode_context(m.n_prompt, m.n_gen))
        effective = center(tok) * n_bytes / 1e9
        stream = combined_ceiling(model.decode_type_n_bytes, probes, span(m), m.threads,
                                  "stream_gb_s")
        read = ceiling_near(probes, span(m), m.threads, ("read_gb_s",))
        copy = ceiling_near(probes, span(m), m.threads, ("copy_gb_s",))
        by_round = round_shares(m, "decode", model.decode_type_n_bytes, probes,
                                "stream_gb_s", n_bytes / 1e9)
        share = (by_round["ratio"] if by_round else
                 effective / stream["value"] if stream["value"] else None)
        flags = list(m.flags) + (["above-ceiling"] if above_ceiling(share, stream, by_round)
                                 else [])
        rows.append({
            "id": m.id, "model": m.model, "model_key": m.model_key, "dtype": m.dtype,
            "threads": m.threads, "n_prompt": m.n_prompt, "n_gen": m.n_gen, "tok_s": tok,
            "bytes_per_token": n_bytes, "file_bytes_per_token": model.weights_n_bytes,
            "moe": bool(model.expert_n_bytes),
            "effective_gb_s": effective, "stream_ceiling": stream, "read_ceiling": read,
            "copy_ceiling": copy,
            "share_of_stream": share, "share_of_stream_ci": by_round,
            "share_of_read": effective / read["value"] if read["value"] else None,
            "flags": flags,
            "noise": m.noise,
            # [[RAM group, round], tok/s] of every repetition: the blocks the fit pairs
            "round_rates": [[list(k), x] for k, x in round_rates(m, "decode").items()],
            # [[RAM group, round, window], tok/s] of step-interleaved decodes: what sizes pair
            "window_rates": [[list(k), x] for k, x in window_rates(m).items()],
            "interleave": m.interleave, "regimes": step_regimes(m),
        })
    return rows


def prefill_rows(measurements: list[Measurement], models: dict[str, Model],
                 probes: list[Probe]) -> list[dict]:
    """Achieved GFLOP/s of every plain prefill and its share of the model's compute peak
    (ggml's matrix-matrix kernels over its matrices' types, weighted by their FLOPs)."""
    rows = []
    for m in filter(is_plain, measurements):
        tok, model = m.prefill_tok_s, models.get(m.model_key)
        if not tok or not model:
            continue
        flops = prefill_flops(ModelSpec(**model.spec), m.n_prompt)
        seconds = m.n_prompt / center(tok)
        gflop_s = flops / seconds / 1e9
        peak = combined_ceiling(model.matmul_type_n_params, probes, span(m), m.threads,
                                "compute_gflop_s")
        by_round = round_shares(m, "prefill", model.matmul_type_n_params, probes,
                                "compute_gflop_s", flops / m.n_prompt / 1e9)
        share = (by_round["ratio"] if by_round else
                 gflop_s / peak["value"] if peak["value"] else None)
        flags = list(m.flags) + (["above-ceiling"] if above_ceiling(share, peak, by_round)
                                 else [])
        rows.append({
            "id": m.id, "model": m.model, "model_key": m.model_key, "dtype": m.dtype,
            "threads": m.threads, "n_prompt": m.n_prompt, "n_gen": m.n_gen, "seconds": seconds,
            "n_ubatch": m.n_ubatch, "flash_attn_used": m.flash_attn_used,
            "tok_s": tok, "flops": flops, "gflop_s": gflop_s, "compute_peak": peak,
            "share_of_peak": share, "share_of_peak_ci": by_round, "flags": flags,
            "noise": m.noise,
            "round_rates": [[list(k), x] for k, x in round_rates(m, "prefill").items()],
        })
    return rows


def prompt_contrasts(prefill: list[dict]) -> list[dict]:
    """Prefill rate at every longer prompt ÷ at the shortest, per model, type and threads
    (prefill-only rows), round by round: how a long prompt slows each prompt token."""
    groups: dict[tuple, list[dict]] = {}
    for r in prefill:
        if r["n_gen"] == 0:
            groups.setdefault(config_key(r), []).append(r)
    out = []
    for rows in groups.values():
        short = min(rows, key=lambda r: r["n_prompt"])
        for r in sorted(rows, key=lambda r: r["n_prompt"]):
            if r is short:
                continue
            c = (contrast(row_blocks(r), row_blocks(short))
                 or unpaired(r["tok_s"], short["tok_s"]))
            out.append(c | {"numerator": r["id"], "denominator": short["id"],
                            "metric": "prefill_tok_s", "n_prompt": r["n_prompt"],
                            "base_n_prompt": short["n_prompt"], "model": r["model"],
                            "dtype": r["dtype"], "threads": r["threads"],
                            "name": f"prefill of {r['model']} {r['dtype']} t{r['threads']}: "
                                    f"pp{r['n_prompt']} ÷ pp{short['n_prompt']}"})
    return out


def config_key(r: dict) -> tuple:
    """Model, weight type and thread count: what two rows must share to be compared."""
    return (r["model"], r["dtype"], r["threads"])


def longest_decodes(decode: list[dict]) -> list[dict]:
    """One decode row per model, type and thread count: its longest generation (a lever's
    shorter baseline decode would repeat the same configuration)."""
    chosen: dict[tuple, dict] = {}
    for r in decode:
        if config_key(r) not in chosen or r["n_gen"] > chosen[config_key(r)]["n_gen"]:
            chosen[config_key(r)] = r
    return list(chosen.values())


def phase_use(decode: list[dict], prefill: list[dict], models: dict) -> list[dict]:
    """Where each phase spends the machine: prefill and decode of one model each as a share of
    the compute peak and of the streaming bandwidth (prefill reads the weights once per ubatch;
    decode does 2 FLOPs per weight per token), against the ceilings measured in the run."""
    out = []
    for d in longest_decodes(decode):
        pre = [p for p in prefill if p["n_gen"] == 0 and config_key(p) == config_key(d)]
        model = models.get(d["model_key"])
        if not pre or not model:
            continue
        p = min(pre, key=lambda r: r["n_prompt"])
        stream, peak = d["stream_ceiling"]["value"], p["compute_peak"]["value"]
        spec = ModelSpec(**model.spec)
        prefill_gb_s = prefill_weight_n_bytes(model, spec, p["n_prompt"],
                                              p["n_ubatch"]) / p["seconds"] / 1e9
        decode_gflop_s = (2 * matmul_params_per_token(spec) + 2 * spec.hidden_size
                          * spec.vocab_size) * center(d["tok_s"]) / 1e9
        base = {"model": d["model"], "dtype": d["dtype"], "threads": d["threads"],
                "moe": spec.is_moe}
        out.append(base | {"phase": "prefill", "n_prompt": p["n_prompt"],
                           "gflop_s": p["gflop_s"], "gb_s": prefill_gb_s,
                           "compute_share": p["share_of_peak"],
                           "compute_share_ci": p["share_of_peak_ci"],
                           "stream_share": prefill_gb_s / stream if stream else None})
        out.append(base | {"phase": "decode", "gflop_s": decode_gflop_s,
                           "gb_s": d["effective_gb_s"],
                           "compute_share": decode_gflop_s / peak if peak else None,
                           "stream_share": d["share_of_stream"],
                           "stream_share_ci": d["share_of_stream_ci"]})
    return out


# --- the fit and its verdict ---------------------------------------------------------------

def size_rows(rows: list[dict], threads: int) -> tuple[list[dict], str | None]:
    """The decode rows that compare model sizes at a thread count, one per model: the weight
    type with the most models (two at least), each model's longest decode; with no such type
    (one model in several types, a quantization sweep), one row per model and type."""
    group = [r for r in longest_decodes(rows) if r["threads"] == threads]
    by_dtype: dict[str, set] = {}
    for r in group:
        by_dtype.setdefault(r["dtype"], set()).add(r["model"])
    dtype = max(by_dtype, key=lambda d: (len(by_dtype[d]), d == "f32"), default=None)
    if dtype is None or len(by_dtype[dtype]) < 2:
        return group, None
    return [r for r in group if r["dtype"] == dtype], dtype


def fit_verdicts(rows: list[dict]) -> list[dict]:
    """One fit per thread count over the rows that compare sizes (size_rows), with a verdict
    that reads the data."""
    out = []
    for threads in sorted({r["threads"] for r in rows}):
        group, dtype = size_rows(rows, threads)
        if len({r["bytes_per_token"] for r in group}) < 2:
            continue  # one size tests nothing: the report leaves the fit out
        fit = fit_through_origin([r["bytes_per_token"] for r in group],
                                 [center(r["tok_s"]) for r in group])
        out.append({"threads": threads, "dtype": dtype, "ids": [r["id"] for r in group],
                    "fit": fit.__dict__, "size_contrasts": size_contrasts(group)}
                   | verdict(fit, group) | round_fits(group))
    return out


def round_fits(group: list[dict]) -> dict:
    """The fit redone in every round in which all of the group's models decoded, so drift
    between rounds cancels: the fitted GB/s with its CI over rounds, and each model's
    measured ÷ fitted tok/s (its residual as a ratio) with its CI. Under 2 such rounds, the
    reason the fit stays unpaired."""
    by_round = [row_blocks(r) for r in group]
    common = sorted(set.intersection(*(set(d) for d in by_round)))
    if len(common) < 2:
        return {"round_fit_unpaired": len(common)} if all(by_round) else {}
    n_bytes = [r["bytes_per_token"] for r in group]
    fits, ratios = [], [[] for _ in group]
    for rnd in common:
        rates = [d[rnd] for d in by_round]
        fit = fit_through_origin(n_bytes, rates)
        fits.append(fit.gb_s)
        for i, (b, x) in enumerate(zip(n_bytes, rates, strict=True)):
            ratios[i].append(x / (fit.gb_s * 1e9 / b))
    return {"round_fit_gb_s": summarize(fits),
            "round_residuals": [{"model": r["model"], "dtype": r["dtype"],
                                 "measured_over_fit": ratio_summary(x) | {
                                     "numerator": r["id"], "denominator": "the size fit",
                                     "metric": "decode_tok_s",
                                     "name": f"decode of {r['model']} {r['dtype']}: measured "
                                             "÷ the fit through every size, round by round"}}
                                for r, x in zip(group, ratios, strict=True)]}


def size_contrasts(group: list[dict]) -> list[dict]:
    """Every pair of model sizes in a fit: the larger's decode rate ÷ the smaller's, round by
    round, beside the ratio the bytes predict (smaller's bytes ÷ larger's)."""
    rows = sorted(group, key=lambda r: r["bytes_per_token"])
    out = []
    for i, small in enumerate(rows):
        for big in rows[i + 1:]:
            c = contrast(*row_pair(big, small))
            if c is None:  # never in a round together: their intervals, drift kept
                c = unpaired(big["tok_s"], small["tok_s"])
            out.append(c | {
                "numerator": big["id"], "denominator": small["id"], "metric": "decode_tok_s",
                "name": f"decode, {big['model']} ÷ {small['model']} ({small['dtype']})",
                "predicted": small["bytes_per_token"] / big["bytes_per_token"],
                "big": big["model"], "small": small["model"],
                "bytes_ratio": big["bytes_per_token"] / small["bytes_per_token"]})
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
    unstable = [r for r in group if "unstable-decode" in r["flags"] and not _two_steady(r)]
    if unstable:
        out.append(", ".join(f"{r['model']} {r['dtype']}" for r in unstable)
                   + f" decoded unsteadily (CV {_cv_range(unstable)} over the repetitions)")
    above = [r for r in group if "above-ceiling" in r["flags"]]
    if above:
        out.append(", ".join(f"{r['model']} {r['dtype']} ({r['share_of_stream']:.0%})"
                             for r in above) + " ran above the streaming ceiling")
    return out


def _two_steady(row: dict) -> bool:
    """A decode that varied only because the machine ran at two speeds, steady at each (the
    run's regimes are said once, not as a fault of every row)."""
    reg = row.get("regimes") or {}
    return reg.get("n") == 2 and reg["cv"] <= UNSTABLE_CV


def _cv_range(rows: list[dict]) -> str:
    cvs = sorted(r["tok_s"]["cv"] for r in rows)
    lo, hi = f"{cvs[0]:.0%}", f"{cvs[-1]:.0%}"
    return lo if lo == hi else f"{lo}–{hi}"


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
