"""The lesson page: a run that has the lesson's data, as a page a teacher pastes unchanged.

Findings first, then the tables that carry them, then the published figures and claims checked
on this machine, estimates, and the diagnostics last. Every sentence is computed from the run
(pure: data -> str); a section the run has no data for is left out.
"""

from __future__ import annotations

from .reference import check_claims
from .report import (
    ABOVE_CEILING_NOTE,
    METHOD,
    Column,
    Table,
    _env_lines,
    _markdown_table,
    ceilings_table,
    estimates_table,
    repetitions_table,
)
from .stats import center, inverse

GIB, GB = 2**30, 1e9
PLOT_CAPTIONS = {
    "decode_vs_bytes": "Decode tok/s against GB read per token, with the fitted bandwidth",
    "prefill_vs_prompt": "Prefill and decode time per token against prompt length",
    "decode_per_token": "Every decode step's time, repetition by repetition (diagnostic)",
}


def lesson_data(records, analysis: dict, reference: dict | None) -> dict:
    """Everything the page shows, as plain data."""
    header = records.header or {}
    env = header.get("env", {})
    main = _main_model(analysis)
    return {"scenario": header.get("scenario", {}), "env": env,
            "created": header.get("created"), "analysis": analysis, "main": main,
            "reference": reference,
            "claims": check_claims(reference, analysis, env) if reference else [],
            "measurements": records.measurements, "failures": records.failures}


def _main_model(analysis: dict) -> tuple | None:
    """The model the side-by-side table is about: the one with the most prompt lengths."""
    counts: dict[tuple, int] = {}
    for r in analysis["prefill"]:
        if r["n_gen"] == 0 and r["dtype"] == "f32":
            key = (r["model"], r["dtype"], r["threads"])
            counts[key] = counts.get(key, 0) + 1
    size = {(r["model"], r["dtype"], r["threads"]): r["bytes_per_token"]
            for r in analysis["decode"]}
    keys = [k for k in counts if k in size]
    # the most prompt lengths; among equals the smallest model (the course's running example)
    return max(keys, key=lambda k: (counts[k], -size[k])) if keys else None


# --- findings ------------------------------------------------------------------------------

def findings(data: dict) -> list[str]:
    """Five or six sentences with the run's numbers, each true of it."""
    a, main = data["analysis"], data["main"]
    out = []
    if main:
        out += _two_phases(a, main)
    out += _size_finding(a) + _use_finding(a) + _long_prompt_finding(a, main)
    out += _quant_finding(a) + _batch_finding(a)
    claims = data["claims"]
    if claims:
        held = sum(c["verdict"] == "holds" for c in claims)
        tested = sum(c["verdict"] != "not measured" for c in claims)
        out.append(f"Of the course's {len(claims)} claims checked here, {held} of the "
                   f"{tested} this run could test hold on this machine (table below).")
    return out


def _rows(rows: list[dict], key: tuple) -> list[dict]:
    return [r for r in rows if (r["model"], r["dtype"], r["threads"]) == key]


def _two_phases(a: dict, main: tuple) -> list[str]:
    pre = sorted((r for r in _rows(a["prefill"], main) if r["n_gen"] == 0),
                 key=lambda r: r["n_prompt"])
    dec = _rows(a["decode"], main)
    if not pre or not dec:
        return []
    p, d = pre[0], dec[0]
    p_ms, d_ms = 1000 / center(p["tok_s"]), 1000 / center(d["tok_s"])
    return [f"On {main[0]} ({main[1].upper()}, {main[2]} threads), prefill of a "
            f"{p['n_prompt']}-token prompt ran at {center(p['tok_s']):.0f} tok/s "
            f"({p_ms:.1f} ms per token) and decode at {center(d['tok_s']):.1f} tok/s "
            f"({d_ms:.0f} ms per token): each decoded token took as long as "
            f"{d_ms / p_ms:.0f} prompt tokens."]


