"""Run a scenario: build each model, load it once, measure prefill and decode apart."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import groupby
from pathlib import Path

from . import __version__
from .core.costs import kv_n_bytes_per_token, model_costs
from .core.dtypes import DTYPES, DType
from .core.errors import EXIT_BUSY, HarnessError, MeasurementError
from .core.memory import weight_types
from .core.records import Footprint as FootprintRecord
from .core.rounds import (
    contrast_pairs,
    group_by_memory,
    model_links,
    round_order,
    split_pairs,
    stop_reason,
    widest_ci,
)
from .core.specs import ModelSpec, resolve_spec
from .engine import noise
from .engine.build import (
    build,
    check_build_space,
    estimated_n_bytes,
    file_sha256,
    missing_build_n_bytes,
)
from .engine.env import available_ram_bytes, physical_cores
from .engine.measure import now_iso, round_series, window_series
from .engine.results import SCHEMA_VERSION, RunWriter
from .engine.scenario import Measurement, MemoryPlan, ModelRef, Scenario
from .study.analyze import analyze_records
from .weights.gguf_inspect import spec_from_gguf, tensor_table


class NoisyMachine(HarnessError):
    """--strict: other processes were using the CPU, so the run stopped."""

    exit_code = EXIT_BUSY


@dataclass
class Console:
    """What the runner tells the user; the CLI supplies the functions."""

    warn: Callable[[str], None] = lambda msg: print(f"warning: {msg}", file=sys.stderr)
    info: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)
    advance: Callable[[dict], None] = lambda record: None  # a cell finished: its record
    round: Callable[[dict], None] = lambda progress: None  # a round ended: how it stands


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
    every ceiling before and after, the ones each round needs before it; return the
    analysis of what the run holds."""
    console = console or Console()
    write_header(scenario, writer, env, argv)
    todo = pending(scenario, writer.records.measured_ids)
    preflight(scenario, todo, cache_dir)
    if todo:
        files = _build_all(todo, writer, scenario.seed, cache_dir, console)
        todo = [m for m in todo if m.model.key in files]
        threads = sorted({1} | {m.settings.threads for m in scenario.measurements})
        dtypes = sorted({t for types in files.values() for t in types[1]})
        extras = _probe_extras(todo, scenario.seed, cache_dir, console)
        with _RunProber(writer, console, prober_factory, dtypes, extras) as prober:
            prober.full("before", threads)
            for group in _groups(todo, writer, console):
                _Rounds(group, writer, scenario, strict, files, prober, console).run()
            prober.full("after", threads)
    if scenario.memory:
        measure_memory(scenario.memory, writer, scenario.seed, cache_dir, console)
    return analyze_records(writer.records)


