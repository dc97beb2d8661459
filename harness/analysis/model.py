"""The model of the machine, stated once and fitted on a run's own points.

decode, seconds per token = fixed + weight bytes ÷ B(type)
                            + max(KV bytes ÷ B(f16 stream), attention FLOPs ÷ P(decode attention))
  fixed: what a step costs whatever its bytes (building the graph, one synchronization of
         the threads per graph node, the logits), measured on skeletons of the run's
         architectures (their layers, every width tiny) and linear in the layer count;
  B(type): the bandwidth the run's decodes of that weight type achieved, the fixed cost
         taken out, round by round; for a type the run did not decode, its streaming ceiling
         (ggml's matrix-vector kernel, probed in the run). Either is carried to a model's
         own row widths by the probed ratio of the type's streaming rate over rows of 512
         and 4,096 weights (a row's fixed work weighs more on short rows; estimates).
  P(decode attention): ggml's flash-attention kernel for one query against a long cache
         (a decode step of one layer), probed in the run: attention over the cache is
         arithmetic at few GFLOP/s, far more than its bytes cost (roofline: the slower of
         the two).
  With 3 or more sizes of one type the straight line t = a + bytes ÷ B is fitted too, by
  least squares over every round's points, and its intercept a set beside the measured fixed.
prefill, seconds = Σ over ubatches of matrix FLOPs ÷ P(type, columns)
                  + attention FLOPs ÷ P(attention) + output layer bytes ÷ B(type stream)
  P(type, columns): the rate the run's shortest prompt of that type achieved, attention's
         part taken out, carried to other ubatch widths by the ratio of ggml's compute peak
         at those widths (probed at 128 and 512 columns: a narrow GEMM is slower); for a type
         the run did not prefill, its ggml compute peak;
  P(attention): ggml's flash-attention kernel at the model's head shape, probed in the run.
  The output layer runs for the last token only: one matrix-vector product, a read of its
  weights at the type's streaming ceiling (on F32 Qwen2.5-0.5B, 545 MB: about 20 ms).
Estimates for configurations the run never measured derive from it (estimate()).
"""

from __future__ import annotations

import math
import statistics

from scipy import stats as sps

from ..core.costs import (
    active_expert_fraction,
    attention_flops,
    decode_n_bytes_by_row_width,
    kv_n_bytes_per_token,
    mean_decode_context,
    prefill_flops,
)
from ..core.dtypes import DTYPES
from ..core.records import Probe
from ..core.specs import ModelSpec
from ..core.stats import center, relative_half_width, row_blocks, summarize
from ..weights.gguf_build import table_from_plan
from .ceilings import probe_figure

KV_TYPE = "f16"  # the cache the plain rows and the estimates use
FIT_MIN_SIZES = 3
SHORT_ROW, LONG_ROW = 512, 4096  # the probe's streaming rows (KernelProbe.NARROW_ROW, N_COLS)


def full_probes(probes: list[Probe]) -> list[Probe]:
    return [p for p in probes if p.result and p.when not in ("beside", "rotation")]


def _median_figure(probes: list[dict], threads: int, path: tuple[str, ...]) -> dict | None:
    """A figure over the run's full probes: the median of their pooled passes, with its
    relative spread (the wider side of that median's interval)."""
    found = [f for p in full_probes(probes) if (f := probe_figure(p, threads, path))]
    pooled = [s for f in found for s in f["samples"]]
    if not pooled:
        return None
    return {"value": statistics.median(pooled),
            "spread": relative_half_width(summarize(pooled)) if len(pooled) > 2 else None}


def fixed_costs(probes: list[dict]) -> dict:
    """{threads: {architecture: {"base_s", "per_layer_s", "layers"}}} from the skeletons the
    full probes timed: a line through their median step times against the layer count."""
    out: dict = {}
    for p in full_probes(probes):
        for t, node in p.result.get("threads", {}).items():
            for arch, by_layers in (node.get("fixed_cost") or {}).items():
                slot = out.setdefault(int(t), {}).setdefault(arch, {})
                for layers, entry in by_layers.items():
                    slot.setdefault(int(layers), []).extend(entry.get("samples_seconds") or [])
    lines: dict = {}
    for t, archs in out.items():
        for arch, samples in archs.items():
            points = sorted((n, statistics.median(s)) for n, s in samples.items() if s)
            if len(points) < 2:
                continue
            (n0, s0), (n1, s1) = points[0], points[-1]
            per_layer = (s1 - s0) / (n1 - n0)
            lines.setdefault(t, {})[arch] = {"base_s": s0 - per_layer * n0,
                                             "per_layer_s": per_layer,
                                             "layers": [n for n, _ in points]}
    return lines


