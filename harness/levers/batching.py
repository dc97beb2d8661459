"""Batching: B sequences decoded together share one read of the weights per step.

The lever's analysis (rows from the stored records), its report table and its plot."""

from __future__ import annotations

from pathlib import Path

from ..analysis.ceilings import combined_ceiling, span
from ..core.costs import (
    decode_bound,
    decode_flops_per_token,
    expert_union_fraction,
    kv_n_bytes_per_token,
    mean_decode_context,
    step_weight_n_bytes,
)
from ..core.records import Measurement, Model, Probe
from ..core.stats import center, scaled
from ..render.plotkit import ci_errors, log2_pair, plt, save
from ..render.tabular import Column, Table
from .common import (
    Lever,
    group_records,
    group_rows,
    median_of,
    round_ratio,
    spec_of,
    threads_label,
    unpaired_note,
)

# --- analysis

def batching_rows(measurements: list[Measurement], models: dict[str, Model],
                  probes: list[Probe]) -> list[dict]:
    """Aggregate and per-sequence decode at each batch size, beside the roofline bound."""
    decodes = [m for m in measurements if m.n_gen and m.decode_tok_s
               and m.kind in ("single", "batched") and not m.depth
               and m.kv_type == "f16" and m.model_key in models]
    rows = []
    for group in group_records(decodes, lambda m: (m.model_key, m.threads, m.n_prompt,
                                                   m.n_gen)):
        if max(m.parallel for m in group) < 2:
            continue
        group.sort(key=lambda m: m.parallel)
        base = group[0] if group[0].parallel == 1 else None
        rows += [_batch_row(m, base, models, probes) for m in group]
    return rows


def _batch_row(m: Measurement, base: Measurement | None, models: dict[str, Model],
               probes: list[Probe]) -> dict:
    model, b = models[m.model_key], m.parallel
    spec = spec_of(models, m.model_key)
    # a mixture of experts reads the union of the B tokens' experts (dense: the same weights)
    solo_n_bytes = model.decode_weight_n_bytes
    weight_n_bytes = step_weight_n_bytes(solo_n_bytes, model.expert_n_bytes or 0, spec, b)
    bw = combined_ceiling(model.decode_type_n_bytes, probes, span(m), m.threads,
                          "stream_gb_s")["value"]
    peak = combined_ceiling(model.matmul_type_n_params, probes, span(m), m.threads,
                            "compute_gflop_s")["value"]
    # One step multiplies every weight matrix by B vectors and reads each sequence's own KV
    # cache, attending over it (core/costs.decode_flops_per_token, decode_bound).
    context = mean_decode_context(m.n_prompt, m.n_gen)
    kv_n_bytes = kv_n_bytes_per_token(spec) * context
    roof = (decode_bound(weight_n_bytes, kv_n_bytes, decode_flops_per_token(spec, context), b,
                         bw, peak) if bw and peak else None)
    bound = roof.tok_s if roof else None
    ridge = roof.ridge_sequences if roof else None
    agg = median_of(m.decode_tok_s)
    return {"model": m.model, "dtype": m.dtype, "threads": m.threads, "parallel": b,
            "tok_s": m.decode_tok_s, "per_sequence_tok_s": m.per_sequence_tok_s
            or m.decode_tok_s, "ms_per_step": m.decode_ms_per_token,
            "speedup": center(ratio := round_ratio(m, base, "decode") if base else None),
            "speedup_ci": ratio, "per_user_ci": _per_user(ratio, b),
            "weight_n_bytes_per_token": weight_n_bytes / b, "bound_tok_s": bound,
            # the speed-up if a step's time followed its bytes alone
            "bytes_speedup": b * (solo_n_bytes + kv_n_bytes) / (weight_n_bytes + b * kv_n_bytes),
            "experts_read": (spec.num_experts * expert_union_fraction(
                spec.num_experts, spec.num_experts_per_tok, b) if spec.is_moe else None),
            "n_experts": spec.num_experts,
            "share_of_bound": agg / bound if bound else None, "ridge_parallel": ridge,
            "stream_gb_s": bw, "compute_gflop_s": peak, "flags": m.flags}