class _RunProber:
    """The run's probes, each appended as a record; a probe that fails is recorded as missing,
    never guessed, and the run goes on."""

    def __init__(self, writer: RunWriter, console: Console, factory: ProberFactory | None,
                 dtypes: list[str], extras: dict | None = None) -> None:
        self.writer, self.console, self.error = writer, console, None
        try:
            if factory is None:
                from .engine.probe import Prober as factory
            self.prober = factory(dtypes, extras)
        except (MemoryError, OSError, ValueError, RuntimeError, HarnessError) as exc:
            self.prober, self.error = None, f"{type(exc).__name__}: {exc}"

    def full(self, when: str, threads: list[int]) -> None:
        self.console.info(f"probing memory bandwidth and ggml's kernels ({when} the "
                          "measurements)")
        self._record({"when": when, "threads": threads}, lambda p: p.full(threads))

    def beside(self, round_index: int, needs: dict[int, tuple[set, set]]) -> None:
        """Before a round: per thread count, the types and phases its cells need."""
        for threads, (dtypes, phases) in sorted(needs.items()):
            self._record({"when": "beside", "round": round_index, "threads": [threads]},
                         lambda p, t=threads, d=dtypes, ph=phases: p.beside(
                             t, sorted(d), tuple(x for x in ("stream", "compute") if x in ph)))

    def rotation(self, round_index: int, needs: dict[int, set[str]]) -> Callable[[], None]:
        """A probe "cell" in a round's rotation of decode steps: called after every tick, one
        streaming pass of each type the decoding cells read, per thread count; the samples
        land, tick by tick, in one record per thread count when the round ends (close)."""
        samples = {t: {d: [] for d in sorted(dtypes)} for t, dtypes in needs.items()}
        errors: list[str] = [self.error] if self.prober is None and self.error else []

        def tick() -> None:
            for threads, by_type in samples.items():
                if errors:
                    return  # a probe that failed once is recorded once, as missing
                try:
                    for dtype, gb_s in self.prober.tick(threads, list(by_type)).items():
                        by_type[dtype].append(gb_s)
                except (MemoryError, OSError, ValueError, RuntimeError, HarnessError) as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")

        def close() -> None:
            record = {"type": "probe", "when": "rotation", "round": round_index}
            if errors:
                self.writer.append(record | {"threads": sorted(samples), "error": errors[0],
                                             "at": now_iso()})
                return
            for threads, by_type in samples.items():
                if any(by_type.values()):
                    self.writer.append(record | {"threads": [threads], "at": now_iso(),
                                                 "result": _rotation_result(threads, by_type)})

        tick.close = close
        return tick

    def pages(self, path: Path, dtypes: list[str], decode_n_bytes: dict[str, int]):
        """The reader a decode repetition is bracketed by: the model's mapped pages, or an
        anonymous buffer when most of its bytes are repacked at load (None if it cannot)."""
        from .engine.probe import PageReader
        from .weights.gguf_inspect import tensor_data_span

        try:
            offset, n_bytes = tensor_data_span(path)
            repacked = sum(n for t, n in decode_n_bytes.items()
                           if self.prober is not None and self.prober.layout(t) == "CPU_REPACK")
            if repacked * 2 > sum(decode_n_bytes.values()):
                return PageReader(None, 0, n_bytes)
            return PageReader(path, offset, n_bytes)
        except (MemoryError, OSError, ValueError) as exc:
            self.console.warn(f"no page reads beside decode of {path.name} ({exc})")
            return None

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


def _rotation_result(threads: int, by_type: dict[str, list]) -> dict:
    """A rotation probe's result in the shape of the others': per type its passes in tick
    order (None where a pass failed), the best of them as the figure."""
    ggml = {d: {"stream_gb_s": max((x for x in xs if x), default=None),
                "stream_samples_gb_s": xs} for d, xs in by_type.items()}
    return {"passes": {"stream": 1}, "threads": {str(threads): {"ggml": ggml}}}


def _probe_extras(todo: list[Measurement], seed: int, cache_dir: Path | None,
                  console: Console) -> dict:
    """What the full probes need beyond the weight types: the attention shapes of the run's
    models, and per architecture the skeleton files that time a decode step's fixed cost."""
    from .engine.probe import SKELETON_LAYERS, skeleton_spec

    specs = {}
    for m in todo:
        try:
            specs.setdefault(m.model.key, _spec_of(m.model))
        except HarnessError:
            continue  # a file the run cannot read a spec from: no extras for it
    shapes = sorted({(s.head_dim, s.num_attention_heads, s.num_key_value_heads)
                     for s in specs.values()})
    skeletons: dict[str, dict[int, str]] = {}
    for spec in specs.values():
        if spec.architecture in skeletons:
            continue
        try:
            skeletons[spec.architecture] = {
                n: str(build(skeleton_spec(spec, n), DTYPES["f32"], seed,
                             directory=cache_dir).path) for n in SKELETON_LAYERS}
        except (HarnessError, OSError, ValueError) as exc:
            console.warn(f"no fixed-cost skeleton for {spec.architecture} ({exc})")
    return {"attention": [list(s) for s in shapes], "skeletons": skeletons}


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


def _groups(todo: list[Measurement], writer: RunWriter, console: Console
            ) -> list[list[Measurement]]:
    """The run's cells, in groups whose models and contexts fit in RAM together (one group
    when everything fits: every cell then interleaves with every other)."""
    needs = dict(_memory_by_model(todo, all_contexts=True))
    links = _links(todo)
    keys = group_by_memory(needs, available_ram_bytes(), links)
    if len(keys) > 1:
        split = split_pairs(keys, links)
        writer.append({"type": "grouping", "groups": keys, "at": now_iso(), "split": split,
                       "why": "the models and their contexts do not fit in RAM together"})
        console.info(f"interleaving in {len(keys)} groups (RAM): "
                     + "; ".join(", ".join(g) for g in keys))
        if split:
            console.warn("not compared side by side (no RAM for both at once): "
                         + "; ".join(" and ".join(p) for p in split))
    return [[m for m in todo if m.model.key in group] for group in keys]


