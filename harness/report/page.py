"""Reports: the tables of a run as data, rendered to markdown, CSV or JSON (all pure)."""

from __future__ import annotations

import csv
import io
import json
from collections import Counter

from ..core.reference import check_claims, reference_from_header
from ..core.stats import center, inverse
from ..levers import PLOT_AFTER, PLOT_CAPTIONS, TABLE_NAMES, lever_tables
from ..render.tabular import (
    GIB,
    Column,
    Table,
    ceiling_share_notes,
    markdown_table,
    notes_for,
)
from .findings import findings, main_model
from .tables import test_label

PLOTS = {
    "decode_vs_bytes": "Decode tok/s against bytes read per token, with the fitted bandwidth "
                       "and the measured read ceiling",
    "prefill_vs_prompt": "Prefill time and tok/s against prompt length",
    "decode_per_token": "Every decode step's time, repetition by repetition (warm-ups grey)",
} | PLOT_CAPTIONS


def prefill_table(measurements: list[dict], analysis: dict) -> Table:
    rows = [{"model": r["model"], "dtype": r["dtype"], "threads": r["threads"],
             "n_prompt": r["n_prompt"], "seconds": r["seconds"], "tok_s": r["tok_s"],
             "gflop_s": r["gflop_s"], "peak": r["compute_peak"]["value"],
             "share": share_summary(r["share_of_peak"], r.get("share_of_peak_ci")),
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


def decode_table(measurements: list[dict], analysis: dict) -> Table:
    rows = []
    for r in analysis["decode"]:
        rows.append({"model": r["model"], "dtype": r["dtype"], "threads": r["threads"],
                     "size": r["file_bytes_per_token"], "bytes": r["bytes_per_token"],
                     "test": f"{r['n_gen']} after {r['n_prompt']}", "tok_s": r["tok_s"],
                     "ms": inverse(r["tok_s"]), "gb_s": r["effective_gb_s"],
                     "stream": r["stream_ceiling"]["value"],
                     "share": share_summary(r["share_of_stream"], r.get("share_of_stream_ci")),
                     "read": r["read_ceiling"]["value"], "share_read": r["share_of_read"],
                     "n": r["tok_s"]["n"],
                     "notes": notes_for(r | {"decode_tok_s": r["tok_s"]}, ("decode",))})
    rows.sort(key=lambda x: (x["threads"], x["bytes"]))
    moe = sorted({r["model"] for r in analysis["decode"] if r.get("moe")})
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
                    if (r.get("share_of_read") or 0) > 1})
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
                 "compute_gflop_s": "compute GFLOP/s"}


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
             "far larger than the cache (GB/s of weight bytes); compute = the same kind of "
             "matrix times a 512-column activation. Beside: the range of the short probes "
             "taken before each round (how many in brackets)."]
    notes += [f"Probe failed: {e}; that ceiling is missing." for e in analysis["probe_errors"]]
    notes += stability_lines(analysis.get("stability") or {})
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


def repetitions_table(measurements: list[dict]) -> Table:
    """How each interleaved cell ended: its repetitions, why it stopped, the CI it reached."""
    words = {"target": "reached its CI target", "budget": "time budget", "max":
             "max_repetitions", "fixed": "fixed count",
             "alone": "min_repetitions (in no contrast)"}
    rows = [{"cell": f"{m['model']} {m['dtype']} t{m['threads']} {test_label(m)}",
             "n": m["repetitions"], "stopped": words.get(m["stopped_by"], m["stopped_by"]),
             "target": (m.get("policy") or {}).get("target_ci")
             if (m.get("policy") or {}).get("repetitions") is None else None,
             "reached": m.get("ci_reached")} for m in measurements if m.get("stopped_by")]
    on = {m.get("target", "absolute") for m in measurements if m.get("stopped_by")}
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
    rows = [dict(w) | {"note": "; ".join(w.get("extrapolated") or [])}
            for w in analysis["workloads"]]
    notes = ["Prefill time = prompt tokens ÷ the prefill rate measured at the nearest prompt "
             "length; decode time = generated tokens ÷ the decode rate measured at the nearest "
             "context depth, both on the same model, weight type and thread count."]
    if any(r["note"] for r in rows):
        notes.append("Rows with a note are estimated beyond the measured range: longer prompts "
                     "prefill slower per token as attention grows, and decode slows as the "
                     "cache fills, so those times are optimistic.")
    return Table("workloads", "Where the time goes in typical requests", [
        Column("model", "model"), Column("dtype", "dtype"), Column("threads", "threads", "int"),
        Column("workload", "workload"), Column("prompt", "n_prompt", "int"),
        Column("generated", "n_gen", "int"), Column("prefill s", "prefill_s", "f2"),
        Column("decode s", "decode_s", "f2"), Column("prefill share", "prefill_share", "pct"),
        Column("note", "note")], rows, notes)