def _per_user(ratio: dict | None, parallel: int) -> dict | None:
    """Each sequence's speed ÷ one sequence alone: the aggregate gain ÷ the sequences."""
    if not ratio or parallel == 1:
        return None
    out = scaled(ratio, 1 / parallel) | {k: ratio[k] for k in ("numerator", "denominator",
                                                               "paired") if k in ratio}
    return out | {"ratio": out["median"], "metric": "per_sequence_tok_s",
                  "name": ratio["name"] + ", per sequence"}


def analyze(measurements: list[Measurement], models: dict[str, Model], probes: list[Probe],
            phases: dict) -> dict:
    return {"batching": batching_rows(measurements, models, probes)}


# --- table

def batching_table(analysis: dict) -> list[Table]:
    rows = analysis["batching"]
    if not rows:
        return []
    return [Table("batching", "Batching: independent sequences decoded together", [
        Column("model", "model"), Column("dtype", "dtype"), Column("threads", "threads", "int"),
        Column("sequences", "parallel", "int"), Column("aggregate tok/s", "tok_s", "stat"),
        Column("per-sequence tok/s", "per_sequence_tok_s", "stat"),
        Column("ms/step", "ms_per_step", "stat"),
        Column("speed-up (×)", "speedup_ci", "stat2"),
        Column("bytes predict (×)", "bytes_speedup", "f2"),
        Column("weight MiB read per token served", "weight_n_bytes_per_token", "mib"),
        Column("roofline bound tok/s", "bound_tok_s", "f1"),
        Column("share of bound", "share_of_bound", "pct")], rows, batching_notes(rows))]


def batching_notes(rows: list[dict]) -> list[str]:
    """Where the gain from batching stops, explained from the measured ceilings."""
    out = ["Each step is one llama_decode of one token from every sequence (its own seq id); "
           "aggregate tok/s counts all of them, per-sequence tok/s is what each user sees. The "
           "weights are read once per step, so the bytes per token served fall as 1/B. "
           "\"Bytes predict\" is the speed-up if a step took time in proportion to the bytes it "
           "reads (weights plus each sequence's KV cache)."]
    for key in sorted({(r["model"], r["dtype"], r["threads"]) for r in rows}):
        group = sorted((r for r in rows if (r["model"], r["dtype"], r["threads"]) == key),
                       key=lambda r: r["parallel"])
        out.append(_batching_note(key, group))
        if group[0]["experts_read"] is not None:
            out.append(_experts_note(key, group))
    return out + unpaired_note([(f"{r['model']} {r['dtype']} at B = {r['parallel']}", "B = 1",
                                 r["speedup_ci"]) for r in rows if r["parallel"] > 1])


def _experts_note(key: tuple, group: list[dict]) -> str:
    """An MoE model's batching against the expert-union prediction."""
    e = group[0]["n_experts"]
    reads = ", ".join(f"{r['experts_read']:.1f} at B = {r['parallel']}" for r in group)
    text = (f"{key[0]} is a mixture of experts: a step of B sequences reads the union of their "
            f"experts, an expected E(1 − (1 − k/E)^B) of its {e} per layer ({reads}; separate "
            "sequences pick independently, and the builder's routers pick every expert as "
            "often; trained routers are skewed, favouring some experts, so that sequences "
            "share more)")
    pairs = [f"{r['speedup']:.2f}× measured against {r['bytes_speedup']:.2f}× from the bytes "
             f"at B = {r['parallel']}" for r in group if r["parallel"] > 1 and r["speedup"]]
    return text + (": " + "; ".join(pairs) if pairs else "") + "."


