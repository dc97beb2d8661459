"""Published figures and the claims a lesson makes: a scenario's `reference:` block, validated
once at load, and checked against a run's analysis so "holds" is decided by data.

The block (every key but source and hardware optional):

    reference:
      source: Course page "How LLM inference uses your hardware"
      hardware: 4-core Xeon VM, F32 random-weight models, llama.cpp
      cores: 4
      memory_gb_s: 45          # their plain memory copy
      figures:
        - {model: qwen2.5-0.5b, prompt: 128, prefill_s: 0.64}
        - {model: qwen2.5-0.5b, decode_tok_s: 11.66}
      claims:
        - {claim: "twice the bytes, half the decode speed", test: decode_follows_bytes,
           tolerance: 0.20}
"""

from __future__ import annotations

from .errors import HarnessError
from .stats import center
from .yamlio import Doc, check_keys, want_float, want_int, want_mapping, want_str

FIGURE_NUMBERS = {"prefill_s": "s", "prefill_tok_s": "tok/s", "decode_tok_s": "tok/s",
                  "ms_per_token": "ms", "size_gib": "GiB", "effective_gb_s": "GB/s"}
FIGURE_KEYS = ["model", "dtype", "threads", "prompt", *FIGURE_NUMBERS]
# Each claim test: its parameters (name -> (kind, default)) and what it checks, in words.
CLAIM_TESTS = {
    "decode_follows_bytes": ({"tolerance": ("float", 0.20)},
                             "every pair of model sizes: speed ratio = inverse bytes ratio"),
    "prefill_compute_decode_memory": ({"min_share": ("float", 0.5)},
                                      "prefill uses ≥ min_share of the compute peak and decode "
                                      "≥ min_share of the streaming ceiling, each far more than "
                                      "of the other resource"),
    "quant_helps_decode_not_prefill": ({"dtype": ("str", "q4_0"),
                                        "min_decode_speedup": ("float", 1.5),
                                        "max_prefill_speedup": ("float", 1.3)},
                                       "decode speed-up ≥ min_decode_speedup, prefill speed-up "
                                       "≤ max_prefill_speedup, against F32"),
    "batching_gain": ({"parallel": ("int", 4), "min_gain": ("float", 2.0)},
                      "aggregate decode at `parallel` sequences ≥ min_gain × one sequence"),
    "long_prompt_first_token": ({"min_tokens": ("int", 100)},
                                "the longest prompt's time to first token ≥ min_tokens decode "
                                "steps"),
    "share_of_plain_memory": ({"low": ("float", 0.5), "high": ("float", 0.8)},
                              "decode's effective bandwidth between low and high × numpy copy"),
}
_TOP = ["source", "hardware", "cores", "memory_gb_s", "figures", "claims"]


def load_reference(doc: Doc, value: object) -> dict:
    """The validated `reference:` block (plain data, stored in the run's header)."""
    path = ("reference",)
    block = want_mapping(doc, path, value)
    check_keys(doc, path, block, _TOP, ("source", "hardware"))
    out = {"source": want_str(doc, path + ("source",), block["source"]),
           "hardware": want_str(doc, path + ("hardware",), block["hardware"])}
    if "cores" in block:
        out["cores"] = want_int(doc, path + ("cores",), block["cores"], minimum=1, maximum=4096)
    if "memory_gb_s" in block:
        out["memory_gb_s"] = want_float(doc, path + ("memory_gb_s",), block["memory_gb_s"],
                                        minimum=0, exclusive_min=True)
    out["figures"] = [_figure(doc, path + ("figures", i), f)
                      for i, f in enumerate(_items(doc, path + ("figures",), block))]
    out["claims"] = [_claim(doc, path + ("claims", i), c)
                     for i, c in enumerate(_items(doc, path + ("claims",), block))]
    return out


def _items(doc: Doc, path: tuple, block: dict) -> list:
    value = block.get(path[-1], [])
    if not isinstance(value, list):
        raise doc.error(path, f"expected a list, got {type(value).__name__}",
                        fix="write one `- {...}` line per entry")
    return value


def _figure(doc: Doc, path: tuple, value: object) -> dict:
    fig = want_mapping(doc, path, value)
    check_keys(doc, path, fig, FIGURE_KEYS, ("model",))
    out = {"model": want_str(doc, path + ("model",), fig["model"]),
           "dtype": want_str(doc, path + ("dtype",), fig.get("dtype", "f32")).lower()}
    for key in ("threads", "prompt"):
        if key in fig:
            out[key] = want_int(doc, path + (key,), fig[key], minimum=1, maximum=1 << 20)
    numbers = [k for k in FIGURE_NUMBERS if k in fig]
    if not numbers:
        raise doc.error(path, "a figure without a number",
                        fix="give at least one of " + ", ".join(FIGURE_NUMBERS))
    for key in numbers:
        out[key] = want_float(doc, path + (key,), fig[key], minimum=0, exclusive_min=True)
    if ("prefill_s" in out or "prefill_tok_s" in out) and "prompt" not in out:
        raise doc.error(path + ("prompt",), "a prefill figure needs its prompt length",
                        fix="add prompt: N (tokens)")
    return out


