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
    "decode_share_of_ceiling": ({"low": ("float", 0.5), "high": ("float", 0.8)},
                                "decode's effective bandwidth between low and high × what "
                                "this machine reads (ggml's streaming kernel)"),
    "workload_balance": ({"prefill_bound": ("str", "classification; rag, long context"),
                          "decode_bound": ("str", "chat; long-form generation")},
                         "each workload named in prefill_bound (decode_bound) spends more "
                         "(less) than half its time in prefill, interval included"),
    "not_tested": ({"needs": ("text", "")}, "a claim this run cannot test, and what would"),
}
# Tests renamed since runs were stored: read under their new name (one migration, at load).
RENAMED_TESTS = {"share_of_plain_memory": "decode_share_of_ceiling"}
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
    test = RENAMED_TESTS.get(claim.get("test"), claim.get("test"))
    if test not in CLAIM_TESTS:
        raise doc.error(path + ("test",), f"unknown claim test {test!r}",
                        fix="choose one of " + ", ".join(CLAIM_TESTS))
    params, _ = CLAIM_TESTS[test]
    check_keys(doc, path, claim, ["claim", "test", "published", *params], ("claim", "test"))
    out = {"claim": want_str(doc, path + ("claim",), claim["claim"]), "test": test,
           "published": str(claim.get("published", ""))}
    readers = {"float": lambda k, v: want_float(doc, path + (k,), v, minimum=0),
               "int": lambda k, v: want_int(doc, path + (k,), v, minimum=1, maximum=1 << 20),
               "str": lambda k, v: want_str(doc, path + (k,), v).lower(),
               "text": lambda k, v: want_str(doc, path + (k,), v)}
    for key, (kind, default) in params.items():
        out[key] = readers[kind](key, claim[key]) if key in claim else default
    if test == "not_tested" and not out["needs"].strip():
        raise doc.error(path + ("needs",), "a claim the run cannot test needs what would test it",
                        fix="add needs: \"...\" (the measurement that would decide it)")
    return out


def published_decode_tok_s(figure: dict) -> float | None:
    """A published figure's decode tok/s, given as such or as ms per token; None without."""
    if figure.get("decode_tok_s"):
        return figure["decode_tok_s"]
    return 1000 / figure["ms_per_token"] if figure.get("ms_per_token") else None


def published_prefill(figure: dict) -> tuple[float, float] | None:
    """A published prefill figure as (tok/s, seconds) of its prompt, whichever it gave;
    None for a figure without a prefill number."""
    tok_s = figure.get("prefill_tok_s") or (figure["prompt"] / figure["prefill_s"]
                                            if figure.get("prefill_s") else None)
    if tok_s is None:
        return None
    return tok_s, figure.get("prefill_s") or figure["prompt"] / tok_s


def reference_from_header(header) -> dict | None:
    """The block a run stored (header: a run's Header record), or None (runs of scenarios
    without one, and serving runs)."""
    ref = ((header.scenario if header else None) or {}).get("reference")
    if ref is not None and not isinstance(ref, dict):
        raise HarnessError("the run's stored reference block is not a mapping",
                           fix="re-run the scenario")
    if ref is None:
        return None
    claims = [c | {"test": RENAMED_TESTS.get(c.get("test"), c.get("test"))}
              for c in ref.get("claims") or []]
    return ref | {"claims": claims}
