"""KV cache depth and type: decode slows as the cache it re-reads grows.

The lever's analysis (rows from the stored records), its report table and its plot."""

from __future__ import annotations

from pathlib import Path

from ..core.costs import (
    decode_n_bytes_per_token,
    kv_n_bytes_per_token,
    mean_decode_context,
)
from ..core.records import Measurement, Model, Probe
from ..core.stats import center
from ..render.plotkit import ci_errors, finish, plt
from ..render.tabular import Column, Table, notes_for
from .common import Lever, group_records, group_rows, median_of, spec_of

KV_MEMORY_USERS = (1, 8, 32, 128)
KV_MEMORY_CONTEXTS = (2048, 8192, 32768, 131072)


# --- analysis

def kv_depth_rows(measurements: list[Measurement], models: dict[str, Model]) -> list[dict]:
    """Decode at each depth with its measured slowdown (against the paired depth-0 baseline)
    and the slowdown its bytes predict. Groups with an F16 cache and nothing cached are left out;
    a cell at a depth has its own paired baseline, so it is shown alone too."""
    singles = [m for m in measurements if m.kind == "single" and m.n_gen
               and m.decode_tok_s and m.model_key in models]
    rows = []
    for group in group_records(singles, lambda m: (m.model_key, m.threads, m.kv_type,
                                                   m.n_prompt, m.n_gen)):
        depths = {m.depth for m in group}
        if depths == {0} and group[0].kv_type == "f16":  # nothing cached, nothing to show
            continue
        group.sort(key=lambda m: m.depth)
        base = group[0]
        for m in group:
            rows.append(_kv_row(m, base, models))
    return rows


def _kv_row(m: Measurement, base: Measurement, models: dict[str, Model]) -> dict:
    model, kv = models[m.model_key], m.kv_type
    per_token = kv_n_bytes_per_token(spec_of(models, m.model_key), kv, kv)

    def step_n_bytes(depth: int) -> float:
        context = depth + mean_decode_context(m.n_prompt, m.n_gen)
        return decode_n_bytes_per_token(model.decode_weight_n_bytes, per_token, context)

    ms, base_ms = median_of(m.decode_ms_per_token), median_of(base.decode_ms_per_token)
    paired = m.paired_slowdown
    if paired:  # the same decode at depth 0, timed beside each repetition
        measured, against = paired, "paired depth-0 baseline"
        if paired.get("median_ci95") and "numerator" not in paired:
            measured = paired | {
                "numerator": m.id, "denominator": f"{m.id} (its depth-0 baseline)",
                "metric": "seconds", "name": f"decode step of {m.model} {m.dtype} at "
                f"depth {m.depth:,} ÷ at depth 0, in the same repetition"}
    elif not m.depth:
        measured, against = {"median": 1.0, "mean": 1.0, "n": 1}, "itself"
    else:  # a run from before the paired baseline existed: another measurement at depth 0
        measured = ({"median": ms / base_ms, "mean": ms / base_ms, "n": 1}
                    if ms and base_ms else None)
        against = f"the depth-{base.depth} measurement"
    return {"model": m.model, "model_key": m.model_key, "dtype": m.dtype, "threads": m.threads,
            "kv_type": kv, "depth": m.depth, "n_gen": m.n_gen, "tok_s": m.decode_tok_s,
            "baseline_tok_s": m.baseline_decode_tok_s,
            "ms_per_token": m.decode_ms_per_token, "kv_n_bytes_per_token": per_token,
            "kv_n_bytes": per_token * (m.depth + mean_decode_context(m.n_prompt, m.n_gen)),
            "bytes_per_token": step_n_bytes(m.depth),
            "slowdown_against": against, "measured_slowdown": measured,
            "predicted_slowdown": step_n_bytes(m.depth) / step_n_bytes(0),
            "flags": m.flags, "noise": m.noise}


def kv_memory_rows(kv_rows: list[dict], models: dict[str, Model]) -> list[dict]:
    """Weights plus every user's KV cache at a context, for each model and KV type measured."""
    rows = []
    for model_key, kv in sorted({(r["model_key"], r["kv_type"]) for r in kv_rows}):
        model = models[model_key]
        spec = spec_of(models, model_key)
        per_token = kv_n_bytes_per_token(spec, kv, kv)
        for context in KV_MEMORY_CONTEXTS:
            if context > spec.max_position_embeddings:
                continue
            row = {"model": model.model, "dtype": model.dtype, "kv_type": kv,
                   "context": context, "kv_per_user": per_token * context}
            for users in KV_MEMORY_USERS:
                row[f"users_{users}"] = model.weights_n_bytes + users * per_token * context
            rows.append(row)
    return rows


def analyze(measurements: list[Measurement], models: dict[str, Model], probes: list[Probe],
            phases: dict) -> dict:
    kv = kv_depth_rows(measurements, models)
    return {"kv_depth": kv, "kv_memory": kv_memory_rows(kv, models)}


# --- table

def _unpaired_note(rows: list[dict]) -> list[str]:
    if any(r["depth"] and r["baseline_tok_s"] is None for r in rows):
        return ["This run predates the paired baseline: its slowdowns compare separate "
                "measurements, so they include the machine's drift between them."]
    return []


