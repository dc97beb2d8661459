"""The findings a page opens with: a few sentences, each computed from the run and true of it,
each left out when the run lacks its data. Pure."""

from __future__ import annotations

from collections import Counter

from ..analysis.machine import regime_sentences
from ..core.stats import WINDOW_TICKS, center
from ..levers.common import threads_label

GB = 1e9


def main_model(analysis: dict) -> tuple | None:
    """The model the side-by-side table is about: the one with the most prompt lengths."""
    counts: dict[tuple, int] = {}
    for r in analysis["prefill"]:
        if r["n_gen"] == 0 and r["dtype"] == "f32":
            key = (r["model"], r["dtype"], r["threads"])
            counts[key] = counts.get(key, 0) + 1
    size = {(r["model"], r["dtype"], r["threads"]): r["bytes_per_token"]
            for r in analysis["decode"]}
    keys = [k for k in counts if k in size]
    # the most prompt lengths; among equals the most threads, then the smallest model
    return max(keys, key=lambda k: (counts[k], k[2], -size[k])) if keys else None


def findings(data: dict) -> list[str]:
    """Five or six sentences with the run's numbers, each true of it (data: the analysis, the
    main model as (model, dtype, threads) or None, and the checked claims)."""
    a, main = data["analysis"], data["main"]
    out = _twin_finding(a)  # the premise every other figure rests on, where the run checked it
    if main:
        out += _two_phases(a, main)
    out += _size_finding(a) + _model_finding(a) + _experts_finding(a) + _use_finding(a)
    out += _long_prompt_finding(a, main)
    out += _quant_finding(a) + _batch_finding(a) + _kv_finding(a) + _threads_finding(a)
    out += _prefix_finding(a)
    out += drift_finding(a)
    claims = data.get("claims") or []
    if claims:
        n = Counter(c["verdict"] for c in claims)
        tested = len(claims) - n["not measured"]
        rest = [f"{n[v]} {v}" for v in ("does not hold", "undecided") if n[v]]
        out.append(f"Of the course's {len(claims)} claims checked here, {n['holds']} of the "
                   f"{tested} this run could test hold on this machine"
                   + (f" ({', '.join(rest)} at this precision)" if rest else "")
                   + ", each decided on its interval (table below).")
    return out


def times(value: float, ratio: dict | None) -> str:
    """2.37× [2.34–2.40]: a ratio with its 95% interval when it has one."""
    ci = (ratio or {}).get("median_ci95")
    return f"{value:.2f}×" + (f" [{ci[0]:.2f}–{ci[1]:.2f}]" if ci else "")


def drift_finding(a: dict) -> list[str]:
    """The machine's drift, stated once: the spread of the round effects."""
    d = a.get("machine_drift")
    if not d:
        return []
    stepped = any(r.get("interleave") == "step" for r in a["decode"])
    how = ("decode ratios between cells that decoded in turn are taken over windows of "
           f"{WINDOW_TICKS} adjacent steps and the other ratios round by round" if stepped
           else "ratios between cells are taken round by round")
    unpaired = [c["name"] for f in a.get("fits") or [] for c in f.get("size_contrasts") or []
                if not c.get("paired")]
    but = (f", except {'; '.join(unpaired)}, whose cells never ran together (unpaired: "
           "the drift is in their intervals)" if unpaired else "")
    regimes = regime_sentences(a["decode"])
    return [f"Across the run's {d['n_rounds']} rounds this machine ran between "
            f"{d['low']:.2f}× and {d['high']:.2f}× of its median speed (the round effects, "
            f"the median over the cells of each round): absolute figures describe those "
            f"minutes; {how}, so the drift cancels in them{but}."
            + (" Within rounds the machine switched between two speeds: " + "; ".join(regimes)
               + "." if regimes else "")]


def rows_of(rows: list[dict], key: tuple) -> list[dict]:
    return [r for r in rows if (r["model"], r["dtype"], r["threads"]) == key]


