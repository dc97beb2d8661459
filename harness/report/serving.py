"""The serving page: findings computed from the levels, then a percentile table per level
(data → markdown; writing the file is harness/serving.py's)."""

from __future__ import annotations

import statistics
from pathlib import Path

from ..render.tabular import Column, Table, markdown_table

METRIC_NOTE = (
    "TTFT: sending a request to its first token's chunk. TPOT: (last chunk − first chunk) ÷ "
    "(output tokens − 1), per request. ITL: each gap between chunks ÷ the tokens its later "
    "chunk carried (llama-server's running predicted_n), per token. Chunk gap: the gaps as "
    "they arrived. E2E: sending to the stream's end. Token counts are the server's (usage, "
    "timings), never re-tokenized. Throughput: finished requests' tokens ÷ the level's wall "
    "time. Definitions as vLLM's benchmark_serving; docs/serving.md cites them.")


def _ms(dist: dict | None, key: str) -> float | None:
    return dist[key] * 1000 if dist else None


def level_row(level: dict) -> dict:
    """One table row: percentiles in ms, throughput, goodput and the server's own figures."""
    s = level["summary"]
    row = {"level": level["label"], "ok": s["n_ok"], "failed": s["n_failed"],
           "request_s": s["request_s"], "output_tok_s": s["output_tok_s"],
           "goodput": s.get("goodput_request_s"),
           "server_prompt_ms": (statistics.median(level["server_prompt_ms"])
                                if level.get("server_prompt_ms") else None),
           "per_decode": (level.get("counters") or {}).get("tokens_per_decode_call"),
           "busy_slots": (level.get("counters") or {}).get("busy_slots_per_decode_call")}
    steady, ip = level.get("steady_decode"), level.get("inprocess_decode_tok_s")
    row |= {"steady_tok_s": steady["tok_s"] if steady else None,
            "steady_window_s": steady["window_s"] if steady else None,
            "inprocess_tok_s": statistics.mean(ip) if ip else None,
            "inprocess_range": f"{min(ip):.1f}–{max(ip):.1f}" if ip else None}
    if "rounds" in level:  # rounds alternating served and in-process: the paired estimate
        if paired := (level["rounds"] or {}).get("served_of_inprocess"):
            row["served_of_inprocess"] = paired["ratio"]
            row["served_of_inprocess_stat"] = paired
            row["n_rounds"] = paired["n"]
    elif steady and ip:  # a run before rounds: one figure before and one after the level
        row["served_of_inprocess"] = steady["tok_s"] / statistics.mean(ip)
        row["served_of_inprocess_stat"] = {"median": row["served_of_inprocess"]}
        row["n_rounds"] = 1
    for metric in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "chunk_gap_s", "server_prompt_s",
                   "ttft_outside_prompt_s"):
        for p in ("p50", "p90", "p99"):
            row[f"{metric}_{p}"] = _ms(s.get(metric), p)
    return row


def levels_table(levels: list[dict], slo: dict | None) -> Table:
    cols = [Column("load", "level"), Column("ok", "ok", "int"), Column("failed", "failed", "int")]
    for metric, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL")):
        cols += [Column(f"{name} p{p} ms", f"{metric}_p{p}", "f2") for p in (50, 90, 99)]
    cols += [Column("chunk gap p50 ms", "chunk_gap_s_p50", "f2"),
             Column("E2E p50 ms", "e2e_s_p50", "f1"), Column("E2E p99 ms", "e2e_s_p99", "f1"),
             Column("requests/s", "request_s", "f2"), Column("output tok/s", "output_tok_s", "f1"),
             Column("busy slots per decode call", "busy_slots", "f2"),
             Column("tokens per decode call", "per_decode", "f2")]
    notes = [METRIC_NOTE, "Busy slots per decode call: llama-server's n_busy_slots_per_decode "
             "(a running mean since it started) taken apart over the level with n_decode_total: "
             "the requests each llama_decode call carried, in prefill or decode. Tokens per "
             "decode call: the growth of tokens_predicted_total ÷ n_decode_total, generated "
             "tokens per call (calls that only ran a prompt count too)."]
    if slo:
        cols.append(Column("goodput requests/s", "goodput", "f2"))
        notes.append("Goodput: requests/s meeting every SLO (" + ", ".join(
            f"{k.replace('_ms', '')} ≤ {v:g} ms" for k, v in slo.items()) + ").")
    return Table("serving", "Latency and throughput per load level", cols,
                 [level_row(lv) for lv in levels], notes)


