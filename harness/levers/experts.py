"""Mixture of experts: a decode step reads k of E experts, so speed follows the active bytes.

The lever's analysis (rows from the stored records), its report table and its plot."""

from __future__ import annotations

import math
from pathlib import Path

from ..analysis.phases import fit_through_origin, longest_decodes
from ..core.records import Measurement, Model, Probe
from ..core.stats import center, ratio_summary, row_blocks
from ..render.plotkit import ci_errors, plt, save
from ..render.tabular import Column, Table
from .common import Lever, threads_label

GB = 1e9


# --- analysis

def expert_rows(models: dict[str, Model], phases: dict) -> list[dict]:
    """Each mixture-of-experts decode beside the two predictions of the rule of thumb (file
    size, active bytes), at a bandwidth the MoE rows did not set: the fit through the dense
    models of the same weight type and threads, else the model's streaming ceiling. The dense
    rows of that group come along, for comparison."""
    decode = longest_decodes(phases["decode"])
    moe = [r for r in decode if r["moe"]]
    rows = []
    for key in sorted({(r["dtype"], r["threads"]) for r in moe}):
        group = [r for r in decode if (r["dtype"], r["threads"]) == key]
        dense = [r for r in group if not r["moe"]]
        fit = _dense_fit(dense)
        for r in sorted(group, key=lambda r: (not r["moe"], r["model"])):
            gb_s, basis = fit or (r["stream_ceiling"]["value"],
                                  "ggml's streaming ceiling for its types")
            row = _expert_row(r, models[r["model_key"]], gb_s, basis)
            rows.append(row | {"of_active_ci": _paired_of_active(r, dense) if row["moe"]
                               else None})
    return rows


def _dense_fit(dense: list[dict]) -> tuple[float, str] | None:
    """The bandwidth the dense models of a group reached (their fit through the origin)."""
    if not dense:
        return None
    fit = fit_through_origin([d["bytes_per_token"] for d in dense],
                             [center(d["tok_s"]) for d in dense])
    return fit.gb_s, f"fitted on the dense {', '.join(sorted(d['model'] for d in dense))}"


def _paired_of_active(r: dict, dense: list[dict]) -> dict | None:
    """Measured ÷ the active-bytes prediction, round by round: in every round where the MoE
    model and the dense models decoded, the dense fit of that round predicts the MoE rate
    (drift cancels); without dense models, the share of the streaming ceiling per round."""
    if not dense:
        return r["share_of_stream_ci"]
    ours, theirs = row_blocks(r), [row_blocks(d) for d in dense]
    common = sorted(set(ours).intersection(*theirs))
    ratios = []
    for rnd in common:
        fit = fit_through_origin([d["bytes_per_token"] for d in dense], [t[rnd] for t in theirs])
        ratios.append(ours[rnd] / (fit.gb_s * GB / r["bytes_per_token"]))
    out = ratio_summary(ratios)
    return out and out | {"numerator": r["id"], "denominator": "the dense models' fit",
                          "metric": "decode_tok_s",
                          "name": f"decode of {r['model']} {r['dtype']}: measured ÷ its active "
                                  "bytes at the dense models' bandwidth, round by round"}


def _expert_row(r: dict, model: Model, gb_s: float | None, basis: str) -> dict:
    spec = model.spec
    kv_n_bytes = r["bytes_per_token"] - model.decode_weight_n_bytes
    file_n_bytes = model.weights_n_bytes + kv_n_bytes
    measured = center(r["tok_s"])
    by_file = gb_s * GB / file_n_bytes if gb_s else None
    by_active = gb_s * GB / r["bytes_per_token"] if gb_s else None
    follows = None
    if r["moe"] and by_file and by_active and measured:
        follows = ("active bytes" if abs(math.log(measured / by_active))
                   < abs(math.log(measured / by_file)) else "file size")
    return {"model": r["model"], "dtype": r["dtype"], "threads": r["threads"],
            "moe": r["moe"],
            "experts": (f"{spec['num_experts_per_tok']} of {spec['num_experts']}"
                        if r["moe"] else "dense"),
            "file_n_bytes": file_n_bytes, "active_n_bytes": r["bytes_per_token"],
            "tok_s": r["tok_s"], "gb_s": gb_s, "basis": basis,
            "by_file_tok_s": by_file, "by_active_tok_s": by_active,
            "of_active": measured / by_active if by_active and measured else None,
            "of_file": measured / by_file if by_file and measured else None,
            "follows": follows, "flags": r["flags"]}


