"""The serving page: findings computed from the levels, then a percentile table per level
(data → markdown; writing the file is harness/serving.py's)."""

from __future__ import annotations

import statistics
from pathlib import Path

from ..core.stats import center
from ..render.tabular import Column, Table, ceiling_share_notes, markdown_table
from .page import system_info_cell

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
                                if level["server_prompt_ms"] else None),
           "per_decode": (level["counters"] or {}).get("tokens_per_decode_call"),
           "busy_slots": (level["counters"] or {}).get("busy_slots_per_decode_call")}
    steady, ip = level["steady_decode"], level["inprocess_decode_tok_s"]
    row |= {"steady_tok_s": steady["tok_s"] if steady else None,
            "steady_window_s": steady["window_s"] if steady else None,
            "inprocess_tok_s": statistics.mean(ip) if ip else None,
            "inprocess_range": f"{min(ip):.1f}–{max(ip):.1f}" if ip else None}
    if level["rounds"]:  # rounds alternating served and in-process: the paired estimate
        if paired := level["rounds"].get("served_of_inprocess"):
            row["served_of_inprocess"] = paired["ratio"]
            row["served_of_inprocess_stat"] = paired
            row["n_rounds"] = paired["n"]
    elif steady and ip:  # a run before rounds: one figure before and one after the level
        row["served_of_inprocess"] = steady["tok_s"] / statistics.mean(ip)
        row["served_of_inprocess_stat"] = {"median": row["served_of_inprocess"]}
        row["n_rounds"] = 1
    for metric in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "chunk_gap_s", "server_prompt_s",
                   "ttft_outside_prompt_s", "wait_s", "ttft_after_prompt_s"):
        for p in ("p50", "p90", "p99"):
            row[f"{metric}_{p}"] = _ms(s.get(metric), p)
    return row


def levels_tables(levels: list[dict], slo: dict | None) -> list[Table]:
    """Latency, throughput and the tails per load level: three tables of at most 8 columns."""
    rows = [level_row(lv) for lv in levels]
    latency = [Column("load", "level"), Column("ok", "ok", "int"),
               Column("failed", "failed", "int"), Column("TTFT p50 ms", "ttft_s_p50", "f2"),
               Column("TPOT p50 ms", "tpot_s_p50", "f2"), Column("ITL p50 ms", "itl_s_p50", "f2"),
               Column("E2E p50 ms", "e2e_s_p50", "f1")]
    tails = [Column("load", "level")] + [
        Column(f"{name} p{p} ms", f"{metric}_p{p}", "f2")
        for metric, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"))
        for p in (90, 99)] + [Column("E2E p99 ms", "e2e_s_p99", "f1")]
    served = [Column("load", "level"), Column("requests/s", "request_s", "f2"),
              Column("output tok/s", "output_tok_s", "f1"),
              Column("chunk gap p50 ms", "chunk_gap_s_p50", "f2"),
              Column("busy slots per decode call", "busy_slots", "f2"),
              Column("tokens per decode call", "per_decode", "f2")]
    notes = ["Busy slots per decode call: llama-server's n_busy_slots_per_decode (a running mean "
             "since it started) taken apart over the level with n_decode_total: the requests "
             "each llama_decode call carried, in prefill or decode. Tokens per decode call: the "
             "growth of tokens_predicted_total ÷ n_decode_total, generated tokens per call "
             "(calls that only ran a prompt count too)."]
    if slo:
        served.append(Column("goodput requests/s", "goodput", "f2"))
        notes.append("Goodput: requests/s meeting every SLO (" + ", ".join(
            f"{k.replace('_ms', '')} ≤ {v:g} ms" for k, v in slo.items()) + ").")
    return [Table("serving", "Latency per load level", latency, rows, [METRIC_NOTE]),
            Table("serving_tails", "The tails: p90 and p99 per load level", tails, rows, []),
            Table("serving_throughput", "Throughput per load level", served, rows, notes)]


