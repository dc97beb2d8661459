"""Reports: the tables of a run as data, rendered to markdown, CSV or JSON (all pure)."""

from __future__ import annotations

import csv
import io
import json
from collections import Counter

from ..analysis.estimates import HARDWARE
from ..core.records import Grouping, Measurement, Probe, to_dict
from ..core.reference import reference_from_header
from ..core.stats import WINDOW_TICKS, center, inverse
from ..levers import PLOT_AFTER, PLOT_CAPTIONS, TABLE_NAMES, lever_tables
from ..levers.common import threads_label
from ..render.tabular import (
    GIB,
    Column,
    Table,
    ceiling_share_notes,
    markdown_table,
    notes_for,
)
from ..study.claims import check_claims
from .findings import findings, main_model
from .templating import FullPage, Section

PLOTS = {
    "decode_vs_bytes": "Decode tok/s against GB read per token (log-log): the run's model of "
                       "each weight type as a line",
    "prefill_vs_prompt": "Prefill time and tok/s against prompt length",
    "decode_per_token": "Every decode step's time, repetition by repetition (warm-ups grey)",
} | PLOT_CAPTIONS


def prefill_table(analysis: dict) -> Table:
    rows = [{"model": r["model"], "dtype": r["dtype"], "threads": r["threads"],
             "n_prompt": r["n_prompt"], "seconds": r["seconds"], "tok_s": r["tok_s"],
             "gflop_s": r["gflop_s"], "peak": r["compute_peak"]["value"],
             "share": share_summary(r["share_of_peak"], r["share_of_peak_ci"]),
             "n": r["tok_s"]["n"],
             "notes": notes_for(r | {"prefill_tok_s": r["tok_s"]}, ("prefill",))}
            for r in analysis["prefill"] if r["n_gen"] == 0]
    notes = ["Prefill time runs from the first prompt token to the logits of the last; tok/s "
             "is the median over the repetitions with, in brackets, the 95% interval of this "
             "machine's long-run median (drift included; docs/statistics.md); "
             "time = prompt tokens ÷ that rate. GFLOP/s counts 2 × matmul parameters per token "
             "plus causal attention (Kaplan et al. 2020). The compute peak is ggml's own "
             "matrix-matrix kernel (weights × a 512-column activation) for each of the model's "
             "matrix types, combined by their share of the FLOPs."]
    notes += ceiling_share_notes([(r["share_of_peak"], r["compute_peak"].get("spread"),
                                   "above-ceiling" in r["flags"])
                                  for r in analysis["prefill"] if r["n_gen"] == 0])
    return Table("prefill", "Prefill: time to first token", [
        Column("model", "model"), Column("dtype", "dtype"), Column("threads", "threads", "int"),
        Column("prompt tokens", "n_prompt", "int"), Column("prefill time (s)", "seconds", "f3"),
        Column("tok/s", "tok_s", "stat"), Column("GFLOP/s", "gflop_s", "f1"),
        Column("compute peak GFLOP/s", "peak", "f1"),
        Column("share of peak", "share", "pctci"), Column("n", "n", "int"),
        Column("notes", "notes")], rows, notes)


def decode_table(analysis: dict) -> Table:
    rows = []
    for r in analysis["decode"]:
        rows.append({"model": r["model"], "dtype": r["dtype"], "threads": r["threads"],
                     "size": r["file_bytes_per_token"], "bytes": r["bytes_per_token"],
                     "test": f"{r['n_gen']} after {r['n_prompt']}", "tok_s": r["tok_s"],
                     "ms": inverse(r["tok_s"]), "gb_s": r["effective_gb_s"],
                     "stream": r["stream_ceiling"]["value"],
                     "share": share_summary(r["share_of_stream"], r["share_of_stream_ci"]),
                     "read": r["read_ceiling"]["value"], "share_read": r["share_of_read"],
                     "n": r["tok_s"]["n"],
                     "notes": notes_for(r | {"decode_tok_s": r["tok_s"]}, ("decode",))})
    rows.sort(key=lambda x: (x["threads"], x["bytes"]))
    moe = sorted({r["model"] for r in analysis["decode"] if r["moe"]})
    notes = ["size is every tensor's bytes (the file-size convention, llama-bench's "
             "model_size), in GiB (2³⁰ bytes); read per token is what one decode step reads, in "
             "GB (10⁹ bytes): every weight, the token embedding as one row unless tied to the "
             "output, plus the KV cache at the mean context"
             + (f"; of a mixture of experts ({', '.join(moe)}) only the k of E experts a token "
                "is routed to (its active bytes)." if moe else "."),
             "tok/s is the median over the repetitions with, in brackets, the 95% interval of "
             "this machine's long-run median (drift included); ms/token = 1000 ÷ that rate, "
             "interval inverted. effective GB/s = tok/s × read per token.",
             "Streaming ceiling: ggml's own matrix-vector kernel over a matrix far larger than "
             "the cache, for each of the model's tensor types, combined by their bytes (total "
             "bytes ÷ Σ bytes of a type ÷ that type's GB/s), probed before every round; the "
             "share is taken round by round (each repetition ÷ the ceiling probed before its "
             "round), with its 95% interval. numpy read: the plain memory "
             "read of the machine (STREAM conventions), a diagnostic beside the yardstick, not "
             "a ceiling."]
    notes += read_share_notes(analysis["decode"])
    notes += _missing_ceiling_notes(analysis["decode"])
    notes += ceiling_share_notes([(r["share_of_stream"], r["stream_ceiling"].get("spread"),
                                   "above-ceiling" in r["flags"]) for r in analysis["decode"]])
    return Table("decode", "Decode against model size", [
        Column("model", "model"), Column("dtype", "dtype"), Column("threads", "threads", "int"),
        Column("size (GiB)", "size", "gib"), Column("read per token (GB)", "bytes", "gb"),
        Column("tokens", "test"), Column("tok/s", "tok_s", "stat"),
        Column("ms/token", "ms", "stat1"), Column("effective GB/s", "gb_s", "f1"),
        Column("streaming ceiling GB/s", "stream", "f1"), Column("share", "share", "pctci"),
        Column("numpy read GB/s (diagnostic)", "read", "f1"),
        Column("share of read (diagnostic)", "share_read", "pct"),
        Column("n", "n", "int"), Column("notes", "notes")], rows, notes)