def _claim(doc: Doc, path: tuple, value: object) -> dict:
    claim = want_mapping(doc, path, value)
    test = claim.get("test")
    if test not in CLAIM_TESTS:
        raise doc.error(path + ("test",), f"unknown claim test {test!r}",
                        fix="choose one of " + ", ".join(CLAIM_TESTS))
    params, _ = CLAIM_TESTS[test]
    check_keys(doc, path, claim, ["claim", "test", "published", *params], ("claim", "test"))
    out = {"claim": want_str(doc, path + ("claim",), claim["claim"]), "test": test,
           "published": str(claim.get("published", ""))}
    readers = {"float": lambda k, v: want_float(doc, path + (k,), v, minimum=0),
               "int": lambda k, v: want_int(doc, path + (k,), v, minimum=1, maximum=1 << 20),
               "str": lambda k, v: want_str(doc, path + (k,), v).lower()}
    for key, (kind, default) in params.items():
        out[key] = readers[kind](key, claim[key]) if key in claim else default
    return out


def reference_from_header(header: dict | None) -> dict | None:
    """The block a run stored, or None (runs of scenarios without one)."""
    ref = ((header or {}).get("scenario") or {}).get("reference")
    if ref is not None and not isinstance(ref, dict):
        raise HarnessError("the run's stored reference block is not a mapping",
                           fix="re-run the scenario")
    return ref


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
    fit = max(analysis.get("fits") or [], key=lambda f: f["threads"], default=None)
    if fit and fit.get("ids"):
        rows = [r for r in analysis["decode"] if r["id"] in fit["ids"]]
    else:
        rows = [r for r in analysis["decode"] if r["dtype"] == "f32"] or analysis["decode"]
        threads = max((r["threads"] for r in rows), default=None)
        rows = [r for r in rows if r["threads"] == threads]
    return sorted(rows, key=lambda r: r["bytes_per_token"])


def _decode_follows_bytes(claim: dict, analysis: dict, env: dict) -> dict:
    rows = _size_rows(analysis)
    if len(rows) < 2:
        return _not_measured("needs decode of two model sizes")
    worst, parts = 0.0, []
    for small, big in zip(rows, rows[1:], strict=False):
        predicted = small["bytes_per_token"] / big["bytes_per_token"]
        measured = center(big["tok_s"]) / center(small["tok_s"])
        worst = max(worst, abs(measured / predicted - 1))
        parts.append(f"{big['model']} reads {1 / predicted:.2f}× the bytes of {small['model']} "
                     f"and decodes at {measured:.2f}× its speed (bytes predict "
                     f"{predicted:.2f}×)")
    holds = worst <= claim["tolerance"]
    return {"verdict": "holds" if holds else "does not hold", "measured": "; ".join(parts),
            "why": f"largest miss {worst:.0%}, tolerance ±{claim['tolerance']:.0%}"}


def _phase_shares(claim: dict, analysis: dict, env: dict) -> dict:
    use = analysis.get("phase_use") or []
    pre = next((u for u in use if u["phase"] == "prefill" and u.get("compute_share")), None)
    dec = next((u for u in use if u["phase"] == "decode" and u.get("stream_share")), None)
    if not pre or not dec:
        return _not_measured("needs prefill and decode with their ceilings measured")
    need = claim["min_share"]
    holds = (pre["compute_share"] >= need and dec["stream_share"] >= need
             and pre["compute_share"] > pre["stream_share"]
             and dec["stream_share"] > dec["compute_share"])
    measured = (f"prefill {pre['compute_share']:.0%} of compute, {pre['stream_share']:.0%} of "
                f"bandwidth; decode {dec['compute_share']:.0%} of compute, "
                f"{dec['stream_share']:.0%} of bandwidth ({pre['model']} {pre['dtype']})")
    return {"verdict": "holds" if holds else "does not hold", "measured": measured,
            "why": f"each phase needs ≥ {need:.0%} of its own resource and more of it than of "
                   "the other"}