def _two_phases(a: dict, main: tuple) -> list[str]:
    pre = sorted((r for r in rows_of(a["prefill"], main) if r["n_gen"] == 0),
                 key=lambda r: r["n_prompt"])
    dec = rows_of(a["decode"], main)
    if not pre or not dec:
        return []
    p, d = pre[0], dec[0]
    p_ms, d_ms = 1000 / center(p["tok_s"]), 1000 / center(d["tok_s"])
    threads = f"{main[2]} thread{'s' if main[2] != 1 else ''}"
    return [f"On {main[0]} ({main[1].upper()}, {threads}), prefill of a "
            f"{p['n_prompt']}-token prompt ran at {center(p['tok_s']):.0f} tok/s "
            f"({p_ms:.1f} ms per token) and decode at {center(d['tok_s']):.1f} tok/s "
            f"({d_ms:.0f} ms per token): each decoded token took as long as "
            f"{d_ms / p_ms:.0f} prompt tokens."]


def _size_finding(a: dict) -> list[str]:
    fit = next((f for f in a["fits"] if f.get("fit")), None)
    if not fit:
        return []
    ids = fit.get("ids")
    rows = sorted((r for r in a["decode"] if r["threads"] == fit["threads"]
                   and (ids is None or r["id"] in ids)), key=lambda r: r["bytes_per_token"])
    several = len({r["dtype"] for r in rows}) > 1
    speeds = ", ".join(f"{r['model']}{' ' + r['dtype'] if several else ''} "
                       f"{r['bytes_per_token'] / GB:.2f} GB{' active' if r.get('moe') else ''}"
                       f" → {center(r['tok_s']):.1f} tok/s"
                       for r in rows)
    tok_s = [center(r["tok_s"]) for r in rows]
    falling = all(a > b for a, b in zip(tok_s, tok_s[1:], strict=False))
    eff = [r["effective_gb_s"] for r in rows]
    head = ("Decode slowed as the bytes read per token grew" if falling else
            "Decode speed did not fall steadily with the bytes read per token")
    low, high = (f"{x:.1f}" if round(min(eff)) == round(max(eff)) else f"{x:.0f}"
                 for x in (min(eff), max(eff)))
    text = (f"{head} ({speeds}); tok/s × bytes ranged {low}–{high} GB/s, "
            f"and the fit through the origin gives {fit['fit']['gb_s']:.1f} GB/s")
    r2 = fit["fit"]["r2"]
    text += f" (R² = {r2:.2f})." if r2 is not None else "."
    if not fit["memory_bound"]:
        text += f" Read with care: {fit['reasons'][0]}."
    return [text]


def _experts_finding(a: dict) -> list[str]:
    out = []
    for r in a["experts"]:
        if r["follows"]:
            out.append(
                f"{r['model']} ({r['dtype'].upper()}, a mixture of experts using {r['experts']} "
                f"experts per token) reads {r['active_n_bytes'] / GB:.2f} GB per token of its "
                f"{r['file_n_bytes'] / GB:.2f} GB and decoded at {center(r['tok_s']):.1f} "
                f"tok/s: at {r['gb_s']:.1f} GB/s the file size predicts "
                f"{r['by_file_tok_s']:.1f} tok/s, the active bytes {r['by_active_tok_s']:.1f}; "
                f"it follows the {r['follows']}.")
    return out


def _use_finding(a: dict) -> list[str]:
    use = a["phase_use"]
    # the configuration the page is about: the most threads, then the first model
    pre = max((u for u in use if u["phase"] == "prefill"), key=lambda u: u["threads"],
              default=None)
    dec = next((u for u in use if u["phase"] == "decode" and pre and
                (u["model"], u["dtype"], u["threads"]) ==
                (pre["model"], pre["dtype"], pre["threads"])), None)
    if not pre or not dec or None in (pre["compute_share"], dec["stream_share"],
                                      pre["stream_share"], dec["compute_share"]):
        return []
    return [f"Prefill of {pre['model']} used {pre['compute_share']:.0%} of the compute peak and "
            f"{pre['stream_share']:.0%} of the memory bandwidth; decode used "
            f"{dec['stream_share']:.0%} of the bandwidth and {dec['compute_share']:.0%} of the "
            "compute (against llama.cpp's own kernels, measured in this run)"
            + ("; a share above 100% means the model ran faster than the ceiling kernel did on "
               "its probe matrix beside it." if max(pre["compute_share"], dec["stream_share"])
               > 1 else ".")]