def share_summary(share: float | None, by_round: dict | None) -> dict | None:
    """A share as a summary the pctci cells print: its round-by-round interval if it has one."""
    if by_round:
        return by_round
    return {"n": 1, "median": share} if share is not None else None


def read_share_notes(rows: list[dict]) -> list[str]:
    """Why decode can exceed numpy's read: it is no ceiling (said where such a share shows)."""
    above = sorted({f"{r['model']} {r['dtype']} ({r['share_of_read']:.0%})" for r in rows
                    if (r["share_of_read"] or 0) > 1})
    if not above:
        return []
    return [f"Decode above numpy's read bandwidth ({', '.join(above)}): numpy's read is a "
            "max() over each thread's share of one array, a reduction that is not ggml's "
            "kernel and need not reach the memory's limit, so exceeding it breaks no ceiling; "
            "the yardstick is the streaming ceiling, and numpy's figure only a diagnostic."]


def _missing_ceiling_notes(rows: list[dict]) -> list[str]:
    reasons = sorted({r["stream_ceiling"].get("reason") for r in rows
                      if not r["stream_ceiling"]["value"]} - {None})
    return [f"Streaming ceiling missing ({reason}): shares against it are n/a."
            for reason in reasons]


CEILING_NAMES = {"read_gb_s": "numpy read GB/s", "copy_gb_s": "numpy copy GB/s",
                 "matmul_gflop_s": "numpy SGEMM GFLOP/s", "stream_gb_s": "streaming GB/s",
                 "compute_gflop_s": "compute GFLOP/s",
                 "shortrows_gb_s": "streaming GB/s, rows of 512",
                 "narrow_gflop_s": "compute GFLOP/s, 128 columns"}


def ceilings_table(analysis: dict) -> Table:
    rows = []
    for c in analysis["ceilings"]:
        path = c["what"]
        name = CEILING_NAMES[path[-1]]
        if path[0] == "ggml":
            name = f"ggml {path[1].upper()} {name}"
        rows.append({"threads": c["threads"], "what": name, "layout": c.get("layout") or "",
                     "before": c["before"], "after": c["after"], "drift": c["drift"],
                     "beside": (f"{c['beside_min']:.1f}–{c['beside_max']:.1f} "
                                f"({c['n_beside']})" if c.get("n_beside") else "")})
    notes = ["Memory: STREAM conventions (arrays ≥ 4× the last-level cache, a warm pass, then "
             "several timed; copy counts bytes read + written); every figure is the median of "
             "its passes. ggml: llama.cpp's own kernels on a "
             "matrix of each weight type, with its weights where llama.cpp puts them at load "
             "(CPU_REPACK: the repacked layout llama.cpp uses for some quantized types on this "
             "CPU; CPU: the plain layout). Streaming = one matrix-vector product over a matrix "
             "far larger than the cache (GB/s of weight bytes), over rows of 4,096 weights "
             "(and of 512: a small model's short rows); compute = the same kind of matrix "
             "times a 512-column activation (and a 128-column one: a short prompt's "
             "ubatch). Beside: the range of the short probes "
             "taken before each round (how many in brackets)."]
    notes += [f"Probe failed: {e}; that ceiling is missing." for e in analysis["probe_errors"]]
    notes += stability_lines(analysis["stability"])
    return Table("ceilings", "Measured ceilings of this machine", [
        Column("threads", "threads", "int"), Column("ceiling", "what"),
        Column("layout", "layout"), Column("before the run", "before", "f1"),
        Column("after the run", "after", "f1"), Column("change", "drift", "spct"),
        Column("beside the measurements", "beside")], rows, notes)


def stability_lines(st: dict) -> list[str]:
    """How steady the machine was during the run, in words from the run's own readings."""
    out = []
    if st.get("n_reads", 0) >= 2:
        text = (f"Machine stability: the {st['n_reads']} reads of the model's pages beside the "
                f"decode repetitions ranged {st['read_min']:.1f}–{st['read_max']:.1f} GB/s "
                f"(CV {st['read']['cv']:.0%})")
        regimes = st.get("regimes")
        if regimes:
            text += ("; they fell into two regimes, " + " and ".join(
                f"about {r['median_gb_s']:.0f} GB/s ({r['share']:.0%} of the reads)"
                for r in regimes))
        out.append(text + ".")
    if st.get("n_rounds"):
        bad = st["disturbed_rounds"]
        out.append(f"{len(bad)} of {st['n_rounds']} rounds began with other processes using "
                   "the CPU" + (f" (rounds {', '.join(str(r + 1) for r in bad[:10])})"
                                if bad else "") + ".")
    return out


