"""The claims of a scenario's `reference:` block (harness.core.reference) checked against a
run's analysis, so "holds" is decided by data."""

from __future__ import annotations

from ..core.reference import CLAIM_TESTS
from ..core.stats import center, contrast, decide, row_blocks, scaled, unpaired

# --- checking the claims -------------------------------------------------------------------

def check_claims(reference: dict, analysis: dict, env: dict) -> list[dict]:
    """Each claim with what this run measured and whether it holds, decided by its test."""
    out = []
    for claim in reference.get("claims", []):
        result = CHECKS[claim["test"]](claim, analysis, env)
        out.append({"claim": claim["claim"], "published": claim.get("published", ""),
                    "test": CLAIM_TESTS[claim["test"]][1]} | result)
    return out


def _not_measured(why: str) -> dict:
    return {"verdict": "not measured", "measured": "–", "why": why}


def _size_rows(analysis: dict) -> list[dict]:
    """The decode rows the fit at the most threads compared (one per model, one weight type),
    smallest first; the F32 decode rows of runs stored before fits named their rows."""
    fit = max(analysis["fits"], key=lambda f: f["threads"], default=None)
    if fit and fit.get("ids"):
        rows = [r for r in analysis["decode"] if r["id"] in fit["ids"]]
    else:
        rows = [r for r in analysis["decode"] if r["dtype"] == "f32"] or analysis["decode"]
        threads = max((r["threads"] for r in rows), default=None)
        rows = [r for r in rows if r["threads"] == threads]
    return sorted(rows, key=lambda r: r["bytes_per_token"])


def _ci_text(c: dict | None, digits: int = 2, pct: bool = False) -> str:
    """A ratio with its 95% interval in brackets (none when it has none)."""
    if not c:
        return "–"
    ci = c.get("median_ci95")

    def f(x: float) -> str:
        return f"{x:.0%}" if pct else f"{x:.{digits}f}×"

    return f(center(c)) + (f" [{f(ci[0])}–{f(ci[1])}]" if ci else " (no interval)")


def _over(c: dict | None, factor: float) -> dict | None:
    """A ratio divided by a constant (measured ÷ predicted)."""
    return scaled(c, 1 / factor) if c else None


def combine(verdicts: list[str]) -> str:
    """Parts of one claim: it holds when every part holds, does not when one does not."""
    if "does not hold" in verdicts:
        return "does not hold"
    return "holds" if all(v == "holds" for v in verdicts) else "undecided"


def needed(c: dict, low: float | None, high: float | None) -> str:
    """The precision that would decide an undecided ratio: its distance to the nearer edge."""
    mid = center(c)
    edges = [e for e in (low, high) if e is not None]
    gap = min(abs(mid - e) for e in edges) / mid
    return f"±{gap:.1%} or better would decide it" if gap > 0 else "it sits on the edge"


def _verdict(parts: list[tuple[str, dict | None, float | None, float | None]]) -> dict:
    """Each part: (what, its ratio, the low and high edge it must lie within)."""
    verdicts = [decide((c or {}).get("median_ci95"), lo, hi) for _, c, lo, hi in parts]
    out = {"verdict": combine(verdicts)}
    if out["verdict"] == "undecided":
        open_parts = [f"{what}: {needed(c, lo, hi)}" for (what, c, lo, hi), v
                      in zip(parts, verdicts, strict=True) if v == "undecided" and c]
        out["undecided_because"] = ("the interval straddles the tolerance (" +
                                    "; ".join(open_parts) + ")")
    out["contrasts"] = [{"what": what, "ratio": center(c), "ci95": (c or {}).get("median_ci95"),
                         "low": lo, "high": hi, "verdict": v}
                        for (what, c, lo, hi), v in zip(parts, verdicts, strict=True)]
    return out