def server_identity(header: dict) -> str:
    """Which llama.cpp served: the harness's own build (and whether its commit is the bindings'),
    the xllamacpp wheel's, a binary the user gave, or an endpoint."""
    server = header["server"] or {}
    if "slots" not in server:
        return f"the server at {server.get('endpoint')}"
    build = server.get("build")
    if build:
        ours = ((header["system_info"] or {}).get("inprocess_commit") or "").split("-")[0]
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
    """Served decode against the same file's in-process decode, level by level."""
    cols = [Column("load", "level"),
            Column("served decode tok/s (steady window)", "steady_tok_s", "f1"),
            Column("steady window s", "steady_window_s", "f2"),
            Column("in-process decode tok/s (range)", "inprocess_range", "text"),
            Column("served ÷ in-process (95% interval)", "served_of_inprocess_stat", "stat2"),
            Column("rounds", "n_rounds", "int"),
            Column("busy slots per decode call", "busy_slots", "f2")]
    return Table("explain", "Why: served decode against in-process decode",
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
                  f"under 3 rounds. The server: {server_identity(header)}."])


def ttft_table(levels: list[dict]) -> Table:
    """What each level's time to first token was made of, per request."""
    cols = [Column("load", "level"), Column("TTFT p50 ms", "ttft_s_p50", "f2"),
            Column("waited before its prompt p50 ms", "wait_s_p50", "f2"),
            Column("server prompt p50 ms", "server_prompt_s_p50", "f2"),
            Column("after the prompt p50 ms", "ttft_after_prompt_s_p50", "f2"),
            Column("TTFT outside the prompt p50 ms", "ttft_outside_prompt_s_p50", "f2"),
            Column("waited p99 ms", "wait_s_p99", "f2"), Column("TTFT p99 ms", "ttft_s_p99", "f2")]
    return Table("ttft", "Why: what the time to first token was made of", cols,
                 [level_row(lv) for lv in levels],
                 ["Each part per request, then its percentiles (percentiles do not add up). "
                  "Waited before its prompt: sending the request to the arrival of the "
                  "server's first prompt-progress event, which llama-server sends when a slot "
                  "starts the prompt: the wait for a free slot and for the server's current "
                  "step, and HTTP both ways. Server prompt: its prompt_ms, from that start to "
                  "the first token sampled. After the prompt: TTFT minus both, the first "
                  "token's trip back less the progress event's. TTFT outside the prompt: TTFT "
                  "minus prompt_ms. – where the server sent no progress event."])


def roofline_row(level: dict) -> dict | None:
    """A closed level's decode bound beside what was served and decoded in-process."""
    roof = level.get("roofline")
    if not roof or not roof.get("bound_tok_s"):
        return None
    steady = level["steady_decode"]
    return {"level": level["label"], "in_flight": level["concurrency"],
            "sequences": roof["n_sequences"],
            "weights_mb": roof["weight_n_bytes"] / 1e6,
            "kv_mb": roof["n_sequences"] * roof["kv_n_bytes"] / 1e6,
            "gflop": roof["n_sequences"] * roof["flops_per_token"] / 1e9,
            "stream_gb_s": roof["stream"]["value"], "compute_gflop_s": roof["compute"]["value"],
            "memory_ms": roof["memory_s"] * 1000, "compute_ms": roof["compute_s"] * 1000,
            "limiter": roof["limiter"], "bound_tok_s": roof["bound_tok_s"],
            "inprocess_tok_s": (statistics.geometric_mean(level["inprocess_decode_tok_s"])
                                if level["inprocess_decode_tok_s"] else None),
            "served_tok_s": steady["tok_s"] if steady else None,
            "served_share": (roof["served_share_stat"] or {"median": roof["served_share"],
                                                           "n": 1})
            if roof["served_share"] else None,
            "inprocess_share": (roof.get("inprocess_share_stat")
                                or {"median": roof["inprocess_share"], "n": 1})
            if roof["inprocess_share"] else None,
            "flags": (roof["above"], roof.get("inprocess_above")),
            "flag": " ".join(f"⚠ {who} above the bound" for who, flagged in
                             (("served", roof["above"]),
                              ("in-process", roof.get("inprocess_above"))) if flagged)}


def roofline_table(levels: list[dict]) -> Table | None:
    rows = [r for r in map(roofline_row, levels) if r]
    if not rows:
        return None
    # the verdict first, so it shows in a narrow column; the bound's inputs after it
    cols = [Column("load", "level"), Column("sequences decoding", "sequences", "int"),
            Column("bound by", "limiter"),
            Column("roofline bound tok/s", "bound_tok_s", "f1"),
            Column("served decode tok/s", "served_tok_s", "f1"),
            Column("served share of bound (95% interval)", "served_share", "pctci"),
            Column("in-process share of bound (95% interval)", "inprocess_share", "pctci"),
            Column("", "flag")]
    shares = [(center(r[key]), None, r["flags"][i]) for r in rows
              for i, key in enumerate(("served_share", "inprocess_share")) if r[key]]
    return Table("roofline", "Why: decode against the roofline of this machine", cols, rows,
                 [*ceiling_share_notes(shares)])