def server_identity(header: dict) -> str:
    """Which llama.cpp served: the harness's own build (and whether its commit is the bindings'),
    the xllamacpp wheel's, a binary the user gave, or an endpoint."""
    server = header.get("server") or {}
    if "slots" not in server:
        return f"the server at {server.get('endpoint')}"
    build = server.get("build")
    if build:
        ours = ((header.get("system_info") or {}).get("inprocess_commit") or "").split("-")[0]
        same = (" (the bindings' own commit)" if ours and build["llama_cpp_commit"].startswith(ours)
                else f" (the bindings report {ours})" if ours else "")
        return (f"llama-server built by harness server build from llama-cpp-python "
                f"{build['llama_cpp_python']}'s source, llama.cpp {build['llama_cpp_commit'][:9]}"
                + same)
    if server.get("server") == "xllamacpp":
        return (f"llama.cpp's server from the {server.get('server_version') or 'xllamacpp'} "
                "wheel (its own llama.cpp commit and build flags, not the bindings')")
    return f"the llama-server binary {server.get('server')} ({server.get('server_version')})"


def explain_table(levels: list[dict], header: dict) -> Table:
    """Served decode against the same file's in-process decode, and what TTFT is made of."""
    cols = [Column("load", "level"),
            Column("served decode tok/s (steady window)", "steady_tok_s", "f1"),
            Column("steady window s", "steady_window_s", "f2"),
            Column("in-process decode tok/s (range)", "inprocess_range", "text"),
            Column("served ÷ in-process (95% interval)", "served_of_inprocess_stat", "stat2"),
            Column("rounds", "n_rounds", "int"),
            Column("busy slots per decode call", "busy_slots", "f2"),
            Column("TTFT p50 ms", "ttft_s_p50", "f2"),
            Column("server prompt p50 ms", "server_prompt_s_p50", "f2"),
            Column("TTFT outside the server's prompt time p50 ms", "ttft_outside_prompt_s_p50",
                   "f2")]
    return Table("explain", "Why: served decode against in-process decode, and TTFT's parts",
                 cols, [level_row(lv) for lv in levels],
                 ["Served decode: tokens after each request's first that arrived while every "
                  "in-flight request was between its first and last token (ramp-up, a new "
                  "request's prefill and the drain left out), ÷ those spans. In-process: the "
                  "same file decoding as many sequences together through the bindings in this "
                  "process (same threads, ubatch, per-sequence context, flash attention auto, "
                  "F16 KV cache, mmap), before the level's first round and after each. Served "
                  "÷ in-process: each round's served decode over the geometric mean of the "
                  "in-process figures either side of it, the geometric mean over the rounds "
                  "with a Student-t interval (the paired contrast of core/stats.py); none "
                  "under 3 rounds. The server: "
                  f"{server_identity(header)}. TTFT outside the server's prompt time: each "
                  "request's TTFT minus its prompt_ms, the wait for a slot, HTTP and "
                  "streaming."])


def cpu_features(system_info: str | None) -> set[str]:
    """The features llama.cpp's system info line marks on ("AVX512 = 1" → AVX512)."""
    out = set()
    for part in (system_info or "").replace("CPU :", "|").split("|"):
        name, _, value = part.partition("=")
        if value.strip() == "1":
            out.add(name.strip())
    return out


def build_difference(header: dict, levels: list[dict]) -> str | None:
    """A sentence on the CPU features one build uses and the other does not (when both are
    known and differ), with served ÷ in-process at the first and last compared level."""
    info = header.get("system_info") or {}
    server, inproc = cpu_features(info.get("server")), cpu_features(info.get("inprocess"))
    compared = [row for row in map(level_row, levels) if row.get("served_of_inprocess")]
    if not server or not inproc or server == inproc or not compared:
        return None
    parts = ([f"the in-process build also uses {', '.join(sorted(inproc - server))}"]
             if inproc - server else []) + (
        [f"the server's also uses {', '.join(sorted(server - inproc))}"]
        if server - inproc else [])
    first, last = compared[0], compared[-1]
    trend = (f"; served ÷ in-process was {first['served_of_inprocess']:.2f} at {first['level']}"
             + (f" and {last['served_of_inprocess']:.2f} at {last['level']}"
                if last is not first else ""))
    return ("The server's llama.cpp build and the in-process one run different CPU kernels: "
            + "; ".join(parts) + " (llama.cpp's system info of each), so the comparison "
            "measures the builds as well as the serving" + trend + ".")