def routing_rows(models: dict[str, Model]) -> list[dict]:
    """Per mixture of experts with recorded routing: the range over its layers of the experts
    a prefill touched and of what consecutive decode steps shared, beside uniform routing."""
    rows = []
    for _, model in sorted(models.items()):
        layers = (model.routing or {}).get("layers") or []
        whole = [r for r in layers if r["prefill_touched"] is not None
                 and r["prefill_tokens"] == model.routing["n_prompt"]]
        overlap = [r["decode_overlap"] for r in layers if r["decode_overlap"] is not None]
        if not layers or not overlap:
            continue
        first = layers[0]
        rows.append({"model": model.model, "dtype": model.dtype,
                     "experts": f"{first['k']} of {first['n_experts']}",
                     "n_prompt": model.routing["n_prompt"],
                     "n_decode": model.routing["n_decode"],
                     "touched": _span([r["prefill_touched"] for r in whole]),
                     "touched_uniform": whole[0]["prefill_uniform"] if whole else None,
                     "n_full": sum(r["prefill_touched"] >= 0.95 * r["n_experts"] for r in whole),
                     "n_layers": len(whole),
                     "overlap": _span(overlap, "{:.1f}"),
                     "overlap_uniform": first["uniform_overlap"],
                     "repeat": _span([r["decode_repeat"] for r in layers
                                      if r.get("decode_repeat") is not None], "{:.0%}"),
                     "repeat_uniform": first.get("uniform_repeat"),
                     "decode_touched": _span([r["decode_touched"] for r in layers])})
    return rows


def _span(values: list, fmt: str = "{}") -> str:
    if not values:
        return ""
    low, high = min(values), max(values)
    return fmt.format(low) if low == high else f"{fmt.format(low)}–{fmt.format(high)}"


def analyze(measurements: list[Measurement], models: dict[str, Model], probes: list[Probe],
            phases: dict) -> dict:
    return {"experts": expert_rows(models, phases), "routing": routing_rows(models)}


# --- table

def experts_table(analysis: dict) -> list[Table]:
    rows = analysis["experts"]
    if not rows:
        return []
    return [_experts_main_table(rows)] + _routing_summary(analysis["routing"])


REPEAT_NOTE = (" Sharing any: the share of consecutive decode steps with at least one expert in "
               "common, the Mixtral paper's \"first or second choice\" repetitions (arXiv "
               "2401.04088, Table 5: trained Mixtral 8x7B on The Pile 44.9–49.9% at layer 0, "
               "61.6–67.0% at layer 15, 44.5–53.6% at layer 31, against 46% uniform).")


def _routing_summary(rows: list[dict]) -> list[Table]:
    if not rows:
        return []
    # runs recorded before the repetition share have no such column
    repeats = ([Column("consecutive steps sharing any, per layer", "repeat"),
                Column("if uniform", "repeat_uniform", "pct")]
               if any(r["repeat"] for r in rows) else [])
    return [Table("routing", "Which experts the tokens picked", [
        Column("model", "model"), Column("dtype", "dtype"),
        Column("experts per token", "experts"), Column("prefill tokens", "n_prompt", "int"),
        Column("experts a prefill touched, per layer", "touched"),
        Column("if uniform", "touched_uniform", "f1"),
        Column("layers with ≥ 95% touched", "n_full", "int"),
        Column("layers", "n_layers", "int"),
        Column("decode steps", "n_decode", "int"),
        Column("shared by consecutive steps, per layer", "overlap"),
        Column("if uniform (k²/E)", "overlap_uniform", "f2"), *repeats,
        Column("experts over the decode, per layer", "decode_touched")], rows,
        ["Read from llama.cpp's graph (the ffn_moe_topk tensor) in one untimed prefill of "
         "random tokens in one ubatch and the decode steps after it, before the measurements; "
         "ranges over the layers (the last layer, which a prefill runs on its last token only, "
         "is left out of the prefill columns). If uniform: every token picking k of E "
         "independently and uniformly at random. `harness routing MODEL` prints every "
         "layer." + (REPEAT_NOTE if repeats else "")])]


def _experts_main_table(rows: list[dict]) -> Table:
    rows = [r | {"of_active_shown": r["of_active_ci"] or (
        {"n": 1, "median": r["of_active"]} if r["of_active"] else None)} for r in rows]
    return Table("experts", "Mixture of experts: file size or active bytes?", [
        Column("model", "model"), Column("dtype", "dtype"), Column("threads", "threads", "int"),
        Column("experts per token", "experts"),
        Column("file + KV GB", "file_n_bytes", "gb"),
        Column("GB read per token (active)", "active_n_bytes", "gb"),
        Column("measured tok/s", "tok_s", "stat"),
        Column("file size predicts tok/s", "by_file_tok_s", "f1"),
        Column("active bytes predict tok/s", "by_active_tok_s", "f1"),
        Column("measured ÷ active prediction", "of_active_shown", "stat2"),
        Column("follows", "follows")], rows, experts_notes(rows))