def bound_inputs_table(levels: list[dict]) -> Table | None:
    """What each level's roofline bound was made of: a step's bytes and FLOPs and the
    ceilings they meet."""
    rows = [r for r in map(roofline_row, levels) if r]
    if not rows:
        return None
    cols = [Column("load", "level"), Column("weights MB per step", "weights_mb", "f1"),
            Column("KV cache MB per step", "kv_mb", "f1"),
            Column("GFLOP per step", "gflop", "f2"),
            Column("streaming ceiling GB/s", "stream_gb_s", "f1"),
            Column("compute ceiling GFLOP/s", "compute_gflop_s", "f0"),
            Column("step ≥ (memory) ms", "memory_ms", "f1"),
            Column("step ≥ (compute) ms", "compute_ms", "f1")]
    return Table("roofline_inputs", "The bound's inputs per load level", cols, rows,
                 [ROOFLINE_NOTE])


ROOFLINE_NOTE = (
    "A decode step of B sequences reads the weights once (a mixture of experts: the expected "
    "union of the B tokens' experts) and each sequence's KV cache (F16, at the mean context of "
    "a request's decode), and multiplies every weight by B vectors (2 FLOPs per weight, each "
    "token's logits, attention over its context: Kaplan et al. 2020). It takes at least its "
    "bytes ÷ the streaming ceiling and at least its FLOPs ÷ the compute ceiling; the bound is "
    "B ÷ the larger. The ceilings are ggml's own matrix-vector and matrix-matrix kernels for "
    "the model's tensor types (combined by their share of the bytes or FLOPs), probed at the "
    "server's threads while it was idle, before each round of the level and after its last; "
    "the table's ceilings and bound pool the level's probes (the median of their passes). "
    "Shares of the bound: each round's served decode (and the in-process figures either side "
    "of it) over the bound from the probes just before and just after that round, the "
    "geometric mean over the rounds with a Student-t interval (core/stats.py); a level of one "
    "round: its steady window over the level's bound.")


def roofline_findings(levels: list[dict], slots: int | None) -> list[str]:
    """Which resource bounds decode and prefill, where each user's speed falls off, and what
    the slots hold back: every clause from the levels' rooflines."""
    closed = [(lv, lv["roofline"]) for lv in levels
              if (lv.get("roofline") or {}).get("bound_tok_s")
              and (not slots or lv["concurrency"] <= slots)]
    out = []
    if closed:
        out.append(_decode_bound_finding(closed))
        if len(closed) >= 2:
            out.append(_per_user_finding(closed))
    prefill = next((r["prefill"] for _, r in closed if r.get("prefill")), None)
    if prefill:
        out.append(_prefill_finding(prefill))
    if ttft := _prompt_sharing_finding(levels, slots):
        out.append(ttft)
    missing = next((r["missing"] for lv in levels if (r := lv.get("roofline"))
                    and r.get("missing")), None)
    if missing:
        out.append(f"No roofline bound: {missing}.")
    if slots:
        out += _slots_findings(levels, slots)
    if behind := _behind_prompt_finding(levels, slots):
        out.append(behind)
    return out


