"""Run a scenario: build each model, load it once, measure prefill and decode apart."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

from . import __version__, noise
from .build import (
    build,
    check_build_space,
    estimated_n_bytes,
    file_sha256,
    missing_build_n_bytes,
)
from .costs import (
    decode_n_bytes_by_type,
    decode_weight_n_bytes,
    kv_n_bytes_per_token,
    matmul_n_params_by_type,
    weights_n_bytes,
)
from .dtypes import DTYPES
from .env import available_ram_bytes
from .errors import HarnessError, MeasurementError
from .gguf_inspect import spec_from_gguf, tensor_table
from .measure import measure, now_iso
from .results import SCHEMA_VERSION, RunWriter
from .scenario import Measurement, ModelRef, Scenario
from .specs import ModelSpec, resolve_spec


class NoisyMachine(HarnessError):
    """--strict: other processes were using the CPU, so the run stopped."""

    exit_code = 3


@dataclass
class Console:
    """What the runner tells the user; the CLI supplies the functions."""

    warn: Callable[[str], None] = lambda msg: print(f"warning: {msg}", file=sys.stderr)
    info: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)
    advance: Callable[[dict], None] = lambda record: None


def pending(scenario: Scenario, done: set[str]) -> list[Measurement]:
    """What is left to measure, grouped by model (first appearance order) so each loads once."""
    todo = [m for m in scenario.measurements if m.id not in done]
    first = {}
    for i, m in enumerate(todo):
        first.setdefault(m.model.key, i)
    return sorted(todo, key=lambda m: first[m.model.key])


ProberFactory = Callable[[list[str]], object]


def run_scenario(scenario: Scenario, writer: RunWriter, env: dict, *, strict: bool = False,
                 cache_dir: Path | None = None, console: Console | None = None,
                 argv: list[str] | None = None,
                 prober_factory: ProberFactory | None = None) -> dict:
    """Measure every pending measurement, appending each record the moment it exists; probe
    every ceiling before and after, the ones each measurement needs right beside it, and
    append the analysis."""
    console = console or Console()
    _write_header(scenario, writer, env, argv)
    todo = pending(scenario, writer.records.measured_ids)
    preflight(scenario, todo, cache_dir)
    if todo:
        files = _build_all(todo, writer, scenario.seed, cache_dir, console)
        todo = [m for m in todo if m.model.key in files]
        threads = sorted({1} | {m.settings.threads for m in scenario.measurements})
        dtypes = sorted({t for types in files.values() for t in types[1]})
        with _RunProber(writer, console, prober_factory, dtypes) as prober:
            prober.full("before", threads)
            _measure_all(todo, writer, scenario, strict, files, prober, console)
            prober.full("after", threads)
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


class _RunProber:
    """The run's probes, each appended as a record; a probe that fails is recorded as missing,
    never guessed, and the run goes on."""

    def __init__(self, writer: RunWriter, console: Console, factory: ProberFactory | None,
                 dtypes: list[str]) -> None:
        self.writer, self.console, self.error = writer, console, None
        try:
            if factory is None:
                from .probe import Prober as factory
            self.prober = factory(dtypes)
        except (MemoryError, OSError, ValueError, RuntimeError, HarnessError) as exc:
            self.prober, self.error = None, f"{type(exc).__name__}: {exc}"

    def full(self, when: str, threads: list[int]) -> None:
        self.console.info(f"probing memory bandwidth and ggml's kernels ({when} the "
                          "measurements)")
        self._record({"when": when, "threads": threads}, lambda p: p.full(threads))

    def beside(self, m: Measurement, dtypes: list[str]) -> None:
        phases = tuple(p for p, on in (("stream", m.n_gen), ("compute", m.n_prompt
                                                            or m.shared_prefix)) if on)
        self._record({"when": "beside", "for": m.id, "threads": [m.settings.threads]},
                     lambda p: p.beside(m.settings.threads, dtypes, phases))

    def _record(self, record: dict, work) -> None:
        record = {"type": "probe", "at": now_iso()} | record
        try:
            if self.prober is None:
                raise RuntimeError(self.error)
            record["result"] = work(self.prober)
        except (MemoryError, OSError, ValueError, RuntimeError, HarnessError) as exc:
            record["error"] = self.error or f"{type(exc).__name__}: {exc}"
            if record["when"] != "beside":
                self.console.warn(f"the {record['when']} probe failed ({record['error']}); "
                                  "ceilings will be missing")
        self.writer.append(record)

    def __enter__(self) -> _RunProber:
        return self

    def __exit__(self, *exc) -> None:
        if self.prober is not None:
            self.prober.close()


def _build_all(todo: list[Measurement], writer: RunWriter, seed: int, cache_dir: Path | None,
               console: Console) -> dict[str, tuple[Path, list[str]]]:
    """Every model file the run needs, with its tensor types (the ceilings to probe); a model
    that cannot be built is recorded as a failure and left out."""
    files = {}
    for key, group in groupby(todo, key=lambda m: m.model.key):
        group = list(group)
        try:
            path = _model_file(group[0].model, seed, cache_dir, console)
        except MeasurementError as exc:
            exc.step = "build"
            _record_failure(writer, key, exc, group, console)
            continue
        files[key] = (path, sorted({t.type_name.lower() for t in tensor_table(path)}))
    return files


def _record_failure(writer: RunWriter, key: str, exc: MeasurementError,
                    group: list[Measurement], console: Console) -> None:
    # One model failing (a build, a load, a decode) must not cost the others their numbers.
    writer.append({"type": "failure", "model_key": key, "step": exc.step,
                   "error": exc.render(), "ids": [m.id for m in group], "at": now_iso()})
    console.warn(f"{key}: {exc.render()}; going on with the next model")


def _measure_all(todo: list[Measurement], writer: RunWriter, scenario: Scenario, strict: bool,
                 files: dict, prober: _RunProber, console: Console) -> None:
    for key, group in groupby(todo, key=lambda m: m.model.key):
        group = list(group)
        try:
            _run_model(group, writer, scenario, strict, files[key], prober, console)
        except MeasurementError as exc:
            _record_failure(writer, key, exc, group, console)


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


def preflight(scenario: Scenario, todo: list[Measurement], cache_dir: Path | None) -> None:
    """Everything that can be refused before any work: RAM, and disk for the builds."""
    check_resources(todo, cache_dir)
    check_build_space(_build_n_bytes(scenario, todo, cache_dir), cache_dir)


def _build_n_bytes(scenario: Scenario, todo: list[Measurement], cache_dir: Path | None) -> int:
    need, seen = 0, set()
    for m in todo:
        key = (m.model.spec_name, m.model.dtype)
        if m.model.gguf_path or key in seen:
            continue
        seen.add(key)
        need += missing_build_n_bytes(resolve_spec(m.model.ref), DTYPES[m.model.dtype],
                                      scenario.seed, cache_dir)
    return need


def plan_summary(scenario: Scenario, cache_dir: Path | None) -> dict:
    """What a run of the scenario would take: model files, peak RAM, bytes still to build."""
    todo = list(scenario.measurements)
    return {"n_models": len({m.model.key for m in todo}),
            "ram_gib": max(need for _, need in _memory_by_model(todo)) / 2**30,
            "build_gib": _build_n_bytes(scenario, todo, cache_dir) / 2**30}


def check_resources(todo: list[Measurement], cache_dir: Path | None) -> None:
    """Refuse before any work when a model cannot fit in RAM."""
    available = available_ram_bytes()
    for key, need in _memory_by_model(todo):
        if available is not None and need > available:
            raise HarnessError(f"{key} needs about {need / 2**30:.2f} GiB of RAM (weights, KV "
                               f"cache, compute buffers), {available / 2**30:.2f} GiB is available",
                               fix="use a smaller model, dtype or context")


def _memory_by_model(todo: list[Measurement]) -> list[tuple[str, int]]:
    """Each model's peak RAM over its measurements (its spec and file size looked up once)."""
    by_model: dict[str, list[Measurement]] = {}
    for m in todo:
        by_model.setdefault(m.model.key, []).append(m)
    out = []
    for key, group in by_model.items():
        ref = group[0].model
        spec = _spec_of(ref)
        weights = ref.gguf_path.stat().st_size if ref.gguf_path else estimated_n_bytes(
            spec, DTYPES[ref.dtype])
        out.append((key, max(weights + memory_needed_bytes(m, spec) for m in group)))
    return out