def fixed_seconds(fixed: dict, threads: int, spec: ModelSpec) -> tuple[float | None, str]:
    """A step's fixed cost for a spec: its architecture's skeleton line at its layer count
    (another architecture's where the run timed none of its own, said so)."""
    lines = fixed.get(threads) or {}
    line, source = lines.get(spec.architecture), spec.architecture
    if line is None and lines:
        source = sorted(lines)[0]
        line = lines[source]
    if line is None:
        return None, "no skeleton was timed at this thread count"
    return line["base_s"] + line["per_layer_s"] * spec.num_hidden_layers, source


def ceilings(probes: list[dict]) -> dict:
    """{threads: {"stream": {type: figure}, "compute": {type: figure}, "attention":
    {shape: figure}}}: every yardstick the full probes hold, as medians of their passes."""
    out: dict = {}
    for p in full_probes(probes):
        for t, node in p.result.get("threads", {}).items():
            slot = out.setdefault(int(t), {"stream": {}, "compute": {}, "attention": {},
                                           "decode_attention": {}})
            for dtype in node.get("ggml") or {}:
                for kind, key in (("stream", "stream_gb_s"), ("compute", "compute_gflop_s"),
                                  ("narrow", "narrow_gflop_s"),
                                  ("short_row_stream", "shortrows_gb_s")):
                    slot.setdefault(kind, {}).setdefault(dtype, ("ggml", dtype, key))
            for kind in ("attention", "decode_attention"):
                for shape in node.get(kind) or {}:
                    slot.setdefault(kind, {}).setdefault(shape, (kind, shape,
                                                                 "attention_gflop_s"))
    return {t: {kind: {k: f for k, path in paths.items()
                       if (f := _median_figure(probes, t, path))}
                for kind, paths in slot.items()} for t, slot in out.items()}


# --- decode --------------------------------------------------------------------------------

def decode_model(decode: list[dict], models: dict, fixed: dict, ceil: dict | None = None
                 ) -> list[dict]:
    """Per thread count and weight type: the achieved bandwidth with the fixed cost and the
    attention over the cache taken out (round by round, its interval over rounds), each
    model's residual, and with 3 or more sizes the least-squares line with its intercept."""
    groups: dict[tuple, dict] = {}
    for r in decode:
        model = models.get(r["model_key"])
        if not model or r["moe"]:
            continue  # a mixture of experts reads a varying set of experts: not this line
        key = (r["threads"], r["dtype"])
        if r["model"] not in groups.setdefault(key, {}) or \
                r["n_gen"] > groups[key][r["model"]]["n_gen"]:
            groups[key][r["model"]] = r
    out = []
    for (threads, dtype), by_model in sorted(groups.items()):
        rows = list(by_model.values())
        specs = {r["model"]: ModelSpec(**models[r["model_key"]].spec) for r in rows}
        fixed_by = {r["model"]: fixed_seconds(fixed, threads, specs[r["model"]])[0] or 0.0
                    for r in rows}
        attention_by = {r["model"]: decode_attention_s(
            ceil or {}, threads, specs[r["model"]], mean_decode_context(r["n_prompt"],
                                                                        r["n_gen"]))
            for r in rows}
        entry = {"threads": threads, "dtype": dtype, "models": [r["model"] for r in rows],
                 "ids": [r["id"] for r in rows], "fixed_s": fixed_by,
                 "attention_s": attention_by,
                 "fixed_from": {m: fixed_seconds(fixed, threads, s)[1]
                                for m, s in specs.items()}}
        entry |= _achieved(rows, {m: fixed_by[m] + attention_by[m] for m in fixed_by})
        # the mean of the models' row-width factors: what the estimates carry B(type) from
        slot = (ceil or {}).get(threads) or {}
        entry["row_width_factor"] = statistics.fmean(
            row_width_factor(s, dtype, slot, threads) for s in specs.values())
        entry["stream_ceiling_gb_s"] = _median([r["stream_ceiling"]["value"] for r in rows])
        if entry.get("gb_s") and entry["stream_ceiling_gb_s"]:
            entry["share_of_stream"] = center(entry["gb_s"]) / entry["stream_ceiling_gb_s"]
            # the same against the ceiling over these models' own row widths (short rows
            # stream more slowly: what the estimates carry to other models)
            if slot.get("short_row_stream", {}).get(ggml_type(dtype)):
                entry["share_at_row_widths"] = (entry["share_of_stream"]
                                                / entry["row_width_factor"])
        if len({r["bytes_per_token"] for r in rows}) >= FIT_MIN_SIZES:
            entry["line"] = line_fit(rows)
        out.append(entry)
    return out


