"""The lesson page: a run that has the lesson's data, as a page a teacher pastes unchanged.

Findings first, then the tables that carry them, then the published figures and claims checked
on this machine, estimates, and the diagnostics last. Every sentence is computed from the run
(pure: data -> str); a section the run has no data for is left out.
"""

from __future__ import annotations

import re

from ..core.records import to_dict
from ..core.reference import published_decode_tok_s, published_prefill
from ..core.stats import center, inverse
from ..levers.common import threads_label
from ..levers.twins import twin_table
from ..render.tabular import Column, Table, ceiling_share_notes, markdown_table
from ..study.claims import check_claims
from .findings import findings, main_model, rows_of
from .page import (
    ceilings_table,
    decode_model_table,
    env_lines,
    estimates_table,
    method_text,
    prefill_model_table,
    read_share_notes,
    repetitions_table,
    round_fit_lines,
    share_summary,
    workloads_table,
)
from .templating import FullPage, Section, nobreak

PLOT_CAPTIONS = {
    "decode_vs_bytes": "Decode tok/s against GB read per token (log-log): the run's model of "
                       "each weight type as a line, the course's points hollow",
    "prefill_vs_prompt": "Prefill and decode time per token against prompt length",
    "decode_per_token": "Every decode step's time, repetition by repetition (diagnostic)",
    "quant_speedup": "Decode and prefill speed of each weight type against F32",
    "batching": "Aggregate and per-sequence decode tok/s against the number of sequences",
    "twins": "Twin ÷ real tok/s per phase, round by round, with the ±2% band",
}


def lesson_data(records, analysis: dict, reference: dict | None) -> dict:
    """Everything the page shows, as plain data."""
    header = records.header
    env = header.env or {}
    main = main_model(analysis)
    return {"scenario": header.scenario or {}, "env": env,
            "created": header.created, "analysis": analysis, "main": main,
            "reference": reference,
            "claims": check_claims(reference, analysis, env) if reference else [],
            "measurements": records.measurements,
            "failures": [to_dict(f) for f in records.failures],
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
             "gib": r["file_bytes_per_token"],
             "gb": r["bytes_per_token"], "tok_s": r["tok_s"], "ms": inverse(r["tok_s"]),
             "gb_s": r["effective_gb_s"],
             "stream": share_summary(r["share_of_stream"], r["share_of_stream_ci"]),
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
             "interval; numpy's plain memory read (the appendix) is a diagnostic, not a "
             "ceiling."]
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
        Column("model", "model"), Column("size (GiB)", "gib", "gib"),
        Column("read per token (GB)", "gb", "gb"), Column("tok/s", "tok_s", "stat"),
        Column("ms/token", "ms", "stat1"), Column("effective GB/s", "gb_s", "f1"),
        Column("share of streaming ceiling", "stream", "pctci"), Column("flags", "flags")],
        rows, notes)


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
         + ("A mixture of experts' ubatch reads the union of its tokens' experts (as the run "
            "recorded them for a ubatch of that size, else the expected union with every "
            "token picking k of E at random), one decode token k of E. "
            if any(u["moe"] for u in rows) else "") +
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
    if "prompt" in f:
        return _prefill_figure(f, a, ref)
    rows = [r for r in a["decode"] if r["model"] == f["model"] and r["dtype"] == f["dtype"]]
    published = published_decode_tok_s(f)
    measured = center(rows[0]["tok_s"]) if rows else None
    return {"model": f["model"], "what": "decode (tok/s)", "published": f"{published:.2f}",
            "measured": f"{measured:.2f}" if measured else "not measured",
            "ratio": measured / published if measured else None,
            "why": _decode_why(f, rows[0], ref, measured / published) if rows else "–"}