def _decode_bound_finding(closed: list[tuple[dict, dict]]) -> str:
    lv, r = closed[-1]
    limiters = sorted({x["limiter"] for _, x in closed})
    head = (f"Decode is bounded by {limiters[0]} at every closed level within the slots"
            if len(limiters) == 1 else "Decode is bounded by " + "; ".join(
                f"{x['limiter']} at {y['label']}" for y, x in closed))
    text = (f"{head}: at {lv['label']} a step must read {_size(r['weight_n_bytes'])} of "
            f"weights and {r['n_sequences']} × {_size(r['kv_n_bytes'])} of KV cache, at least "
            f"{_msec(r['memory_s'])} at the {r['stream']['value']:.1f} GB/s ggml streams this "
            f"model's types, and compute {r['n_sequences']} × {_flop(r['flops_per_token'])}, "
            f"at least {_msec(r['compute_s'])} at {r['compute']['value']:.0f} GFLOP/s; the "
            f"bound is {r['bound_tok_s']:.1f} tok/s")
    if r["served_share"] is not None:
        text += (f", and the server decoded {lv['steady_decode']['tok_s']:.1f} "
                 f"({_share(r)}")
        text += (f"; in-process {r['inprocess_share']:.0%})" if r["inprocess_share"] else ")")
    above = [(y["label"], x) for y, x in closed if x["above"]]
    if above:
        text += (". Above the bound beyond its uncertainty at "
                 + ", ".join(f"{label} (the level's probes ranged {_span(x)})"
                             for label, x in above)
                 + ": the ceilings were probed between the rounds, not during them, and this "
                 "machine's speed swings within a minute, so the bound is a yardstick here, not "
                 "a limit")
    return text + "." + _ridge_clause(closed)


def _share(roof: dict) -> str:
    """A share of the bound with its round-by-round interval where there is one."""
    ci = (roof.get("served_share_stat") or {}).get("median_ci95")
    return (f"{roof['served_share']:.0%} of it, 95% interval {ci[0]:.0%}–{ci[1]:.0%}" if ci
            else f"{roof['served_share']:.0%} of it")


def _span(roof: dict) -> str:
    lo, hi = roof.get("ceiling_range") or (None, None)
    unit = "GB/s" if roof["limiter"] == "memory bandwidth" else "GFLOP/s"
    return f"{lo:.1f}–{hi:.1f} {unit}" if lo else "unknown: one probe"


def _ridge_clause(closed: list[tuple[dict, dict]]) -> str:
    ridge = closed[-1][1]["ridge_sequences"]
    top = max(x["n_sequences"] for _, x in closed)
    if not ridge:
        return ""
    where = ("inside the range run" if ridge <= top else
             f"beyond the {top} decoded together here: estimated, not measured")
    return (f" The two floors meet at about {ridge:.1f} sequences ({where}): below it, another "
            "sequence adds only its KV cache reads to a step; above it, its FLOPs.")


def _per_user_finding(closed: list[tuple[dict, dict]]) -> str:
    """Each user's bound against one user's, and how the measured share of the bound moved:
    shares are each against the probes beside their own level, so drift between levels
    cancels to first order."""
    (lv1, r1), (lvn, rn) = closed[0], closed[-1]
    why = ("each sequence adds only its KV cache reads while memory bandwidth binds"
           if rn["limiter"] == "memory bandwidth" else "compute binds: each sequence adds its "
           "FLOPs")
    text = (f"Per user, the bound at {rn['n_sequences']} sequences is "
            f"{rn['per_user_of_solo']:.1%} of one sequence's with the same ceilings ({why})")
    s1, sn = r1["served_share"], rn["served_share"]
    if s1 and sn:
        text += (f"; the server's share of its bound went from {s1:.0%} at {lv1['label']} to "
                 f"{sn:.0%} at {lvn['label']}")
        if r1["inprocess_share"] and rn["inprocess_share"]:
            text += (f" (in-process {r1['inprocess_share']:.0%} to "
                     f"{rn['inprocess_share']:.0%})")
        text += ", each against the probes beside its own level"
        if sn < 0.95 * s1:
            text += (", so each user lost more speed than the bound's bytes and FLOPs account "
                     "for: the rest is in costs the roofline leaves out")
            i1, i_n = r1["inprocess_share"], rn["inprocess_share"]
            if i1 and i_n:
                text += _inprocess_fall(i_n / i1, sn / s1)
    return text + "."


def _inprocess_fall(kept_inprocess: float, kept_served: float) -> str:
    """Whose shortfall it is: how far the in-process share fell beside the server's."""
    fall_i, fall_s = 1 - kept_inprocess, 1 - kept_served
    text = (f"; in-process the share fell to {kept_inprocess:.2f}× against the server's "
            f"{kept_served:.2f}×")
    if abs(fall_i - fall_s) <= 0.1 * fall_s:
        return text + ": as far, so the shortfall is llama.cpp's batched decode, not the serving"
    if fall_i > fall_s:
        return text + ": further, so the shortfall is llama.cpp's batched decode, not the serving"
    if fall_i >= 0.5 * fall_s:
        return text + (": most of the shortfall is llama.cpp's batched decode itself, the rest "
                       "the serving's")
    return text + ": most of the shortfall is the serving's"


