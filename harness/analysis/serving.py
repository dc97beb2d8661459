"""Each serving level against the roofline: the bound the machine's measured ceilings put on
its decode (a step's bytes over ggml's streaming ceiling for the model's types, its FLOPs over
ggml's compute peak), which of the two binds, and, with one request in flight, the prompt's
share of the compute peak. Pure functions of a serving run's records."""

from __future__ import annotations

import statistics

from ..core.costs import (
    DecodeBound,
    decode_bound,
    decode_flops_per_token,
    mean_decode_context,
    prefill_flops,
    prefill_weight_n_bytes,
    step_weight_n_bytes,
)
from ..core.records import Level, Model, Probe
from ..core.specs import ModelSpec
from ..core.stats import ratio_summary
from .ceilings import above_ceiling, combined_ceiling

STREAM, COMPUTE = ("decode_type_n_bytes", "stream_gb_s"), ("matmul_type_n_params",
                                                           "compute_gflop_s")


def level_roofline(level: Level, model: Model | None, probes: list[Probe], workload: dict,
                   threads: int, slots: int) -> dict | None:
    """A closed-loop level's decode bound at the sequences decoding together (the requests in
    flight, at most the slots) from the probes of its rounds pooled, and the served and
    in-process decode as shares of it, round by round against the probes either side of
    each round; None for an open loop (no steady number of sequences) or a run without the
    served model's costs or probes."""
    seqs = set(level.probe_seqs)
    if model and model.error and level.concurrency:
        return {"missing": f"the served file's costs could not be read ({model.error})"}
    if not model or not model.spec or not level.concurrency or not seqs:
        return None
    mine = sorted((p for p in probes if p.seq in seqs), key=lambda p: p.seq)
    spec, b = ModelSpec(**model.spec), min(level.concurrency, slots)
    stream, peak = (_ceiling(model, mine, threads, what) for what in (STREAM, COMPUTE))
    out = {"n_sequences": b, "stream": stream, "compute": peak}
    if not (stream["value"] and peak["value"]):
        return out | {"missing": stream.get("reason") or peak.get("reason")}
    roof = _bound(model, spec, workload, b, stream["value"], peak["value"])
    solo = _bound(model, spec, workload, 1, stream["value"], peak["value"])
    binding = STREAM if roof.limiter == "memory bandwidth" else COMPUTE
    out |= {"bound_tok_s": roof.tok_s, "per_user_bound_tok_s": roof.tok_s / b,
            # each sequence's bound ÷ one sequence's alone, with the same ceilings
            "per_user_of_solo": solo.step_s / roof.step_s,
            "memory_s": roof.memory_s, "compute_s": roof.compute_s, "limiter": roof.limiter,
            "ridge_sequences": roof.ridge_sequences, "weight_n_bytes": _weights(model, spec, b),
            "kv_n_bytes": _kv_n_bytes(model, workload),
            "flops_per_token": decode_flops_per_token(spec, _context(workload)),
            "ceiling_range": _range(model, mine, threads, binding)}
    out |= _shares(level, model, spec, workload, mine, threads, b, roof,
                   stream if binding is STREAM else peak)
    if b == 1 and not workload.get("prefix_cache") and level.server_prompt_ms:
        out["prefill"] = prompt_roofline(spec, model, workload["n_prompt"],
                                         statistics.median(level.server_prompt_ms) / 1000,
                                         stream["value"], peak)
        out["prefill"]["ceiling_range"] = _range(model, mine, threads, COMPUTE)
    return out