def _links(todo: list[Measurement]) -> set[frozenset[str]]:
    """The model pairs the run's contrasts compare."""
    return model_links({m.id: m.pairing_key for m in todo}, {m.id: m.model.key for m in todo},
                       {m.id: {m.phase} for m in todo})


class _Budget:
    """The run's time budget: seconds spent in rounds (an interrupted run's included), never
    the time spent loading models."""

    def __init__(self, spent_s: float) -> None:
        self.spent_s, self.clock = spent_s, time.monotonic()

    def start(self) -> None:
        self.clock = time.monotonic()

    @contextlib.contextmanager
    def paused(self):
        clock = time.monotonic()
        try:
            yield
        finally:
            self.clock += time.monotonic() - clock

    def elapsed_s(self) -> float:
        return self.spent_s + time.monotonic() - self.clock


class _Group:
    """The models of one RAM group, loaded (their page readers and model records with them),
    and the cells' contexts kept alive on them."""

    def __init__(self, todo: list[Measurement], writer: RunWriter, scenario: Scenario,
                 strict: bool, files: dict, prober: _RunProber, console: Console) -> None:
        self.todo, self.writer, self.scenario, self.strict = todo, writer, scenario, strict
        self.files, self.prober, self.console = files, prober, console
        self.models, self.pages, self.cells, self.infos = {}, {}, {}, {}
        self.reload = any(m.model.in_twin_pair for m in todo)

    def cell(self, m: Measurement):
        """m's context on its loaded model, made (and warmed) on first use."""
        from .engine.measure import Cell

        if m.id not in self.cells:
            self.cells[m.id] = Cell(self.models[m.model.key], m, self.scenario.seed,
                                    self.pages.get(m.model.key))
        return self.cells[m.id]

    def drop(self, m: Measurement):
        """m's context taken out of the group (closed by the caller), or None."""
        return self.cells.pop(m.id, None)

    def take(self, m: Measurement):
        """m's context for its record (closed by the caller): the one its repetitions ran in,
        else, for a cell whose repetitions all landed before an interruption, one set up and
        warmed again now, so the record states its setup; None where its model is not loaded
        (a twin pair's group between rounds)."""
        if m.id not in self.cells and m.model.key in self.models:
            self.cell(m)
        return self.drop(m)

    def unload(self) -> None:
        for cell in self.cells.values():
            cell.close()
        self.cells.clear()
        for model in self.models.values():
            model.close()
        self.models.clear()

    def reload_for(self, round_index: int, active: list[Measurement]) -> list[Measurement]:
        """A group with a twin pair loads its models afresh before every round, each file's
        cached pages dropped and read back first, in an order that alternates round by round:
        where a file's pages sit, and which model was loaded first, moved decode by up to 11%
        between byte-identical files (docs/twins.md), so no model keeps the better place."""
        keys = list(dict.fromkeys(m.model.key for m in active))
        self.unload()
        self.load(keys if round_index % 2 == 0 else keys[::-1], round_index)
        return [m for m in active if m.model.key in self.models]

    def load(self, keys: list[str], round_index: int | None = None) -> list[Measurement]:
        from .engine.llama import Model
        from .engine.pagecache import huge_mapped_n_bytes, recache

        huge = {}
        for key in keys:
            path, dtypes = self.files[key]
            ref = next(m.model for m in self.todo if m.model.key == key)
            _noise_gate(f"before loading {ref.label}", self.strict, self.console)
            try:
                if self.reload:
                    recache(path)
                self.models[key] = Model(path, use_mmap=self.scenario.mmap)
            except (MeasurementError, OSError) as exc:
                exc = exc if isinstance(exc, MeasurementError) else MeasurementError(
                    f"cannot read the model file ({exc})", source=str(path))
                exc.step = "load"
                _record_failure(self.writer, key, exc, [m for m in self.todo
                                                        if m.model.key == key], self.console)
                continue
            huge[key] = huge_mapped_n_bytes(path)
            if key not in self.infos:
                threads = max(m.settings.threads for m in self.todo if m.model.key == key)
                self.infos[key] = _model_record(self.writer, ref, path, self.models[key],
                                                huge[key], threads)
                self.pages[key] = self.prober.pages(path, dtypes,
                                                    self.infos[key].decode_type_n_bytes)
        if self.reload:
            self.writer.append({"type": "load", "round": round_index, "order": keys,
                                "recached": True, "huge_mapped_n_bytes": huge,
                                "at": now_iso()})
        return [m for m in self.todo if m.model.key in self.models]


