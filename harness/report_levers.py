"""Report sections of the levers: quantization, KV cache, batching, threads, prefix caching."""

from __future__ import annotations

from .stats import center
from .tabular import ABOVE_CEILING_NOTE, Column, Table, notes_for

GIB = 2**30


def _shares(shares: dict) -> str:
    return ", ".join(f"{t} {s:.0%}" for t, s in shares.items() if s >= 0.005)


def quant_tables(analysis: dict) -> list[Table]:
    rows = analysis.get("quant") or []
    if not rows:
        return []
    speed = Table("quant", "Quantization: fewer bytes per token, faster decode", [
        Column("model", "model"), Column("dtype", "dtype"), Column("threads", "threads", "int"),
        Column("bits/weight", "bits_per_weight", "f2"), Column("size (GiB)", "file_n_bytes", "gib"),
        Column("read per token (GiB)", "bytes_per_token", "gib"),
        Column("byte reduction", "byte_reduction", "x"),
        Column("decode tok/s", "decode_tok_s", "stat"),
        Column("decode speed-up (×)", "decode_speedup_ci", "stat2"),
        Column("prefill tok/s", "prefill_tok_s", "stat"),
        Column("prefill speed-up (×)", "prefill_speedup_ci", "stat2"),
        Column("speed-up ÷ byte reduction", "speedup_per_byte_reduction", "f2")], rows,
        [f"Speed-ups and byte reductions are against {rows[0]['baseline'].upper()} of the same "
         "model. If decode were purely bandwidth-bound, its speed-up would equal the byte "
         "reduction (last column 1.00); below 1, dequantizing the blocks costs CPU time that "
         "the saved bytes do not cover on these cores.",
         _prefill_note(rows)])
    comp = Table("quant_composition", "What each file really holds", [
        Column("model", "model"), Column("dtype", "dtype"),
        Column("bits/weight", "bits_per_weight", "f2"),
        Column("share of weights by type", "params"), Column("share of bytes by type", "bytes")],
        list({(r["model"], r["dtype"]): {
            "model": r["model"], "dtype": r["dtype"], "bits_per_weight": r["bits_per_weight"],
            "params": _shares(r["params_share"]), "bytes": _shares(r["bytes_share"])}
            for r in rows}.values()),
        ["Read from each file's tensor table. bits/weight = 8 × all tensor bytes ÷ all weights. "
         "llama.cpp's quantize recipes keep norms in F32, give some tensors (the output layer, "
         "V and FFN-down in the K-quant mixes) more bits, and fall back to another type for "
         "any tensor whose rows are not a multiple of the type's block (256 for K-quants)."])
    return [speed, comp]


def _prefill_note(rows: list[dict]) -> str:
    """What prefill did with fewer bytes, from this run's numbers."""
    def span(key: str) -> str:
        values = [r[key] for r in rows if r.get(key) and r["dtype"] != r["baseline"]]
        return f"{min(values):.2f}–{max(values):.2f}×" if values else "not measured"

    return ("Prefill multiplies whole matrices and is compute-bound, so its bytes matter little: "
            "what changes is the kernel each type runs (ggml's quantized types quantize the "
            "activations to 8 bits and use integer dot products; F16 and BF16 have their own "
            "kernels, which depend on the CPU's instructions). Speed-up here: "
            f"prefill {span('prefill_speedup')}, decode {span('decode_speedup')}.")


def _unpaired_note(rows: list[dict]) -> list[str]:
    if any(r["depth"] and r["baseline_tok_s"] is None for r in rows):
        return ["This run predates the paired baseline: its slowdowns compare separate "
                "measurements, so they include the machine's drift between them."]
    return []


def _drift_notes(rows: list[dict]) -> list[str]:
    """At depth 0 the cache holds next to nothing, so KV types differing there is drift."""
    out = []
    for key in sorted({(r["model"], r["dtype"], r["threads"]) for r in rows}):
        zero = {r["kv_type"]: center(r["tok_s"]) for r in rows if r["depth"] == 0
                and (r["model"], r["dtype"], r["threads"]) == key}
        if len(zero) >= 2:
            spread = max(zero.values()) / min(zero.values()) - 1
            out.append(f"{key[0]} {key[1]}: at depth 0 the KV types read almost the same bytes, "
                       f"yet decode differed by {spread:.0%} ("
                       + ", ".join(f"{k} {v:.2f} tok/s" for k, v in zero.items())
                       + "): that is how far this machine drifted between measurements, "
                       "and why each slowdown is measured against its own paired baseline.")
    return out