def _size(n_bytes: float) -> str:
    return (f"{n_bytes / 1e9:.2f} GB" if n_bytes >= 1e9 else f"{_sig(n_bytes / 1e6)} MB"
            if n_bytes >= 1e6 else f"{_sig(n_bytes / 1e3)} kB")


def _flop(flops: float) -> str:
    return f"{_sig(flops / 1e9)} GFLOP" if flops >= 1e8 else f"{_sig(flops / 1e6)} MFLOP"


def _msec(seconds: float) -> str:
    return f"{_sig(seconds * 1000)} ms"


def _sig(value: float) -> str:
    """Three significant digits, without exponents: 1,823, 117, 61.4, 1.00, 0.0472."""
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}" if value >= 1 else f"{value:.3g}"


def _prefill_finding(p: dict) -> str:
    bound_by = "compute" if p["compute_s"] >= p["memory_s"] else "memory bandwidth"
    text = (f"Prefill is bound by {bound_by}: its {_flop(p['flops'])} take "
            f"{p['compute_s'] / p['memory_s']:.1f}× as long at ggml's compute ceiling as "
            f"reading the weights once at its streaming ceiling" if bound_by == "compute" else
            f"Prefill is bound by {bound_by}: reading the weights once takes "
            f"{p['memory_s'] / p['compute_s']:.1f}× as long as its {_flop(p['flops'])} at "
            "ggml's compute ceiling")
    text += (f". With one request in flight the server processed each {p['n_prompt']}-token "
             f"prompt in {_msec(p['prompt_s'])} (its prompt_ms, p50): {_sig(p['gflop_s'])} "
             f"GFLOP/s, {p['share']:.0%} of the {p['compute_gflop_s']:.0f} GFLOP/s ggml's "
             "matrix-matrix kernels reached for this model's types")
    if p["share"] > 1:
        lo, hi = p.get("ceiling_range") or (None, None)
        text += (" — above that ceiling" + (" beyond its spread" if p["above"] else
                                              ", within its spread")
                 + (f"; the level's compute probes ranged {lo:.0f}–{hi:.0f} GFLOP/s" if lo
                    else "") + ": they ran between the rounds, not during the prompts, on a "
                 "machine whose speed swings within a minute, so here the ceiling is a "
                 "yardstick, not a limit")
    return text + "."


def _prompt_sharing_finding(levels: list[dict], slots: int | None) -> str | None:
    """How the server's own prompt time grew from 1 in flight to the most requests in flight
    within the slots, against how many prompts arrived together."""
    closed = [lv for lv in levels if lv["concurrency"] and lv["server_prompt_ms"]
              and (not slots or lv["concurrency"] <= slots)]
    first = next((lv for lv in closed if lv["concurrency"] == 1), None)
    top = closed[-1] if closed else None
    if not first or top is first:
        return None
    p1, pn = (statistics.median(lv["server_prompt_ms"]) for lv in (first, top))
    c, ratio = top["concurrency"], pn / p1
    text = (f"At {top['label']} TTFT p50 was {_ms(top['summary']['ttft_s'], 'p50'):.0f} ms, "
            f"of which the server's own prompt time {pn:.0f} ms (p50), {ratio:.2f}× its "
            f"{p1:.0f} ms at {first['label']}")
    if 0.75 * c <= ratio <= 1.25 * c:
        text += (f": about what {c} prompts take one after another, as the requests of a "
                 "closed loop arrive together and the server processes their prompts in the "
                 "same batches, so each first token waits for all of them")
    return text + "."


def _slots_findings(levels: list[dict], slots: int) -> list[str]:
    """Levels with more requests in flight than slots: the rest wait for a slot."""
    out = []
    within = [lv for lv in levels if lv["concurrency"] and lv["concurrency"] <= slots]
    for lv in levels:
        if not lv["concurrency"] or lv["concurrency"] <= slots:
            continue
        text = (f"At {lv['label']} the {slots} slots are the limit: {slots} requests decode "
                f"together and {lv['concurrency'] - slots} wait")
        ref = within[-1] if within else None
        # the wait itself where the server's progress events were seen; before them, TTFT
        # outside the prompt time bounds it
        key, said, joint = (
            ("wait_s", "a request waited {:.0f} ms (p50) before a slot started its prompt", ",")
            if lv["summary"].get("wait_s") else
            ("ttft_outside_prompt_s", "TTFT outside the server's prompt time p50 {:.0f} ms", ""))
        if (wait := _ms(lv["summary"].get(key), "p50")) is not None:
            text += "; " + said.format(wait)
            if ref and (was := _ms(ref["summary"].get(key), "p50")) is not None:
                text += f"{joint} against {was:.0f} ms at {ref['label']}"
        out.append(text + ".")
    return out