class _Contrasts:
    """What a cell is judged on: the contrasts with the auto cells of its group that differ
    from it in one setting, from the repetitions so far; a cell that failed leaves them."""

    def __init__(self, todo: list[Measurement], reps: dict, target: str) -> None:
        self.by_id, self.reps, self.target = {m.id: m for m in todo}, reps, target
        self.failed: set[str] = set()
        self.partners: dict[str, list[tuple[str, str]]] = {}
        for a, b, phase in contrast_pairs({m.id: m.pairing_key for m in todo},
                                          {m.id: {m.phase} for m in todo}):
            self.partners.setdefault(a, []).append((b, phase))
            self.partners.setdefault(b, []).append((a, phase))

    def of(self, m: Measurement) -> list[tuple[str, str]]:
        """The (cell, phase) contrasts m is judged on (a finished partner's rounds are
        complete)."""
        return [(o, ph) for o, ph in self.partners.get(m.id, [])
                if o not in self.failed and self.by_id[o].settings.policy.auto]

    def widest(self, m: Measurement) -> float | None:
        """The widest interval m is judged on (harness.core.rounds.widest_ci)."""
        def series(cell: str, phase: str | None) -> tuple[dict, dict]:
            m, reps = self.by_id[cell], self.reps[cell]
            return window_series(m, reps, phase), round_series(m, reps, phase)

        return widest_ci(m.id, self.of(m), series, self.target)


