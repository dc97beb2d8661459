"""Run a scenario: build each model, load it once, measure prefill and decode apart."""

from __future__ import annotations

import datetime as dt
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import groupby
from pathlib import Path

import numpy as np

from . import __version__, noise
from .build import build, estimated_n_bytes, file_sha256
from .costs import decode_weight_n_bytes, kv_n_bytes_per_token, weights_n_bytes
from .dtypes import DTYPES
from .env import available_ram_bytes
from .errors import HarnessError, MeasurementError
from .gguf_inspect import spec_from_gguf, tensor_table
from .results import SCHEMA_VERSION, RunWriter
from .scenario import Measurement, ModelRef, Scenario
from .specs import ModelSpec, resolve_spec
from .stats import is_unstable, rates, summarize

PERF_TOLERANCE = 0.05  # llama.cpp's counters may differ from the wall clock by 5% at most
FIRST_TOKEN = 259  # skip <unk>, <s>, </s> and the byte tokens: random "text" ids only


class NoisyMachine(HarnessError):
    """--strict: other processes were using the CPU, so the run stopped."""

    exit_code = 3


@dataclass
class Console:
    """What the runner tells the user; the CLI supplies the functions."""

    warn: Callable[[str], None] = lambda msg: print(f"warning: {msg}", file=sys.stderr)
    info: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)
    advance: Callable[[dict], None] = lambda record: None


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def model_key(ref: ModelRef) -> str:
    return f"{ref.label}|{ref.dtype}"


def pending(scenario: Scenario, done: set[str]) -> list[Measurement]:
    """What is left to measure, grouped by model (first appearance order) so each loads once."""
    todo = [m for m in scenario.measurements if m.id not in done]
    first = {}
    for i, m in enumerate(todo):
        first.setdefault(model_key(m.model), i)
    return sorted(todo, key=lambda m: first[model_key(m.model)])


ProbeFn = Callable[[list[int]], dict]


def run_scenario(scenario: Scenario, writer: RunWriter, env: dict, *, strict: bool = False,
                 cache_dir: Path | None = None, console: Console | None = None,
                 argv: list[str] | None = None, probe_fn: ProbeFn | None = None) -> dict:
    """Measure every pending measurement, appending each record the moment it exists; probe
    the ceilings before and after, and append the analysis."""
    console = console or Console()
    _write_header(scenario, writer, env, argv)
    todo = pending(scenario, writer.records.measured_ids)
    check_resources(todo, cache_dir)
    threads = sorted({1} | {m.settings.threads for m in scenario.measurements})
    if todo:
        _probe(writer, "before", threads, probe_fn, console)
    _measure_all(todo, writer, scenario, strict, cache_dir, console)
    if todo:
        _probe(writer, "after", threads, probe_fn, console)
    analysis = analyze_records(writer.records)
    writer.append(analysis)
    return analysis


def analyze_records(records) -> dict:
    """The analysis of whatever a results file holds (complete or not)."""
    from .analysis import analyze, prediction_table
    from .specs import all_specs

    try:
        table = prediction_table(all_specs())
    except HarnessError:
        table = {}
    return analyze(records.measurements, records.models, records.probes, table)


def _probe(writer: RunWriter, when: str, threads: list[int], probe_fn: ProbeFn | None,
           console: Console) -> None:
    """Measure the ceilings; a probe that fails is recorded as missing, never guessed."""
    from .probe import probe

    console.info(f"probing memory bandwidth and matmul peak ({when} the measurements)")
    record = {"type": "probe", "when": when, "at": now_iso(), "threads": threads}
    try:
        record["result"] = (probe_fn or probe)(threads)
    except (MemoryError, OSError, ValueError, RuntimeError) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        console.warn(f"the {when} probe failed ({record['error']}); ceilings will be missing")
    writer.append(record)


def _measure_all(todo: list[Measurement], writer: RunWriter, scenario: Scenario, strict: bool,
                 cache_dir: Path | None, console: Console) -> None:
    for key, group in groupby(todo, key=lambda m: model_key(m.model)):
        group = list(group)
        try:
            _run_model(group, writer, scenario, strict, cache_dir, console)
        except MeasurementError as exc:
            # One model failing (a load, a decode) must not cost the others their numbers.
            writer.append({"type": "failure", "model_key": key, "step": exc.step,
                           "error": exc.render(), "ids": [m.id for m in group],
                           "at": now_iso()})
            console.warn(f"{key}: {exc.render()}; going on with the next model")