def repetitions_table(measurements: list[Measurement]) -> Table:
    """How each interleaved cell ended: its repetitions, why it stopped, the CI it reached."""
    words = {"target": "reached its CI target", "budget": "time budget", "max":
             "max_repetitions", "fixed": "fixed count",
             "alone": "min_repetitions (in no contrast)"}
    rows = [{"cell": f"{m.model} {m.dtype} t{m.threads} {m.cell.test}",
             "n": m.repetitions, "stopped": words.get(m.stopped_by, m.stopped_by),
             "target": (m.policy or {}).get("target_ci")
             if (m.policy or {}).get("repetitions") is None else None,
             "reached": m.ci_reached} for m in measurements if m.stopped_by]
    on = {m.target or "absolute" for m in measurements if m.stopped_by}
    judged = ("the widest 95% interval of its contrasts with the cells it differs from in one "
              "setting (its own figure's where it has none), relative" if "contrasts" in on
              else "the half-width of the 95% interval of its median, relative to it")
    notes = ["Every round runs one repetition of every cell still going, in a shuffled order, "
             "so slow and fast spells of the machine hit every cell alike. A cell leaves the "
             f"rounds once its interval is within target; CI reached: {judged} (– under 3 "
             "rounds)."]
    budget = [r for r in rows if r["stopped"] == "time budget"]
    auto = [r for r in rows if r["target"] is not None]
    alone = [r for r in rows if r["stopped"] == words["alone"]]
    if alone:
        notes.append(f"{len(alone)} cell{'s' if len(alone) != 1 else ''} took part in no "
                     "contrast the report draws (no cell differs from "
                     f"{'them' if len(alone) != 1 else 'it'} in one setting it compares), so "
                     "ran min_repetitions; their own intervals are in the tables.")
    if budget:
        notes.append(f"The run ended at its time budget: {len(budget)} of {len(rows)} cells "
                     "stopped there before reaching their target.")
    elif auto:
        notes.append(f"The run ended when all {len(auto)} auto cells had reached their target "
                     "(or min_repetitions, in no contrast), before its time budget.")
    return Table("repetitions", "Repetitions: how each measurement ended", [
        Column("cell", "cell"), Column("repetitions", "n", "int"),
        Column("stopped by", "stopped"), Column("target ±", "target", "pct1"),
        Column("CI reached ±", "reached", "pct1")], rows, notes)


def workloads_table(analysis: dict) -> Table:
    rows = [dict(w) | {"note": "; ".join(w.get("modelled") or [])}
            for w in analysis["workloads"]]
    notes = ["Each phase from the measurement nearest the workload on the same model, weight "
             "type and thread count: prefill at the nearest prompt length, decode at the "
             "nearest context depth. Where the workload's own length differs, the run's model "
             "carries the measured time to it (prefill: matrix FLOPs at the rate the run "
             "measured plus attention FLOPs at flash attention's probed rate; decode: the "
             "fixed cost, the weights at the run's bandwidth and the attention over the larger "
             "cache at the decode-attention rate probed in the run), "
             "and the note says so: those times are modelled, not measured."]
    return Table("workloads", "Where the time goes in typical requests", [
        Column("model", "model"), Column("dtype", "dtype"), Column("workload", "workload"),
        Column("prompt", "n_prompt", "int"), Column("generated", "n_gen", "int"),
        Column("prefill s", "prefill_s", "f2"), Column("decode s", "decode_s", "f2"),
        Column("prefill share", "prefill_share", "pct"), Column("note", "note")], rows, notes)


def _tok_s_cell(value: float | None, ci: list | None = None, why: str | None = None) -> str:
    if value is None:
        return why or "–"
    text = f"{value:,.1f}" if value < 100 else f"{value:,.0f}"
    return text + (f" ({ci[0]:,.1f}–{ci[1]:,.1f})" if ci and value < 100 else
                   f" ({ci[0]:,.0f}–{ci[1]:,.0f})" if ci else "")