class _Rounds:
    """Interleaved rounds over one group of cells: every model loaded and every cell's context
    kept alive; each round runs one repetition of every cell still going, in a shuffled order;
    a cell leaves when its policy says so, and its measurement record is written then."""

    def __init__(self, todo: list[Measurement], writer: RunWriter, scenario: Scenario,
                 strict: bool, files: dict, prober: _RunProber, console: Console) -> None:
        self.todo, self.writer, self.scenario = todo, writer, scenario
        self.strict, self.prober, self.console = strict, prober, console
        self.group = _Group(todo, writer, scenario, strict, files, prober, console)
        self.reps = {m.id: [r for r in writer.records.repetitions if r.id == m.id]
                     for m in todo}
        self.contrasts = _Contrasts(todo, self.reps, scenario.target)
        self.budget = _Budget(max((r.elapsed_s for r in writer.records.repetitions),
                                  default=0.0))

    def run(self) -> None:
        group = self.group
        try:
            keys = list(dict.fromkeys(m.model.key for m in self.todo))
            active = list(self.todo) if group.reload else group.load(keys)
            self.budget.start()  # the budget counts rounds, not loading the models
            round_index, resumed = self._first_round(active)
            if resumed:  # cells whose repetitions were all done leave first
                active = self._finish(active, round_index - 1)
            while active:
                if group.reload:
                    with self.budget.paused():  # loading is not measuring
                        active = group.reload_for(round_index, active)
                self._round(round_index, active)
                active = self._finish(active, round_index)
                round_index += 1
        finally:
            group.unload()

    def _first_round(self, active: list[Measurement]) -> tuple[int, bool]:
        """Where this group's rounds begin, and whether it is resumed: a group with
        repetitions goes on at its last round if a cell still lacks its repetition there
        (else the one after); a new group numbers on after every round the run has had, so
        cells of two RAM groups never share a round number (and are never paired)."""
        rounds = [r.round for reps in self.reps.values() for r in reps]
        if not rounds:
            return 1 + max((r.round for r in self.writer.records.rounds), default=-1), False
        last = max(rounds)
        missing = any(all(r.round != last for r in self.reps[m.id]) for m in active)
        return (last if missing else last + 1), True

    def _round(self, round_index: int, active: list[Measurement]) -> None:
        order = round_order([m.id for m in active], self.scenario.seed, round_index)
        idle = _noise_gate(f"before round {round_index}", self.strict, self.console)
        self.prober.beside(round_index, self._needs(active))
        if all(r.round != round_index for r in self.writer.records.rounds):  # not resumed
            self.writer.append({"type": "round", "round": round_index, "order": order,
                                "idle_other_cores": idle, "at": now_iso()})
        by_id = {m.id: m for m in active}
        todo = [(position, by_id[cell_id]) for position, cell_id in enumerate(order)
                if all(r.round != round_index for r in self.reps[cell_id])]  # resume keeps
        step = self.scenario.interleave == "step"
        live = []
        for position, m in todo:  # prompts in, cell by cell, in the round's order
            steps = self._start(m, round_index, position, "step" if step else "round")
            while steps and self._advance(m, steps):
                if step:  # its decode waits for the others' prompts, then runs in turn
                    live.append((m, steps))
                    break
        needs = self._needs([m for m, _ in live])  # cells that decode: their types streamed
        tick = self.prober.rotation(round_index, {t: d for t, (d, _) in needs.items()})
        while live:  # one decode step of each cell in turn, then the probe's, again and again
            live = [(m, steps) for m, steps in live if self._advance(m, steps)]
            if live:
                tick()
        tick.close()

    def _start(self, m: Measurement, round_index: int, position: int, interleave: str):
        """m's repetition of this round, not yet begun (None when its context failed)."""
        try:
            return self.group.cell(m).steps(round_index, position, interleave)
        except MeasurementError as exc:
            self._failed(m, exc)
            return None

    def _advance(self, m: Measurement, steps) -> bool:
        """One piece of m's repetition (its prompt, or one decode step); False once it has
        ended, its repetition record written, or failed."""
        try:
            next(steps)
            return True
        except StopIteration as done:
            self._write_repetition(m, done.value)
        except MeasurementError as exc:
            self._failed(m, exc)
        return False

    def _failed(self, m: Measurement, exc: MeasurementError) -> None:
        # One cell failing (a decode error) must not cost the others their numbers.
        _record_failure(self.writer, m.model.key, exc, [m], self.console)
        self.contrasts.failed.add(m.id)
        cell = self.group.drop(m)
        if cell:
            cell.close()

    def _needs(self, active: list[Measurement]) -> dict[int, tuple[set, set]]:
        """Per thread count, the tensor types and phases the round's cells need probed."""
        needs: dict[int, tuple[set, set]] = {}
        for m in active:
            dtypes, phases = needs.setdefault(m.settings.threads, (set(), set()))
            dtypes.update(self.group.files[m.model.key][1])
            phases.update(p for p, on in (("stream", m.n_gen), ("compute", m.n_prompt
                                                                or m.shared_prefix)) if on)
        return needs

    def _write_repetition(self, m: Measurement, rep: dict) -> None:
        self.writer.append({"type": "repetition", "id": m.id, "round": rep["round"],
                            "position": rep["position"], "rep": rep,
                            "elapsed_s": self.budget.elapsed_s(), "at": now_iso()})
        self.reps[m.id].append(self.writer.records.repetitions[-1])

    def _finish(self, active: list[Measurement], round_index: int) -> list[Measurement]:
        """Cells whose policy (or the run's time budget) says stop leave the rounds: an auto
        cell once the contrasts it is part of (its own figure under `target: absolute`) are
        within target_ci, or at min_repetitions when it is in none; the cells of a contrast
        leave together."""
        elapsed = self.budget.elapsed_s()
        over = self.scenario.max_seconds is not None and elapsed >= self.scenario.max_seconds
        live = [m for m in active if m.id not in self.contrasts.failed]
        widths = {m.id: self.contrasts.widest(m) for m in live}
        still, widest = [], (0.0, None)
        for m in live:
            alone = self.scenario.target == "contrasts" and not self.contrasts.of(m)
            reason = stop_reason(len(self.reps[m.id]), widths[m.id], m.settings.policy, over,
                                 alone)
            if reason:
                self._write_measurement(m, reason, widths[m.id])
                continue
            still.append(m)
            if m.settings.policy.auto and not alone:
                ci = widths[m.id]
                widest = max(widest, (ci if ci is not None else float("inf"), m.id),
                             key=lambda w: w[0])
        self.console.round({"round": round_index, "active": len(still), "finished":
                            len(active) - len(still), "widest_ci": widest[0],
                            "widest_id": widest[1], "elapsed_s": elapsed,
                            "target": self.scenario.target})
        return still

    def _write_measurement(self, m: Measurement, reason: str, ci: float | None) -> None:
        from .engine.measure import make_record

        cell = self.group.take(m)
        reps = [r.rep for r in self.reps[m.id]]
        idle = [r.idle_other_cores for r in self.writer.records.rounds
                if r.round in {x.round for x in self.reps[m.id]}]
        during = [r.get("during_other_cores") for r in reps]
        reading = {"idle_other_cores": max((i for i in idle if i is not None), default=None),
                   "during_other_cores": max((d for d in during if d is not None), default=None)}
        run = {"stopped_by": reason, "policy": m.settings.policy.__dict__,
               "span_seq": [self.reps[m.id][0].seq, self.reps[m.id][-1].seq],
               "ci_reached": ci, "target": self.scenario.target,
               "partners": [list(p) for p in self.contrasts.partners.get(m.id, [])]}
        setup = cell.setup if cell else None  # missing: the model is not loaded now
        warmups = cell.warmups if cell else []
        started = cell.started if cell else self.reps[m.id][0].at
        self.writer.append(make_record(m, self.group.infos[m.model.key], warmups, reps, setup,
                                       reading, started, run))
        self.console.advance(self.writer.records.measurements[-1])
        if cell:
            cell.close()


