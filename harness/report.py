"""Reports: the tables of a run as data, rendered to markdown, CSV or JSON (all pure)."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field

from .analysis import is_plain
from .noise import NOISY_CORES
from .stats import UNSTABLE_CV

GIB = 2**30
PLOTS = {
    "decode_vs_bytes": "Decode tok/s against bytes read per token, with the fitted bandwidth "
                       "and the measured read ceiling",
    "prefill_vs_prompt": "Prefill time and tok/s against prompt length",
    "decode_per_token": "Every decode step's time, repetition by repetition (warm-ups grey)",
    "quant_speedup": "Decode and prefill speed-up of each weight type against its byte reduction",
    "kv_depth": "Decode slowdown against context depth, measured and predicted from bytes",
    "batching": "Aggregate and per-sequence decode tok/s against the number of sequences",
    "threads": "Speed-up of prefill and decode with threads, beside the ceilings' own scaling",
    "prefix_cache": "Time to first token with the shared prefix recomputed or reused",
}
LEVER_TABLES = ("quant", "quant_composition", "kv_depth", "kv_memory", "batching", "threads",
                "prefix")
# A lever's plot goes right after its table; the others follow the last table.
PLOT_AFTER = {"quant_speedup": "quant_composition", "kv_depth": "kv_memory",
              "batching": "batching", "threads": "threads", "prefix_cache": "prefix"}


@dataclass(frozen=True)
class Column:
    header: str
    key: str
    kind: str = "str"  # str, int, f1, f2, f3, pct, gib, stat


@dataclass
class Table:
    name: str
    title: str
    columns: list[Column]
    rows: list[dict]
    notes: list[str] = field(default_factory=list)


def _notes_for(record: dict, phases: tuple[str, ...] = ("prefill", "decode")) -> str:
    """Each flag with its reason, for the notes column (only the phases the table shows)."""
    out = []
    for flag in record.get("flags", []):
        if flag.startswith("unstable-"):
            phase = flag.split("-", 1)[1]
            if phase not in phases:
                continue
            cv = (record.get(f"{phase}_tok_s") or {}).get("cv") or 0
            out.append(f"⚠ {phase} unstable (CV {cv:.1%} > {UNSTABLE_CV:.0%})")
        elif flag == "noisy":
            n = record["noise"]
            worst = max(n["idle_other_cores"], n.get("during_other_cores") or 0)
            out.append(f"⚠ noisy (other processes used {worst:.2f} cores > {NOISY_CORES})")
        elif flag == "perf-mismatch":
            out.append("⚠ llama.cpp's counters differ from the wall clock by > 5%")
        else:
            out.append(f"⚠ {flag}")
    return "; ".join(out)


def prefill_table(measurements: list[dict], analysis: dict) -> Table:
    gflop = {r["id"]: r for r in analysis["prefill"]}
    rows = [{"model": m["model"], "dtype": m["dtype"], "threads": m["threads"],
             "n_prompt": m["n_prompt"], "seconds": m["ttft_s"], "tok_s": m["prefill_tok_s"],
             "gflop_s": gflop.get(m["id"], {}).get("gflop_s"),
             "share": gflop.get(m["id"], {}).get("share_of_peak"),
             "n": m["repetitions"], "notes": _notes_for(m)}
            for m in measurements if m["n_gen"] == 0 and m.get("prefill_tok_s") and is_plain(m)]
    return Table("prefill", "Prefill: time to first token", [
        Column("model", "model"), Column("dtype", "dtype"), Column("threads", "threads", "int"),
        Column("prompt tokens", "n_prompt", "int"), Column("prefill time (s)", "seconds", "stat3"),
        Column("tok/s", "tok_s", "stat"), Column("GFLOP/s", "gflop_s", "f1"),
        Column("share of matmul peak", "share", "pct"), Column("n", "n", "int"),
        Column("notes", "notes")], rows,
        ["Prefill time runs from the first prompt token to the logits of the last; "
         "tok/s = prompt tokens ÷ that time. GFLOP/s counts 2 × matmul parameters per token "
         "plus causal attention (Kaplan et al. 2020)."])


def decode_table(measurements: list[dict], analysis: dict) -> Table:
    rows = []
    by_id = {m["id"]: m for m in measurements}
    for r in analysis["decode"]:
        m = by_id[r["id"]]
        rows.append({"model": r["model"], "dtype": r["dtype"], "threads": r["threads"],
                     "size": r["file_bytes_per_token"], "bytes": r["bytes_per_token"],
                     "test": f"{r['n_gen']} after {r['n_prompt']}", "tok_s": r["tok_s"],
                     "ms": r["ms_per_token"], "gb_s": r["effective_gb_s"],
                     "ceiling": r["read_ceiling"]["value"], "share": r["share_of_read"],
                     "n": m["repetitions"], "notes": _notes_for(m, ("decode",))})
    rows.sort(key=lambda x: (x["threads"], x["bytes"]))
    return Table("decode", "Decode against model size", [
        Column("model", "model"), Column("dtype", "dtype"), Column("threads", "threads", "int"),
        Column("size (GiB)", "size", "gib"), Column("read per token (GiB)", "bytes", "gib"),
        Column("tokens", "test"), Column("tok/s", "tok_s", "stat"),
        Column("ms/token", "ms", "stat"), Column("effective GB/s", "gb_s", "f1"),
        Column("read ceiling GB/s", "ceiling", "f1"), Column("share of ceiling", "share", "pct"),
        Column("n", "n", "int"), Column("notes", "notes")], rows,
        ["size is every tensor's bytes (the file-size convention, llama-bench's model_size); "
         "read per token is what one decode step reads: every weight, the token embedding as "
         "one row unless tied to the output, plus the KV cache at the mean context.",
         "effective GB/s = tok/s × read per token; the read ceiling is the probe measured "
         "beside the run (mean of before and after)."])


def ceilings_table(analysis: dict) -> Table:
    names = {"read_gb_s": "read GB/s", "copy_gb_s": "copy GB/s",
             "matmul_gflop_s": "F32 matmul GFLOP/s"}
    rows = [{"threads": c["threads"], "what": names[c["what"]], "before": c["before"],
             "after": c["after"], "drift": c["drift"]} for c in analysis["ceilings"]]
    notes = ["Memory: STREAM conventions (arrays ≥ 4× the last-level cache, a warm pass, best "
             "of several; copy counts bytes read + written). Compute: numpy/OpenBLAS SGEMM."]
    notes += [f"Probe failed: {e}; those ceilings are missing." for e in analysis["probe_errors"]]
    return Table("ceilings", "Measured ceilings of this machine", [
        Column("threads", "threads", "int"), Column("ceiling", "what"),
        Column("before the run", "before", "f1"), Column("after the run", "after", "f1"),
        Column("change", "drift", "spct")], rows, notes)


def workloads_table(analysis: dict) -> Table:
    rows = [dict(w) for w in analysis["workloads"]]
    notes = []
    froms = {(w["model"], w["prefill_rate_from"]) for w in rows}
    if froms:
        notes.append("Prefill rates come from the nearest measured prompt length ("
                     + ", ".join(f"{m}: {n} tokens" for m, n in sorted(froms))
                     + "); longer prompts run slower per token as attention grows, so long-"
                     "prompt prefill times here are optimistic.")
    return Table("workloads", "Where the time goes in typical requests", [
        Column("model", "model"), Column("dtype", "dtype"), Column("workload", "workload"),
        Column("prompt", "n_prompt", "int"), Column("generated", "n_gen", "int"),
        Column("prefill s", "prefill_s", "f2"), Column("decode s", "decode_s", "f2"),
        Column("prefill share", "prefill_share", "pct")], rows, notes)


def predictions_tables(analysis: dict) -> list[Table]:
    p = analysis["predictions"]
    if not p.get("this_machine"):
        return []
    models = sorted({r["model"] for r in p["this_machine"]})
    this = {}
    for r in p["this_machine"]:
        this.setdefault(r["model"], {"model": r["model"]})[r["dtype"]] = r["tok_s"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in p["this_machine"]))
    t1 = Table("predictions", f"Estimates: decode tok/s of every spec on this machine "
               f"({p['gb_s']:.1f} GB/s)", [Column("model", "model")] +
               [Column(f"{d.upper()}{'*' if d.startswith('q') else ''}", d, "f2")
                for d in dtypes], [this[m] for m in models],
               ["Estimates, not measurements: the fitted (or measured effective) bandwidth "
                "÷ bytes per decode step at context 0. * quantized sizes are nominal."])
    ref: dict[str, dict] = {}
    for r in p["reference"]:
        if r["dtype"] == "q4_0":
            row = ref.setdefault(r["hardware"], {"hardware": r["hardware"],
                                                 "bw": r["bandwidth_gb_s"]})
            row[r["model"]] = r["tok_s"]
    eff = p["efficiency"]
    t2 = Table("reference", "Estimates: Q4_0 decode tok/s on reference hardware",
               [Column("hardware", "hardware"), Column("spec GB/s", "bw", "f1")] +
               [Column(m, m, "f1") for m in models], list(ref.values()),
               [f"Estimates, not measurements: spec-sheet bandwidth × {eff:.0%} (the share of "
                "its measured read ceiling this machine's decode reached) ÷ nominal Q4_0 bytes "
                "per token." if eff else "Estimates, not measurements: spec-sheet bandwidth "
                "÷ nominal Q4_0 bytes per token (no ceiling was measured here)."])
    return [t1, t2]


def missing(records) -> list[str]:
    done = records.measured_ids
    return [i for i in (records.header or {}).get("plan", []) if i not in done]


def report_data(records, analysis: dict) -> dict:
    """Everything a report shows, as plain data."""
    header = records.header or {}
    tables = [prefill_table(records.measurements, analysis),
              decode_table(records.measurements, analysis), ceilings_table(analysis)]
    tables += predictions_tables(analysis) + [workloads_table(analysis)]
    from .report_levers import lever_tables

    tables += lever_tables(analysis)
    return {"scenario": header.get("scenario", {}), "env": header.get("env", {}),
            "created": header.get("created"), "harness": header.get("harness"),
            "tables": [t for t in tables if t.rows], "fits": analysis["fits"],
            "missing": missing(records), "failures": records.failures,
            "n_measurements": len(records.measurements)}


# --- rendering -----------------------------------------------------------------------------

_FORMATS = {
    "int": lambda v: f"{v:,}",
    "f1": lambda v: f"{v:,.1f}", "f2": lambda v: f"{v:,.2f}", "f3": lambda v: f"{v:,.3f}",
    "pct": lambda v: f"{v:.0%}", "spct": lambda v: f"{v:+.1%}", "x": lambda v: f"{v:.2f}×",
    "gib": lambda v: f"{v / GIB:.2f}", "gib3": lambda v: f"{v / GIB:.3f}",
    "mib": lambda v: f"{v / 2**20:,.1f}", "kib": lambda v: f"{v / 2**10:,.1f}",
}


def _cell(value, kind: str) -> str:
    if value is None or value == "":
        return "–" if kind != "str" else ""
    if kind.startswith("stat"):
        digits = int(kind[4:] or 2)
        ci = value.get("ci95")
        half = f" ± {(ci[1] - ci[0]) / 2:.{digits}f}" if ci else ""
        return f"{value['mean']:.{digits}f}{half}"
    if kind in _FORMATS:
        return _FORMATS[kind](value)
    return str(value).replace("|", "\\|")


def _markdown_table(t: Table) -> str:
    head = "| " + " | ".join(c.header for c in t.columns) + " |"
    align = "|" + "|".join("---" if c.kind == "str" else "---:" for c in t.columns) + "|"
    body = ["| " + " | ".join(_cell(r.get(c.key), c.kind) for c in t.columns) + " |"
            for r in t.rows]
    notes = [f"\n{n}" for n in t.notes]
    return "\n".join([f"### {t.title}", "", head, align, *body]) + "\n" + "\n".join(notes)


def _env_lines(env: dict) -> list[str]:
    llama = env.get("llama", {})
    ram = (env.get("ram_total_bytes") or 0) / GIB
    return [
        "| | |", "|---|---|",
        f"| CPU | {env.get('cpu_model')} ({env.get('physical_cores')} physical / "
        f"{env.get('logical_cores')} logical cores) |",
        f"| RAM | {ram:.1f} GiB |",
        f"| OS | {env.get('os')} |",
        f"| llama.cpp | commit {llama.get('ggml_commit')} (ggml {llama.get('ggml_version')}), "
        f"llama-cpp-python {llama.get('llama_cpp_python')} |",
        f"| llama.cpp system info | `{llama.get('system_info')}` |",
        f"| Python, gguf, numpy | {env.get('python')}, {env.get('gguf')}, {env.get('numpy')} |",
        f"| harness | {env.get('harness')} |",
    ]


METHOD = (
    "The models are random-weight GGUF files with the exact tensor shapes of the named "
    "architectures (meaningless text, the same matrix work and memory reads), run in-process "
    "through llama.cpp's C API on the CPU. Prompts are random token ids, with no tokenizer and "
    "no sampling. Prefill is timed from the first prompt token to the last token's logits; "
    "decode times every single-token step, each synchronized. The KV cache is cleared before "
    "every repetition; warm-up repetitions do the full work and are kept out of the statistics. "
    "Numbers are means with the half-width of their 95% confidence interval (Student t) over "
    "the repetitions (n). Memory bandwidth and matmul ceilings are probed right before and "
    "after the measurements.")


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
    plots = list(plots or [])
    placed = {PLOT_AFTER[p.rsplit(".", 1)[0]]: p for p in plots
              if PLOT_AFTER.get(p.rsplit(".", 1)[0]) in {t.name for t in data["tables"]}}
    levers = [t.name for t in data["tables"] if t.name in LEVER_TABLES]
    rest = [p for p in plots if p not in placed.values()]
    for t in data["tables"]:
        if levers and t.name == levers[0]:
            for name in rest:
                out += _plot_line(name)
            rest = []
            out += ["## Levers", ""]
        out += [_markdown_table(t), ""]
        if t.name == "decode":
            out += _fit_lines(data["fits"])
        if t.name in placed:
            out += _plot_line(placed[t.name])
    for name in rest:
        out += _plot_line(name)
    out += ["## Method", "", METHOD, "", "## Environment", "", *_env_lines(env), "",
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
        if fit:
            r2 = f"{fit['r2']:.3f}" if fit["r2"] is not None else "n/a"
            out.append(f"- {f['threads']} threads: least-squares fit through the origin over "
                       f"{fit['n_points']} measurements: **{fit['gb_s']:.1f} GB/s** (R² = {r2}).")
        out.append(f"  Verdict: **{f['verdict']}**.")
        out += [f"  Note: {n}." for n in f.get("notes", [])]
    return out + [""]


def render_csv(data: dict) -> str:
    """Every table in one CSV, a `table` column first; statistics as mean, CI low, CI high."""
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
                    ci = (v or {}).get("ci95") or [None, None]
                    row += [(v or {}).get("mean"), ci[0], ci[1], (v or {}).get("n")]
                else:
                    row.append(v)
            writer.writerow(row)
    return buf.getvalue()


def render_json(data: dict) -> str:
    tables = {t.name: {"title": t.title, "columns": [c.key for c in t.columns],
                       "rows": t.rows, "notes": t.notes} for t in data["tables"]}
    out = {k: v for k, v in data.items() if k != "tables"} | {"tables": tables}
    return json.dumps(out, indent=1, sort_keys=True)