def _decode_follows_bytes(claim: dict, analysis: dict, env: dict) -> dict:
    fit = max(analysis["fits"], key=lambda f: f["threads"], default=None)
    pairs = (fit or {}).get("size_contrasts") or []
    if not pairs:
        return _not_measured("needs decode of two model sizes")
    tol = claim["tolerance"]
    parts, text = [], []
    for c in pairs:
        of = _over(c, c["predicted"])
        parts.append((f"{c['big']} ÷ {c['small']}", of, 1 - tol, 1 + tol))
        text.append(f"{c['big']} ÷ {c['small']}: {_ci_text(c)} the speed for "
                    f"{c['bytes_ratio']:.2f}× the bytes")
    worst = max(abs(center(of) - 1) for _, of, _, _ in parts)
    out = _verdict(parts)
    return out | {"measured": "; ".join(text), "tolerance": tol,
                  "why": f"every pair of sizes, each within ±{tol:.0%} with its interval "
                         f"(largest miss {worst:.0%})" + _undecided(out)}


def _undecided(out: dict) -> str:
    return f"; undecided: {out['undecided_because']}" if "undecided_because" in out else ""


def _phase_shares(claim: dict, analysis: dict, env: dict) -> dict:
    use = analysis["phase_use"]
    pre = next((u for u in use if u["phase"] == "prefill" and u["compute_share"]), None)
    dec = next((u for u in use if u["phase"] == "decode" and u["stream_share"]), None)
    if not pre or not dec:
        return _not_measured("needs prefill and decode with their ceilings measured")
    need = claim["min_share"]
    pre_c = pre["compute_share_ci"] or {"n": 1, "median": pre["compute_share"]}
    dec_c = dec["stream_share_ci"] or {"n": 1, "median": dec["stream_share"]}
    out = _verdict([("prefill's share of the compute peak", pre_c, need, None),
                    ("decode's share of the streaming ceiling", dec_c, need, None)])
    if out["verdict"] != "does not hold" and not (
            pre["compute_share"] > pre["stream_share"]
            and dec["stream_share"] > dec["compute_share"]):
        out["verdict"] = "does not hold"
    measured = (f"prefill {_ci_text(pre_c, pct=True)} of compute, {pre['stream_share']:.0%} "
                f"of bandwidth; decode {dec['compute_share']:.0%} of compute, "
                f"{_ci_text(dec_c, pct=True)} of bandwidth ({pre['model']} {pre['dtype']})")
    return out | {"measured": measured, "tolerance": need,
                  "why": f"each phase needs ≥ {need:.0%} of its own resource (its interval "
                         "too) and more of it than of the other" + _undecided(out)}


def _quant(claim: dict, analysis: dict, env: dict) -> dict:
    rows = analysis["quant"]
    q = next((r for r in rows if r["dtype"] == claim["dtype"] and r["baseline"] == "f32"), None)
    if not q or q["decode_speedup"] is None or q["prefill_speedup"] is None:
        return _not_measured(f"needs decode and prefill of {claim['dtype']} beside F32")
    dec, pre = q["decode_speedup_ci"], q["prefill_speedup_ci"]
    lo_dec, hi_pre = claim["min_decode_speedup"], claim["max_prefill_speedup"]
    out = _verdict([("decode speed-up", dec, lo_dec, None),
                    ("prefill speed-up", pre, None, hi_pre)])
    measured = (f"{claim['dtype'].upper()} decode {_ci_text(dec)}, prefill {_ci_text(pre)} "
                "F32")
    why = [f"decode ≥ {lo_dec:.2f}×, prefill ≤ {hi_pre:.2f}×, each with its interval"]
    if decide(pre.get("median_ci95"), None, hi_pre) == "does not hold":
        why.append(f"prefill gained more than {hi_pre:.2f}×: this CPU's integer kernels "
                   f"({_cpu_features(env)}) run the quantized matrices faster than F32, so "
                   "prefill's compute got cheaper too")
    return out | {"measured": measured, "tolerance": [lo_dec, hi_pre],
                  "why": "; ".join(why) + _undecided(out)}


def _cpu_features(env: dict) -> str:
    info = (env.get("llama") or {}).get("system_info") or ""
    found = [f for f in ("AVX512_VNNI", "AVX_VNNI", "AVX512", "AVX2", "NEON", "DOTPROD")
             if f"{f} = 1" in info]
    return ", ".join(found[:2]) or "its SIMD"