def _prefill_figure(f: dict, a: dict, ref: dict) -> dict:
    """A published prefill in its own units (seconds) beside tok/s, and why they differ: the
    compute per core here and there, and the long prompt's slowdown against the model's."""
    rows = [r for r in a["prefill"] if r["model"] == f["model"] and r["dtype"] == f["dtype"]
            and r["n_gen"] == 0 and r["n_prompt"] == f["prompt"]]
    published, published_s = published_prefill(f)
    out = {"model": f["model"], "what": f"prefill {f['prompt']:,} tokens",
           "published": f"{published_s:.2f} s ({published:.0f} tok/s)",
           "measured": "not measured", "ratio": None, "why": "–"}
    if not rows:
        return out
    r = rows[0]
    measured = center(r["tok_s"])
    out |= {"measured": f"{r['seconds']:.2f} s ({measured:.0f} tok/s)",
            "ratio": measured / published}
    why = []
    if ref.get("cores"):
        here = r["gflop_s"] / r["threads"]
        there = published * r["flops"] / r["n_prompt"] / 1e9 / ref["cores"]
        why.append(f"compute: {r['threads']} threads here at {here:.0f} GFLOP/s each, "
                   f"{ref['cores']} cores there at {there:.0f} each (implied by its time)")
    why += _slowdown_why(f, r, a, ref)
    return out | {"why": "; ".join(why) or "–"}


def _slowdown_why(f: dict, r: dict, a: dict, ref: dict) -> list[str]:
    """A long prompt's per-token time against the shortest published one, here, there and
    as the run's model (matrices plus attention) predicts it."""
    base = min((g for g in ref["figures"] if g.get("prompt") and g["model"] == f["model"]),
               key=lambda g: g["prompt"], default=None)
    if base is None or base["prompt"] == f["prompt"]:
        return []
    fit = next((p for p in a["machine_model"]["prefill"]
                if p["model"] == f["model"] and p["dtype"] == f["dtype"]
                and p["threads"] == r["threads"]), None)
    points = {pt["n_prompt"]: pt for pt in (fit or {}).get("points", [])}
    if base["prompt"] not in points or f["prompt"] not in points:
        return []

    def per_token(s: float, n: int) -> float:
        return s / n

    b, p = points[base["prompt"]], points[f["prompt"]]
    here = per_token(p["measured_s"], p["n_prompt"]) / per_token(b["measured_s"], b["n_prompt"])
    model = (per_token(p["predicted_s"], p["n_prompt"])
             / per_token(b["predicted_s"], b["n_prompt"]))
    there = (per_token(published_prefill(f)[1], f["prompt"])
             / per_token(published_prefill(base)[1], base["prompt"]))
    return [f"per token, {f['prompt']:,} tokens took {here:.2f}× the time of "
            f"{base['prompt']:,} here (the attention model predicts {model:.2f}×: attention "
            f"is {p['attention_flop_share']:.0%} of the FLOPs at "
            f"{fit['attention_gflop_s']:.0f} GFLOP/s against {fit['matmul_gflop_s']:.0f} for "
            f"the matrices) and {there:.2f}× there"]


def _decode_why(f: dict, row: dict, ref: dict, ratio: float) -> str:
    """Decode's share of the plain memory copy here against the course's own share."""
    copy = row["copy_ceiling"]["value"]
    if not copy or not ref.get("memory_gb_s"):
        return "depends on memory bandwidth (no copy figure to compare)"
    here = row["effective_gb_s"] / copy
    there_gb_s = f.get("effective_gb_s") or (f.get("size_gib") or 0) * 2**30 / 1e9 * (
        f.get("decode_tok_s") or 0)
    if not there_gb_s:
        return f"bandwidth: decode used {here:.0%} of a {copy:.0f} GB/s copy here"
    there = there_gb_s / ref["memory_gb_s"]
    return (f"bandwidth: decode used {here:.0%} of a {copy:.0f} GB/s copy here "
            f"({row['effective_gb_s']:.1f} GB/s), {there:.0%} of {ref['memory_gb_s']:.0f} "
            f"there ({there_gb_s:.1f} GB/s): {row['effective_gb_s'] / there_gb_s:.2f}× the "
            "effective bandwidth")


def workloads_of_main(data: dict) -> Table | None:
    """Where the time goes in typical requests, for the page's main model only."""
    full = workloads_table(data["analysis"])
    main = data["main"]
    rows = [r for r in full.rows if main and (r["model"], r["dtype"], r["threads"]) == main]
    if not rows:
        return None
    keep = [c for c in full.columns if c.key not in ("model", "dtype")]
    title = f"{full.title} ({main[0]}, {main[1].upper()}, {threads_label(main[2])})"
    return Table(full.name, title, keep, rows, full.notes)


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