def estimates_table(analysis: dict) -> list[Table]:
    """Estimated decode tok/s of the run's models and a few common sizes, here and on
    reference hardware with sourced per-type figures: at most 6 columns."""
    p = analysis["predictions"]
    if not p.get("rows"):
        return []
    hw = p["hardware"]
    rows = []
    for r in p["rows"]:
        row = {"model": r["model"] + (" (MoE)" if r["moe"] else ""),
               "dtype": r["dtype"].upper() + ("" if r["bytes_from"] == "file" else "*"),
               "gb": r["decode_weight_n_bytes"] / 1e9}
        why = r.get("why") or r.get("decode_why")
        if r.get("fits_in_memory") is False:
            why = (f"does not fit ({r['memory_needed_n_bytes'] / 1e9:.0f} GB > "
                   f"{r['ram_n_bytes'] / 1e9:.0f} GB)")
        here = _tok_s_cell(r.get("decode_tok_s"), r.get("decode_tok_s_ci95"), why)
        row["here"] = here + (" †" if r.get("decode_gb_s_from", "").endswith(
            f"did not decode {r['dtype']})") else "")
        for key, e in r["elsewhere"].items():
            row[key] = (e["why"] if e["tok_s"] is None else
                        f"{e['tok_s']:,.0f}" + (" ‡" if e.get("floored") else ""))
        rows.append(row)
    notes = [
        "Estimates, not measurements (the run's own measurements are in the tables above). "
        "This machine: tok/s = 1 ÷ (fixed cost + bytes ÷ the weight type's bandwidth at the "
        "model's row widths), the run's model of its machine at an empty cache; the interval "
        "carries the bandwidth's 95% interval. † the run did not decode this type: its "
        "streaming ceiling at the model's row widths stands in for the bandwidth"
        f"{_share_range(analysis)}.",
        "* nominal bytes: every matrix at the base type's bits per weight (llama.cpp's recipes "
        "keep some tensors at other types, so real files are somewhat larger); no star: the "
        "run built the file and read its tensor table.",
        "A model whose weights and a 4,096-token KV cache do not fit in a machine's memory is "
        "shown as not fitting (GB needed > GB there), not estimated; one far smaller than the "
        "model a source measured gets no estimate where no small-model rate was found, since "
        "per-token launch and synchronization costs, not bytes, bound it. Mixtures of experts "
        "read k of their E experts per token (their active bytes) but must hold every expert.",
    ]
    for key, h in hw.items():
        src = "; ".join(f"{d.upper()} {t:.2f} tok/s at {g:.2f} GiB ({s})"
                        for d, (t, g, s) in HARDWARE[key]["figures"].items())
        floor = HARDWARE[key]["floor"]
        notes.append(f"{h['name']}: {h['bandwidth_gb_s']:.0f} GB/s spec sheet, "
                     f"{h['memory_gb']:.0f} GB" + (f", {h['memory_note']}" if h["memory_note"]
                                                   else "")
                     + f". Each type's share of the bandwidth from a measured llama-bench row: "
                     f"{src}." + (f" ‡ capped at {floor[0]:.0f} tok/s, the rate of a small "
                                  f"model on this card ({floor[1]}): per-token launch and "
                                  "synchronization costs, not bytes, bound small models."
                                  if floor else ""))
    columns = [Column("model", "model"), Column("weights", "dtype"),
               Column("GB read per token", "gb", "f2"), Column("this machine", "here")]
    columns += [Column(h["name"].split(" (")[0], key) for key, h in hw.items()]
    return [Table("estimates", "Estimates: decode tok/s here and on other hardware", columns,
                  rows, notes)]


def _share_range(analysis: dict) -> str:
    shares = [d["share_of_stream"] for d in analysis["machine_model"]["decode"]
              or [] if d.get("share_of_stream")]
    if not shares:
        return ""
    lo, hi = min(shares), max(shares)
    span = f"{lo:.0%}" if abs(hi - lo) < 0.005 else f"{lo:.0%}–{hi:.0%}"
    return f" (the types the run did decode reached {span} of their ceiling)"


def decode_model_table(analysis: dict) -> list[Table]:
    """The decode part of the run's model: per weight type, the fixed cost, the achieved
    bandwidth and its share of the streaming ceiling, each model's residual, and the line
    with an intercept where the run has 3 or more sizes."""
    mm = analysis["machine_model"]
    rows = []
    for d in mm["decode"]:
        if not d.get("gb_s"):
            continue
        fixed_ms = sorted(v * 1e3 for v in d["fixed_s"].values())
        line = d.get("line") or {}
        rows.append({
            "dtype": f"{d['dtype'].upper()}, {threads_label(d['threads'])}",
            "models": ", ".join(d["models"]),
            "fixed": (f"{fixed_ms[0]:.2f}" if fixed_ms[0] == fixed_ms[-1] else
                      f"{fixed_ms[0]:.2f}–{fixed_ms[-1]:.2f}") if any(fixed_ms) else "–",
            "gb_s": d["gb_s"], "share": d.get("share_of_stream"),
            "share_rows": d.get("share_at_row_widths"),
            "residuals": ", ".join(f"{r['measured_over_model']:.2f}" for r in d["residuals"]),
            "line": (f"{line['intercept_ms']:.1f} [{line['intercept_ci_ms'][0]:.1f}–"
                     f"{line['intercept_ci_ms'][1]:.1f}] ms + bytes ÷ {line['gb_s']:.1f} GB/s"
                     if line.get("gb_s") else "–")})
    if not rows:
        return []
    attention = sorted(v * 1e3 for d in mm["decode"] for v in
                       (d.get("attention_s") or {}).values())
    notes = [fixed_cost_sentence(mm), "bandwidth: the run's decodes of that type, the fixed "
             "cost and the attention over the cache taken out (" + (
                 f"{attention[0]:.2f}–{attention[-1]:.2f} ms per step at these rows' contexts, "
                 "at the decode-attention rate probed in the run" if attention and attention[-1]
                 else "no decode-attention probe in this run") + "), "
             "pooled over the type's models in each round, the median over "
             "rounds with its 95% interval; share: of ggml's streaming ceiling for the type "
             "(its matrix-vector kernel on a large matrix of rows of 4,096 weights, probed in "
             "the run); at its rows: of the same kernel over the models' own row widths "
             "(probed at rows of 512 and 4,096 weights and interpolated: a short row streams "
             "more slowly), the yardstick the estimates carry to other models; residual: each "
             "model's measured ÷ modelled speed, in the order listed."]
    if any(r["line"] != "–" for r in rows):
        notes.append("line: seconds per token = a + bytes ÷ B fitted by least squares over "
                     "every round's point of every size (95% intervals), set beside the fixed "
                     "cost measured on skeletons. An intercept above that fixed cost is not "
                     "time that does not scale with bytes: a straight line through a few sizes "
                     "also reads as an intercept any bandwidth that differs between them (their "
                     "matrices differ in width, and ggml's kernels stream narrow rows more "
                     "slowly), so the estimates use the measured fixed cost instead.")
    return [Table("decode_model", "The model of decode: a fixed cost plus bytes ÷ bandwidth, "
                  "per weight type", [
                      Column("weights", "dtype"),
                      Column("models", "models"), Column("fixed ms", "fixed"),
                      Column("bandwidth GB/s", "gb_s", "stat"),
                      Column("share of ceiling", "share", "pct"),
                      Column("at its rows", "share_rows", "pct"),
                      Column("residuals", "residuals"), Column("line", "line")], rows, notes)]