def _median(values: list) -> float | None:
    values = [v for v in values if v]
    return statistics.median(values) if values else None


def _achieved(rows: list[dict], fixed_by: dict) -> dict:
    """The pooled bandwidth of each round (the rows' bytes over their steps' time less the
    time that is not bytes: the fixed cost and the attention over the cache), summarized
    over rounds; each row's measured ÷ modelled speed."""
    blocks = [row_blocks(r) for r in rows]
    per_round = []
    for block in sorted(set().union(*blocks)):
        present = [(r, b[block]) for r, b in zip(rows, blocks, strict=True) if block in b]
        variable = sum(1 / rate - fixed_by[r["model"]] for r, rate in present)
        if variable > 0:
            per_round.append(sum(r["bytes_per_token"] for r, _ in present) / variable / 1e9)
    if not per_round:
        return {"gb_s": None, "residuals": []}
    gb_s = summarize(per_round)
    residuals = [{"model": r["model"], "measured_over_model": center(r["tok_s"]) * (
        fixed_by[r["model"]] + r["bytes_per_token"] / (center(gb_s) * 1e9))} for r in rows]
    return {"gb_s": gb_s, "n_rounds": len(per_round), "residuals": residuals}


def line_fit(rows: list[dict]) -> dict | None:
    """seconds per token = a + bytes ÷ B by least squares over every round's point of every
    size: a (ms) and B (GB/s) with 95% intervals (Student t, n - 2 degrees of freedom)."""
    xs, ys = [], []
    for r in rows:
        for rate in row_blocks(r).values():
            xs.append(r["bytes_per_token"] / 1e9)
            ys.append(1 / rate)
    if len(set(xs)) < FIT_MIN_SIZES or len(xs) < 4:
        return None
    fit = sps.linregress(xs, ys)
    t = sps.t.ppf(0.975, len(xs) - 2)
    slope_ci = [fit.slope - t * fit.stderr, fit.slope + t * fit.stderr]
    return {"intercept_ms": fit.intercept * 1e3,
            "intercept_ci_ms": [(fit.intercept - t * fit.intercept_stderr) * 1e3,
                                (fit.intercept + t * fit.intercept_stderr) * 1e3],
            "gb_s": 1 / fit.slope if fit.slope > 0 else None,
            "gb_s_ci": ([1 / slope_ci[1], 1 / slope_ci[0]] if slope_ci[0] > 0 else None),
            "r2": fit.rvalue ** 2, "n_points": len(xs)}


# --- prefill -------------------------------------------------------------------------------

def decode_attention_s(ceil: dict, threads: int, spec: ModelSpec, n_context: float) -> float:
    """Seconds a decode step spends attending over n_context cached positions at the probed
    decode-attention rate (0 where the run did not probe it: then it stays in the bandwidth)."""
    rate, _ = attention_rate(ceil, threads, spec, "decode_attention")
    return attention_flops(spec, 1, n_context - 1) / (rate * 1e9) if rate else 0.0


def attention_rate(ceil: dict, threads: int, spec: ModelSpec, kind: str = "attention"
                   ) -> tuple[float | None, str]:
    """Flash attention's probed GFLOP/s at the spec's head shape, for a prefill ubatch
    ("attention") or a decode step ("decode_attention"); the nearest probed shape, said so,
    where the run probed another."""
    probed = (ceil.get(threads) or {}).get(kind) or {}
    shape = f"{spec.head_dim}x{spec.num_attention_heads}x{spec.num_key_value_heads}"
    if shape in probed:
        return probed[shape]["value"], shape
    if not probed:
        return None, "no attention probe at this thread count"
    near = min(probed, key=lambda s: abs(int(s.split("x")[0]) - spec.head_dim))
    return probed[near]["value"], near