def estimates_table(analysis: dict) -> list[Table]:
    """One table of estimates: every spec on this machine and on reference hardware."""
    p = analysis["predictions"]
    if not p.get("this_machine"):
        return []
    models = sorted({r["model"] for r in p["this_machine"]})
    cells: dict[str, dict] = {}
    for r in p["this_machine"]:
        row = cells.setdefault(f"this machine {r['dtype']}", {
            "hardware": "this machine (measured fit)", "dtype": r["dtype"].upper(),
            "bw": f"{p['gb_s']:.1f}"})
        row[r["model"]] = f"{r['tok_s']:.1f}" + ("" if r["bytes_from"] == "file" else "*")
    for r in p["reference"]:
        if r["dtype"] != "q4_0":
            continue
        row = cells.setdefault(r["hardware"], {"hardware": r["hardware"], "dtype": "Q4_0",
                                               "bw": f"{r['bandwidth_gb_s']:.0f} (spec)"})
        row[r["model"]] = (f"{r['tok_s_low']:.0f}–{r['tok_s_high']:.0f}"
                           + ("" if r["bytes_from"] == "file" else "*"))
    bands = {k: v for k, v in p["bands"].items()}
    notes = [f"Estimates, not measurements: decode tok/s = bandwidth ÷ bytes per decode step "
             f"at context 0. This machine: {p['gb_s']:.1f} GB/s from {p['gb_s_from']}. "
             "Reference hardware: spec-sheet bandwidth × the fraction decode reaches on that "
             "class of hardware, shown as a range.",
             "* nominal bytes: every matrix at the base type's bits per weight; llama.cpp's "
             "recipes keep some tensors at other types, so real files are larger (a run that "
             "built the file uses its tensor table: no star)."]
    notes += [f"{k.upper() if k != 'apple' else 'Apple'} band {lo:.0%}–{hi:.0%}: {src}."
              for k, (lo, hi, src) in bands.items()]
    moe = [m for m in p.get("moe_models") or [] if m in models]
    if moe:
        notes.append(f"{', '.join(moe)}: mixtures of experts, estimated from their active bytes "
                     "(k of E experts per token); the whole file must still fit in memory.")
    if p.get("share_of_read") is not None:
        notes.append(f"Diagnostic: this run's decode reached a median {p['share_of_read']:.0%} "
                     "of the numpy read bandwidth measured beside it (numpy's read is no "
                     "ceiling; the yardstick is ggml's streaming ceiling).")
    return [Table("estimates", "Estimates: decode tok/s of every model, here and elsewhere",
                  [Column("hardware", "hardware"), Column("weights", "dtype"),
                   Column("GB/s", "bw")] + [Column(m, m) for m in models],
                  list(cells.values()), notes)]


def missing(records) -> list[str]:
    done = records.measured_ids
    return [i for i in (records.header or {}).get("plan", []) if i not in done]