def _behind_prompt_finding(levels: list[dict], slots: int | None) -> str | None:
    """Within the slots, what the requests that waited while another's prompt ran waited,
    against the others of their level."""
    parts = []
    for lv in levels:
        s = lv["summary"]
        during, other = s.get("wait_on_prompt_s"), s.get("wait_otherwise_s")
        if not during or (slots and (lv["concurrency"] or 0) > slots):
            continue
        n_all = during["n"] + (other["n"] if other else 0)
        against = (f", against p50 {_ms(other, 'p50'):.0f} ms for the other {other['n']}"
                   if other else "")
        waited = f"{'' if during['n'] == 1 else 'p50 '}{_ms(during, 'p50'):.0f} ms"
        parts.append(f"{during['n']} of {n_all} at {lv['label']} ({waited}{against})")
    if not parts:
        return None
    return ("Within the slots, a request that arrived while the server ran another's prompt "
            "(that one's first token came before its own prompt began) waited for that step: "
            f"{'; '.join(parts)}. llama-server takes up a new "
            "request only between its steps (llama_decode calls), and a step that carries "
            "prompts lasts as long as they take.")


def _waited(row: dict) -> str:
    """How long a level's requests waited before their prompt began, where it was seen."""
    if row.get("wait_s_p50") is None:
        return ""
    return (f"; a request waited {row['wait_s_p50']:.1f} ms (p50, p99 "
            f"{row['wait_s_p99']:.1f}) before the server started its prompt")


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
    info = header["system_info"] or {}
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
    closed = [row for lv, row in rows if lv["concurrency"]]
    out = [_closed_finding(closed[0], row) for row in closed]
    out += [_served_finding(row) for row in closed
            if row.get("served_of_inprocess") and row.get("steady_tok_s")]
    for lv, row in rows:
        if lv["rate"]:
            out.append(f"At {row['level']} offered (Poisson): {row['request_s']:.2f} requests/s "
                       f"finished, {row['output_tok_s']:.1f} output tok/s; TTFT p50 "
                       f"{row['ttft_s_p50']:.1f} ms (p99 {row['ttft_s_p99']:.1f}), TPOT p50 "
                       f"{_or(row['tpot_s_p50'])} ms{_waited(row)}.")
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
            f"{_or(row.get('server_prompt_s_p50'))} ms{_waited(row)}.")


def _or(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def render_serving_page(header: dict, levels: list[dict],
                        plots: list[tuple[str, str]] = ()) -> str:
    """The whole page: title, setup, findings first, the table, and what was not measured."""
    w, server = header["workload"] or {}, header["server"] or {}
    where = server_identity(header) + (f", {server.get('slots')} slot(s)"
                                       if "slots" in server else "")
    scenario = header["scenario"] or {}
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
    lines += [f"- {f}" for f in roofline_findings(levels, server.get("slots"))]
    if differ := build_difference(header, levels):
        lines.append(f"- {differ}")
    lines.append("")
    for table in levels_tables(levels, header["slo"]):
        lines += [markdown_table(table).rstrip("\n"), ""]
    if any(lv["steady_decode"] for lv in levels):
        lines += [markdown_table(explain_table(levels, header)), ""]
    if any(lv["summary"].get("server_prompt_s") for lv in levels):
        lines += [markdown_table(ttft_table(levels)), ""]
    for table in (roofline_table(levels), bound_inputs_table(levels)):
        if table:
            lines += [markdown_table(table), ""]
    lines += [f"![{caption}]({name})\n" for name, caption in plots]
    failed = [lv for lv in levels if lv["errors"]]
    lines += [f"- {lv['label']}: {'; '.join(lv['errors'])}" for lv in failed]
    lines += ["", *serving_environment(header)]
    return "\n".join(lines).rstrip() + "\n"


def serving_environment(header: dict) -> list[str]:
    """The environment and the command that reproduces the run, from its header."""
    server, info = header["server"] or {}, header["system_info"] or {}
    build = server.get("build") or {}
    rows = [("server", server.get("server_version") or server.get("server")
             or server.get("endpoint")),
            ("server command", " ".join(_redact_port(server.get("command") or [])) or None),
            ("llama.cpp (server build)", build.get("llama_cpp_commit", "")[:12] or None),
            ("llama.cpp (in-process bindings)", info.get("inprocess_commit")),
            ("llama.cpp system info", system_info_cell(info.get("server"))),
            ("Python, harness", f"{header.get('python')}, {header.get('harness')}")]
    table = ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows if v]
    scenario = (header["scenario"] or {}).get("path")
    again = f"harness run {scenario}" if scenario else "harness " + " ".join(
        _without_out(header.get("argv") or [])[1:])
    return ["## Environment", "", *table, "", "## Reproduce", "", "```sh", again, "```"]