def write_header(scenario: Scenario, writer: RunWriter, env: dict, argv) -> None:
    """The run's header, or on resume the check that scenario and machine are unchanged (once
    per writer: the CLI checks before it says anything, run_scenario again for a fleet node)."""
    writer.begin({
        "type": "header", "kind": "measurement", "schema_version": SCHEMA_VERSION,
        "harness": __version__, "created": now_iso(), "argv": argv or sys.argv,
        "scenario": {"path": str(scenario.path), "name": scenario.name,
                     "title": scenario.title, "description": scenario.description,
                     "sha256": scenario.sha256, "text": scenario.text,
                     "reference": scenario.reference,
                     **({"template": scenario.template} if scenario.template else {}),
                     **({"memory": asdict(scenario.memory)} if scenario.memory else {})},
        "plan": [m.id for m in scenario.measurements], "env": env,
    }, argv or sys.argv)


def measure_memory(plan: MemoryPlan, writer: RunWriter, seed: int, cache_dir: Path | None,
                   console: Console) -> None:
    """Each load of the scenario's `memory:` block in a fresh process (mmap off: the weights
    held once, in memory the process owns), one footprint record each; on resume, the loads
    not yet recorded."""
    from .engine.footprint import measure_in_fresh_process
    from .report.memory import Request, context_params

    done = {(f.model, f.dtype, f.kv_type, f.n_users)
            for f in writer.records.of_type(FootprintRecord)}
    for model, dtype, kv_type, users in plan.loads():
        if (model, dtype, kv_type, users) in done:
            continue
        spec = resolve_spec(model)
        path = _build(spec, DTYPES[dtype], seed, cache_dir, console)
        request = Request(spec, dtype, path, plan.context, users, kv_type, physical_cores(),
                          (False,), False)
        record = {"type": "footprint", "model": model, "dtype": dtype, "kv_type": kv_type,
                  "n_users": users, "context": plan.context, "path": str(path),
                  "file_n_bytes": path.stat().st_size,
                  "weights": [asdict(w) for w in weight_types(tensor_table(path))],
                  "ram_available_n_bytes": available_ram_bytes()}
        console.info(f"memory: {model} {dtype}, {users} × {plan.context:,} tokens of "
                     f"{kv_type} cache")
        try:
            footprint = measure_in_fresh_process(path, context_params(request, users), False,
                                                 False)
            record["footprint"] = asdict(footprint)
        except (HarnessError, RuntimeError, OSError) as exc:
            record["error"] = str(exc)
        writer.append(record | {"at": now_iso()})


