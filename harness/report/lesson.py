"""The lesson page: a run that has the lesson's data, as a page a teacher pastes unchanged.

Findings first, then the tables that carry them, then the published figures and claims checked
on this machine, estimates, and the diagnostics last. Every sentence is computed from the run
(pure: data -> str); a section the run has no data for is left out.
"""

from __future__ import annotations

from ..core.reference import check_claims
from ..core.stats import center, inverse
from ..levers.common import threads_label
from ..render.tabular import Column, Table, ceiling_share_notes, markdown_table
from .findings import findings, main_model, rows_of
from .page import (
    ceilings_table,
    env_lines,
    estimates_table,
    method_text,
    read_share_notes,
    repetitions_table,
    round_fit_lines,
    share_summary,
)

PLOT_CAPTIONS = {
    "decode_vs_bytes": "Decode tok/s against GB read per token, with the fitted bandwidth",
    "prefill_vs_prompt": "Prefill and decode time per token against prompt length",
    "decode_per_token": "Every decode step's time, repetition by repetition (diagnostic)",
}


def lesson_data(records, analysis: dict, reference: dict | None) -> dict:
    """Everything the page shows, as plain data."""
    header = records.header or {}
    env = header.get("env", {})
    main = main_model(analysis)
    return {"scenario": header.get("scenario", {}), "env": env,
            "created": header.get("created"), "analysis": analysis, "main": main,
            "reference": reference,
            "claims": check_claims(reference, analysis, env) if reference else [],
            "measurements": records.measurements, "failures": records.failures,
            "records": records}


# --- tables --------------------------------------------------------------------------------

def side_by_side(data: dict) -> Table | None:
    a, main = data["analysis"], data["main"]
    if not main:
        return None
    pre = sorted((r for r in rows_of(a["prefill"], main) if r["n_gen"] == 0),
                 key=lambda r: r["n_prompt"])
    dec = rows_of(a["decode"], main)
    rows = [{"phase": "prefill", "tokens": f"{p['n_prompt']:,} prompt tokens",
             "seconds": p["seconds"], "tok_s": p["tok_s"], "ms": inverse(p["tok_s"])}
            for p in pre]
    for d in dec:
        rows.append({"phase": "decode", "tokens": f"{d['n_gen']} tokens after {d['n_prompt']}",
                     "seconds": d["n_gen"] / center(d["tok_s"]), "tok_s": d["tok_s"],
                     "ms": inverse(d["tok_s"])})
    notes = []
    if pre and dec:
        ratio = center(pre[0]["tok_s"]) / center(dec[0]["tok_s"])
        notes.append(f"Per token, decode took {ratio:.0f}× as long as prefill of "
                     f"{pre[0]['n_prompt']} tokens: the same weights, read once per "
                     "ubatch of prompt tokens but once per generated token.")
    notes.append("tok/s: median over the repetitions, with the 95% interval of this "
                 "machine's long-run median (drift included) in brackets; seconds and "
                 "ms/token follow from that median, ms/token's interval inverted.")
    return Table("side_by_side", f"Prefill and decode, side by side ({main[0]}, "
                 f"{main[1].upper()}, {main[2]} threads)", [
                     Column("phase", "phase"), Column("work", "tokens"),
                     Column("seconds", "seconds", "f2"), Column("tok/s", "tok_s", "stat"),
                     Column("ms/token", "ms", "stat1")], rows, notes)


