"""The serving page: findings computed from the levels, then a percentile table per level
(data → markdown; writing the file is harness/serving.py's)."""

from __future__ import annotations

import statistics

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
           "per_decode": (level.get("counters") or {}).get("tokens_per_decode_call")}
    steady, ip = level.get("steady_decode"), level.get("inprocess_decode_tok_s")
    row |= {"steady_tok_s": steady["tok_s"] if steady else None,
            "steady_window_s": steady["window_s"] if steady else None,
            "inprocess_tok_s": statistics.mean(ip) if ip else None,
            "inprocess_range": f"{min(ip):.1f}–{max(ip):.1f}" if ip else None}
    if steady and ip:
        row["served_of_inprocess"] = steady["tok_s"] / statistics.mean(ip)
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
             Column("tokens per decode call", "per_decode", "f2")]
    notes = [METRIC_NOTE, "Tokens per decode call: the growth of llama-server's "
             "tokens_predicted_total ÷ n_decode_total counters over the level, how many "
             "sequences each of its batched decode steps carried on average (its busy slots)."]
    if slo:
        cols.append(Column("goodput requests/s", "goodput", "f2"))
        notes.append("Goodput: requests/s meeting every SLO (" + ", ".join(
            f"{k.replace('_ms', '')} ≤ {v:g} ms" for k, v in slo.items()) + ").")
    return Table("serving", "Latency and throughput per load level", cols,
                 [level_row(lv) for lv in levels], notes)


def explain_table(levels: list[dict]) -> Table:
    """Served decode against the same file's in-process decode, and what TTFT is made of."""
    cols = [Column("load", "level"),
            Column("served decode tok/s (steady window)", "steady_tok_s", "f1"),
            Column("steady window s", "steady_window_s", "f2"),
            Column("in-process decode tok/s (before–after)", "inprocess_range"),
            Column("served ÷ in-process", "served_of_inprocess", "f2"),
            Column("tokens per decode call", "per_decode", "f2"),
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
                  "F16 KV cache, mmap), once before and once after the level; the server's "
                  "llama.cpp is another build (xllamacpp's) unless a llama-server binary was "
                  "given. TTFT outside the server's prompt time: each request's TTFT minus its "
                  "prompt_ms, the wait for a slot, HTTP and streaming."])


def findings(levels: list[dict]) -> list[str]:
    """What the levels showed, from their rows: per-user speed against aggregate throughput
    (closed-loop levels, against the first of them) and offered against served load (open)."""
    rows = [(lv, level_row(lv)) for lv in levels if lv["summary"]["n_ok"]]
    if not rows:
        return ["No request finished: nothing was measured."]
    closed = [row for lv, row in rows if lv.get("concurrency")]
    out = [_closed_finding(closed[0], row) for row in closed]
    out += [_served_finding(row) for row in closed if row.get("served_of_inprocess")]
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
    busy = (f"; its decode steps carried {row['per_decode']:.2f} sequences on average"
            if row.get("per_decode") else "")
    return (f"At {row['level']} the server decoded {row['steady_tok_s']:.1f} tok/s over its "
            f"steady window ({row['steady_window_s']:.1f} s), {row['served_of_inprocess']:.2f}× "
            f"the same file's in-process batched decode ({row['inprocess_range']} tok/s before "
            f"and after){busy}; of its TTFT p50 {row['ttft_s_p50']:.1f} ms, the server's prompt "
            f"time was {_or(row.get('server_prompt_s_p50'))} ms.")


def _or(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def render_serving_page(header: dict, levels: list[dict]) -> str:
    """The whole page: title, setup, findings first, the table, and what was not measured."""
    w, server = header.get("workload", {}), header.get("server", {})
    where = (f"{server.get('server_version') or server.get('server')}, {server.get('slots')} "
             f"slot(s)" if "slots" in server else f"endpoint {server.get('endpoint')}")
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
    lines += ["", markdown_table(levels_table(levels, header.get("slo"))), ""]
    if any(lv.get("steady_decode") for lv in levels):
        lines += [markdown_table(explain_table(levels)), ""]
    failed = [lv for lv in levels if lv.get("errors")]
    lines += [f"- {lv['label']}: {'; '.join(lv['errors'])}" for lv in failed]
    return "\n".join(lines).rstrip() + "\n"