def _without_out(argv: list[str]) -> list[str]:
    """A command line without its --out folder (where this run wrote, not what it did)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--out", "-o"):
            skip = True
        elif not arg.startswith("--out="):
            out.append(arg)
    return out


def _redact_port(command: list[str]) -> list[str]:
    """The server's command with its port, a free one picked per run, as PORT."""
    return ["PORT" if i and command[i - 1] == "--port" else c for i, c in enumerate(command)]


def write_serving_plots(levels: list[dict], out_dir: Path) -> list[tuple[str, str]]:
    """The latency-throughput plot and, with two or more closed levels, TTFT and ITL against
    the requests in flight; (file, caption) pairs for the page."""
    from ..render import plotkit

    rows = [(lv, level_row(lv)) for lv in levels if lv["summary"]["n_ok"]]
    if not rows:
        return []
    fig, (a1, a2) = plotkit.plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, name in ((a1, "tpot_s", "TPOT"), (a2, "ttft_s", "TTFT")):
        by_x = sorted(range(len(rows)), key=lambda j: rows[j][1]["output_tok_s"])
        for i, (lv, row) in enumerate(rows):
            marker = "o" if lv["concurrency"] else "s"
            ax.errorbar([row["output_tok_s"]], [row[f"{key}_p50"]], fmt=marker,
                        yerr=[[0], [row[f"{key}_p90"] - row[f"{key}_p50"]]], capsize=3)
            # above and below the point in turn, left to right: neighbours' labels apart
            ax.annotate(row["level"], (row["output_tok_s"], row[f"{key}_p50"]), fontsize=8,
                        xytext=(4, 4 if by_x.index(i) % 2 == 0 else -11),
                        textcoords="offset points")
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
    closed = [(lv["concurrency"], row) for lv, row in rows if lv["concurrency"]]
    if len(closed) >= 2:
        out.append((_by_concurrency(plotkit, closed, out_dir),
                    "TTFT and ITL against the requests in flight (closed loop)"))
    bounded = [r for r in map(roofline_row, levels) if r]
    if len(bounded) >= 2:
        out.append((_against_bound(plotkit, bounded, out_dir),
                    "Aggregate decode against the requests in flight: served (steady "
                    "window), in-process, and the roofline bound from the measured ceilings"))
    return out


def _against_bound(plotkit, rows: list[dict], out_dir: Path) -> str:
    fig, ax = plotkit.plt.subplots(figsize=(6, 4))
    xs = [r["in_flight"] for r in rows]
    ax.plot(xs, [r["bound_tok_s"] for r in rows], "k--", label="roofline bound")
    ax.plot(xs, [r["served_tok_s"] for r in rows], "o-", label="served (steady window)")
    ax.plot(xs, [r["inprocess_tok_s"] for r in rows], "s:", label="in-process (geometric mean)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("requests in flight (at most the slots decode together)")
    ax.set_ylabel("aggregate decode tok/s")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    last = rows[-1]
    fig.suptitle(f"At {last['level']}: served {last['served_share']['median']:.0%} of the "
                 f"bound ({last['limiter']})" if last["served_share"] else
                 "Decode against the bound")
    fig.tight_layout()
    return plotkit.save(fig, out_dir, "decode_against_bound")


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
            ("wait_s_p50", "waited before the prompt p50 ms"),
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