def preflight(scenario: Scenario, todo: list[Measurement], cache_dir: Path | None) -> None:
    """Everything that can be refused before any work: RAM, and disk for the builds."""
    check_resources(todo, cache_dir)
    check_build_space(_build_n_bytes(scenario, todo, cache_dir), cache_dir)


def _build_n_bytes(scenario: Scenario, todo: list[Measurement], cache_dir: Path | None) -> int:
    need, seen = 0, set()
    for m in todo:
        if m.model.key in seen:
            continue
        seen.add(m.model.key)
        if m.model.twin_of:
            need += m.model.twin_of.stat().st_size  # at most: a cached twin needs none
        if m.model.file:
            continue
        need += missing_build_n_bytes(resolve_spec(m.model.ref), DTYPES[m.model.dtype],
                                      scenario.seed, cache_dir)
    plan = scenario.memory
    for model, dtype in ({(m, d) for m, d, _, _ in plan.loads()} if plan else ()):
        if f"{model}|{dtype}" not in seen:
            need += missing_build_n_bytes(resolve_spec(model), DTYPES[dtype], scenario.seed,
                                          cache_dir)
    return need


def plan_summary(scenario: Scenario, cache_dir: Path | None) -> dict:
    """What a run of the scenario would take: model files, peak RAM (the largest group of
    models kept loaded together, with all their cells' contexts), bytes still to build."""
    todo = list(scenario.measurements)
    needs = dict(_memory_by_model(todo, all_contexts=True))
    groups = group_by_memory(needs, available_ram_bytes(), _links(todo))
    return {"n_models": len(needs), "n_groups": len(groups),
            "ram_gib": max(sum(needs[k] for k in g) for g in groups) / 2**30,
            "build_gib": _build_n_bytes(scenario, todo, cache_dir) / 2**30}


def check_resources(todo: list[Measurement], cache_dir: Path | None) -> None:
    """Refuse before any work when a model cannot fit in RAM."""
    available = available_ram_bytes()
    for key, need in _memory_by_model(todo):
        if available is not None and need > available:
            raise HarnessError(f"{key} needs about {need / 2**30:.2f} GiB of RAM (weights, KV "
                               f"cache, compute buffers), {available / 2**30:.2f} GiB is available",
                               fix="use a smaller model, dtype or context")


def _memory_by_model(todo: list[Measurement], all_contexts: bool = False
                     ) -> list[tuple[str, int]]:
    """Each model's RAM: its weights plus its largest context (or, all_contexts, every cell's
    context at once, as interleaved rounds keep them), spec and file size looked up once."""
    by_model: dict[str, list[Measurement]] = {}
    for m in todo:
        by_model.setdefault(m.model.key, []).append(m)
    out = []
    for key, group in by_model.items():
        ref = group[0].model
        spec = _spec_of(ref)
        weights = ref.file.stat().st_size if ref.file else estimated_n_bytes(
            spec, DTYPES[ref.dtype])
        contexts = [memory_needed_bytes(m, spec) for m in group]
        out.append((key, weights + (sum(contexts) if all_contexts else max(contexts))))
    return out


def _spec_of(ref: ModelRef) -> ModelSpec:
    return spec_from_gguf(ref.file) if ref.file else resolve_spec(ref.ref)


def memory_needed_bytes(m: Measurement, spec: ModelSpec) -> int:
    """KV cache + an upper estimate of llama.cpp's compute buffers (the weights come on top)."""
    n_ctx = m.n_ctx_total
    kv = kv_n_bytes_per_token(spec, m.kv_type, m.kv_type) * n_ctx
    # Activations of one ubatch: attention scores, FFN intermediates, the residual stream, and
    # one row of logits, in F32 (what llama.cpp's graph allocator reserves, within ~2x).
    per_token = (spec.num_attention_heads * n_ctx + 3 * spec.intermediate_size
                 + 4 * spec.hidden_size + spec.vocab_size)
    compute = 4 * min(m.settings.n_ubatch, n_ctx) * per_token
    return int(kv + compute)