def _shares(level: Level, model: Model, spec: ModelSpec, workload: dict, mine: list[Probe],
            threads: int, b: int, roof: DecodeBound, binding: dict) -> dict:
    """Served and in-process decode over the bound: each round's against the bound from the
    probes just before and just after it (a paired contrast, with its interval), or, for a
    level of one round, the steady window's over the level's bound."""
    rounds = (level.rounds or {}).get("per_round") or []
    served, inproc = [], []
    for r, row in enumerate(rounds):
        pair = mine[r:r + 2]
        if len(pair) < 2:
            continue
        bw, pk = (_ceiling(model, pair, threads, what)["value"] for what in (STREAM, COMPUTE))
        if not (bw and pk):
            continue
        bound = _bound(model, spec, workload, b, bw, pk).tok_s
        if row.get("served_tok_s"):
            served.append(row["served_tok_s"] / bound)
        inproc.append(row["inprocess_tok_s"] / bound)
    if served:
        stat, ip_stat = ratio_summary(served), ratio_summary(inproc)
        return {"served_share": stat["ratio"], "served_share_stat": stat,
                "inprocess_share": ip_stat["ratio"], "inprocess_share_stat": ip_stat,
                "above": _above(stat, binding), "inprocess_above": _above(ip_stat, binding)}
    steady, ip = level.steady_decode, level.inprocess_decode_tok_s
    share = steady["tok_s"] / roof.tok_s if steady else None
    ip_share = statistics.geometric_mean(ip) / roof.tok_s if ip else None
    return {"served_share": share, "served_share_stat": None,
            "inprocess_share": ip_share, "inprocess_share_stat": None,
            "above": above_ceiling(share, binding),
            "inprocess_above": above_ceiling(ip_share, binding)}


def _above(stat: dict, binding: dict) -> bool:
    """A share above 1 beyond its round-by-round interval (or the ceiling's spread)."""
    ci = stat.get("median_ci95")
    return ci[0] > 1 if ci else above_ceiling(stat["ratio"], binding)


def prompt_roofline(spec: ModelSpec, model: Model, n_prompt: int, prompt_s: float,
                    stream_gb_s: float, peak: dict) -> dict:
    """A prompt processed alone: its GFLOP/s over the server's prompt time, that over ggml's
    compute peak, and the two floors of its time (the weights read once, its FLOPs)."""
    flops = prefill_flops(spec, n_prompt)
    gflop_s = flops / prompt_s / 1e9
    share = gflop_s / peak["value"]
    return {"n_prompt": n_prompt, "prompt_s": prompt_s, "flops": flops, "gflop_s": gflop_s,
            "compute_gflop_s": peak["value"], "share": share,
            "above": above_ceiling(share, peak),
            "compute_s": flops / (peak["value"] * 1e9),
            # one ubatch of n_prompt tokens: the union of their experts, recorded or expected
            "memory_s": prefill_weight_n_bytes(model, spec, n_prompt, n_prompt)
            / (stream_gb_s * 1e9)}


def _bound(model: Model, spec: ModelSpec, workload: dict, b: int, stream_gb_s: float,
           compute_gflop_s: float) -> DecodeBound:
    context = _context(workload)
    return decode_bound(_weights(model, spec, b), _kv_n_bytes(model, workload),
                        decode_flops_per_token(spec, context), b, stream_gb_s, compute_gflop_s)


def _weights(model: Model, spec: ModelSpec, b: int) -> float:
    return step_weight_n_bytes(model.decode_weight_n_bytes, model.expert_n_bytes or 0, spec, b)


def _context(workload: dict) -> float:
    return mean_decode_context(workload["n_prompt"], workload["n_generate"])


def _kv_n_bytes(model: Model, workload: dict) -> float:
    return model.kv_n_bytes_per_token_f16 * _context(workload)


def _ceiling(model: Model, probes: list[Probe], threads: int, what: tuple[str, str]) -> dict:
    """The model's combined ceiling from these probes alone, their passes pooled."""
    span = (probes[0].seq - 1, probes[-1].seq + 1) if probes else (0, 0)
    return combined_ceiling(getattr(model, what[0]), probes, span, threads, what[1])


def _range(model: dict, probes: list[dict], threads: int, what: tuple[str, str]
           ) -> list[float] | None:
    """The lowest and highest ceiling one probe of the level gave: how far it swung."""
    values = [v for p in probes if (v := _ceiling(model, [p], threads, what)["value"])]
    return [min(values), max(values)] if values else None