def size_table(data: dict) -> Table | None:
    a = data["analysis"]
    # the rows each fit compared; runs stored before fits named them: every F32 decode
    ids = {i for f in a["fits"] for i in f.get("ids") or []} or {
        r["id"] for r in a["decode"] if r["dtype"] == "f32"}
    rows = [{"model": r["model"], "dtype": r["dtype"], "threads": r["threads"],
             "params": (_model_params(data, r)), "gib": r["file_bytes_per_token"],
             "gb": r["bytes_per_token"], "tok_s": r["tok_s"], "ms": inverse(r["tok_s"]),
             "gb_s": r["effective_gb_s"],
             "stream": share_summary(r["share_of_stream"], r.get("share_of_stream_ci")),
             "read": r["share_of_read"], "flags": ", ".join(r["flags"])}
            for r in a["decode"] if r["id"] in ids]
    if len({r["gb"] for r in rows}) < 2:
        return None
    rows.sort(key=lambda r: (r["threads"], r["gb"]))
    notes = ["size: every tensor's bytes in GiB (2³⁰) and GB (10⁹); read per token: what one "
             "decode step reads, in GB (every weight, the embedding as one row unless tied, "
             "and the KV cache). effective GB/s = tok/s × GB read per token. The yardstick is "
             "the streaming ceiling (llama.cpp's own matrix-vector kernel on this machine, "
             "probed before every round), the share taken round by round with its 95% "
             "interval; numpy's plain memory read beside it is a diagnostic, not a ceiling."]
    notes += read_share_notes([r for r in a["decode"] if r["id"] in ids])
    notes += [f"- {threads_label(f['threads'])}: tok/s ≈ {f['fit']['gb_s']:.1f} GB/s ÷ GB read per "
              f"token ({f['fit']['n_points']} "
              f"{f['dtype'].upper() + ' ' if f.get('dtype') else ''}models, R² = "
              f"{f['fit']['r2']:.3f}); {f['verdict']}." if f["fit"]["r2"] is not None else
              f"- {threads_label(f['threads'])}: tok/s ≈ {f['fit']['gb_s']:.1f} GB/s ÷ GB read per "
              f"token; {f['verdict']}." for f in a["fits"]]
    notes += [line.strip() for f in a["fits"] for line in round_fit_lines(f)]
    notes += ceiling_share_notes([(r["share_of_stream"], r["stream_ceiling"].get("spread"),
                                   "above-ceiling" in r["flags"])
                                  for r in a["decode"] if r["id"] in ids])
    return Table("size", "Decode against model size", [
        Column("model", "model"), Column("parameters", "params", "int"),
        Column("size (GiB)", "gib", "gib"), Column("read per token (GB)", "gb", "gb"),
        Column("tok/s", "tok_s", "stat"), Column("ms/token", "ms", "stat1"),
        Column("effective GB/s", "gb_s", "f1"), Column("share of streaming ceiling",
                                                        "stream", "pctci"),
        Column("share of numpy read (diagnostic)", "read", "pct"), Column("flags", "flags")],
        rows, notes)


def _model_params(data: dict, row: dict) -> int | None:
    m = next((m for m in data["measurements"] if m["id"] == row["id"]), None)
    return m["n_params"] if m else None


def use_table(data: dict) -> Table | None:
    rows = [u | {"what": (f"prefill {u['n_prompt']} tokens" if u["phase"] == "prefill"
                          else "decode")} for u in data["analysis"].get("phase_use") or []]
    if not rows:
        return None
    return Table("phase_use", "Where each phase spends the machine", [
        Column("model", "model"), Column("dtype", "dtype"), Column("phase", "what"),
        Column("GFLOP/s", "gflop_s", "f1"), Column("share of compute peak", "compute_share",
                                                   "pct"),
        Column("GB/s of weights", "gb_s", "f1"), Column("share of streaming bandwidth",
                                                        "stream_share", "pct")], rows,
        ["Prefill multiplies each weight matrix by a whole ubatch of tokens: it reads the "
         "weights once per ubatch and spends the machine's arithmetic. Decode multiplies them "
         "by one token: it reads every weight per token and leaves the arithmetic idle. "
         "Compute peak and streaming bandwidth: llama.cpp's own kernels for this model's "
         "weight types, measured in this run."] + ceiling_share_notes(
            [_own_share(u) for u in rows]))


def _own_share(u: dict) -> tuple[float | None, None, bool]:
    """A phase's share of its own resource (prefill: compute, decode: bandwidth), and whether
    its round-by-round interval lies wholly above 100%, for the notes shares above it owe."""
    key = "compute_share" if u["phase"] == "prefill" else "stream_share"
    ci = (u.get(f"{key}_ci") or {}).get("median_ci95")
    return u[key], None, bool(ci and ci[0] > 1)


def figures_table(data: dict) -> Table | None:
    ref, a, env = data["reference"], data["analysis"], data["env"]
    if not ref or not ref.get("figures"):
        return None
    rows = [_figure_row(f, a, env, ref) for f in ref["figures"]]
    return Table("figures", f"Published figures beside this machine ({ref['hardware']})", [
        Column("model", "model"), Column("what", "what"), Column("published", "published"),
        Column("measured here", "measured"), Column("here ÷ published", "ratio", "x"),
        Column("why they differ", "why")], rows,
        [f"Published: {ref['source']}, on {ref['hardware']}. Ratios above 1 mean this "
         "machine was faster."])


