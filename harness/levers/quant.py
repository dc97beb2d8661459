"""Quantization: fewer bytes per weight, faster decode, prefill about the same.

The lever's analysis (rows from the stored records), its report table and its plot."""

from __future__ import annotations

from pathlib import Path

from ..analysis.ceilings import is_plain
from ..core.records import Measurement, Model, Probe
from ..core.stats import center
from ..engine.scenario import TWIN_PAIR
from ..render.plotkit import ci_errors, plt, save
from ..render.tabular import Column, Table
from .common import Lever, group_records, group_rows, round_ratio, unpaired_note

# --- analysis

def composition(model: Model) -> dict:
    """What a file really holds: bits per weight and each tensor type's share of the weights."""
    params = model.tensor_type_n_params
    n_bytes = model.tensor_type_n_bytes
    total_params = sum(params.values())
    shares = ({t: n / total_params for t, n in sorted(params.items(), key=lambda kv: -kv[1])}
              if total_params else {})
    # Runs recorded before the per-type counts existed: llama.cpp's own parameter count.
    n_params = total_params or model.n_params
    return {"bits_per_weight": 8 * sum(n_bytes.values()) / n_params if n_params else None,
            "params_share": shares,
            "bytes_share": {t: n / sum(n_bytes.values()) for t, n in n_bytes.items()}}


def quant_rows(measurements: list[Measurement], models: dict[str, Model]) -> list[dict]:
    """Per model and thread count with two or more dtypes: bytes, speeds and speed-ups."""
    # a twin pair is one file's values against random ones, not two types (levers/twins.py)
    plain = [m for m in measurements if is_plain(m) and m.model_key in models
             and m.dtype not in TWIN_PAIR]
    rows = []
    for group in group_records(plain, lambda m: (m.model, m.threads)):
        by_dtype: dict[str, dict] = {}
        keys: dict[str, str] = {}
        for m in group:
            row = by_dtype.setdefault(m.dtype, {"model": m.model, "dtype": m.dtype,
                                                "threads": m.threads})
            keys.setdefault(m.dtype, m.model_key)
            if m.n_gen and "decode_tok_s" not in row:
                row["decode_tok_s"], row["_decode"] = m.decode_tok_s, m
            if m.n_gen == 0 and m.prefill_tok_s and "prefill_tok_s" not in row:
                row["prefill_tok_s"], row["n_prompt"] = m.prefill_tok_s, m.n_prompt
                row["_prefill"] = m
        if len(by_dtype) < 2:
            continue
        for dtype, row in by_dtype.items():
            model = models[keys[dtype]]
            row |= {"file_n_bytes": model.weights_n_bytes,
                    "bytes_per_token": model.decode_weight_n_bytes} | composition(model)
        rows += _speedups(list(by_dtype.values()))
    return rows


def _speedups(rows: list[dict]) -> list[dict]:
    """Against the widest type present (F32 normally): byte reduction and speed-ups."""
    base = max(rows, key=lambda r: r["bytes_per_token"])
    for r in rows:
        r["baseline"] = base["dtype"]
        r["byte_reduction"] = base["bytes_per_token"] / r["bytes_per_token"]
        for phase in ("decode", "prefill"):
            ours, theirs = r.get(f"_{phase}"), base.get(f"_{phase}")
            ratio = round_ratio(ours, theirs, phase) if ours and theirs else None
            r[f"{phase}_speedup"] = center(ratio)
            r[f"{phase}_speedup_ci"] = ratio
        r["speedup_per_byte_reduction"] = (r["decode_speedup"] / r["byte_reduction"]
                                           if r["decode_speedup"] else None)
    for r in rows:
        r.pop("_decode", None)
        r.pop("_prefill", None)
    return sorted(rows, key=lambda r: -r["bytes_per_token"])


def analyze(measurements: list[Measurement], models: dict[str, Model], probes: list[Probe],
            phases: dict) -> dict:
    return {"quant": quant_rows(measurements, models)}


# --- table

def _shares(shares: dict) -> str:
    return ", ".join(f"{t} {s:.0%}" for t, s in shares.items() if s >= 0.005)