def full_sections(data: dict, plots: list[str] | None = None) -> FullPage:
    """The full report of a lesson run, section by section; plots are relative file names."""
    s, env = data["scenario"], data["env"]
    plots = [p for p in plots or [] if p.rsplit(".", 1)[0] in PLOT_CAPTIONS]
    head = [s["description"].strip(), ""] if s.get("description") else []
    head += [f"Measured {(data['created'] or '')[:10]} on {env.get('cpu_model')} "
             f"({env.get('physical_cores')} cores) with llama.cpp "
             f"{(env.get('llama') or {}).get('ggml_commit')}.", ""]
    head += [f"> **Failed:** {f['model_key']} at {f['step']}: {f['error']}" for f in
             data["failures"]]
    out = [Section.of("intro", head),
           Section.of("findings", ["## Findings", ""]
                                     + [f"- {line}" for line in findings(data)] + [""])]
    a = data["analysis"]
    tables = [(side_by_side(data), "prefill_vs_prompt"),
              (next(iter(prefill_model_table(a)), None), None),
              (size_table(data), "decode_vs_bytes"),
              (next(iter(decode_model_table(a)), None), "quant_speedup"),
              (use_table(data), None), (figures_table(data), None),
              (workloads_of_main(data), None), (claims_table(data), "batching")]
    for table, plot in tables:
        if table is not None:
            out.append(Section.of(table.name,
                [unbreakable(markdown_table(table).replace("### ", "## ", 1)), ""]
                + _plot(plot, plots)))
    out.append(Section.of("twins", twin_section(a) + _plot("twins", plots)))
    est = estimates_table(data["analysis"])
    if est:
        head, _, rest = unbreakable(markdown_table(est[0])).partition("\n")
        out.append(Section.of("estimates",
            ["## Your machine against others (estimates: decode tok/s)", rest, ""]))
    out += [Section.of("method", ["## Method", "", method_text(data["records"]), ""]),
            Section.of("environment", ["## Environment", "", *env_lines(env), ""]),
            Section.of("reproduce", ["## Reproduce", "", "```sh",
                                        f"harness run {s.get('path', 'SCENARIO')}", "```",
                                        ""])]
    appendix = ["## Appendix: diagnostics", ""]
    for table in (ceilings_table(data["analysis"]), repetitions_table(data["measurements"])):
        appendix += [markdown_table(table), ""]
    out.append(Section.of("diagnostics", appendix + _plot("decode_per_token", plots)))
    return FullPage(f"{s.get('title') or s.get('name', 'Run')}: the full report", tuple(out))



def render_lesson(data: dict, plots: list[str] | None = None) -> str:
    """The full report of a lesson run as markdown, through the built-in `full` template."""
    from .templating import render

    return render("full", full_sections(data, plots))


def twin_section(a: dict) -> list[str]:
    """The premise that random weights time like real ones: the run's check, or a line saying
    it was not checked and how to check it."""
    tables = twin_table(a)
    if tables:
        return [unbreakable(markdown_table(tables[0]).replace("### ", "## ", 1)), ""]
    return ["## Random weights against real weights", "",
            "Not checked in this run: every model here has random weights. To time a real "
            "GGUF file beside its random-weight twin, add `- twin_of: path/to/model.gguf` to "
            "the scenario's models, or run `harness twin path/to/model.gguf` (`--against "
            "built` for the file the builder makes of its spec, as every run times).", ""]


MODEL_NAME = re.compile(r"\b[A-Za-z][A-Za-z0-9.]*(?:-[A-Za-z0-9.]+)+\b")


def unbreakable(table_md: str) -> str:
    """A table's model names (hyphenated words with a digit: qwen2.5-0.5b) with non-breaking
    hyphens (U+2011, the same glyph), so a narrow column of an 860 px page never splits one."""
    def name(m: re.Match) -> str:
        word = m.group(0)
        return nobreak(word) if any(c.isdigit() for c in word) else word

    return "\n".join(MODEL_NAME.sub(name, line) if line.startswith("|") else line
                      for line in table_md.split("\n"))


def _plot(name: str | None, plots: list[str]) -> list[str]:
    file = next((p for p in plots if name and p.rsplit(".", 1)[0] == name), None)
    return [f"![{PLOT_CAPTIONS[name]}]({file})", ""] if file else []