def _figure_row(f: dict, a: dict, env: dict, ref: dict) -> dict:
    cores = env.get("physical_cores")
    if "prompt" in f:
        rows = [r for r in a["prefill"] if r["model"] == f["model"] and r["dtype"] ==
                f["dtype"] and r["n_gen"] == 0 and r["n_prompt"] == f["prompt"]]
        published = f.get("prefill_tok_s") or f["prompt"] / f["prefill_s"]
        measured = center(rows[0]["tok_s"]) if rows else None
        why = (f"compute-bound: {cores} cores here, {ref['cores']} there" if ref.get("cores")
               else "compute-bound: depends on cores and their SIMD")
        return {"model": f["model"], "what": f"prefill {f['prompt']:,} tokens (tok/s)",
                "published": f"{published:.0f}", "measured": f"{measured:.0f}" if measured
                else "not measured", "ratio": measured / published if measured else None,
                "why": why}
    rows = [r for r in a["decode"] if r["model"] == f["model"] and r["dtype"] == f["dtype"]]
    published = f.get("decode_tok_s") or 1000 / f["ms_per_token"]
    measured = center(rows[0]["tok_s"]) if rows else None
    copy = (rows[0].get("copy_ceiling") or {}).get("value") if rows else None
    why = "memory-bound: "
    why += (f"numpy copy {copy:.0f} GB/s here, {ref['memory_gb_s']:.0f} GB/s there"
            if copy and ref.get("memory_gb_s") else "depends on memory bandwidth")
    return {"model": f["model"], "what": "decode (tok/s)", "published": f"{published:.2f}",
            "measured": f"{measured:.2f}" if measured else "not measured",
            "ratio": measured / published if measured else None, "why": why}


def claims_table(data: dict) -> Table | None:
    if not data["claims"]:
        return None
    return Table("claims", "The lesson's claims, checked on this machine", [
        Column("claim", "claim"), Column("published", "published"),
        Column("measured here", "measured"), Column("verdict", "verdict"),
        Column("why", "why"), Column("test", "test")], data["claims"],
        ["Each claim is decided by the test and tolerance the scenario's reference block "
         "states, on this run's numbers; \"not measured\" means the run lacks the data."])


# --- the page ------------------------------------------------------------------------------

def render_lesson(data: dict, plots: list[str] | None = None) -> str:
    """The lesson page as markdown; plots are relative file names."""
    s, env = data["scenario"], data["env"]
    plots = [p for p in plots or [] if p.rsplit(".", 1)[0] in PLOT_CAPTIONS]
    out = [f"# {s.get('title') or s.get('name', 'Run')}", ""]
    if s.get("description"):
        out += [s["description"].strip(), ""]
    out += [f"Measured {(data['created'] or '')[:10]} on {env.get('cpu_model')} "
            f"({env.get('physical_cores')} cores) with llama.cpp "
            f"{(env.get('llama') or {}).get('ggml_commit')}.", ""]
    out += [f"> **Failed:** {f['model_key']} at {f['step']}: {f['error']}" for f in
            data["failures"]]
    out += ["## Findings", ""] + [f"- {line}" for line in findings(data)] + [""]
    sections = [(side_by_side(data), "prefill_vs_prompt"), (size_table(data), "decode_vs_bytes"),
                (use_table(data), None), (figures_table(data), None), (claims_table(data), None)]
    for table, plot in sections:
        if table is None:
            continue
        out += [markdown_table(table).replace("### ", "## ", 1), ""]
        out += _plot(plot, plots)
    est = estimates_table(data["analysis"])
    if est:
        head, _, rest = markdown_table(est[0]).partition("\n")
        out += ["## Your machine against others (estimates: decode tok/s of every model)", rest,
                ""]
    out += ["## Method", "", method_text(data["records"]), "", "## Environment", "",
            *env_lines(env), "",
            "## Reproduce", "", "```sh", f"harness run {s.get('path', 'SCENARIO')}", "```", ""]
    out += ["## Appendix: diagnostics", ""]
    for table in (ceilings_table(data["analysis"]), repetitions_table(data["measurements"])):
        out += [markdown_table(table), ""]
    out += _plot("decode_per_token", plots)
    return "\n".join(out)


def _plot(name: str | None, plots: list[str]) -> list[str]:
    file = next((p for p in plots if name and p.rsplit(".", 1)[0] == name), None)
    return [f"![{PLOT_CAPTIONS[name]}]({file})", ""] if file else []