def _size_finding(a: dict) -> list[str]:
    fit = next((f for f in a["fits"] if f.get("fit")), None)
    if not fit:
        return []
    rows = sorted((r for r in a["decode"] if r["threads"] == fit["threads"]),
                  key=lambda r: r["bytes_per_token"])
    speeds = ", ".join(f"{r['model']} {r['bytes_per_token'] / GB:.2f} GB → "
                       f"{center(r['tok_s']):.1f} tok/s" for r in rows)
    eff = [r["effective_gb_s"] for r in rows]
    text = (f"Decode slowed as the bytes read per token grew ({speeds}); tok/s × bytes stayed "
            f"at {min(eff):.0f}–{max(eff):.0f} GB/s, and the fit through the origin gives "
            f"{fit['fit']['gb_s']:.1f} GB/s")
    r2 = fit["fit"]["r2"]
    text += f" (R² = {r2:.2f})." if r2 is not None else "."
    if not fit["memory_bound"]:
        text += f" Read with care: {fit['reasons'][0]}."
    return [text]


def _use_finding(a: dict) -> list[str]:
    use = a.get("phase_use") or []
    pre = next((u for u in use if u["phase"] == "prefill"), None)
    dec = next((u for u in use if u["phase"] == "decode" and u["model"] == (pre or {}).get(
        "model")), None)
    if not pre or not dec or None in (pre["compute_share"], dec["stream_share"],
                                      pre["stream_share"], dec["compute_share"]):
        return []
    return [f"Prefill kept the cores busy ({pre['compute_share']:.0%} of the compute peak, "
            f"{pre['stream_share']:.0%} of the memory bandwidth); decode did the reverse "
            f"({dec['stream_share']:.0%} of the bandwidth, {dec['compute_share']:.0%} of the "
            f"compute), both against llama.cpp's own kernels measured in this run."]


def _long_prompt_finding(a: dict, main: tuple | None) -> list[str]:
    pre = [r for r in (_rows(a["prefill"], main) if main else []) if r["n_gen"] == 0]
    if len(pre) < 2:
        return []
    short, long = min(pre, key=lambda r: r["n_prompt"]), max(pre, key=lambda r: r["n_prompt"])
    return [f"A {long['n_prompt']:,}-token prompt took {long['seconds']:.1f} s before its first "
            f"token ({center(long['tok_s']):.0f} tok/s, against "
            f"{center(short['tok_s']):.0f} tok/s at {short['n_prompt']} tokens)."]


def _quant_finding(a: dict) -> list[str]:
    q = [r for r in a.get("quant") or [] if r["dtype"] != r["baseline"]
         and r.get("decode_speedup") and r.get("prefill_speedup")]
    if not q:
        return []
    r = min(q, key=lambda r: r["bytes_per_token"])
    return [f"{r['dtype'].upper()} weights ({r['bits_per_weight']:.1f} bits per weight, "
            f"{r['byte_reduction']:.1f}× fewer bytes than {r['baseline'].upper()}) decoded "
            f"{r['decode_speedup']:.2f}× and prefilled {r['prefill_speedup']:.2f}× as fast."]


def _batch_finding(a: dict) -> list[str]:
    rows = [r for r in a.get("batching") or [] if r["parallel"] > 1 and r.get("speedup")]
    if not rows:
        return []
    r = max(rows, key=lambda r: r["parallel"])
    return [f"{r['parallel']} sequences decoded together gave {r['speedup']:.2f}× the aggregate "
            f"tok/s of one; each sequence still got {center(r['per_sequence_tok_s']):.1f} "
            "tok/s."]


# --- tables --------------------------------------------------------------------------------

