"""A measurement record's summaries and flags, recomputed from its raw samples: the same
function makes them when a cell finishes and brings older runs to today's convention when a
results file is read. Pure."""

from __future__ import annotations

from ..core.stats import inverse, is_unstable, rates, ratio_summary, summarize
from . import noise

PERF_TOLERANCE = 0.05  # llama.cpp's counters may differ from the wall clock by 5% at most


def summarized(record: dict) -> dict:
    """The record with every summary recomputed from its raw samples (records of older
    versions are brought to today's statistics the same way)."""
    record = dict(record)
    samples = record["samples"]
    n_gen, parallel = record["n_gen"], record.get("parallel", 1)
    prefill = samples["prefill_s"]
    decode_totals = [sum(d) for d in samples["decode_s"] if d]
    n_prefill = parallel * (record.get("shared_prefix", 0) + record["n_prompt"])
    record |= {
        "ttft_s": summarize(prefill) if prefill else None,
        "prefill_tok_s": summarize(rates(n_prefill, prefill)) if prefill else None,
        # Tokens served per second: every sequence's tokens (the aggregate when batched).
        "decode_tok_s": (summarize(rates(parallel * n_gen, decode_totals))
                         if decode_totals else None),
    }
    # Per step: the gap between two tokens of one sequence, the exact inverse of the rate.
    record["decode_ms_per_token"] = inverse(record["decode_tok_s"], 1000.0 * parallel)
    if parallel > 1 and decode_totals:
        record["per_sequence_tok_s"] = summarize(rates(n_gen, decode_totals))
    if record.get("depth") and decode_totals and "baseline_decode_s" in samples:
        _paired(record, decode_totals)
    if "reuse_s" in samples:
        record["ttft_reuse_s"] = {k: summarize(v) for k, v in samples["reuse_s"].items()}
    record["flags"] = flags(record)
    return record


def _paired(record: dict, decode_totals: list[float]) -> None:
    """The depth-0 baseline decoded beside each repetition, and the per-repetition slowdown."""
    totals = [sum(b) for b in record["samples"]["baseline_decode_s"]]
    record["baseline_decode_tok_s"] = summarize(rates(record["n_gen"], totals))
    record["paired_slowdown"] = ratio_summary([d / b for d, b in zip(decode_totals, totals,
                                                                      strict=True) if b > 0])


def flags(record: dict) -> list[str]:
    """Why a measurement should be read with care: unstable, noisy, counters disagree."""
    out = []
    for phase in ("prefill", "decode"):
        summary = record[f"{phase}_tok_s"]
        if summary and is_unstable(summary):
            out.append(f"unstable-{phase}")
    for method, summary in (record.get("ttft_reuse_s") or {}).items():
        if is_unstable(summary):
            out.append(f"unstable-{method}")
    reading = record["noise"]
    during = reading["during_other_cores"]
    if (reading["idle_other_cores"] or 0) > noise.NOISY_CORES or (during or 0) > noise.NOISY_CORES:
        out.append("noisy")
    if _perf_disagrees(record):
        out.append("perf-mismatch")
    return out


def _perf_disagrees(record: dict) -> bool:
    samples = record["samples"]
    kind = record.get("kind", "single")
    if kind == "prefix_cache":
        return False  # the counters mix three prefills per repetition
    for i, perf in enumerate(samples["perf"]):
        prefill_wall = samples["prefill_s"][i] if samples["prefill_s"] else 0.0
        decode_wall = sum(samples["decode_s"][i])
        if kind == "batched":  # a multi-token batch counts as prompt eval: compare totals
            counted = perf["t_p_eval_ms"] + perf["t_eval_ms"]
            if counted and _off(counted / 1000, prefill_wall + decode_wall):
                return True
            continue
        prefill_off = prefill_wall and perf["n_p_eval"] and _off(perf["t_p_eval_ms"] / 1000,
                                                                  prefill_wall)
        decode_off = decode_wall and perf["n_eval"] and _off(perf["t_eval_ms"] / 1000,
                                                              decode_wall)
        if prefill_off or decode_off:
            return True
    return False


def _off(counter_s: float, wall_s: float) -> bool:
    return wall_s > 0 and abs(counter_s - wall_s) / wall_s > PERF_TOLERANCE