def kv_tables(analysis: dict) -> list[Table]:
    rows = analysis.get("kv_depth") or []
    if not rows:
        return []
    depth = Table("kv_depth", "KV cache: decode at context depth", [
        Column("model", "model"), Column("dtype", "dtype"), Column("threads", "threads", "int"),
        Column("KV type", "kv_type"), Column("depth", "depth", "int"),
        Column("KV per token (KiB)", "kv_n_bytes_per_token", "kib"),
        Column("KV read per step (MiB)", "kv_n_bytes", "mib"),
        Column("read per step (GiB)", "bytes_per_token", "gib"),
        Column("decode tok/s", "tok_s", "stat"), Column("ms/token", "ms_per_token", "stat"),
        Column("paired depth-0 tok/s", "baseline_tok_s", "stat"),
        Column("measured slowdown (×)", "measured_slowdown", "stat2"),
        Column("slowdown the bytes predict", "predicted_slowdown", "x"),
        Column("notes", "notes")],
        [r | {"notes": notes_for(r | {"decode_tok_s": r["tok_s"]}, ("decode",))}
         for r in rows],
        ["The depth is filled once, untimed; every repetition then trims the cache back to it "
         "and times the decode. Each step reads every weight plus K and V of every cached "
         "token (layers × KV heads × head size × 2 × bytes per element).",
         "Measured slowdown: in every repetition the same tokens are first decoded on an empty "
         "second sequence of the same context (depth 0), then at the depth; the slowdown is "
         "the ratio of the two, so drift of the machine between measurements cancels. The "
         "predicted slowdown is the ratio of bytes read per step; a measured slowdown above "
         "it means attention costs more than its bytes: the dot products over the context, "
         "run on few cores.",
         *_drift_notes(rows), *_unpaired_note(rows)])
    memory = Table("kv_memory", "Memory for concurrent users (estimates)", [
        Column("model", "model"), Column("dtype", "dtype"), Column("KV type", "kv_type"),
        Column("context", "context", "int"), Column("KV per user (GiB)", "kv_per_user", "gib3"),
        Column("1 user (GiB)", "users_1", "gib"), Column("8 users (GiB)", "users_8", "gib"),
        Column("32 users (GiB)", "users_32", "gib"),
        Column("128 users (GiB)", "users_128", "gib")], analysis.get("kv_memory") or [],
        ["Estimates, not measurements: weights once plus each user's full-context KV cache "
         "(llama.cpp keeps a cell per token per sequence); compute buffers come on top."])
    return [depth, memory]


def batching_table(analysis: dict) -> list[Table]:
    rows = analysis.get("batching") or []
    if not rows:
        return []
    return [Table("batching", "Batching: independent sequences decoded together", [
        Column("model", "model"), Column("dtype", "dtype"), Column("threads", "threads", "int"),
        Column("sequences", "parallel", "int"), Column("aggregate tok/s", "tok_s", "stat"),
        Column("per-sequence tok/s", "per_sequence_tok_s", "stat"),
        Column("ms/step", "ms_per_step", "stat"),
        Column("speed-up (×)", "speedup_ci", "stat2"),
        Column("weight MiB read per token served", "weight_n_bytes_per_token", "mib"),
        Column("roofline bound tok/s", "bound_tok_s", "f1"),
        Column("share of bound", "share_of_bound", "pct")], rows, batching_notes(rows))]


def batching_notes(rows: list[dict]) -> list[str]:
    """Where the gain from batching stops, explained from the measured ceilings."""
    out = ["Each step is one llama_decode of one token from every sequence (its own seq id); "
           "aggregate tok/s counts all of them, per-sequence tok/s is what each user sees. The "
           "weights are read once per step, so the bytes per token served fall as 1/B."]
    for key in sorted({(r["model"], r["dtype"], r["threads"]) for r in rows}):
        group = sorted((r for r in rows if (r["model"], r["dtype"], r["threads"]) == key),
                       key=lambda r: r["parallel"])
        out.append(_batching_note(key, group))
    return out


def _batching_note(key: tuple, group: list[dict]) -> str:
    """The measured gain, and where the roofline puts the end of it, said only as far as the
    run measured."""
    best = max(group, key=lambda r: center(r["tok_s"]))
    top = group[-1]["parallel"]
    text = (f"{key[0]} {key[1]}, {_threads(key[2])}: the best aggregate was "
            f"{center(best['tok_s']):.1f} tok/s at {best['parallel']} sequences")
    if len(group) >= 2:
        last, prev = group[-1], group[-2]
        gain = center(last["tok_s"]) / center(prev["tok_s"]) - 1
        text += (f"; from {prev['parallel']} to {last['parallel']} sequences the aggregate "
                 f"{'still grew' if gain > 0 else 'changed'} by {gain:+.0%}")
    r = next((r for r in group if r["ridge_parallel"]), None)
    if r:
        ridge = r["ridge_parallel"]
        text += (f". A step costs at least max((weights + B × KV) ÷ {r['stream_gb_s']:.1f} "
                 f"GB/s, B × FLOPs per token ÷ {r['compute_gflop_s']:.0f} GFLOP/s), with the "
                 "streaming and compute ceilings of ggml's own kernels for this model's types; "
                 f"the two meet at B ≈ {ridge:.1f}")
        text += (", inside the measured range: beyond it each extra sequence costs its own "
                 "compute" if ridge <= top else
                 f", beyond the largest batch measured ({top}): where the gain really ends "
                 "was not measured (estimated)")
        shares = [f"{x['share_of_bound']:.0%} at B = {x['parallel']}" for x in group
                  if x["share_of_bound"]]
        if shares:
            text += ". Measured against that bound: " + ", ".join(shares)
    return text + "."


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"