def flash_sentence(analysis: dict) -> str:
    """Whether flash attention ran in the prefills the model is set beside."""
    used = {r["id"]: r["flash_attn_used"] for r in analysis["prefill"]
            if r["n_gen"] == 0}
    if used and all(v is True for v in used.values()):
        return ("Flash attention ran in every prefill here (llama.cpp's auto resolved to on, "
                "as its log says), so the probe's kernel is the one the prompts ran.")
    off = sorted(i for i, v in used.items() if v is False)
    if off:
        return (f"Flash attention did not run in {len(off)} of {len(used)} prefills: their "
                "attention ran as matrix products and softmax, which the flash-attention "
                "probe does not time, so the model's attention rate is not theirs.")
    return "Whether flash attention ran was not recorded for these prefills."


def fixed_cost_sentence(mm: dict) -> str:
    """What the fixed cost is, in a sentence, from the skeletons the run timed."""
    parts = []
    for threads, archs in sorted(mm["fixed"].items(), key=lambda kv: int(kv[0])):
        for arch, line in sorted(archs.items()):
            parts.append(f"{arch} at {threads} thread{'s' if int(threads) != 1 else ''}: "
                         f"{line['base_s'] * 1e6:.0f} µs per step plus "
                         f"{line['per_layer_s'] * 1e6:.1f} µs per layer")
    if not parts:
        return ("fixed cost: not measured (the run timed no skeletons; it was recorded before "
                "they existed), so none is taken out.")
    return ("fixed cost: a decode step's time that does not scale with bytes, measured on "
            "skeletons of the run's architectures (the same layers, every width tiny, so the "
            "step reads almost nothing): building the graph, the threads' synchronization at "
            "each of its nodes, and the logits. " + "; ".join(parts) + ".")


def prefill_model_table(analysis: dict) -> list[Table]:
    """The prefill part of the run's model against the measured prompt lengths."""
    mm = analysis["machine_model"]
    rows = []
    for p in mm["prefill"]:
        if len(p["points"]) < 2:
            continue
        for pt in p["points"]:
            rows.append({"model": f"{p['model']} {p['dtype'].upper()}",
                         "threads": p["threads"], "n_prompt": pt["n_prompt"],
                         "gflop_s": pt["measured_gflop_s"],
                         "attn_share": pt["attention_flop_share"],
                         "attn_time": pt["attention_time_share"],
                         "predicted": pt["predicted_s"], "measured": pt["measured_s"],
                         "ratio": pt["measured_over_predicted"]})
    if not rows:
        return []
    p0 = next(p for p in mm["prefill"] if len(p["points"]) >= 2)
    notes = [f"predicted s = matrix FLOPs ÷ {p0['matmul_gflop_s']:.0f} GFLOP/s (the rate "
             f"{p0['model']} {p0['dtype']} reached at {p0['calibrated_at']:,} tokens, "
             "attention taken out) + attention FLOPs ÷ "
             f"{p0['attention_gflop_s']:.0f} GFLOP/s (ggml's flash-attention kernel at its "
             f"{p0['attention_shape'].replace('x', ' × ')} head shape: head size × heads × KV "
             "heads, F16 K and V, probed in the run). measured ÷ predicted above 1: the run "
             "was slower than the model.", flash_sentence(analysis)]
    return [Table("prefill_model", "The model of prefill: matrices plus attention, against "
                  "prompt length", [
                      Column("model", "model"), Column("prompt", "n_prompt", "int"),
                      Column("measured GFLOP/s", "gflop_s", "f1"),
                      Column("attention share of FLOPs", "attn_share", "pct"),
                      Column("of predicted time", "attn_time", "pct"),
                      Column("predicted s", "predicted", "f2"),
                      Column("measured s", "measured", "f2"),
                      Column("measured ÷ predicted", "ratio", "f2")], rows, notes)]


def system_info_cell(info: str | None) -> str:
    """llama.cpp's system line for a table cell: its ` | ` separators as commas (a `|`, even
    inside a code span, ends a GitHub table cell)."""
    if not info:
        return "–"
    parts = [p.strip() for p in info.replace("|", "\n").splitlines() if p.strip()]
    return ", ".join(parts)


def missing(records) -> list[str]:
    done = records.measured_ids
    return [i for i in (records.header.plan if records.header else []) if i not in done]


def report_data(records, analysis: dict) -> dict:
    """Everything a report shows, as plain data."""
    header = records.header
    tables = [prefill_table(analysis), decode_table(analysis), ceilings_table(analysis)]
    tables += decode_model_table(analysis) + prefill_model_table(analysis)
    tables += [workloads_table(analysis)] + estimates_table(analysis)
    tables += [repetitions_table(records.measurements)]
    tables += lever_tables(analysis)
    reference = reference_from_header(records.header)
    claims = check_claims(reference, analysis, header.env or {}) if reference else []
    found = findings({"analysis": analysis, "main": main_model(analysis), "claims": []})
    return {"findings": found, "scenario": header.scenario or {}, "env": header.env or {},
            "created": header.created, "harness": header.harness,
            "tables": [t for t in tables if t.rows], "fits": analysis["fits"],
            "missing": missing(records), "failures": [to_dict(f) for f in records.failures],
            "n_measurements": len(records.measurements),
            "method": method_text(records),
            "contrasts": analysis["contrasts"], "claims": claims,
            "machine_drift": analysis.get("machine_drift")}