def experts_notes(rows: list[dict]) -> list[str]:
    """What the predictions are and what the measurement followed, from the rows."""
    out = ["A mixture-of-experts layer holds E experts and routes each token to k of them; "
           "ggml's mul_mat_id reads only the chosen experts' rows, so one decode step reads "
           "everything outside the experts (router and shared experts included) and k/E of "
           "the experts. Both predictions are bandwidth ÷ bytes (KV cache included), one with "
           "the whole file, one with the active bytes. The weights are random, so the router "
           "does not pick as a trained one does (see which experts the tokens picked, where "
           "recorded); that changes which experts are read, not how many per token."]
    for r in rows:
        if r["moe"] and r["follows"]:
            out.append(
                f"{r['model']} {r['dtype']}, {threads_label(r['threads'])}: at "
                f"{r['gb_s']:.1f} GB/s ({r['basis']}) its file size predicts "
                f"{r['by_file_tok_s']:.1f} tok/s and its active bytes "
                f"{r['by_active_tok_s']:.1f} tok/s; it measured {center(r['tok_s']):.1f} tok/s, "
                f"{r['of_active']:.0%} of the active-bytes prediction and "
                f"{r['of_file']:.1f}× the file-size one: it follows the {r['follows']}.")
    return out


# --- plot

def experts_finding(rows: list[dict]) -> str:
    """The plot's title: what the first MoE model's decode followed."""
    r = next((r for r in rows if r["follows"]), None)
    if not r:
        return "Mixture of experts: decode against file size and active bytes"
    return (f"{r['model']} decodes at {center(r['tok_s']):.1f} tok/s: "
            f"{r['of_active']:.0%} of the active-bytes prediction, "
            f"{r['of_file']:.1f}× the file-size one")


def experts(analysis: dict, out_dir: Path) -> str | None:
    rows = [r for r in analysis["experts"] if r["by_file_tok_s"]]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(rows))
    width = 0.27
    ax.bar([x - width for x in xs], [r["by_file_tok_s"] for r in rows], width,
           label="predicted from the file size", color="#bbbbbb")
    ax.bar(list(xs), [center(r["tok_s"]) for r in rows], width, label="measured (95% CI)",
           color="#1f77b4", yerr=ci_errors([r["tok_s"] for r in rows]), capsize=3)
    ax.bar([x + width for x in xs], [r["by_active_tok_s"] for r in rows], width,
           label="predicted from the active bytes", color="#ff7f0e")
    ax.set_xticks(list(xs), [f"{r['model']}\n{r['dtype']}, {r['experts']}" for r in rows],
                  fontsize=8)
    ax.set_ylabel("decode tokens/s")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    ax.set_title(experts_finding(rows), fontsize=10)
    return save(fig, out_dir, "experts")


LEVER = Lever("experts", analyze, experts_table, ("experts", "routing"), experts, "experts",
              "Measured decode tok/s of each model beside the tok/s its file size and its "
              "active bytes predict")


# --- routing (harness routing: the experts each token picks, recorded from the graph)

def routing_table(rows: list[dict], model: str) -> Table:
    """Per layer: experts a prefill touched and consecutive decode steps shared, beside what
    tokens picking uniformly at random would give."""
    first = rows[0] if rows else {"n_experts": 0, "k": 0}
    return Table("routing", f"Expert routing of {model}", [
        Column("layer", "layer", "int"), Column("prefill tokens", "prefill_tokens", "int"),
        Column("experts touched", "prefill_touched", "int"),
        Column("if uniform", "prefill_uniform", "f1"),
        Column("neighbours sharing any", "prefill_repeat", "pct"),
        Column("64–256 apart", "prefill_repeat_far", "pct"),
        Column("decode steps", "decode_steps", "int"),
        Column("shared by consecutive steps", "decode_overlap", "f2"),
        Column("if uniform (k²/E)", "uniform_overlap", "f2"),
        Column("steps sharing any", "decode_repeat", "pct"),
        Column("if uniform", "uniform_repeat", "pct"),
        Column("experts over the decode", "decode_touched", "int")], rows,
        [f"Each token picks {first['k']} of {first['n_experts']} experts per layer, read from "
         "llama.cpp's graph (the ffn_moe_topk tensor) as it ran. If uniform: every token "
         "picking independently and uniformly at random, E(1 − (1 − k/E)^n) experts touched by "
         "n tokens, k²/E shared by two consecutive ones, and 1 − C(E − k, k)/C(E, k) of "
         "consecutive pairs sharing any. Neighbours sharing any: consecutive prefill tokens; "
         "64–256 apart: the same for tokens 64, 128 and 256 apart (their mean), at the "
         "uniform figure when routing has locality but no bias shared by a whole sequence."
         + REPEAT_NOTE + " A layer a prefill runs on its last "
         "token only (llama.cpp drops the other tokens before the last layer's FFN) shows one "
         "prefill token."])