def _write_header(scenario: Scenario, writer: RunWriter, env: dict, argv) -> None:
    header = writer.records.header
    if header is None:
        writer.append({
            "type": "header", "schema_version": SCHEMA_VERSION, "harness": __version__,
            "created": now_iso(), "argv": argv or sys.argv,
            "scenario": {"path": str(scenario.path), "name": scenario.name,
                         "title": scenario.title, "description": scenario.description,
                         "sha256": scenario.sha256, "text": scenario.text},
            "plan": [m.id for m in scenario.measurements], "env": env,
        })
        return
    if header["scenario"]["sha256"] != scenario.sha256:
        raise HarnessError("the scenario changed since this run started", source=str(writer.dir),
                           fix="resume with the same scenario file, or start a new run")
    writer.append({"type": "resume", "at": now_iso(), "argv": argv or sys.argv, "env": env})


def check_resources(todo: list[Measurement], cache_dir: Path | None) -> None:
    """Refuse before any work when a model cannot fit in RAM."""
    available = available_ram_bytes()
    for key, group in groupby(todo, key=lambda m: model_key(m.model)):
        group = list(group)
        need = memory_needed_bytes(group[0].model, max(m.n_ctx for m in group),
                                   max(m.settings.n_ubatch for m in group))
        if available is not None and need > available:
            raise HarnessError(f"{key} needs about {need / 2**30:.2f} GiB of RAM (weights, KV "
                               f"cache, compute buffers), {available / 2**30:.2f} GiB is available",
                               fix="use a smaller model, dtype or context")


def _spec_of(ref: ModelRef) -> ModelSpec:
    return spec_from_gguf(ref.gguf_path) if ref.gguf_path else resolve_spec(ref.ref)


def memory_needed_bytes(ref: ModelRef, n_ctx: int, n_ubatch: int) -> int:
    """Weights + F16 KV cache + an upper estimate of llama.cpp's compute buffers."""
    spec = _spec_of(ref)
    weights = ref.gguf_path.stat().st_size if ref.gguf_path else estimated_n_bytes(
        spec, DTYPES[ref.dtype])
    kv = kv_n_bytes_per_token(spec) * n_ctx
    # Activations of one ubatch: attention scores, FFN intermediates, the residual stream, and
    # one row of logits, in F32 (what llama.cpp's graph allocator reserves, within ~2x).
    per_token = (spec.num_attention_heads * n_ctx + 3 * spec.intermediate_size
                 + 4 * spec.hidden_size + spec.vocab_size)
    compute = 4 * min(n_ubatch, n_ctx) * per_token
    return int(weights + kv + compute)


def _run_model(group: list[Measurement], writer: RunWriter, scenario: Scenario, strict: bool,
               cache_dir: Path | None, console: Console) -> None:
    from .llama import Model

    ref = group[0].model
    path = _model_file(ref, scenario.seed, cache_dir, console)
    _noise_gate(f"before loading {ref.label}", strict, console)
    try:
        model = Model(path)
    except MeasurementError as exc:
        exc.step = "load"
        raise
    try:
        info = _model_record(writer, ref, path, model)
        for m in group:
            writer.append(measure(model, m, info, scenario.seed, strict, console))
            console.advance(writer.records.measurements[-1])
    finally:
        model.close()


def _model_file(ref: ModelRef, seed: int, cache_dir: Path | None, console: Console) -> Path:
    if ref.gguf_path:
        return ref.gguf_path
    spec = resolve_spec(ref.ref)
    start = time.perf_counter()
    built = build(spec, DTYPES[ref.dtype], seed, directory=cache_dir)
    if not built.cached:
        console.info(f"built {built.path.name} in {time.perf_counter() - start:.1f} s")
    return built.path


def _model_record(writer: RunWriter, ref: ModelRef, path: Path, model) -> dict:
    key = model_key(ref)
    if key in writer.records.models:
        return writer.records.models[key]
    info = model.info()
    table = tensor_table(path)
    spec = _spec_of(ref)
    types: dict[str, int] = {}
    for t in table:
        types[t.type_name] = types.get(t.type_name, 0) + t.n_bytes
    writer.append({
        "type": "model", "key": key, "model": ref.label, "dtype": ref.dtype, "path": str(path),
        "file_n_bytes": path.stat().st_size, "sha256": file_sha256(path),
        "n_params": info.n_params, "model_n_bytes": info.n_bytes, "description": info.description,
        "weights_n_bytes": weights_n_bytes(table),
        "decode_weight_n_bytes": decode_weight_n_bytes(table),
        "kv_n_bytes_per_token_f16": kv_n_bytes_per_token(spec),
        "tensor_type_n_bytes": types, "spec": spec.to_dict(),
    })
    return writer.records.models[key]


def _noise_gate(where: str, strict: bool, console: Console) -> float:
    cores = noise.idle_reading()
    if cores > noise.NOISY_CORES:
        message = f"other processes are using {cores:.2f} cores {where}; timings will be noisy"
        if strict:
            raise NoisyMachine(message, fix="stop them and rerun with --resume")
        console.warn(message)
    return cores