def _batching(claim: dict, analysis: dict, env: dict) -> dict:
    rows = analysis["batching"]
    row = next((r for r in rows if r["parallel"] == claim["parallel"] and r["speedup"]),
               None)
    if not row:
        return _not_measured(f"needs decode of 1 and {claim['parallel']} sequences")
    gain = row["speedup_ci"]
    each = row.get("per_user_ci") or _over(gain, row["parallel"])  # rows from the lever have it
    out = _verdict([("aggregate gain", gain, claim["min_gain"], None)])
    return out | {"tolerance": claim["min_gain"],
                  "measured": f"{row['parallel']} sequences: {_ci_text(gain)} the aggregate "
                              f"tok/s of one; each sequence {_ci_text(each)} the speed of one "
                              f"alone ({center(row['per_sequence_tok_s']):.1f} tok/s)",
                  "why": f"needs ≥ {claim['min_gain']:.1f}× aggregate; the per-user cost is "
                         "the price of it" + _undecided(out)}


def first_token_steps(decode: dict, prefill: dict) -> dict:
    """A prompt's time to its first token in decode steps of the same model: prefill seconds
    ÷ seconds per step = n_prompt × decode tok/s ÷ prefill tok/s, round by round where both
    ran (the drift cancels), else their medians, unpaired."""
    return scaled(contrast(row_blocks(decode), row_blocks(prefill))
                  or unpaired(decode["tok_s"], prefill["tok_s"]), prefill["n_prompt"])


def _long_prompt(claim: dict, analysis: dict, env: dict) -> dict:
    pre = [r for r in analysis["prefill"] if r["n_gen"] == 0]
    dec = analysis["decode"]
    if not pre or not dec:
        return _not_measured("needs a prefill and a decode")
    longest = max(pre, key=lambda r: r["n_prompt"])
    same = [d for d in dec if (d["model"], d["dtype"]) == (longest["model"], longest["dtype"])]
    if not same:
        return _not_measured("needs decode of the model of the longest prompt")
    steps = first_token_steps(same[0], longest)
    out = _verdict([("decode steps in the first token's time", steps, claim["min_tokens"],
                     None)])
    ms = 1000 / center(same[0]["tok_s"])
    ci = steps.get("median_ci95")
    return out | {"tolerance": claim["min_tokens"],
                  "measured": f"{longest['n_prompt']:,} tokens: {longest['seconds']:.1f} s "
                              f"before the first token, the time of {center(steps):.0f}"
                              + (f" [{ci[0]:.0f}–{ci[1]:.0f}]" if ci else "")
                              + f" decode steps of {ms:.0f} ms",
                  "why": f"needs ≥ {claim['min_tokens']} decode steps" + _undecided(out)}


def _ceiling_share(claim: dict, analysis: dict, env: dict) -> dict:
    """Decode's effective bandwidth as a share of what this machine reads: ggml's own
    matrix-vector kernel for the weight type, probed beside the decodes, round by round."""
    parts = []
    for r in _size_rows(analysis):
        share = r.get("share_of_stream_ci") or (
            {"n": 1, "median": r["share_of_stream"]} if r.get("share_of_stream") else None)
        if share:
            parts.append((r["model"], share, claim["low"], claim["high"]))
    if not parts:
        return _not_measured("needs decode with its streaming ceiling probed beside it")
    out = _verdict(parts)
    shares = [center(c) for _, c, _, _ in parts]
    above = all(s > claim["high"] for s in shares)
    copies = [r["effective_gb_s"] / r["copy_ceiling"]["value"] for r in _size_rows(analysis)
              if r["copy_ceiling"]["value"]]
    copy = (f"; against numpy's memory copy, the course's yardstick, decode reached "
            f"{min(copies):.0%}–{max(copies):.0%}" if copies else "")
    return out | {"tolerance": [claim["low"], claim["high"]],
                  "measured": "decode reached " + ", ".join(
                      f"{m} {_ci_text(c, pct=True)}" for m, c, _, _ in parts)
                  + " of what this machine reads (llama.cpp's matrix-vector kernel)",
                  "why": f"needs every share within {claim['low']:.0%}–{claim['high']:.0%}"
                         + ("; every one is above it: llama.cpp's decode keeps nearly all of "
                            "its own kernel's rate" if above else "") + copy
                         + _undecided(out)}