def side_by_side(data: dict) -> Table | None:
    a, main = data["analysis"], data["main"]
    if not main:
        return None
    pre = sorted((r for r in _rows(a["prefill"], main) if r["n_gen"] == 0),
                 key=lambda r: r["n_prompt"])
    dec = _rows(a["decode"], main)
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
    notes.append("tok/s: median over the repetitions, 95% confidence interval in brackets; "
                 "seconds and ms/token follow from that median.")
    return Table("side_by_side", f"Prefill and decode, side by side ({main[0]}, "
                 f"{main[1].upper()}, {main[2]} threads)", [
                     Column("phase", "phase"), Column("work", "tokens"),
                     Column("seconds", "seconds", "f2"), Column("tok/s", "tok_s", "stat"),
                     Column("ms/token", "ms", "stat1")], rows, notes)


def size_table(data: dict) -> Table | None:
    a = data["analysis"]
    rows = [{"model": r["model"], "dtype": r["dtype"], "threads": r["threads"],
             "params": (_model_params(data, r)), "gib": r["file_bytes_per_token"],
             "gb": r["bytes_per_token"], "tok_s": r["tok_s"], "ms": inverse(r["tok_s"]),
             "gb_s": r["effective_gb_s"], "stream": r["share_of_stream"],
             "read": r["share_of_read"], "flags": ", ".join(r["flags"])}
            for r in a["decode"] if r["dtype"] == "f32"]
    if len({r["gb"] for r in rows}) < 2:
        return None
    rows.sort(key=lambda r: (r["threads"], r["gb"]))
    notes = ["size: every tensor's bytes in GiB (2³⁰) and GB (10⁹); read per token: what one "
             "decode step reads, in GB (every weight, the embedding as one row unless tied, "
             "and the KV cache). effective GB/s = tok/s × GB read per token. Shares: of the "
             "streaming ceiling (llama.cpp's own matrix-vector kernel on this machine) and of "
             "numpy's plain memory read, both measured beside the decode."]
    notes += [f"- {f['threads']} threads: tok/s ≈ {f['fit']['gb_s']:.1f} GB/s ÷ GB read per "
              f"token ({f['fit']['n_points']} models, R² = "
              f"{f['fit']['r2']:.3f}); {f['verdict']}." if f["fit"]["r2"] is not None else
              f"- {f['threads']} threads: tok/s ≈ {f['fit']['gb_s']:.1f} GB/s ÷ GB read per "
              f"token; {f['verdict']}." for f in a["fits"]]
    if any("above-ceiling" in r["flags"] for r in rows):
        notes.append(ABOVE_CEILING_NOTE)
    return Table("size", "Decode against model size", [
        Column("model", "model"), Column("parameters", "params", "int"),
        Column("size (GiB)", "gib", "gib"), Column("read per token (GB)", "gb", "gb"),
        Column("tok/s", "tok_s", "stat"), Column("ms/token", "ms", "stat1"),
        Column("effective GB/s", "gb_s", "f1"), Column("share of streaming ceiling",
                                                        "stream", "pct"),
        Column("share of numpy read", "read", "pct"), Column("flags", "flags")], rows, notes)


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
         "weight types, measured in this run."])


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
        out += [_markdown_table(table).replace("### ", "## ", 1), ""]
        out += _plot(plot, plots)
    est = estimates_table(data["analysis"])
    if est:
        out += [_markdown_table(est[0]).replace("### ", "## Your machine against others: ", 1),
                ""]
    out += ["## Method", "", METHOD, "", "## Environment", "", *_env_lines(env), "",
            "## Reproduce", "", "```sh", f"harness run {s.get('path', 'SCENARIO')}", "```", ""]
    out += ["## Appendix: diagnostics", ""]
    for table in (ceilings_table(data["analysis"]), repetitions_table(data["measurements"])):
        out += [_markdown_table(table), ""]
    out += _plot("decode_per_token", plots)
    return "\n".join(out)


def _plot(name: str | None, plots: list[str]) -> list[str]:
    file = next((p for p in plots if name and p.rsplit(".", 1)[0] == name), None)
    return [f"![{PLOT_CAPTIONS[name]}]({file})", ""] if file else []