def _long_prompt_finding(a: dict, main: tuple | None) -> list[str]:
    groups: dict[tuple, list[dict]] = {}
    for r in a["prefill"]:
        if r["n_gen"] == 0:
            groups.setdefault((r["model"], r["dtype"], r["threads"]), []).append(r)
    if main not in groups:  # the model with the most prompt lengths
        main = max(groups, key=lambda k: (len(groups[k]), k), default=None)
    pre = groups.get(main, [])
    if len({r["n_prompt"] for r in pre}) < 2:
        return []
    short, long = min(pre, key=lambda r: r["n_prompt"]), max(pre, key=lambda r: r["n_prompt"])
    c = next((c for c in a["prompt_lengths"] if c["numerator"] == long["id"]
              and c["denominator"] == short["id"]), None)
    paired = (f", {times(c['ratio'], c)} that rate, "
              f"{'round by round' if c.get('paired') else 'unpaired'}" if c else "")
    return [f"A {long['n_prompt']:,}-token prompt to {main[0]} took {long['seconds']:.1f} s "
            f"before its first token ({center(long['tok_s']):.0f} tok/s, against "
            f"{center(short['tok_s']):.0f} tok/s at {short['n_prompt']} tokens{paired})"
            + _attention_clause(a, long) + "."]


def _attention_clause(a: dict, long: dict) -> str:
    """Why a long prompt is slower per token, from the run's prefill model."""
    for p in a["machine_model"]["prefill"]:
        for pt in p["points"]:
            if pt["id"] == long["id"] and pt["n_prompt"] > p["calibrated_at"]:
                return (f": attention is {pt['attention_flop_share']:.0%} of its FLOPs but "
                        f"{pt['attention_time_share']:.0%} of the time the model predicts, "
                        f"flash attention running at {p['attention_gflop_s']:.0f} GFLOP/s "
                        f"against {p['matmul_gflop_s']:.0f} for the matrices (measured ÷ "
                        f"predicted {pt['measured_over_predicted']:.2f})")
    return ""


FILE_TYPES = {"file": "the given file", "real": "the real file",
              "twin": "its random-weight twin", "built": "its spec-built stand-in"}


def type_words(dtype: str) -> str:
    """A weight type as the page names it: Q4_K_M; a given file or a twin pair in words."""
    return FILE_TYPES.get(dtype, dtype.upper())


def _model_finding(a: dict) -> list[str]:
    """The decode model per weight type: its fixed cost and achieved bandwidth."""
    rows = [d for d in a["machine_model"]["decode"] if d.get("gb_s")]
    if not rows:
        return []
    several = len({d["threads"] for d in rows}) > 1
    parts, shares = [], []
    for d in rows:
        share = (f", {d['share_of_stream']:.0%} of its streaming ceiling"
                 if d.get("share_of_stream") else "")
        if d.get("share_at_row_widths"):
            share += f" ({d['share_at_row_widths']:.0%} at the models' own row widths)"
        shares += [d.get("share_of_stream") or 0, d.get("share_at_row_widths") or 0]
        ci = d["gb_s"].get("median_ci95")
        parts.append(type_words(d["dtype"])
                     + (f" at {threads_label(d['threads'])}" if several else "")
                     + f" {center(d['gb_s']):.1f}"
                     + (f" [{ci[0]:.1f}–{ci[1]:.1f}]" if ci else "") + f" GB/s{share}")
    fixed = max(v for d in rows for v in d["fixed_s"].values()) * 1e3
    above = (" A share above 100%: decode ran faster than ggml's kernel did on the probe's "
             "matrix beside it (the tables below say where)." if max(shares) > 1 else "")
    head = ("Per weight type" if all(d["dtype"] not in FILE_TYPES for d in rows)
            else "Per weight type and file")
    return [f"{head}, decode ran at " + "; ".join(parts) + " once the fixed cost of "
            f"a step (up to {fixed:.2f} ms here, timed on skeletons of the same layers) is "
            "taken out: the run's model of its machine, which the estimates below use."
            + above]