# --- rendering -----------------------------------------------------------------------------


def env_lines(env: dict) -> list[str]:
    llama = env.get("llama", {})
    ram = env.get("ram_total_bytes")
    freq = env.get("cpu_freq_mhz") or {}
    clock = f", {freq['current'] / 1000:.2f} GHz" if freq.get("current") else ""
    out = [
        "| | |", "|---|---|",
        f"| CPU | {env.get('cpu_model') or 'not reported'} ({env.get('physical_cores')} "
        f"physical / {env.get('logical_cores')} logical cores{clock}) |",
        f"| RAM | {f'{ram / GIB:.1f} GiB' if ram else 'not reported'} |",
        f"| OS | {env.get('os')} |",
        f"| llama.cpp | commit {llama.get('ggml_commit')} (ggml {llama.get('ggml_version')}), "
        f"llama-cpp-python {llama.get('llama_cpp_python')} |",
        f"| llama.cpp system info | {system_info_cell(llama.get('system_info'))} |",
        f"| Python, gguf, numpy | {env.get('python')}, {env.get('gguf')}, {env.get('numpy')} |",
        f"| harness | {_harness_line(env)} |",
    ]
    if env.get("missing"):
        out.append(f"| not reported by this platform | {', '.join(env['missing'])} |")
    return out


def _harness_line(env: dict) -> str:
    src = env.get("harness_source") or {}
    if not src.get("commit"):
        return str(env.get("harness"))
    dirty = " with uncommitted changes" if src.get("dirty") else ""
    return f"{env.get('harness')}, commit {src['commit'][:12]}{dirty}"


METHOD = (
    "The models are random-weight GGUF files with the exact tensor shapes of the named "
    "architectures (meaningless text, the same matrix work and memory reads), run in-process "
    "through llama.cpp's C API on the CPU. Prompts are random token ids, with no tokenizer and "
    "no sampling. Prefill is timed from the first prompt token to the last token's logits; "
    "decode times every single-token step, each synchronized.")
STATISTICS = (
    "Every round is a block: the log rate of a cell in a round is the cell's effect plus the "
    "round's (the machine's state then, shared by every cell) plus a residual. A comparison "
    "of two cells (a ratio) is the geometric mean of their per-round ratios over the rounds "
    "both ran, so drift between rounds cancels, with a 95% Student-t interval of the mean log "
    "ratio. A figure (tok/s, ms, GB/s) is the median of its repetitions with a 95% interval "
    "of the machine's long-run median, drift included: t · √(π/2) · sd / √n_eff of the log "
    "values, n_eff the rounds counted as independent after their lag-1 autocorrelation. Both "
    "are computed on the log scale, so tok/s and ms per token are exact inverses. "
    "scripts/sim_intervals.py measures their coverage (docs/statistics.md).")

NO_ROUNDS = (
    "This run recorded no rounds (a harness before interleaving): each figure is the median of "
    "its repetitions with the interval of its long-run median (t · √(π/2) · sd / √n_eff of "
    "the log values), and every ratio between cells is a ratio of two medians, unpaired, its "
    "interval combining theirs, so the machine's drift between them is in it.")


def method_text(records) -> str:
    """The Method paragraph, computed from what the run did."""
    ms = records.measurements
    parts = [METHOD, _cache_sentence(ms), _rounds_sentence(records), _steps_sentence(records),
             STATISTICS if records.rounds else NO_ROUNDS, _split_sentence(records),
             _probe_sentence(records.probes), context_sentence(ms)]
    return " ".join(t for t in parts if t)


def _cache_sentence(ms: list[Measurement]) -> str:
    warmups = sorted({m.warmup for m in ms})
    depth = sum(1 for m in ms if m.depth)
    prefix = sum(1 for m in ms if m.shared_prefix)
    text = ("The KV cache is cleared before every repetition"
            + (f" ({depth} cell{'s' if depth != 1 else ''} then fill it to their depth, "
               "untimed" if depth else "")
            + ("; " if depth and prefix else " (" if prefix and not depth else "")
            + (f"{prefix} prefix cell{'s' if prefix != 1 else ''} keep their cached prefix"
               if prefix else "") + (")" if depth or prefix else "") + "; ")
    one = warmups == [1]
    short = sorted({len(d) for m in ms for d in (m.warmup_samples.get("decode_s") or [])
                    if len(d) < m.n_gen})
    work = (f"the prompt and the first {'–'.join(map(str, short))} decode steps (each step "
            "reads every weight)" if short else "the full work")
    text += (f"{'–'.join(map(str, warmups))} warm-up repetition{'' if one else 's'} per cell "
             f"{'does' if one else 'do'} {work} and {'is' if one else 'are'} kept out "
             "of the statistics." if warmups else "")
    return text


