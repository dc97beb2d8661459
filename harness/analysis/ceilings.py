"""The yardsticks beside each measurement: probe figures looked up by record position, a
model's ceiling combined over its tensor types, and the per-repetition rates the comparisons
use. Pure functions of the stored records."""

from __future__ import annotations

from ..core.stats import half_width


def _samples_key(key: str) -> str:
    """read_gb_s -> read_samples_gb_s; stream_gb_s -> stream_samples_gb_s; ..."""
    name, _, unit = key.partition("_")
    return f"{name}_samples_{unit}"


def probe_figure(probe: dict | None, threads: int, path: tuple[str, ...]) -> dict | None:
    """One figure of one probe at a thread count: its value (best pass), samples, layout."""
    node = ((probe or {}).get("result") or {}).get("threads", {}).get(str(threads))
    for part in path[:-1]:
        node = (node or {}).get(part)
    if not node or not node.get(path[-1]):
        return None
    return {"value": node[path[-1]], "samples": node.get(_samples_key(path[-1])) or [],
            "layout": node.get("layout")}


def span(m: dict) -> tuple[int, int]:
    """The records a measurement's repetitions lie between (one point for older runs)."""
    first = (m.get("span_seq") or [m["seq"]])[0]
    return first, m["seq"]


def ceiling_near(probes: list[dict], seq: int | tuple[int, int], threads: int,
                 path: tuple[str, ...]) -> dict:
    """The figure from the probes that measured it nearest a record (or a span of records:
    the nearest before, every one inside, the nearest after): their mean, and its spread
    (half-width of the 95% CI of their pooled samples, relative)."""
    lo, hi = seq if isinstance(seq, tuple) else (seq, seq)
    before = next((f for p in reversed(probes) if p["seq"] < lo
                   and (f := probe_figure(p, threads, path))), None)
    inside = [f for p in probes if lo < p["seq"] < hi and (f := probe_figure(p, threads, path))]
    after = next((f for p in probes if p["seq"] > hi
                  and (f := probe_figure(p, threads, path))), None)
    found = [f for f in (before, *inside, after) if f]
    out = {"before": before and before["value"], "after": after and after["value"],
           "value": None, "spread": None, "layout": next((f["layout"] for f in found), None),
           "n_probes": len(found)}
    if not found:
        return out
    out["value"] = sum(f["value"] for f in found) / len(found)
    spread = half_width([s for f in found for s in f["samples"]])
    out["spread"] = spread / out["value"] if spread is not None else None  # relative
    if before and after:
        out["drift"] = (after["value"] - before["value"]) / before["value"]
    return out


def combined_ceiling(weights: dict[str, float], probes: list[dict],
                     seq: int | tuple[int, int], threads: int, what: str) -> dict:
    """A model's ceiling over its mix of tensor types: total ÷ Σ (weight of t ÷ ceiling of t)
    (time adds up over the types); a type without a ceiling leaves it missing, not guessed."""
    weights = {t: w for t, w in (weights or {}).items() if w > 0}
    if not weights:
        return {"value": None, "spread": None, "missing": [], "reason": "no per-type counts "
                "(a run recorded before they existed)"}
    per = {t: ceiling_near(probes, seq, threads, ("ggml", t, what)) for t in weights}
    missing = sorted(t for t, c in per.items() if not c["value"])
    if missing:
        return {"value": None, "spread": None, "missing": missing,
                "reason": f"no ggml ceiling for {', '.join(missing)} at {threads} threads"}
    times = {t: w / per[t]["value"] for t, w in weights.items()}
    total_time = sum(times.values())
    spreads = [(times[t], per[t]["spread"]) for t in weights if per[t]["spread"] is not None]
    spread = (sum(w * s for w, s in spreads) / sum(w for w, _ in spreads)) if spreads else None
    return {"value": sum(weights.values()) / total_time, "spread": spread, "missing": [],
            "by_type": {t: per[t]["value"] for t in weights},
            "layouts": {t: per[t]["layout"] for t in weights}}


def above_ceiling(share: float | None, ceiling: dict) -> bool:
    """A share above 100% by more than the ceiling's own spread."""
    return share is not None and share > 1 + (ceiling.get("spread") or 0)


def is_plain(m: dict) -> bool:
    """One sequence from an empty F16 KV cache: the measurements the rule of thumb fits."""
    return (m.get("kind", "single") == "single" and not m.get("depth")
            and m.get("kv_type", "f16") == "f16")


def rep_rates(m: dict, phase: str) -> list[float | None]:
    """Each repetition's tok/s of one phase (decode counts every sequence's tokens), in the
    order of the record's samples; None where a repetition has no such phase."""
    samples = m.get("samples") or {}
    if phase == "decode":
        n = m.get("parallel", 1) * m["n_gen"]
        return [n / sum(d) if d and sum(d) > 0 else None for d in samples.get("decode_s", [])]
    n = m.get("parallel", 1) * (m.get("shared_prefix", 0) + m["n_prompt"])
    return [n / t if t else None for t in samples.get("prefill_s", [])]


def round_rates(m: dict, phase: str) -> dict[tuple[int, int], float]:
    """Each repetition's rate keyed by its block, (RAM group, round): only cells of one group
    ran side by side, so only they pair (runs before rounds ran on across groups numbered
    each group's rounds from 0)."""
    rounds = (m.get("samples") or {}).get("rounds") or []
    group = m.get("ram_group", 0)
    return {(group, r): x for r, x in zip(rounds, rep_rates(m, phase), strict=False)
            if r is not None and x}