def _quant_finding(a: dict) -> list[str]:
    q = [r for r in a["quant"] if r["dtype"] != r["baseline"]
         and r["decode_speedup"] and r["prefill_speedup"]]
    if not q:
        return []
    r = min(q, key=lambda r: r["bytes_per_token"])
    return [f"{r['dtype'].upper()} weights ({r['bits_per_weight']:.1f} bits per weight, "
            f"{r['byte_reduction']:.1f}× fewer bytes than {r['baseline'].upper()}) decoded "
            f"{times(r['decode_speedup'], r.get('decode_speedup_ci'))} and prefilled "
            f"{times(r['prefill_speedup'], r.get('prefill_speedup_ci'))} as fast"
            + (" (95% intervals, round by round)." if r.get("decode_speedup_ci") else ".")]


def _batch_finding(a: dict) -> list[str]:
    rows = [r for r in a["batching"] if r["parallel"] > 1 and r["speedup"]]
    if not rows:
        return []
    models = sorted({(r.get("model", ""), r.get("dtype", "")) for r in rows})
    out = []
    for key in models:
        r = max((r for r in rows if (r.get("model", ""), r.get("dtype", "")) == key),
                key=lambda r: r["parallel"])
        who = f" of {r['model']}" if len(models) > 1 else ""
        each = r.get("per_user_ci")
        out.append(f"{r['parallel']} sequences{who} decoded together gave "
                   f"{times(r['speedup'], r.get('speedup_ci'))} the aggregate tok/s of one; "
                   f"each sequence still got {center(r['per_sequence_tok_s']):.1f} tok/s"
                   + (f", {times(center(each), each)} the speed of one alone." if each
                      else "."))
    return out


def _kv_finding(a: dict) -> list[str]:
    rows = [r for r in a["kv_depth"] if r["depth"] and r["kv_type"] == "f16"
            and r["measured_slowdown"]]
    if not rows:
        return []
    r = max(rows, key=lambda r: r["depth"])
    return [f"With {r['depth']:,} tokens already cached, decode of {r['model']} ran "
            f"{times(center(r['measured_slowdown']), r['measured_slowdown'])} slower than from "
            "an empty cache timed "
            f"beside it, where the extra bytes alone predict {r['predicted_slowdown']:.2f}×."]


def _threads_finding(a: dict) -> list[str]:
    out = []
    for phase in ("prefill", "decode"):
        rows = [r for r in a["threads"] if r["phase"] == phase and r["speedup"]]
        if len({r["threads"] for r in rows}) < 2:
            continue
        lo, hi = min(rows, key=lambda r: r["threads"]), max(rows, key=lambda r: r["threads"])
        ratio = hi.get("speedup_ci") if lo["threads"] == hi.get("base_threads") else None
        out.append(f"{phase.capitalize()} of {hi['model']} ran "
                   f"{times(hi['speedup'] / lo['speedup'], ratio)} faster on {hi['threads']} "
                   f"threads than on {lo['threads']}.")
    return out


def _twin_finding(a: dict) -> list[str]:
    """The lesson's premise checked: each twin ÷ real ratio in words."""
    from ..levers.twins import twin_sentence

    return [twin_sentence(r) for r in a["twins"]]


def _prefix_finding(a: dict) -> list[str]:
    rows = [r for r in a["prefix"] if r.get("seq_copy_s")]
    if not rows:
        return []
    r = rows[0]
    ci = (r.get("seq_copy_speedup_ci") or {}).get("median_ci95")
    saved = (f"a saving of {r['seq_copy_saving']:.0%} [{1 - 1 / ci[0]:.0%}–{1 - 1 / ci[1]:.0%}],"
             " both timed in each repetition" if ci else
             f"a saving of {r['seq_copy_saving']:.0%}")
    return [f"Reusing a cached {r['shared_prefix']:,}-token prefix cut the time to first token "
            f"from {center(r['recompute_s']):.2f} s to {center(r['seq_copy_s']):.2f} s "
            f"({saved})."]