def quant_tables(analysis: dict) -> list[Table]:
    rows = analysis["quant"]
    if not rows:
        return []
    speed = Table("quant", "Quantization: fewer bytes per token, faster decode", [
        Column("model", "model"), Column("dtype", "dtype"), Column("threads", "threads", "int"),
        Column("bits/weight", "bits_per_weight", "f2"), Column("size (GiB)", "file_n_bytes", "gib"),
        Column("read per token (GiB)", "bytes_per_token", "gib"),
        Column("byte reduction", "byte_reduction", "x"),
        Column("decode tok/s", "decode_tok_s", "stat"),
        Column("decode speed-up (×)", "decode_speedup_ci", "stat2"),
        Column("prefill tok/s", "prefill_tok_s", "stat"),
        Column("prefill speed-up (×)", "prefill_speedup_ci", "stat2"),
        Column("speed-up ÷ byte reduction", "speedup_per_byte_reduction", "f2")], rows,
        [f"Speed-ups and byte reductions are against {rows[0]['baseline'].upper()} of the same "
         "model. If decode were purely bandwidth-bound, its speed-up would equal the byte "
         "reduction (last column 1.00); below 1, dequantizing the blocks costs CPU time that "
         "the saved bytes do not cover on these cores.",
         _prefill_note(rows), *unpaired_note([
             (f"{phase} of {r['model']} {r['dtype']}", r["baseline"].upper(),
              r[f"{phase}_speedup_ci"])
             for r in rows if r["dtype"] != r["baseline"] for phase in ("decode", "prefill")])])
    comp = Table("quant_composition", "What each file really holds", [
        Column("model", "model"), Column("dtype", "dtype"),
        Column("bits/weight", "bits_per_weight", "f2"),
        Column("share of weights by type", "params"), Column("share of bytes by type", "bytes")],
        list({(r["model"], r["dtype"]): {
            "model": r["model"], "dtype": r["dtype"], "bits_per_weight": r["bits_per_weight"],
            "params": _shares(r["params_share"]), "bytes": _shares(r["bytes_share"])}
            for r in rows}.values()),
        ["Read from each file's tensor table. bits/weight = 8 × all tensor bytes ÷ all weights. "
         "llama.cpp's quantize recipes keep norms in F32, give some tensors (the output layer, "
         "V and FFN-down in the K-quant mixes) more bits, and fall back to another type for "
         "any tensor whose rows are not a multiple of the type's block (256 for K-quants)."])
    return [speed, comp]


def _prefill_note(rows: list[dict]) -> str:
    """What prefill did with fewer bytes, from this run's numbers."""
    def span(key: str) -> str:
        values = [r[key] for r in rows if r.get(key) and r["dtype"] != r["baseline"]]
        return f"{min(values):.2f}–{max(values):.2f}×" if values else "not measured"

    return ("Prefill multiplies whole matrices and is compute-bound, so its bytes matter little: "
            "what changes is the kernel each type runs (ggml's quantized types quantize the "
            "activations to 8 bits and use integer dot products; F16 and BF16 have their own "
            "kernels, which depend on the CPU's instructions). Speed-up here: "
            f"prefill {span('prefill_speedup')}, decode {span('decode_speedup')}.")


# --- plot

def quant_finding(rows: list[dict]) -> str:
    """The plot's title: the largest byte reduction measured and what it bought each phase."""
    top = max(rows, key=lambda r: r["byte_reduction"])
    text = (f"{top['dtype']} reads {top['byte_reduction']:.1f}× fewer bytes than "
            f"{top['baseline']}")
    speeds = [f"{phase} {top[f'{phase}_speedup']:.2f}× faster" for phase in ("decode", "prefill")
              if top.get(f"{phase}_speedup")]
    return text + (": " + ", ".join(speeds) if speeds else "")


def quant_speedup(analysis: dict, out_dir: Path) -> str | None:
    """Decode and prefill side by side, one colour per weight type in a legend (labels beside
    the points overlapped where types cut the bytes alike), one marker per model."""
    rows = [r for r in analysis["quant"] if r["dtype"] != r["baseline"]]
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5), sharey=True)
    top = max(r["byte_reduction"] for r in rows) * 1.1
    # in the rows' order where two types cut the bytes alike (a set's order changes per process)
    dtypes = sorted(dict.fromkeys(r["dtype"] for r in rows), key=lambda d: min(
        x["byte_reduction"] for x in rows if x["dtype"] == d))
    colours = {d: plt.get_cmap("tab10")(i % 10) for i, d in enumerate(dtypes)}
    groups = group_rows(rows, "model", "threads")
    markers = dict(zip(groups, "osD^v<>", strict=False))
    # types that cut the bytes alike (f16, bf16) sit side by side, not on top of each other
    alike = group_rows([r | {"x": round(r["byte_reduction"], 1)} for r in rows], "x")
    dodge = {(r["model"], r["threads"], r["dtype"]): (i - (len(g) - 1) / 2) * 0.08
             for g in alike.values() for i, r in enumerate(g)}
    for ax, phase in zip(axes, ("decode", "prefill"), strict=True):
        ax.plot([1, top], [1, top], "--", color="0.6", label="speed-up = byte reduction")
        for key, group in groups.items():
            for r in group:
                if not r.get(f"{phase}_speedup"):
                    continue
                label = r["dtype"] + (f" ({key[0]}, {key[1]} threads)" if len(groups) > 1
                                      else "")
                x = r["byte_reduction"] + dodge[(r["model"], r["threads"], r["dtype"])]
                ax.errorbar([x], [r[f"{phase}_speedup"]],
                            yerr=ci_errors([r[f"{phase}_speedup_ci"] or {}]),
                            fmt=markers.get(key, "o"), color=colours[r["dtype"]], capsize=3,
                            label=label)
        ax.set_title(f"{phase} (95% CI)", fontsize=10)
        ax.set_xlabel("× fewer bytes per decode step than the widest type\n"
                      "(types with equal reductions drawn side by side)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speed-up over the widest type (×)")
    axes[0].legend(fontsize=8)
    fig.suptitle(quant_finding(rows))
    return save(fig, out_dir, "quant_speedup")


LEVER = Lever("quant", analyze, quant_tables, ("quant", "quant_composition"),
              quant_speedup, "quant_speedup",
              "Decode and prefill speed-up of each weight type against its byte reduction")