def _batching_note(key: tuple, group: list[dict]) -> str:
    """The measured gain, and where the roofline puts the end of it, said only as far as the
    run measured."""
    best = max(group, key=lambda r: center(r["tok_s"]))
    top = group[-1]["parallel"]
    text = (f"{key[0]} {key[1]}, {threads_label(key[2])}: the best aggregate was "
            f"{center(best['tok_s']):.1f} tok/s at {best['parallel']} sequences")
    if len(group) >= 2:
        last, prev = group[-1], group[-2]
        gain = center(last["tok_s"]) / center(prev["tok_s"]) - 1
        text += (f"; from {prev['parallel']} to {last['parallel']} sequences the aggregate "
                 f"{'still grew' if gain > 0 else 'changed'} by {gain:+.0%}")
    r = next((r for r in group if r["ridge_parallel"]), None)
    if r:
        ridge = r["ridge_parallel"]
        text += (f". A step costs at least max((weights + B × KV) ÷ {r['stream_gb_s']:.1f} "
                 f"GB/s, B × FLOPs per token ÷ {r['compute_gflop_s']:.0f} GFLOP/s), with the "
                 "streaming and compute ceilings of ggml's own kernels for this model's types; "
                 f"the two meet at B ≈ {ridge:.1f}")
        text += (", inside the measured range: beyond it each extra sequence costs its own "
                 "compute" if ridge <= top else
                 f", beyond the largest batch measured ({top}): where the gain really ends "
                 "was not measured (estimated)")
        shares = [f"{x['share_of_bound']:.0%} at B = {x['parallel']}" for x in group
                  if x["share_of_bound"]]
        if shares:
            text += ". Measured against that bound: " + ", ".join(shares)
    return text + "."


# --- plot

def batching_finding(rows: list[dict]) -> str:
    """The plot's title: the largest batch measured, its aggregate gain and each user's share."""
    top = max(rows, key=lambda r: (r["parallel"], center(r["tok_s"])))
    solo = next((r for r in rows if r["parallel"] == 1 and (r["model"], r["dtype"], r["threads"])
                 == (top["model"], top["dtype"], top["threads"])), None)
    if not solo or not top["speedup"]:
        return f"Batching: up to {top['parallel']} sequences decoded together"
    each = center(top["per_sequence_tok_s"]) / center(solo["tok_s"])
    return (f"{top['parallel']} sequences together ({top['model']} {top['dtype']}): "
            f"{top['speedup']:.2f}× the tokens/s of one; each sequence at {each:.0%} of its solo "
            "speed")


def batching(analysis: dict, out_dir: Path) -> str | None:
    rows = analysis["batching"]
    if not rows:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for key, group in group_rows(rows, "model", "dtype", "threads").items():
        group = sorted(group, key=lambda r: r["parallel"])
        b = [r["parallel"] for r in group]
        label = f"{key[0]} {key[1]} ({key[2]} threads)"
        line = a1.errorbar(b, [center(r["tok_s"]) for r in group],
                           yerr=ci_errors([r["tok_s"] for r in group]), fmt="o-", capsize=3,
                           label=f"{label}: measured (95% CI)")[0]
        if all(r["bound_tok_s"] for r in group):
            a1.plot(b, [r["bound_tok_s"] for r in group], "--", color=line.get_color(),
                    label=f"{key[0]}: roofline bound from the measured ceilings")
        a2.errorbar(b, [center(r["per_sequence_tok_s"]) for r in group],
                    yerr=ci_errors([r["per_sequence_tok_s"] for r in group]), fmt="o-",
                    capsize=3, label=label)
    log2_pair(a1, a2, "sequences decoded together", "aggregate tokens/s",
              "tokens/s each sequence sees")
    for ax in (a1, a2):  # under the panels: inside, long labels covered the lines and ticks
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    fig.suptitle(batching_finding(rows))
    return save(fig, out_dir, "batching")


LEVER = Lever("batching", analyze, batching_table, ("batching",),
              batching, "batching",
              "Aggregate and per-sequence decode tok/s against the number of sequences")