def _drift_notes(rows: list[dict]) -> list[str]:
    """At depth 0 the cache holds next to nothing, so KV types differing there is drift."""
    out = []
    for key in sorted({(r["model"], r["dtype"], r["threads"]) for r in rows}):
        zero = {r["kv_type"]: center(r["tok_s"]) for r in rows if r["depth"] == 0
                and (r["model"], r["dtype"], r["threads"]) == key}
        if len(zero) >= 2:
            spread = max(zero.values()) / min(zero.values()) - 1
            out.append(f"{key[0]} {key[1]}: at depth 0 the KV types read almost the same bytes, "
                       f"yet decode differed by {spread:.0%} ("
                       + ", ".join(f"{k} {v:.2f} tok/s" for k, v in zero.items())
                       + "): that is how far this machine drifted between measurements, "
                       "and why each slowdown is measured against its own paired baseline.")
    return out


def kv_tables(analysis: dict) -> list[Table]:
    rows = analysis["kv_depth"]
    if not rows:
        return []
    depth = Table("kv_depth", "KV cache: decode at context depth", [
        Column("model", "model"), Column("dtype", "dtype"), Column("threads", "threads", "int"),
        Column("KV type", "kv_type"), Column("depth", "depth", "int"),
        Column("KV per token (KiB)", "kv_n_bytes_per_token", "kib"),
        Column("KV read per step (MiB)", "kv_n_bytes", "mib"),
        Column("read per step (GiB)", "bytes_per_token", "gib"),
        Column("decode tok/s", "tok_s", "stat"), Column("ms/token", "ms_per_token", "stat"),
        Column("paired depth-0 tok/s", "baseline_tok_s", "stat"),
        Column("measured slowdown (×)", "measured_slowdown", "stat2"),
        Column("slowdown the bytes predict", "predicted_slowdown", "x"),
        Column("notes", "notes")],
        [r | {"notes": notes_for(r | {"decode_tok_s": r["tok_s"]}, ("decode",))}
         for r in rows],
        ["The depth is filled once, untimed; every repetition then trims the cache back to it "
         "and times the decode. Each step reads every weight plus K and V of every cached "
         "token (layers × KV heads × head size × 2 × bytes per element).",
         "Measured slowdown: in every repetition the same tokens are first decoded on an empty "
         "second sequence of the same context (depth 0), then at the depth; the slowdown is "
         "the ratio of the two, so drift of the machine between measurements cancels. The "
         "predicted slowdown is the ratio of bytes read per step; a measured slowdown above "
         "it means attention costs more than its bytes: the dot products over the context, "
         "run on few cores.",
         *_drift_notes(rows), *_unpaired_note(rows)])
    memory = Table("kv_memory", "Memory for concurrent users (estimates)", [
        Column("model", "model"), Column("dtype", "dtype"), Column("KV type", "kv_type"),
        Column("context", "context", "int"), Column("KV per user (GiB)", "kv_per_user", "gib3"),
        Column("1 user (GiB)", "users_1", "gib"), Column("8 users (GiB)", "users_8", "gib"),
        Column("32 users (GiB)", "users_32", "gib"),
        Column("128 users (GiB)", "users_128", "gib")], analysis["kv_memory"],
        ["Estimates, not measurements: weights once plus each user's full-context KV cache "
         "(llama.cpp keeps a cell per token per sequence); compute buffers come on top."])
    return [depth, memory]


# --- plot

def kv_finding(rows: list[dict]) -> str:
    """The plot's title: the deepest measured point's slowdown against what its bytes predict."""
    deep = max(rows, key=lambda r: (r["depth"], center(r["measured_slowdown"])))
    return (f"At {deep['depth']:,} cached tokens ({deep['model']}, KV {deep['kv_type']}) decode "
            f"ran {center(deep['measured_slowdown']):.2f}× slower; its bytes predict "
            f"{deep['predicted_slowdown']:.2f}×")


def kv_depth(analysis: dict, out_dir: Path) -> str | None:
    rows = [r for r in analysis["kv_depth"] if r["measured_slowdown"]]
    if len({r["depth"] for r in rows}) < 2:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, group in group_rows(rows, "model", "dtype", "kv_type", "threads").items():
        group = sorted(group, key=lambda r: r["depth"])
        depths = [r["depth"] for r in group]
        err = ci_errors([r["measured_slowdown"] for r in group])
        line = ax.errorbar(depths, [center(r["measured_slowdown"]) for r in group], yerr=err,
                           fmt="o-", capsize=4, label=f"{key[0]} {key[1]}, KV {key[2]}: "
                           "measured (95% CI)")[0]
        ax.plot(depths, [r["predicted_slowdown"] for r in group], "--", color=line.get_color(),
                label=f"KV {key[2]}: predicted from bytes")
    ax.axhline(1, color="0.7", lw=0.8)
    return finish(ax, fig, out_dir, "kv_depth", "context depth (tokens already in the KV cache)",
                  "decode slowdown against depth 0 (×)", kv_finding(rows))


LEVER = Lever("kv_depth", analyze, kv_tables, ("kv_depth", "kv_memory"),
              kv_depth, "kv_depth",
              "Decode slowdown against context depth, measured and predicted from bytes")