def _probed_ratio(ceil: dict, threads: int, dtype: str, kinds: tuple[str, str],
                  span: tuple[int, int]):
    """rel(n): the type's rate at size n relative to its rate at span[1], log-interpolated
    between the probes at span[0] (kinds[1]) and span[1] (kinds[0]), flat outside them;
    1 where either probe is missing."""
    slot = ceil.get(threads) or {}
    full, small = ((slot.get(k) or {}).get(ggml_type(dtype)) for k in kinds)
    if not full or not small:
        return lambda n: 1.0
    low, (lo, hi) = small["value"] / full["value"], span

    def rel(n: int) -> float:
        return low ** (1 - min(max(math.log(n / lo) / math.log(hi / lo), 0.0), 1.0))

    return rel


def column_scale(ceil: dict, threads: int, dtype: str):
    """rel(columns): the type's compute rate at a ubatch of that many columns relative to
    its rate at 512, log-interpolated between the probed 128 and 512 (1 without a probe)."""
    return _probed_ratio(ceil, threads, dtype, ("compute", "narrow"), (128, 512))


def row_scale(ceil: dict, threads: int, dtype: str):
    """rel(weights per row): the type's streaming rate over rows of that width relative to
    its rate at 4,096, log-interpolated between the probed 512 and 4,096 and held flat
    outside them (1 without a short-row probe)."""
    return _probed_ratio(ceil, threads, dtype, ("stream", "short_row_stream"),
                         (SHORT_ROW, LONG_ROW))


def row_width_factor(spec: ModelSpec, dtype: str, ceil: dict, threads: int) -> float:
    """The type's streaming rate over a spec's decode matrices relative to its rate at the
    probe's 4,096-weight rows: their bytes ÷ Σ each row width's bytes ÷ rel(width)."""
    rel = row_scale({threads: ceil}, threads, dtype)
    widths = decode_n_bytes_by_row_width(table_from_plan(spec, DTYPES["f32"]),
                                         active_expert_fraction(spec))
    total = sum(widths.values())
    return total / sum(n / rel(k) for k, n in widths.items()) if total else 1.0


def matrix_units(spec: ModelSpec, n_prompt: int, n_ubatch: int, rel) -> float:
    """A prompt's block-matrix FLOPs (the output layer apart) in 512-column equivalents:
    each ubatch's FLOPs ÷ rel(its width)."""
    per_token = (prefill_flops(spec, 1) - attention_flops(spec, 1)
                 - 2 * spec.hidden_size * spec.vocab_size)
    sizes = [n_ubatch] * (n_prompt // n_ubatch) + ([n_prompt % n_ubatch] if n_prompt %
                                                   n_ubatch else [])
    return sum(per_token * n / rel(n) for n in sizes)


def output_seconds(spec: ModelSpec, dtype: str, ceil: dict, threads: int) -> float:
    """The output layer of a prefill: logits of the last token only, one matrix-vector
    product over hidden × vocabulary weights, at the type's streaming ceiling for rows of
    hidden-size weights (nominal bits per weight; 0 without a ceiling)."""
    stream = ((ceil.get(threads) or {}).get("stream") or {}).get(ggml_type(dtype))
    if not stream or dtype not in DTYPES:
        return 0.0
    n_bytes = spec.hidden_size * spec.vocab_size * DTYPES[dtype].bits_per_weight / 8
    rate = stream["value"] * row_scale(ceil, threads, dtype)(spec.hidden_size)
    return n_bytes / (rate * 1e9)


def prefill_seconds(spec: ModelSpec, n_prompt: int, n_ubatch: int, mm_gflop_s: float,
                    attn_gflop_s: float, rel, output_s: float = 0.0) -> float:
    """The model's prefill time: block matrices at mm_gflop_s (a 512-column rate) per ubatch
    width, attention at attn_gflop_s, the output layer's one matrix-vector product."""
    return (matrix_units(spec, n_prompt, n_ubatch, rel) / (mm_gflop_s * 1e9)
            + attention_flops(spec, n_prompt) / (attn_gflop_s * 1e9) + output_s)