def _rounds_sentence(records) -> str:
    rounds = records.rounds
    if not rounds:
        return ""
    sizes = [len(r.order) for r in rounds]
    reasons = Counter(m.stopped_by for m in records.measurements if m.stopped_by)
    words = {"target": "reached {} target", "budget": "stopped at the time budget",
             "max": "stopped at max_repetitions", "fixed": "ran {} fixed count",
             "alone": "stopped at min_repetitions, in no contrast the report draws"}
    ended = ", ".join(f"{n} " + words.get(k, k).format("its" if n == 1 else "their")
                      for k, n in sorted(reasons.items()))
    size = f"{min(sizes)}" if min(sizes) == max(sizes) else f"{min(sizes)}–{max(sizes)}"
    return (f"The run had {len(rounds)} round{'s' if len(rounds) != 1 else ''} of {size} "
            f"cells, each in an order shuffled per round; of its cells, {ended}.")


def _steps_sentence(records) -> str:
    """How a round ran its cells' decode steps, when one step of each ran in turn."""
    stepped = [m for m in records.measurements if m.interleave == "step"]
    if not stepped:
        return ""
    n = len(stepped)
    return (f"In each round the prompts ran one cell after another, then the decode steps of "
            f"{n} cell{'s' if n != 1 else ''} in turn, one step of each again and again, so a "
            f"decode comparison between two of them is the geometric mean of their ratios over "
            f"windows of {WINDOW_TICKS} adjacent steps, each window timed beside its partner's "
            "(the machine's speed switches cancel inside a window); prefill comparisons, and "
            "decodes that ran whole (at a depth), pair round by round.")


def _split_sentence(records) -> str:
    """Which compared models could not be in RAM together, by name, and so were not paired."""
    split = [p for g in records.of_type(Grouping) for p in g.split]
    if not split:
        return ""
    names = "; ".join(" and ".join(pair) for pair in split)
    return (f"Not compared side by side: {names}. Their models and contexts did not fit in RAM "
            "at once, so they ran in different groups, and a ratio between them is of two "
            "medians, unpaired, the machine's drift between the groups in its interval.")


def _probe_sentence(probes: list[Probe]) -> str:
    full = [p for p in probes if p.when in ("before", "after") and p.result]
    beside = [p for p in probes if p.when == "beside" and p.result]
    if not full and not beside:
        return "No ceilings were measured (the probes failed or did not run)."
    passes = sorted({len(x) for p in beside for x in _pass_counts(p)})
    text = (f"The ceilings are measured by the run itself with llama.cpp's own ggml kernels: "
            f"{len(full)} full probe{'s' if len(full) != 1 else ''} "
            f"({', '.join(p.when for p in full)} the measurements)")
    if beside:
        text += (f", and {len(beside)} beside the cells, one before each round, of the thread "
                 "counts and tensor types that round needs"
                 + (f" ({passes[0]}–{passes[-1]} passes each)" if passes else ""))
    rotation = sorted({p.round for p in probes if p.when == "rotation" and p.result})
    if rotation:
        text += (f"; in {len(rotation)} round{'s' if len(rotation) != 1 else ''}, one streaming "
                 "pass of each tensor type after every tick of the decode steps, so a decode's "
                 "share of its ceiling is taken window by window against the passes beside it")
    return text + (". A ceiling is the median of its probes' passes, the statistic a "
                   "repetition is compared with" + (
                       (", and any other share is taken round by round: a repetition ÷ the "
                        "ceiling probed before its round." if rotation else
                        ", and a share is taken round by round: a repetition ÷ the ceiling "
                        "probed before its round.") if beside else
                       "; each share is a median ÷ the ceilings nearest it."))


def _pass_counts(probe: Probe) -> list[list]:
    out = []
    for entry in ((probe.result or {}).get("threads") or {}).values():
        for by_type in (entry.get("ggml") or {}).values():
            out += [v for k, v in by_type.items() if "samples" in k and isinstance(v, list)]
    return out


def context_sentence(measurements: list[Measurement]) -> str:
    """How this run sized its contexts, from its records."""
    sizes = Counter(m.n_ctx for m in measurements)
    old = sizes.pop(None, 0)
    out = []
    if sizes:
        listed = ", ".join(f"{n:,} ({k} cell{'s' if k != 1 else ''})"
                           for n, k in sorted(sizes.items()))
        out.append("Every context is sized as a deployment sizes it, in whole blocks of 256 "
                   "KV cells per sequence (each cell's tokens rounded up, or the scenario's "
                   f"n_ctx): this run's contexts held {listed} cells per sequence; the size is "
                   "part of each measurement's id.")
    if old:
        out.append(f"{old} measurement{'s' if old != 1 else ''} predate recorded contexts: "
                   "each such context was sized exactly to its tokens, and llama.cpp shrinks "
                   "the prefill's ubatch to that size, which alone can slow prefill (see "
                   "docs/scenarios.md, Contexts).")
    return " ".join(out)


def run_sections(data: dict, plots: list[str] | None = None):
    """The report of a run as named sections (intro, findings, each table with its plot, the
    levers' heading, method, environment, reproduce); plots are relative file names."""
    s, env = data["scenario"], data["env"]
    head = [s["description"].strip(), ""] if s.get("description") else []
    head += [f"Measured {(data['created'] or '')[:10]} on {env.get('cpu_model')} "
             f"({env.get('physical_cores')} cores), llama.cpp "
             f"{env.get('llama', {}).get('ggml_commit')}; {data['n_measurements']} "
             "measurements.", ""]
    if data["missing"]:
        head += [f"> **Incomplete run:** {len(data['missing'])} planned measurement(s) are "
                 "missing: " + ", ".join(f"`{m}`" for m in data["missing"]), ""]
    for f in data["failures"]:
        head += [f"> **Failed:** {f['model_key']} at {f['step']}: {f['error']}", ""]
    out = [Section.of("intro", head)]
    if data.get("findings"):
        out.append(Section.of("findings", ["## Findings", ""] + [
            f"- {line}" for line in data["findings"]] + [""]))
    out += _table_sections(data, list(plots or []))
    out += [Section.of("method", ["## Method", "", data["method"], ""]),
            Section.of("environment", ["## Environment", "", *env_lines(env), ""]),
            Section.of("reproduce", [
                "## Reproduce", "", "```sh", f"harness run {s.get('path', 'SCENARIO')}", "```",
                "", f"Scenario SHA-256 `{s.get('sha256')}`. Model files are rebuilt "
                "byte-identically from the specs and seed; numbers will differ on another "
                "machine, and by a few percent between runs on this one.", ""])]
    return FullPage(s.get("title") or s.get("name", "Run"), tuple(out))