def findings(levels: list[dict]) -> list[str]:
    """What the levels showed, from their rows: per-user speed against aggregate throughput
    (closed-loop levels, against the first of them) and offered against served load (open)."""
    rows = [(lv, level_row(lv)) for lv in levels if lv["summary"]["n_ok"]]
    if not rows:
        return ["No request finished: nothing was measured."]
    closed = [row for lv, row in rows if lv.get("concurrency")]
    out = [_closed_finding(closed[0], row) for row in closed]
    out += [_served_finding(row) for row in closed
            if row.get("served_of_inprocess") and row.get("steady_tok_s")]
    for lv, row in rows:
        if lv.get("rate"):
            out.append(f"At {row['level']} offered (Poisson): {row['request_s']:.2f} requests/s "
                       f"finished, {row['output_tok_s']:.1f} output tok/s; TTFT p50 "
                       f"{row['ttft_s_p50']:.1f} ms (p99 {row['ttft_s_p99']:.1f}), TPOT p50 "
                       f"{_or(row['tpot_s_p50'])} ms.")
    return out


def _closed_finding(first: dict, row: dict) -> str:
    head = (f"At {row['level']}: {row['output_tok_s']:.1f} output tok/s, TTFT p50 "
            f"{row['ttft_s_p50']:.1f} ms, TPOT p50 {_or(row['tpot_s_p50'])} ms")
    if row is first or not (first["tpot_s_p50"] and row["tpot_s_p50"]):
        return head + "."
    return (head + f": {row['output_tok_s'] / first['output_tok_s']:.2f}× the aggregate of "
            f"{first['level']}, each request's TPOT {row['tpot_s_p50'] / first['tpot_s_p50']:.2f}×"
            f" and TTFT {row['ttft_s_p50'] / first['ttft_s_p50']:.2f}× theirs.")


def _served_finding(row: dict) -> str:
    busy = (f"; its decode calls carried {row['busy_slots']:.2f} busy slots on average"
            if row.get("busy_slots") else
            f"; its decode calls produced {row['per_decode']:.2f} tokens on average"
            if row.get("per_decode") else "")
    stat = row["served_of_inprocess_stat"]
    ci = stat.get("median_ci95")
    paired = (f" (95% interval {ci[0]:.2f}–{ci[1]:.2f}, {row['n_rounds']} rounds paired with "
              f"in-process figures of {row['inprocess_range']} tok/s)" if ci else
              f" ({row['n_rounds']} round(s), too few for an interval; in-process "
              f"{row['inprocess_range']} tok/s)")
    return (f"At {row['level']} the server decoded {row['steady_tok_s']:.1f} tok/s over its "
            f"steady window ({row['steady_window_s']:.1f} s), {row['served_of_inprocess']:.2f}× "
            f"the same file's in-process batched decode{paired}{busy}; of its TTFT p50 "
            f"{row['ttft_s_p50']:.1f} ms, the server's prompt time was "
            f"{_or(row.get('server_prompt_s_p50'))} ms.")