def prefill_model(prefill: list[dict], models: dict, ceil: dict) -> list[dict]:
    """Per model, type and thread count with prefill-only rows: the matrix rate achieved at
    the shortest prompt (attention's probed time taken out, as a 512-column rate), and every
    prompt length's predicted time from both parts beside the measured one."""
    groups: dict[tuple, list[dict]] = {}
    for r in prefill:
        if r["n_gen"] == 0 and r["model_key"] in models:
            groups.setdefault((r["model_key"], r["dtype"], r["threads"]), []).append(r)
    out = []
    for (key, dtype, threads), rows in sorted(groups.items()):
        spec, name = ModelSpec(**models[key].spec), rows[0]["model"]
        attn_gflop_s, shape = attention_rate(ceil, threads, spec)
        if not attn_gflop_s:
            continue
        rel = column_scale(ceil, threads, dtype)
        output_s = output_seconds(spec, dtype, ceil, threads)
        short = min(rows, key=lambda r: r["n_prompt"])
        left = (short["seconds"] - output_s
                - attention_flops(spec, short["n_prompt"]) / (attn_gflop_s * 1e9))
        if left <= 0:
            continue
        mm_gflop_s = matrix_units(spec, short["n_prompt"], short["n_ubatch"], rel) / left / 1e9
        points = [_prefill_point(spec, r, mm_gflop_s, attn_gflop_s, rel, output_s)
                  for r in sorted(rows, key=lambda r: r["n_prompt"])]
        out.append({"model": name, "dtype": dtype, "threads": threads, "output_s": output_s,
                    "matmul_gflop_s": mm_gflop_s, "attention_gflop_s": attn_gflop_s,
                    "attention_shape": shape, "calibrated_at": short["n_prompt"],
                    "narrow_over_wide": rel(128), "n_ubatch": short["n_ubatch"],
                    "compute_peak_gflop_s": short["compute_peak"]["value"],
                    "points": points})
    return out


def _prefill_point(spec: ModelSpec, row: dict, mm_gflop_s: float, attn_gflop_s: float,
                   rel, output_s: float) -> dict:
    attention = attention_flops(spec, row["n_prompt"])
    matmul = prefill_flops(spec, row["n_prompt"]) - attention
    attention_s = attention / (attn_gflop_s * 1e9)
    predicted_s = prefill_seconds(spec, row["n_prompt"], row["n_ubatch"], mm_gflop_s,
                                  attn_gflop_s, rel, output_s)
    return {"n_prompt": row["n_prompt"], "id": row["id"], "matmul_gflop": matmul / 1e9,
            "attention_gflop": attention / 1e9,
            "attention_flop_share": attention / (attention + matmul),
            "attention_time_share": attention_s / predicted_s,
            "predicted_s": predicted_s, "measured_s": row["seconds"],
            "measured_gflop_s": row["gflop_s"],
            "measured_over_predicted": row["seconds"] / predicted_s}


def machine_model(decode: list[dict], prefill: list[dict], models: dict, probes: list[dict],
                  ram_bytes: int | None = None) -> dict:
    """Everything estimate() needs, and what the report shows of the model."""
    fixed = fixed_costs(probes)
    ceil = ceilings(probes)
    return {"fixed": {str(t): v for t, v in fixed.items()},
            "ceilings": {str(t): v for t, v in ceil.items()},
            "decode": decode_model(decode, models, fixed, ceil),
            "prefill": prefill_model(prefill, models, ceil),
            "ram_bytes": ram_bytes,
            "models": {k: {f: getattr(m, f) for f in ("spec", "decode_weight_n_bytes",
                                                      "weights_n_bytes")}
                       for k, m in models.items()}}


def int_keys(node: dict) -> dict:
    """A stored model's thread-count keys back to ints (JSON keeps them as strings)."""
    return {int(k): v for k, v in (node or {}).items()}


def ggml_type(dtype: str) -> str:
    """The ggml type a file type's matrices mostly are (q4_k_m -> q4_k)."""
    return DTYPES[dtype].ggml_type.name.lower() if dtype in DTYPES else dtype


def kv_bytes(spec: ModelSpec, n_context: float) -> float:
    return kv_n_bytes_per_token(spec, KV_TYPE, KV_TYPE) * n_context


def log_ci(value: float, spread: float | None) -> list[float] | None:
    """value × / ÷ (1 + spread): a relative interval on the log scale."""
    if spread is None:
        return None
    return [value / (1 + spread), value * (1 + spread)]


def widen(low_high: list[float] | None, value: float) -> float | None:
    """The wider side of an interval relative to its value."""
    if not low_high or not value:
        return None
    return max(value / low_high[0] - 1, low_high[1] / value - 1)


def combine_spreads(*spreads: float | None) -> float | None:
    """Independent relative spreads combined on the log scale (root sum of squares)."""
    got = [math.log1p(s) for s in spreads if s is not None]
    return math.expm1(math.sqrt(sum(g * g for g in got))) if got else None