def threads_table(analysis: dict) -> list[Table]:
    rows = analysis.get("threads") or []
    if not rows:
        return []
    names = {"compute_gflop_s": "ggml compute peak", "stream_gb_s": "ggml streaming"}
    table_rows = [r | {"test": (f"pp{r['n_prompt']}" if r["phase"] == "prefill"
                                else f"tg{r['n_gen']}"), "ceiling_name": names[r["ceiling"]],
                       "knee_mark": "◀ knee" if r["knee"] else ""} for r in rows]
    knees = sorted({(r["phase"], r["model"], r["dtype"], r["knee_threads"],
                     max(x["threads"] for x in rows if x["phase"] == r["phase"]
                         and x["model"] == r["model"] and x["dtype"] == r["dtype"]))
                    for r in rows})
    notes = [_knee_note(phase, model, dtype, knee, top) for phase, model, dtype, knee, top
             in knees]
    notes.append("Prefill is matrix-matrix work: it scales with cores as the compute peak "
                 "does. Decode reads every weight per token: it scales until it reaches "
                 "the streaming bandwidth of its thread count (share of ceiling: effective GB/s "
                 "÷ ggml's streaming ceiling for decode, achieved GFLOP/s ÷ ggml's compute "
                 "peak for prefill, each over the model's tensor types).")
    notes += _ceiling_notes(rows)
    if any((r.get("share_of_ceiling") or 0) > 1 for r in rows):
        notes.append(ABOVE_CEILING_NOTE)
    return [Table("threads", "Threads: how prefill and decode scale", [
        Column("phase", "phase"), Column("model", "model"), Column("dtype", "dtype"),
        Column("test", "test"), Column("threads", "threads", "int"),
        Column("tok/s", "tok_s", "stat"), Column("speed-up (×)", "speedup_ci", "stat2"),
        Column("efficiency", "efficiency", "pct"), Column("ceiling", "ceiling_name"),
        Column("ceiling speed-up", "ceiling_speedup", "x"),
        Column("share of ceiling", "share_of_ceiling", "pct"), Column("", "knee_mark")],
        table_rows, notes)]


def _knee_note(phase: str, model: str, dtype: str, knee: int, top: int) -> str:
    """The knee, said only where the measured thread counts can show one."""
    if knee == top:
        return (f"{phase}, {model} {dtype}: still gaining at {_threads(top)}, the most "
                "measured; this run cannot show where the gain ends.")
    return (f"{phase}, {model} {dtype}: knee at {_threads(knee)} of {top} (the fewest within "
            "2% of the best).")


def _ceiling_notes(rows: list[dict]) -> list[str]:
    """Where each phase stood against its ceiling at the fewest and the most threads."""
    out = []
    for phase in ("decode", "prefill"):
        group = [r for r in rows if r["phase"] == phase and r.get("share_of_ceiling")]
        if len(group) < 2:
            continue
        lo = min(group, key=lambda r: r["threads"])
        hi = max(group, key=lambda r: r["threads"])
        speedup = hi["speedup"] / lo["speedup"]
        text = (f"Measured here: {phase} reached {lo['share_of_ceiling']:.0%} of its ceiling "
                f"at {_threads(lo['threads'])} and {hi['share_of_ceiling']:.0%} at "
                f"{_threads(hi['threads'])}, a {speedup:.2f}× speed-up")
        if phase == "decode" and hi["share_of_ceiling"] >= 0.9:
            text += (f"; at {_threads(hi['threads'])} it ran at its streaming ceiling, so "
                     "more threads would add compute that waits on memory")
        out.append(text + ".")
    return out


def prefix_table(analysis: dict) -> list[Table]:
    rows = analysis.get("prefix") or []
    if not rows:
        return []
    return [Table("prefix", "Prefix caching: time to first token", [
        Column("model", "model"), Column("dtype", "dtype"), Column("threads", "threads", "int"),
        Column("shared prefix", "shared_prefix", "int"), Column("question", "n_prompt", "int"),
        Column("recomputed (s)", "recompute_s", "stat3"),
        Column("sequence copy (s)", "seq_copy_s", "stat3"),
        Column("saving", "seq_copy_saving", "pct"),
        Column("state restore (s)", "state_restore_s", "stat3"),
        Column("saving", "state_restore_saving", "pct"),
        Column("saved state (MiB)", "state_n_bytes", "mib")], rows,
        ["Recomputed: prefill of prefix + question from an empty cache. Sequence copy: the "
         "prefix stays cached in sequence 0 and a new sequence shares its cells "
         "(llama_memory_seq_cp in a unified cache, no data moved), then only the question is "
         "prefilled. State restore: the prefix's cache was saved once "
         "(llama_state_seq_get_data) and is copied back in before the question, as a server "
         "restoring a cached prompt from RAM does. Each time ends at the last token's logits."])]


def lever_tables(analysis: dict) -> list[Table]:
    return (quant_tables(analysis) + kv_tables(analysis) + batching_table(analysis)
            + threads_table(analysis) + prefix_table(analysis))