def report_data(records, analysis: dict) -> dict:
    """Everything a report shows, as plain data."""
    header = records.header or {}
    tables = [prefill_table(records.measurements, analysis),
              decode_table(records.measurements, analysis), ceilings_table(analysis)]
    tables += [workloads_table(analysis)] + estimates_table(analysis)
    tables += [repetitions_table(records.measurements)]
    tables += lever_tables(analysis)
    reference = reference_from_header(header)
    claims = check_claims(reference, analysis, header.get("env", {})) if reference else []
    found = findings({"analysis": analysis, "main": main_model(analysis), "claims": []})
    return {"findings": found, "scenario": header.get("scenario", {}),
            "env": header.get("env", {}),
            "created": header.get("created"), "harness": header.get("harness"),
            "tables": [t for t in tables if t.rows], "fits": analysis["fits"],
            "missing": missing(records), "failures": records.failures,
            "n_measurements": len(records.measurements),
            "method": method_text(records),
            "contrasts": analysis.get("contrasts", []), "claims": claims,
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
        f"| llama.cpp system info | `{llama.get('system_info')}` |",
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
    parts = [METHOD, _cache_sentence(ms), _rounds_sentence(records),
             STATISTICS if records.rounds else NO_ROUNDS, _probe_sentence(records.probes),
             context_sentence(ms)]
    return " ".join(t for t in parts if t)


def _cache_sentence(ms: list[dict]) -> str:
    warmups = sorted({m.get("warmup", 0) for m in ms})
    depth = sum(1 for m in ms if m.get("depth"))
    prefix = sum(1 for m in ms if m.get("shared_prefix"))
    text = ("The KV cache is cleared before every repetition"
            + (f" ({depth} cell{'s' if depth != 1 else ''} then fill it to their depth, "
               "untimed" if depth else "")
            + ("; " if depth and prefix else " (" if prefix and not depth else "")
            + (f"{prefix} prefix cell{'s' if prefix != 1 else ''} keep their cached prefix"
               if prefix else "") + (")" if depth or prefix else "") + "; ")
    one = warmups == [1]
    text += (f"{'–'.join(map(str, warmups))} warm-up repetition{'' if one else 's'} per cell "
             f"{'does' if one else 'do'} the full work and {'is' if one else 'are'} kept out "
             "of the statistics." if warmups else "")
    return text


def _rounds_sentence(records) -> str:
    rounds = records.rounds
    if not rounds:
        return ""
    sizes = [len(r.get("order") or []) for r in rounds]
    reasons = Counter(m.get("stopped_by") for m in records.measurements if m.get("stopped_by"))
    words = {"target": "reached {} target", "budget": "stopped at the time budget",
             "max": "stopped at max_repetitions", "fixed": "ran {} fixed count",
             "alone": "stopped at min_repetitions, in no contrast the report draws"}
    ended = ", ".join(f"{n} " + words.get(k, k).format("its" if n == 1 else "their")
                      for k, n in sorted(reasons.items()))
    size = f"{min(sizes)}" if min(sizes) == max(sizes) else f"{min(sizes)}–{max(sizes)}"
    return (f"The run had {len(rounds)} round{'s' if len(rounds) != 1 else ''} of {size} "
            f"cells, each in an order shuffled per round; of its cells, {ended}.")


def _probe_sentence(probes: list[dict]) -> str:
    full = [p for p in probes if p.get("when") in ("before", "after") and p.get("result")]
    beside = [p for p in probes if p.get("when") == "beside" and p.get("result")]
    if not full and not beside:
        return "No ceilings were measured (the probes failed or did not run)."
    passes = sorted({len(x) for p in beside for x in _pass_counts(p)})
    text = (f"The ceilings are measured by the run itself with llama.cpp's own ggml kernels: "
            f"{len(full)} full probe{'s' if len(full) != 1 else ''} "
            f"({', '.join(p['when'] for p in full)} the measurements)")
    if beside:
        text += (f", and {len(beside)} beside the cells, one before each round, of the thread "
                 "counts and tensor types that round needs"
                 + (f" ({passes[0]}–{passes[-1]} passes each)" if passes else ""))
    return text + (". A ceiling is the median of its probes' passes, the statistic a "
                   "repetition is compared with" + (
                       ", and a share is taken round by round: a repetition ÷ the ceiling "
                       "probed before its round." if beside else
                       "; each share is a median ÷ the ceilings nearest it."))


def _pass_counts(probe: dict) -> list[list]:
    out = []
    for entry in ((probe.get("result") or {}).get("threads") or {}).values():
        for by_type in (entry.get("ggml") or {}).values():
            out += [v for k, v in by_type.items() if "samples" in k and isinstance(v, list)]
    return out


def context_sentence(measurements: list[dict]) -> str:
    """How this run sized its contexts, from its records."""
    sizes = Counter(m.get("n_ctx") for m in measurements)
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


def render_markdown(data: dict, plots: list[str] | None = None) -> str:
    """The report as GitHub-flavoured markdown; plots are relative file names."""
    s = data["scenario"]
    out = [f"# {s.get('title') or s.get('name', 'Run')}", ""]
    if s.get("description"):
        out += [s["description"].strip(), ""]
    env = data["env"]
    out += [f"Measured {(data['created'] or '')[:10]} on {env.get('cpu_model')} "
            f"({env.get('physical_cores')} cores), llama.cpp "
            f"{env.get('llama', {}).get('ggml_commit')}; {data['n_measurements']} measurements.",
            ""]
    if data["missing"]:
        out += [f"> **Incomplete run:** {len(data['missing'])} planned measurement(s) are "
                "missing: " + ", ".join(f"`{m}`" for m in data["missing"]), ""]
    for f in data["failures"]:
        out += [f"> **Failed:** {f['model_key']} at {f['step']}: {f['error']}", ""]
    if data.get("findings"):
        out += ["## Findings", ""] + [f"- {line}" for line in data["findings"]] + [""]
    plots = list(plots or [])
    placed = {PLOT_AFTER[p.rsplit(".", 1)[0]]: p for p in plots
              if PLOT_AFTER.get(p.rsplit(".", 1)[0]) in {t.name for t in data["tables"]}}
    levers = [t.name for t in data["tables"] if t.name in TABLE_NAMES]
    rest = [p for p in plots if p not in placed.values()]
    for t in data["tables"]:
        if levers and t.name == levers[0]:
            for name in rest:
                out += _plot_line(name)
            rest = []
            out += ["## Levers", ""]
        out += [markdown_table(t), ""]
        if t.name == "decode" and data["fits"]:
            out += _fit_lines(data["fits"])
        if t.name in placed:
            out += _plot_line(placed[t.name])
    for name in rest:
        out += _plot_line(name)
    out += ["## Method", "", data["method"], "", "## Environment", "", *env_lines(env), "",
            "## Reproduce", "", "```sh", f"harness run {s.get('path', 'SCENARIO')}", "```", "",
            f"Scenario SHA-256 `{s.get('sha256')}`. Model files are rebuilt byte-identically "
            "from the specs and seed; numbers will differ on another machine, and by a few "
            "percent between runs on this one.", ""]
    return "\n".join(out)


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