def measure(model, m: Measurement, info: dict, seed: int, strict: bool,
            console: Console) -> dict:
    """Warm up, then time every repetition of one measurement; return its record."""
    from .llama import ContextParams, check_abort, open_context

    s = m.settings
    params = ContextParams(n_ctx=max(m.n_ctx, 16), n_batch=s.n_batch, n_ubatch=s.n_ubatch,
                           n_threads=s.threads, flash_attn=s.flash_attn)
    idle = _noise_gate(f"before {m.id}", strict, console)
    started = now_iso()
    with open_context(model, params) as ctx:
        rng = np.random.default_rng([seed, m.n_prompt, m.n_gen])
        prompt = rng.integers(FIRST_TOKEN, ctx.n_vocab, m.n_prompt).tolist()
        gen = rng.integers(FIRST_TOKEN, ctx.n_vocab, m.n_gen).tolist()

        def repetition() -> dict:
            ctx.clear()  # no KV reuse between repetitions: every prefill starts from empty
            prefill_s = ctx.prefill(prompt) if prompt else None
            decode_s = ctx.decode(gen) if gen else []
            return {"prefill_s": prefill_s, "decode_s": decode_s, "perf": asdict(ctx.perf())}

        try:
            warmups = [repetition() for _ in range(s.warmup)]
            before = noise.snapshot()
            reps = []
            for _ in range(s.repetitions):
                check_abort()
                reps.append(repetition())
            during = noise.other_cores(before, noise.snapshot())
        except MeasurementError as exc:
            exc.step = f"measure {m.id}"
            raise
    return _record(m, info, warmups, reps, {"idle_other_cores": idle,
                                            "during_other_cores": during}, started)


def _record(m: Measurement, info: dict, warmups: list[dict], reps: list[dict], noise_reading,
            started: str) -> dict:
    s = m.settings
    prefill = [r["prefill_s"] for r in reps if r["prefill_s"] is not None]
    decode_totals = [sum(r["decode_s"]) for r in reps if r["decode_s"]]
    record = {
        "type": "measurement", "id": m.id, "test": m.test_name, "model": m.model.label,
        "model_key": model_key(m.model), "dtype": m.model.dtype, "threads": s.threads,
        "n_batch": s.n_batch, "n_ubatch": s.n_ubatch, "flash_attn": s.flash_attn,
        "n_prompt": m.n_prompt, "n_gen": m.n_gen, "repetitions": s.repetitions,
        "warmup": s.warmup, "n_params": info["n_params"], "model_bytes": info["model_n_bytes"],
        "samples": {"prefill_s": prefill, "decode_s": [r["decode_s"] for r in reps],
                    "perf": [r["perf"] for r in reps]},
        "warmup_samples": {"prefill_s": [r["prefill_s"] for r in warmups],
                           "decode_s": [r["decode_s"] for r in warmups]},
        "ttft_s": summarize(prefill) if prefill else None,
        "prefill_tok_s": summarize(rates(m.n_prompt, prefill)) if prefill else None,
        "decode_tok_s": summarize(rates(m.n_gen, decode_totals)) if decode_totals else None,
        "decode_ms_per_token": (summarize([1000 * t / m.n_gen for t in decode_totals])
                                if decode_totals else None),
        "noise": noise_reading, "started": started, "finished": now_iso(),
    }
    record["flags"] = flags(record)
    return record


def flags(record: dict) -> list[str]:
    """Why a measurement should be read with care: unstable, noisy, counters disagree."""
    out = []
    for phase in ("prefill", "decode"):
        summary = record[f"{phase}_tok_s"]
        if summary and is_unstable(summary):
            out.append(f"unstable-{phase}")
    reading = record["noise"]
    during = reading["during_other_cores"]
    if reading["idle_other_cores"] > noise.NOISY_CORES or (during or 0) > noise.NOISY_CORES:
        out.append("noisy")
    if _perf_disagrees(record):
        out.append("perf-mismatch")
    return out


def _perf_disagrees(record: dict) -> bool:
    samples = record["samples"]
    for i, perf in enumerate(samples["perf"]):
        prefill_off = (samples["prefill_s"] and perf["n_p_eval"]
                       and _off(perf["t_p_eval_ms"] / 1000, samples["prefill_s"][i]))
        decode_off = (samples["decode_s"][i] and perf["n_eval"]
                      and _off(perf["t_eval_ms"] / 1000, sum(samples["decode_s"][i])))
        if prefill_off or decode_off:
            return True
    return False


def _off(counter_s: float, wall_s: float) -> bool:
    return wall_s > 0 and abs(counter_s - wall_s) / wall_s > PERF_TOLERANCE