def _spec_of(ref: ModelRef) -> ModelSpec:
    return spec_from_gguf(ref.gguf_path) if ref.gguf_path else resolve_spec(ref.ref)


def memory_needed_bytes(m: Measurement, spec: ModelSpec) -> int:
    """KV cache + an upper estimate of llama.cpp's compute buffers (the weights come on top)."""
    n_ctx = m.n_ctx
    kv = kv_n_bytes_per_token(spec, m.kv_type, m.kv_type) * n_ctx
    # Activations of one ubatch: attention scores, FFN intermediates, the residual stream, and
    # one row of logits, in F32 (what llama.cpp's graph allocator reserves, within ~2x).
    per_token = (spec.num_attention_heads * n_ctx + 3 * spec.intermediate_size
                 + 4 * spec.hidden_size + spec.vocab_size)
    compute = 4 * min(m.settings.n_ubatch, n_ctx) * per_token
    return int(kv + compute)


def _run_model(group: list[Measurement], writer: RunWriter, scenario: Scenario, strict: bool,
               file: tuple[Path, list[str]], prober: _RunProber, console: Console) -> None:
    from .llama import Model

    ref = group[0].model
    path, dtypes = file
    _noise_gate(f"before loading {ref.label}", strict, console)
    try:
        model = Model(path)
    except MeasurementError as exc:
        exc.step = "load"
        raise
    try:
        info = _model_record(writer, ref, path, model)
        for m in group:
            prober.beside(m, dtypes)
            writer.append(measure(model, m, info, scenario.seed,
                                  lambda where: _noise_gate(where, strict, console)))
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
    key = ref.key
    if key in writer.records.models:
        return writer.records.models[key]
    info = model.info()
    table = tensor_table(path)
    spec = _spec_of(ref)
    types: dict[str, int] = {}
    type_params: dict[str, int] = {}
    for t in table:
        types[t.type_name] = types.get(t.type_name, 0) + t.n_bytes
        type_params[t.type_name] = type_params.get(t.type_name, 0) + t.n_elements
    writer.append({
        "type": "model", "key": key, "model": ref.label, "dtype": ref.dtype, "path": str(path),
        "file_n_bytes": path.stat().st_size, "sha256": file_sha256(path),
        "n_params": info.n_params, "model_n_bytes": info.n_bytes, "description": info.description,
        "weights_n_bytes": weights_n_bytes(table),
        "decode_weight_n_bytes": decode_weight_n_bytes(table),
        "decode_type_n_bytes": decode_n_bytes_by_type(table),
        "matmul_type_n_params": matmul_n_params_by_type(table),
        "kv_n_bytes_per_token_f16": kv_n_bytes_per_token(spec),
        "tensor_type_n_bytes": types, "tensor_type_n_params": type_params,
        "spec": spec.to_dict(),
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