def _quant(claim: dict, analysis: dict, env: dict) -> dict:
    rows = analysis.get("quant") or []
    q = next((r for r in rows if r["dtype"] == claim["dtype"] and r["baseline"] == "f32"), None)
    if not q or q.get("decode_speedup") is None or q.get("prefill_speedup") is None:
        return _not_measured(f"needs decode and prefill of {claim['dtype']} beside F32")
    dec, pre = q["decode_speedup"], q["prefill_speedup"]
    ok_dec, ok_pre = dec >= claim["min_decode_speedup"], pre <= claim["max_prefill_speedup"]
    measured = f"{claim['dtype'].upper()} decode {dec:.2f}×, prefill {pre:.2f}× F32"
    if ok_dec and ok_pre:
        return {"verdict": "holds", "measured": measured,
                "why": f"decode ≥ {claim['min_decode_speedup']:.2f}×, prefill ≤ "
                       f"{claim['max_prefill_speedup']:.2f}×"}
    why = [] if ok_dec else [f"decode gained less than {claim['min_decode_speedup']:.2f}×"]
    if not ok_pre:
        why.append(f"prefill gained {pre:.2f}×, more than {claim['max_prefill_speedup']:.2f}×: "
                   f"this CPU's integer kernels ({_cpu_features(env)}) run the quantized "
                   "matrices faster than F32, so prefill's compute got cheaper too")
    return {"verdict": "does not hold", "measured": measured, "why": "; ".join(why)}


def _cpu_features(env: dict) -> str:
    info = (env.get("llama") or {}).get("system_info") or ""
    found = [f for f in ("AVX512_VNNI", "AVX_VNNI", "AVX512", "AVX2", "NEON", "DOTPROD")
             if f"{f} = 1" in info]
    return ", ".join(found[:2]) or "its SIMD"


def _batching(claim: dict, analysis: dict, env: dict) -> dict:
    rows = analysis.get("batching") or []
    row = next((r for r in rows if r["parallel"] == claim["parallel"] and r.get("speedup")),
               None)
    if not row:
        return _not_measured(f"needs decode of 1 and {claim['parallel']} sequences")
    holds = row["speedup"] >= claim["min_gain"]
    per_seq = center(row["per_sequence_tok_s"])
    return {"verdict": "holds" if holds else "does not hold",
            "measured": f"{row['parallel']} sequences: {row['speedup']:.2f}× the aggregate "
                        f"tok/s of one, each sequence at {per_seq:.1f} tok/s",
            "why": f"needs ≥ {claim['min_gain']:.1f}×"}


def _long_prompt(claim: dict, analysis: dict, env: dict) -> dict:
    pre = [r for r in analysis["prefill"] if r["n_gen"] == 0]
    dec = analysis["decode"]
    if not pre or not dec:
        return _not_measured("needs a prefill and a decode")
    longest = max(pre, key=lambda r: r["n_prompt"])
    same = [d for d in dec if (d["model"], d["dtype"]) == (longest["model"], longest["dtype"])]
    if not same:
        return _not_measured("needs decode of the model of the longest prompt")
    ms = 1000 / center(same[0]["tok_s"])
    steps = longest["seconds"] * 1000 / ms
    holds = steps >= claim["min_tokens"]
    return {"verdict": "holds" if holds else "does not hold",
            "measured": f"{longest['n_prompt']:,} tokens: {longest['seconds']:.1f} s before the "
                        f"first token, the time of {steps:.0f} decode steps of {ms:.0f} ms",
            "why": f"needs ≥ {claim['min_tokens']} decode steps"}


def _plain_memory(claim: dict, analysis: dict, env: dict) -> dict:
    shares = [(r["effective_gb_s"] / r["copy_ceiling"]["value"], r) for r in _size_rows(analysis)
              if (r.get("copy_ceiling") or {}).get("value")]
    if not shares:
        return _not_measured("needs decode with a numpy copy measured beside it")
    lo, hi = min(s for s, _ in shares), max(s for s, _ in shares)
    holds = claim["low"] <= lo and hi <= claim["high"]
    return {"verdict": "holds" if holds else "does not hold",
            "measured": f"decode of {', '.join(r['model'] for _, r in shares)} reached "
                        f"{lo:.0%}–{hi:.0%} of the numpy copy bandwidth",
            "why": f"band {claim['low']:.0%}–{claim['high']:.0%}"}


CHECKS = {"decode_follows_bytes": _decode_follows_bytes,
          "prefill_compute_decode_memory": _phase_shares,
          "quant_helps_decode_not_prefill": _quant, "batching_gain": _batching,
          "long_prompt_first_token": _long_prompt, "share_of_plain_memory": _plain_memory}
assert set(CHECKS) == set(CLAIM_TESTS)