def workload_rows(analysis: dict) -> list[dict]:
    """The workload rows of the run's main configuration (the model and type with the most
    measured prompt lengths behind its rows, at the most threads): the rows a page shows."""
    rows = analysis["workloads"]
    if not rows:
        return []
    threads = max(r["threads"] for r in rows)
    keys = list(dict.fromkeys((r["model"], r["dtype"]) for r in rows if r["threads"] == threads))
    key = max(keys, key=lambda k: len({r["prefill_rate_from"] for r in rows
                                       if (r["model"], r["dtype"]) == k}))
    return [r for r in rows if (r["model"], r["dtype"]) == key and r["threads"] == threads]


BEYOND = 2.0  # a modelled prompt more than 2x the longest measured one decides nothing


def beyond_measured(analysis: dict, row: dict) -> float | None:
    """A workload row's prompt ÷ the longest prompt its configuration measured, where that is
    more than BEYOND (too far to model), else None."""
    longest = max((p["n_prompt"] for p in analysis["prefill"] if p["n_gen"] == 0
                   and (p["model"], p["dtype"], p["threads"])
                   == (row["model"], row["dtype"], row["threads"])), default=0)
    return row["n_prompt"] / longest if longest and row["n_prompt"] > BEYOND * longest else None


def _workload_balance(claim: dict, analysis: dict, env: dict) -> dict:
    """Each named workload's prefill share of its time on the run's main configuration, above
    or below one half; a workload whose prompt lies more than BEYOND x past the longest prompt
    measured is left untested, and a verdict resting on modelled times says so."""
    rows = workload_rows(analysis)
    if not rows:
        return _not_measured("no workload rows: the run needs prefill and decode of one model")
    main = {r["workload"].lower(): r for r in rows}
    parts, text, missing, beyond, modelled = [], [], [], [], False
    for side, names in (("prefill", claim["prefill_bound"]), ("decode", claim["decode_bound"])):
        for name in (n.strip() for n in names.split(";") if n.strip()):
            row = main.get(name)
            if row is None:
                missing.append(name)
                continue
            if past := beyond_measured(analysis, row):
                beyond.append(f"{row['workload']} ({past:.1f}× the longest prompt measured, "
                              f"{row['n_prompt'] / past:,.0f} tokens)")
                continue
            share = {"n": 1, "median": row["prefill_share"],
                     "median_ci95": row.get("prefill_share_ci")}
            parts.append((f"{row['workload']} prefill share", share,
                          0.5 if side == "prefill" else None, 0.5 if side == "decode" else None))
            text.append(f"{row['workload']} {row['prefill_share']:.0%} prefill"
                        + (" (modelled)" if row.get("modelled") else ""))
            modelled = modelled or bool(row.get("modelled"))
    if missing:
        return _not_measured("no workload named " + ", ".join(missing))
    if not parts:
        return _not_measured("every named workload lies beyond the prompts measured")
    out = _verdict(parts)
    why = "each share on the named side of 50% with its interval"
    if beyond:
        why += "; not tested, too far to model: " + "; ".join(beyond)
    r = rows[0]
    plural = "s" if r["threads"] != 1 else ""
    n_named = len(parts) + len(beyond)
    return out | {"measured": "; ".join(text) + f" ({r['model']} {r['dtype']}, {r['threads']} "
                              f"thread{plural})",
                  "why": why + _undecided(out), "modelled": modelled,
                  "scope": f"{len(parts)} of {n_named} workloads" if beyond else ""}


def _not_tested(claim: dict, analysis: dict, env: dict) -> dict:
    """A claim this kind of run cannot test, with what would test it."""
    return {"verdict": "not tested", "measured": "–", "why": claim["needs"]}


CHECKS = {"decode_follows_bytes": _decode_follows_bytes, "workload_balance": _workload_balance,
          "prefill_compute_decode_memory": _phase_shares,
          "quant_helps_decode_not_prefill": _quant, "batching_gain": _batching,
          "long_prompt_first_token": _long_prompt, "decode_share_of_ceiling": _ceiling_share,
          "not_tested": _not_tested}
assert set(CHECKS) == set(CLAIM_TESTS)