def _or(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def render_serving_page(header: dict, levels: list[dict],
                        plots: list[tuple[str, str]] = ()) -> str:
    """The whole page: title, setup, findings first, the table, and what was not measured."""
    w, server = header.get("workload", {}), header.get("server", {})
    where = server_identity(header) + (f", {server.get('slots')} slot(s)"
                                       if "slots" in server else "")
    scenario = header.get("scenario") or {}
    lines = [f"# {scenario.get('title') or 'Serving ' + header.get('model', '')}", ""]
    if scenario.get("description"):
        lines += [scenario["description"], ""]
    lines += [
             f"Measured {header.get('created', '')[:10]} against {where}; every request "
             f"{w.get('n_prompt')} prompt tokens (unique random ids) and {w.get('n_generate')} "
             f"generated (EOS ignored), after {w.get('warmup')} warm-up request(s) per level; "
             f"at most {w.get('n_requests')} requests or {w.get('duration_s'):g} s per level; "
             f"model {header.get('model', '')}.", "", "## Findings", ""]
    lines += [f"- {f}" for f in findings(levels)]
    if differ := build_difference(header, levels):
        lines.append(f"- {differ}")
    lines += ["", markdown_table(levels_table(levels, header.get("slo"))), ""]
    if any(lv.get("steady_decode") for lv in levels):
        lines += [markdown_table(explain_table(levels, header)), ""]
    lines += [f"![{caption}]({name})\n" for name, caption in plots]
    failed = [lv for lv in levels if lv.get("errors")]
    lines += [f"- {lv['label']}: {'; '.join(lv['errors'])}" for lv in failed]
    return "\n".join(lines).rstrip() + "\n"


def write_serving_plots(levels: list[dict], out_dir: Path) -> list[tuple[str, str]]:
    """The latency-throughput plot and, with two or more closed levels, TTFT and ITL against
    the requests in flight; (file, caption) pairs for the page."""
    from ..render import plotkit

    rows = [(lv, level_row(lv)) for lv in levels if lv["summary"]["n_ok"]]
    if not rows:
        return []
    fig, (a1, a2) = plotkit.plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, name in ((a1, "tpot_s", "TPOT"), (a2, "ttft_s", "TTFT")):
        for lv, row in rows:
            marker = "o" if lv.get("concurrency") else "s"
            ax.errorbar([row["output_tok_s"]], [row[f"{key}_p50"]], fmt=marker,
                        yerr=[[0], [row[f"{key}_p90"] - row[f"{key}_p50"]]], capsize=3)
            ax.annotate(row["level"], (row["output_tok_s"], row[f"{key}_p50"]), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")
        ax.set_xlabel("output tok/s (all requests)")
        ax.set_ylabel(f"{name} ms (p50, bar to p90)")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)  # room for the top point's label
        ax.margins(x=0.12)
        ax.grid(alpha=0.3)
    fig.suptitle("Each level: what users wait for against what the server delivers")
    fig.tight_layout()
    out = [(plotkit.save(fig, out_dir, "latency_vs_throughput"),
            "Per-user latency against aggregate throughput, one point per load level "
            "(circles closed loop, squares open loop)")]
    closed = [(lv["concurrency"], row) for lv, row in rows if lv.get("concurrency")]
    if len(closed) >= 2:
        out.append((_by_concurrency(plotkit, closed, out_dir),
                    "TTFT and ITL against the requests in flight (closed loop)"))
    return out


def _by_concurrency(plotkit, closed: list[tuple[int, dict]], out_dir: Path) -> str:
    fig, (a1, a2) = plotkit.plt.subplots(1, 2, figsize=(10, 4))
    xs = [c for c, _ in closed]
    for ax, key, name in ((a1, "ttft_s", "TTFT"), (a2, "itl_s", "ITL")):
        for p, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(xs, [row[f"{key}_{p}"] for _, row in closed], style, label=f"{name} {p}")
        ax.legend(fontsize=8)
    plotkit.log2_pair(a1, a2, "requests in flight", "TTFT ms", "ITL ms")
    return plotkit.save(fig, out_dir, "latency_by_concurrency")


COMPARED = (("ttft_s_p50", "TTFT p50 ms"), ("ttft_s_p99", "TTFT p99 ms"),
            ("itl_s_p50", "ITL p50 ms"), ("itl_s_p99", "ITL p99 ms"),
            ("output_tok_s", "output tok/s"), ("request_s", "requests/s"))


def render_serving_compare(runs: list[tuple[str, dict, list[dict]]]) -> str:
    """Serving runs side by side per load level: each metric of every run, and each later
    run ÷ the first. One run per level each: single figures, no intervals."""
    names = [name for name, _, _ in runs]
    by_run = [{lv["level"]: level_row(lv) for lv in levels} for _, _, levels in runs]
    keys = [k for k in dict.fromkeys(k for rows in by_run for k in rows)]
    lines = ["# Serving runs compared", "", "Runs: " + ", ".join(
        f"{n} ({h.get('model', '')}, {h.get('created', '')[:10]})" for n, h, _ in runs), ""]
    head = ["load", "metric", *names, *(f"{n} ÷ {names[0]}" for n in names[1:])]
    lines += ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for key in keys:
        rows = [r.get(key) for r in by_run]
        label = next(r["level"] for r in rows if r)
        for metric, title in COMPARED:
            values = [r.get(metric) if r else None for r in rows]
            ratios = [(v / values[0]) if v and values[0] else None for v in values[1:]]
            lines.append("| " + " | ".join([label, title, *(_or(v) for v in values),
                                            *(_or(x) for x in ratios)]) + " |")
    lines += ["", "A level appears when any run has it; – where a run did not measure it. "
              "Each figure is one run's percentile or rate: a ratio far from 1 may still be "
              "this machine's swings between the runs' minutes."]
    return "\n".join(lines) + "\n"