def _model_file(ref: ModelRef, seed: int, cache_dir: Path | None, console: Console) -> Path:
    if ref.gguf_path:
        return ref.gguf_path
    if ref.dtype == "built":
        return _built_stand_in(ref.twin_of, seed, cache_dir, console)
    if ref.twin_of:
        from .engine.twin import build_twin

        start = time.perf_counter()
        path = build_twin(ref.twin_of, seed, directory=cache_dir, threads=physical_cores())
        if (seconds := time.perf_counter() - start) > 1:
            console.info(f"built {path.name}, the random-weight twin, in {seconds:.1f} s")
        return path
    return _build(resolve_spec(ref.ref), DTYPES[ref.dtype], seed, cache_dir, console)


def _build(spec: ModelSpec, dtype: DType, seed: int, cache_dir: Path | None, console: Console,
           what: str = "") -> Path:
    """The cached build of spec at dtype, saying how long it took when it had to be made."""
    start = time.perf_counter()
    built = build(spec, dtype, seed, directory=cache_dir)
    if not built.cached:
        console.info(f"built {built.path.name}{what} in {time.perf_counter() - start:.1f} s")
    return built.path


def _built_stand_in(real: Path, seed: int, cache_dir: Path | None, console: Console) -> Path:
    """The builder's file of the spec real's header gives, at real's type, as every run's
    builds are made; refused (exit 2) when its tensors differ from real's in name, shape or
    type."""
    from .weights.gguf_inspect import file_dtype
    from .weights.twin import built_mismatch

    path = _build(spec_from_gguf(real), file_dtype(real), seed, cache_dir, console,
                  ", the spec-built file,")
    if problem := built_mismatch(real, path):
        raise HarnessError(f"the spec-built file does not match the real file: {problem}",
                           source=str(real), fix="time it against its twin (random: twin)")
    return path


def _model_record(writer: RunWriter, ref: ModelRef, path: Path, model,
                  huge_n_bytes: int | None = None, threads: int = 1) -> dict:
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
        **model_costs(table, spec),
        "tensor_type_n_bytes": types, "tensor_type_n_params": type_params,
        "spec": spec.to_dict(), "huge_mapped_n_bytes": huge_n_bytes,
        "mmap": model.use_mmap,
        "routing": _routing(model, spec, threads) if spec.is_moe else None,
    } | (_twin_fields(ref, path) if ref.in_twin_pair else {}))
    return writer.records.models[key]


ROUTING_PROMPT, ROUTING_DECODE = 512, 32  # one full ubatch; a short generation


def _routing(model, spec: ModelSpec, threads: int) -> dict | None:
    """Which experts a mixture of experts' tokens pick, per layer (harness.engine.routing): a
    512-token prefill and 32 decode steps, untimed, before the measurements; None when it
    cannot run (recorded as missing, never guessed)."""
    from .engine.routing import expert_selections, routing_stats

    n_prompt = min(ROUTING_PROMPT, spec.max_position_embeddings - ROUTING_DECODE)
    try:
        chosen = expert_selections(model, n_prompt, ROUTING_DECODE, threads)
    except (MeasurementError, MemoryError):
        return None
    return {"n_prompt": n_prompt, "n_decode": ROUTING_DECODE,
            "layers": routing_stats(chosen, spec)}


def _twin_fields(ref: ModelRef, path: Path) -> dict:
    """What a twin pair's model record adds: the real file, and how the twin was calibrated."""
    from .engine.twin import twin_calibration

    return {"twin_of": str(ref.file), "real_sha256": file_sha256(ref.file),
            "calibration": twin_calibration(path) if ref.dtype == "twin" else None}


def _noise_gate(where: str, strict: bool, console: Console) -> float | None:
    cores = noise.idle_reading()
    if cores is None:
        console.warn(f"this OS reports no machine-wide CPU time {where}: the noise guard "
                     "cannot tell whether other processes disturb the timings")
        return None
    if cores > noise.NOISY_CORES:
        message = f"other processes are using {cores:.2f} cores {where}; timings will be noisy"
        if strict:
            raise NoisyMachine(message, fix="stop them and rerun with --resume")
        console.warn(message)
    return cores
