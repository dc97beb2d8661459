"""The typed result a course page is rendered from: every figure the lesson template can print,
named, with its interval, computed from one run's analysis. Pure (analysis -> CoursePage); the
words are in templates/lesson.md.j2."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..analysis.machine import regime_sentences
from ..core.costs import kv_n_bytes_per_token, kv_type_bytes_per_element
from ..core.reference import published_decode_tok_s, published_prefill
from ..core.specs import ModelSpec
from ..core.stats import center
from ..study.claims import beyond_measured, check_claims, first_token_steps, workload_rows
from .findings import main_model, rows_of
from .templating import GIB, Figure, Provenance, provenance


@dataclass(frozen=True)
class TwoPhases:
    model: str
    dtype: str
    threads: int
    n_prompt: int
    prefill_tok_s: Figure
    decode_tok_s: Figure
    prompt_tokens_per_step: float
    prefill_compute_share: float | None
    prefill_stream_share: float | None
    decode_compute_share: float | None
    decode_stream_share: float | None
    n_ubatch: int
    prefill_compute_ci: Figure | None
    decode_stream_ci: Figure | None


@dataclass(frozen=True)
class PrefillRow:
    n_prompt: int
    seconds: float
    tok_s: Figure
    ms_per_token: Figure
    published_s: float | None
    published_tok_s: float | None
    gflop_s: float | None
    published_gflop_s: float | None  # the published tok/s × this prompt's FLOPs per token


@dataclass(frozen=True)
class Reference:
    """Where the published figures come from."""

    source: str
    hardware: str
    cores: int | None
    memory_gb_s: float | None


@dataclass(frozen=True)
class DecodeRow:
    model: str
    size_gib: float
    n_bytes_per_token: float
    tok_s: Figure
    ms_per_token: Figure
    effective_gb_s: float
    share_of_ceiling: Figure | None
    published_tok_s: float | None
    published_gb_s: float | None


@dataclass(frozen=True)
class Yardstick:
    """One bandwidth for decode: what this machine reads (ggml's matrix-vector kernel), and the
    course's copy figure related to it once."""

    gb_s: float
    dtype: str
    threads: int
    one_thread_gb_s: float | None  # the same kernel on one thread (the full probes' median)
    copy_gb_s: float | None
    copy_low_gb_s: float | None
    copy_high_gb_s: float | None
    read_over_copy: float | None
    course_copy_gb_s: float | None
    course_reads_as_gb_s: float | None
    course_effective_low: float | None
    course_effective_high: float | None


@dataclass(frozen=True)
class DecodeModel:
    """Seconds per step = fixed + bytes ÷ gb_s, one line for the page, its plot and text."""

    dtype: str
    gb_s: Figure
    fixed_ms: float
    fixed_ms_low: float
    fixed_ms_high: float
    share_of_ceiling: float | None
    worst_residual: float
    n_models: int


@dataclass(frozen=True)
class Quant:
    dtype: str
    bits_per_weight: float
    bytes_ratio: float
    decode: Figure | None
    prefill: Figure | None
    ceiling_gb_s: float | None
    f32_ceiling_gb_s: float | None
    predicted_decode: float | None
    weights_gb_s: float | None
    composition: tuple[tuple[str, float], ...]  # (tensor type, its share of the parameters)
    fixed_share: float | None  # the step's fixed cost as a share of a quantized step
    f32_fixed_share: float | None
    share_of_ceiling: float | None  # of its own streaming ceiling, the run's decode model
    f32_share_of_ceiling: float | None
    compute_gflop_s: float | None  # the type's matrix-matrix kernel, probed in the run
    f32_compute_gflop_s: float | None


@dataclass(frozen=True)
class Batching:
    parallel: int
    aggregate: Figure
    per_sequence: Figure
    per_sequence_tok_s: float
    single_tok_s: float  # one sequence alone, the cell the ratios pair with
    bound_tok_s: float | None  # the roofline bound at `parallel` from the measured ceilings
    share_of_bound: float | None
    ridge_parallel: float | None  # where arithmetic would start to bind


@dataclass(frozen=True)
class LongPrompt:
    n_prompt: int
    seconds: float
    tok_s: float
    short_n_prompt: int
    short_tok_s: float
    rate_ratio: Figure | None
    decode_steps: Figure | None
    attention_flop_share: float | None
    predicted_rate_ratio: float | None  # the run's prefill model: matrices plus attention
    measured_over_predicted: float | None


@dataclass(frozen=True)
class KvCache:
    """Bytes the cache stores per token, from the model's shape (a formula, not a reading)."""

    model: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    bytes_per_element: int
    n_bytes_per_token: int
    at_tokens: int
    weights_n_bytes: int


@dataclass(frozen=True)
class Hardware:
    """One estimate of a larger model, here and on a catalogued machine (modelled)."""

    model: str
    dtype: str
    n_bytes_per_token: float
    here_tok_s: float
    elsewhere: str
    elsewhere_gb_s: float
    elsewhere_tok_s: float


@dataclass(frozen=True)
class Workload:
    name: str
    n_prompt: int
    n_gen: int
    prefill_s: float
    decode_s: float
    prefill_share: Figure
    modelled: bool
    side: str
    beyond: float | None  # the prompt ÷ the longest measured, where past BEYOND: not tested


@dataclass(frozen=True)
class Claim:
    claim: str
    published: str
    measured: str
    verdict: str
    why: str
    modelled: bool  # the verdict rests on modelled figures
    scope: str  # "" or which parts the verdict covers ("3 of 4 workloads")


@dataclass(frozen=True)
class Untested:
    claim: str
    needs: str


@dataclass(frozen=True)
class Pitfalls:
    n_rounds: int
    drift_low: float
    drift_high: float
    regimes: tuple[str, ...]
    stepped: bool
    unpaired: tuple[str, ...]
    warmup_reps: int
    n_cells: int
    n_at_budget: int  # cells the time budget stopped before their target
    target: float | None  # the relative half-width the cells aimed at


@dataclass(frozen=True)
class Plot:
    file: str
    title: str


@dataclass(frozen=True)
class CoursePage:
    """Everything the lesson template can print; a part is None where the run lacks it."""

    title: str
    intro: str
    provenance: Provenance
    reference: Reference | None
    phases: TwoPhases | None
    prefill: tuple[PrefillRow, ...]
    decode: tuple[DecodeRow, ...]
    yardstick: Yardstick | None
    decode_model: DecodeModel | None
    quant: Quant | None
    batching: Batching | None
    long_prompt: LongPrompt | None
    kv: KvCache | None
    hardware: Hardware | None
    workloads: tuple[Workload, ...]
    claims: tuple[Claim, ...]
    untested: tuple[Untested, ...]
    pitfalls: Pitfalls | None
    plots: dict
    failures: tuple[str, ...]
    full_report: str | None


# --- building the page's result from a run's analysis ----------------------------------------

def course_page(records, analysis: dict, reference: dict | None, plots: dict | None = None,
                full_report: str | None = None) -> CoursePage:
    """The typed result of one run for the lesson template (plots: name -> Plot)."""
    header = records.header
    scenario, env = header.scenario or {}, header.env or {}
    main = main_model(analysis)
    figures = (reference or {}).get("figures") or []
    claims = check_claims(reference, analysis, env) if reference else []
    return CoursePage(
        title=scenario.get("title") or scenario.get("name") or "Run",
        intro=(scenario.get("description") or "").strip(),
        provenance=provenance(header, env, scenario),
        reference=Reference(reference["source"], reference["hardware"],
                            reference.get("cores"), reference.get("memory_gb_s"))
        if reference else None,
        phases=_phases(analysis, main), prefill=_prefill_rows(analysis, main, figures),
        decode=_decode_rows(analysis, figures), yardstick=_yardstick(analysis, reference),
        decode_model=_decode_model(analysis), quant=_quant(analysis),
        batching=_batching(analysis), long_prompt=_long_prompt(analysis, main),
        kv=_kv(analysis, main), hardware=_hardware(analysis),
        workloads=_workloads(analysis, reference),
        claims=tuple(Claim(c["claim"], c["published"], c["measured"], c["verdict"],
                           c["why"], bool(c.get("modelled")), c.get("scope", ""))
                     for c in claims if c["verdict"] != "not tested"),
        untested=tuple(Untested(c["claim"], c["why"]) for c in claims
                       if c["verdict"] == "not tested"),
        pitfalls=_pitfalls(analysis, records.measurements), plots=dict(plots or {}),
        failures=tuple(f"{f.model_key} at {f.step}: {f.error}" for f in records.failures),
        full_report=full_report)


def _phases(a: dict, main: tuple | None) -> TwoPhases | None:
    if not main:
        return None
    pre = sorted((r for r in rows_of(a["prefill"], main) if r["n_gen"] == 0),
                 key=lambda r: r["n_prompt"])
    dec = rows_of(a["decode"], main)
    if not pre or not dec:
        return None
    use = {u["phase"]: u for u in a.get("phase_use") or []
           if (u["model"], u["dtype"], u["threads"]) == main}
    p, d = use.get("prefill", {}), use.get("decode", {})
    return TwoPhases(main[0], main[1], main[2], pre[0]["n_prompt"], Figure.of(pre[0]["tok_s"]),
                     Figure.of(dec[0]["tok_s"]),
                     center(pre[0]["tok_s"]) / center(dec[0]["tok_s"]),
                     p.get("compute_share"), p.get("stream_share"), d.get("compute_share"),
                     d.get("stream_share"), pre[0].get("n_ubatch") or 512,
                     Figure.of(p.get("compute_share_ci")), Figure.of(d.get("stream_share_ci")))


def _prefill_rows(a: dict, main: tuple | None, figures: list[dict]) -> tuple[PrefillRow, ...]:
    if not main:
        return ()
    published = {f["prompt"]: f for f in figures if f.get("prompt") and f["model"] == main[0]
                 and f["dtype"] == main[1]}
    out = []
    for r in sorted((r for r in rows_of(a["prefill"], main) if r["n_gen"] == 0),
                    key=lambda r: r["n_prompt"]):
        f = published.get(r["n_prompt"])
        pub_tok_s, pub_s = (f and published_prefill(f)) or (None, None)
        tok_s = Figure.of(r["tok_s"])
        flop_per_token = r["flops"] / r["n_prompt"] if r.get("flops") else None
        out.append(PrefillRow(r["n_prompt"], r["seconds"], tok_s, tok_s.inverse(1000), pub_s,
                              pub_tok_s, r.get("gflop_s"),
                              pub_tok_s * flop_per_token / 1e9
                              if pub_tok_s and flop_per_token else None))
    return tuple(out)


def _size_ids(a: dict) -> set[str]:
    fit = max(a["fits"], key=lambda f: f["threads"], default=None)
    return set((fit or {}).get("ids") or [])


def _decode_rows(a: dict, figures: list[dict]) -> tuple[DecodeRow, ...]:
    ids = _size_ids(a)
    published = {f["model"]: f for f in figures if f["dtype"] == "f32"
                 and published_decode_tok_s(f)}
    out = []
    for r in sorted((r for r in a["decode"] if r["id"] in ids),
                    key=lambda r: r["bytes_per_token"]):
        f = published.get(r["model"], {})
        pub = published_decode_tok_s(f)
        share = Figure.of(r.get("share_of_stream_ci")) or (
            Figure(r["share_of_stream"]) if r.get("share_of_stream") else None)
        tok_s = Figure.of(r["tok_s"])
        out.append(DecodeRow(r["model"], r["file_bytes_per_token"] / GIB, r["bytes_per_token"],
                             tok_s, tok_s.inverse(1000), r["effective_gb_s"], share, pub,
                             f.get("effective_gb_s")))
    return tuple(out)


def _fit_model(a: dict) -> dict | None:
    """The decode model of the weight type the size rows share (the one the page plots)."""
    ids = _size_ids(a)
    return next((d for d in a["machine_model"]["decode"] if d.get("gb_s")
                 and ids & set(d.get("ids") or [])), None)


def _yardstick(a: dict, reference: dict | None) -> Yardstick | None:
    d = _fit_model(a)
    if not d or not d.get("stream_ceiling_gb_s"):
        return None
    rows = [r for r in a["decode"] if r["id"] in set(d["ids"])]
    probe = next((r["copy_ceiling"] for r in rows if r["copy_ceiling"]["value"]), {})
    copy = probe.get("value")
    ratio = d["stream_ceiling_gb_s"] / copy if copy else None
    ends = [v for v in (probe.get("before"), probe.get("after")) if v]
    course = (reference or {}).get("memory_gb_s")
    effective = [f["effective_gb_s"] for f in (reference or {}).get("figures") or []
                 if f.get("effective_gb_s")]
    one = (((a["machine_model"]["ceilings"].get("1") or {}).get("stream") or {})
           .get(d["dtype"]) or {}).get("value") if d["threads"] != 1 else None
    return Yardstick(d["stream_ceiling_gb_s"], d["dtype"], d["threads"], one, copy,
                     min(ends, default=None),
                     max(ends, default=None), ratio, course,
                     course * ratio if course and ratio else None,
                     min(effective, default=None), max(effective, default=None))


def _decode_model(a: dict) -> DecodeModel | None:
    d = _fit_model(a)
    if not d:
        return None
    fixed = [s * 1e3 for s in d["fixed_s"].values()]
    worst = max(abs(r["measured_over_model"] - 1) for r in d["residuals"])
    return DecodeModel(d["dtype"], Figure.of(d["gb_s"]), statistics.median(fixed), min(fixed),
                       max(fixed), d.get("share_of_stream"), worst, len(d["models"]))


def _quant(a: dict) -> Quant | None:
    q = next((r for r in a["quant"] if r["baseline"] == "f32" and r["dtype"] != "f32"
              and r["decode_speedup"]), None)
    if not q:
        return None
    ceilings = {d["dtype"]: d.get("stream_ceiling_gb_s") for d in a["machine_model"]["decode"]
                if d["threads"] == q["threads"]}
    own, f32 = ceilings.get(q["dtype"]), ceilings.get("f32")
    predicted = q["byte_reduction"] * own / f32 if own and f32 else None
    row = next((r for r in a["decode"] if (r["model"], r["dtype"], r["threads"])
                == (q["model"], q["dtype"], q["threads"])), None)
    models = {d["dtype"]: d for d in a["machine_model"]["decode"] if d["threads"] == q["threads"]}
    base = next((r for r in a["quant"] if (r["model"], r["dtype"], r["threads"])
                 == (q["model"], "f32", q["threads"])), None)
    compute = (a["machine_model"]["ceilings"].get(str(q["threads"])) or {}).get("compute") or {}

    def fixed_share(d: dict | None, tok_s: dict | None) -> float | None:
        fixed = (d or {}).get("fixed_s", {}).get(q["model"])
        return fixed * center(tok_s) if fixed and tok_s else None

    return Quant(q["dtype"], q["bits_per_weight"], q["byte_reduction"],
                 Figure.of(q.get("decode_speedup_ci")), Figure.of(q.get("prefill_speedup_ci")),
                 own, f32, predicted, row["effective_gb_s"] if row else None,
                 tuple(sorted(q["params_share"].items(), key=lambda kv: -kv[1])),
                 fixed_share(models.get(q["dtype"]), q.get("decode_tok_s")),
                 fixed_share(models.get("f32"), (base or {}).get("decode_tok_s")),
                 models.get(q["dtype"], {}).get("share_of_stream"),
                 models.get("f32", {}).get("share_of_stream"),
                 (compute.get(q["dtype"]) or {}).get("value"),
                 (compute.get("f32") or {}).get("value"))


def _batching(a: dict) -> Batching | None:
    row = max((r for r in a["batching"] if r["parallel"] > 1 and r.get("speedup_ci")),
              key=lambda r: r["parallel"], default=None)
    if not row:
        return None
    gain = Figure.of(row["speedup_ci"])
    each = Figure.of(row.get("per_user_ci")) or Figure(gain.value / row["parallel"])
    solo = next((r for r in a["batching"] if r["parallel"] == 1 and (
        r["model"], r["dtype"], r["threads"]) == (row["model"], row["dtype"], row["threads"])),
        None)
    return Batching(row["parallel"], gain, each, center(row["per_sequence_tok_s"]),
                    center(solo["tok_s"]) if solo else center(row["per_sequence_tok_s"]),
                    row.get("bound_tok_s"), row.get("share_of_bound"), row.get("ridge_parallel"))


def _long_prompt(a: dict, main: tuple | None) -> LongPrompt | None:
    pre = [r for r in rows_of(a["prefill"], main) if r["n_gen"] == 0] if main else []
    dec = rows_of(a["decode"], main) if main else []
    if len({r["n_prompt"] for r in pre}) < 2 or not dec:
        return None
    short = min(pre, key=lambda r: r["n_prompt"])
    long = max(pre, key=lambda r: r["n_prompt"])
    c = next((c for c in a["prompt_lengths"] if c["numerator"] == long["id"]
              and c["denominator"] == short["id"]), None)
    steps = first_token_steps(dec[0], long)
    points = {pt["id"]: pt for p in a["machine_model"]["prefill"] for pt in p["points"]}
    lp, sp = points.get(long["id"]), points.get(short["id"])
    predicted = (sp["predicted_s"] / sp["n_prompt"]) / (lp["predicted_s"] / lp["n_prompt"]) \
        if lp and sp else None
    return LongPrompt(long["n_prompt"], long["seconds"], center(long["tok_s"]),
                      short["n_prompt"], center(short["tok_s"]), Figure.of(c),
                      Figure.of(steps), lp["attention_flop_share"] if lp else None, predicted,
                      lp["measured_over_predicted"] if lp else None)


def _kv(a: dict, main: tuple | None) -> KvCache | None:
    """The cache per token of the main model at F16, llama.cpp's default cache type."""
    entry = (a["machine_model"].get("models") or {}).get(f"{main[0]}|{main[1]}") if main else None
    if not entry:
        return None
    spec = ModelSpec(**entry["spec"])
    longest = max((r["n_prompt"] for r in a["prefill"]), default=0)
    return KvCache(main[0], spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim,
                   int(kv_type_bytes_per_element("f16")), int(kv_n_bytes_per_token(spec)),
                   longest, entry["weights_n_bytes"])


def _hardware(a: dict) -> Hardware | None:
    """The largest model the run estimates both here and on a catalogued machine."""
    p = a["predictions"]
    for r in sorted(p.get("rows") or [], key=lambda r: -r["decode_weight_n_bytes"]):
        if r.get("moe") or not r.get("decode_tok_s"):
            continue
        for key, e in r["elsewhere"].items():
            if e["tok_s"] and not e.get("floored"):
                hw = p["hardware"][key]
                return Hardware(r["model"], r["dtype"], r["decode_weight_n_bytes"],
                                r["decode_tok_s"], hw["name"].split(" (")[0],
                                hw["bandwidth_gb_s"],
                                e["tok_s"])
    return None


def _workloads(a: dict, reference: dict | None) -> tuple[Workload, ...]:
    """The workloads the balance claim names, on the configuration it judged."""
    claim = next((c for c in (reference or {}).get("claims") or []
                  if c["test"] == "workload_balance"), None)
    if not claim:
        return ()
    sides = {n.strip(): side for side in ("prefill", "decode")
             for n in claim[f"{side}_bound"].split(";") if n.strip()}
    return tuple(Workload(r["workload"], r["n_prompt"], r["n_gen"], r["prefill_s"],
                          r["decode_s"], Figure(r["prefill_share"],
                                                *(r.get("prefill_share_ci") or (None, None))),
                          bool(r.get("modelled")), sides[r["workload"].lower()],
                          beyond_measured(a, r))
                 for r in workload_rows(a) if r["workload"].lower() in sides)


def _pitfalls(a: dict, measurements) -> Pitfalls | None:
    d = a.get("machine_drift")
    if not d:
        return None
    unpaired = tuple(c["name"] for f in a.get("fits") or [] for c in
                     f.get("size_contrasts") or [] if not c.get("paired"))
    stopped = [m for m in measurements if m.stopped_by]
    return Pitfalls(d["n_rounds"], d["low"], d["high"], tuple(regime_sentences(a["decode"])),
                    any(r.get("interleave") == "step" for r in a["decode"]), unpaired,
                    max((m.warmup for m in measurements), default=0), len(measurements),
                    sum(m.stopped_by == "budget" for m in stopped),
                    max((m.policy.get("target_ci") or 0 for m in stopped
                         if isinstance(m.policy, dict)), default=None) or None)


PAGE_PLOTS = ("prefill_vs_prompt", "decode_vs_bytes", "quant_speedup", "batching")


def page_plots(records, analysis: dict, files: list[str]) -> dict:
    """The page's plots (at most four) that were drawn, each titled with its finding, the same
    words as the drawing's own title."""
    from ..levers.batching import batching_finding
    from ..levers.quant import quant_finding
    from .plots import decode_finding, prefill_finding

    titles = {"prefill_vs_prompt": lambda: prefill_finding(records.measurements),
              "decode_vs_bytes": lambda: decode_finding(analysis),
              "quant_speedup": lambda: quant_finding(
                  [r for r in analysis["quant"] if r["dtype"] != r["baseline"]]),
              "batching": lambda: batching_finding(analysis["batching"])}
    drawn = {f.rsplit(".", 1)[0]: f for f in files}
    return {name: Plot(drawn[name], titles[name]()) for name in PAGE_PLOTS if name in drawn}