def _table_sections(data: dict, plots: list[str]) -> list:
    """Each table as a section named after it (a lever's plot after its last table), the
    unplaced plots before the levers' heading."""
    placed = {PLOT_AFTER[p.rsplit(".", 1)[0]]: p for p in plots
              if PLOT_AFTER.get(p.rsplit(".", 1)[0]) in {t.name for t in data["tables"]}}
    levers = [t.name for t in data["tables"] if t.name in TABLE_NAMES]
    rest = [p for p in plots if p not in placed.values()]
    out = []
    for t in data["tables"]:
        if levers and t.name == levers[0]:
            out += _rest_plots(rest)
            rest = []
            out.append(Section.of("levers", ["## Levers", ""]))
        lines = [markdown_table(t), ""]
        if t.name == "decode" and data["fits"]:
            lines += _fit_lines(data["fits"])
        if t.name in placed:
            lines += _plot_line(placed[t.name])
        out.append(Section.of(t.name, lines))
    return out + _rest_plots(rest)


def _rest_plots(plots: list[str]) -> list:
    return [Section.of("plots", [line for p in plots for line in _plot_line(p)])] \
        if plots else []



def render_markdown(data: dict, plots: list[str] | None = None) -> str:
    """The report as GitHub-flavoured markdown, through the built-in `full` template."""
    from .templating import render

    return render("full", run_sections(data, plots))


def _plot_line(name: str) -> list[str]:
    return [f"![{PLOTS.get(name.rsplit('.', 1)[0], name)}]({name})", ""]


def _fit_lines(fits: list[dict]) -> list[str]:
    out = ["### The rule of thumb: decode tok/s ≈ bandwidth ÷ bytes per token", ""]
    for f in fits:
        fit = f["fit"]
        r2 = f"{fit['r2']:.3f}" if fit["r2"] is not None else "n/a"
        threads = f"{f['threads']} thread{'s' if f['threads'] != 1 else ''}"
        what = f"{f['dtype'].upper()} models" if f.get("dtype") else "measurements"
        out.append(f"- {threads}: least-squares fit through the origin over "
                   f"{fit['n_points']} {what}: **{fit['gb_s']:.1f} GB/s** (R² = {r2}).")
        out += round_fit_lines(f)
        out.append(f"  Verdict: **{f['verdict']}**.")
    return out + [""]


def round_fit_lines(f: dict) -> list[str]:
    """The fit redone round by round: its CI, and each model's measured ÷ fitted speed."""
    per_round = f.get("round_fit_gb_s")
    if "round_fit_unpaired" in f:
        n = f["round_fit_unpaired"]
        return [f"  Not redone round by round: the models decoded together in {n} round"
                f"{'' if n == 1 else 's'} (at least 2 are needed; models of other RAM groups "
                "never share one), so the fit above carries the drift between them."]
    if not per_round:
        return []
    parts = [f"{r['model']} {r['dtype']} {_ratio_ci(r['measured_over_fit'])}"
             for r in f["round_residuals"]]
    return [f"  Redone in each of the {per_round['n']} rounds where every model decoded (drift "
            f"between rounds cancels): {_ratio_ci(per_round, 1)} GB/s; measured ÷ fitted "
            "speed per model, a residual of 1.00 lying on the line: " + ", ".join(parts) + "."]


def _ratio_ci(summary: dict, digits: int = 2) -> str:
    ci = summary.get("median_ci95")
    text = f"{center(summary):.{digits}f}"
    return text + (f" [{ci[0]:.{digits}f}–{ci[1]:.{digits}f}]" if ci else "")


def render_csv(data: dict) -> str:
    """Every table in one CSV, a `table` column first; statistics as median, CI low, CI high."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    for t in data["tables"]:
        header = ["table"]
        for c in t.columns:
            header += ([c.key, f"{c.key}_ci_low", f"{c.key}_ci_high", f"{c.key}_n"]
                       if c.kind.startswith("stat") else [c.key])
        writer.writerow(header)
        for r in t.rows:
            row = [t.name]
            for c in t.columns:
                v = r.get(c.key)
                if c.kind.startswith("stat"):
                    ci = (v or {}).get("median_ci95") or [None, None]
                    row += [center(v), ci[0], ci[1], (v or {}).get("n")]
                else:
                    row.append(v)
            writer.writerow(row)
    return buf.getvalue()


def render_json(data: dict) -> str:
    tables = {t.name: {"title": t.title, "columns": [c.key for c in t.columns],
                       "rows": t.rows, "notes": t.notes} for t in data["tables"]}
    out = {k: v for k, v in data.items() if k != "tables"} | {"tables": tables}
    return json.dumps(out, indent=1, sort_keys=True)
