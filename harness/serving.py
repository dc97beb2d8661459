"""A serving run: start (or reach) a server, load it level by level, keep every request's
record and each level's summary in results.jsonl, and render the serving page."""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from . import __version__
from .analysis.serving import level_roofline
from .core import records as rectypes
from .core.costs import model_costs
from .core.errors import HarnessError, MeasurementError
from .core.records import to_dict
from .core.serving import RequestTiming, level_summary, steady_decode
from .core.stats import ratio_summary
from .engine.build import write_text_atomically
from .engine.env import collect_env
from .engine.load import Level, Workload, run_level
from .engine.measure import now_iso
from .engine.results import (
    RESULTS_FILE,
    SCHEMA_VERSION,
    Records,
    RunWriter,
    check_folder,
    read_records,
    run_kind,
)
from .engine.server import (
    RunningServer,
    ServerSpec,
    server_system_info,
    server_version_line,
    start_server,
)
from .engine.serverbuild import cached_build
from .report.serving import render_serving_page, write_serving_plots

# Counters llama-server's /metrics keeps (deltas over a level mean something); the rest are
# gauges of the last request, kept as read.
COUNTERS = ("prompt_tokens_total", "prompt_seconds_total", "tokens_predicted_total",
            "tokens_predicted_seconds_total", "n_decode_total", "prompt_tokens_cached_total")


@dataclass(frozen=True)
class ServingRun:
    """Everything a serving run does: where the server is, the load levels and the workload."""

    levels: tuple[Level, ...]
    workload: Workload
    server: ServerSpec | None = None  # None: endpoint names a server already running
    endpoint: str | None = None
    slo: dict | None = None
    model_label: str = ""
    compare_inprocess: bool = True  # closed levels of a started server: the same file in-process
    rounds: int = 3  # a compared level: served and in-process alternate, round by round
    pin_slots: bool = True  # a started server's closed levels: worker k on slot k
    scenario: dict = field(default_factory=dict)  # the scenario file's name, title and text


def serving_run(plan, model_path: Path, n_vocab: int, physical_cores: int) -> ServingRun:
    """The run a serving plan (harness.servescenario.ServePlan) asks for, on a model file."""
    per_slot = plan.n_prompt + plan.n_generate + 16
    server = None if plan.endpoint else ServerSpec(
        plan.server, model_path, plan.slots, ctx=plan.slots * per_slot,
        threads=plan.threads or physical_cores)
    workload = Workload(plan.n_prompt, plan.n_generate, n_vocab, plan.n_requests,
                        plan.duration_s, plan.warmup, plan.prefix_cache, plan.timeout_s,
                        plan.seed)
    label = Path(plan.model).stem if plan.model.endswith(".gguf") else plan.model
    return ServingRun(plan.levels, workload, server, plan.endpoint, plan.slo or None, label,
                      plan.inprocess, plan.rounds, plan.pin_slots, _scenario_fields(plan))


def _scenario_fields(plan) -> dict:
    if plan.path is None:
        return {}
    return {"path": str(plan.path), "name": plan.name, "title": plan.title,
            "description": plan.description, "text": plan.path.read_text()}


def counter_deltas(before: dict | None, after: dict | None) -> dict | None:
    """Each llama-server counter's growth over a level, and the sequences per decode call."""
    if not before or not after:
        return None
    out = {name: after[f"llamacpp:{name}"] - before[f"llamacpp:{name}"] for name in COUNTERS
           if f"llamacpp:{name}" in after and f"llamacpp:{name}" in before}
    if out.get("n_decode_total"):
        out["tokens_per_decode_call"] = out["tokens_predicted_total"] / out["n_decode_total"]
        gauge, calls = "llamacpp:n_busy_slots_per_decode", "llamacpp:n_decode_total"
        if gauge in before and gauge in after:  # a running mean since start: undo it per level
            out["busy_slots_per_decode_call"] = (
                after[gauge] * after[calls] - before[gauge] * before[calls]) / out["n_decode_total"]
    return out


def timings_of(records: list[dict]) -> list[RequestTiming]:
    """The requests that finished, with the server's token counts (usage, else timings)."""
    out = []
    for r in records:
        if r["error"] or not r["chunk_s"]:
            continue
        usage, timings = r.get("usage") or {}, r.get("timings") or {}
        n_out = usage.get("completion_tokens", timings.get("predicted_n"))
        n_in = usage.get("prompt_tokens", timings.get("prompt_n"))
        if n_out is None or n_in is None:
            continue
        prompt_ms = timings.get("prompt_ms")
        out.append(RequestTiming(r["sent_s"], tuple(r["chunk_s"]), tuple(r["chunk_tokens"]),
                                 r["end_s"], int(n_out), int(n_in),
                                 None if prompt_ms is None else float(prompt_ms) / 1000,
                                 r.get("started_s")))
    return out


def run_serving(run: ServingRun, out_dir: Path, argv: list[str],
                say: Callable[[str], None] = print, resume: bool = False) -> Path:
    """Run every level, writing records as they come; return the report's path. A server that
    dies or a level that fails ends the run with what was measured kept and rendered; with
    resume, the levels an earlier run of out_dir finished are kept and the others run whole."""
    env = collect_env()
    # a resume that differs is refused before the server starts (its port and command are
    # the only parts of the header a started server adds)
    check_folder(out_dir, resume=resume, kind="serving",
                 header=_header(run, argv, run.endpoint or "", None, env))
    server = start_server(run.server) if run.server else None  # nothing written before
    yard = roof = None
    try:
        url = server.url if server else run.endpoint.rstrip("/")
        with RunWriter(out_dir, resume=resume, kind="serving") as writer:
            writer.keep_through(closes_unit)  # a level cut short is run again, whole
            writer.begin(_header(run, argv, url, server, env), argv)
            done = {lv.level for lv in finished_levels(writer.records) if closes_unit(lv)}
            yard = _yardstick(run) if server else None
            costs = _costs(run) if server else None
            if costs and not writer.records.models:
                writer.append(costs)
            roof = _Ceilings(costs, run.server.threads) if costs else None
            try:
                for level in run.levels:
                    if level.key in done:
                        say(f"{level.label}: kept from the earlier run")
                        continue
                    _run_one(run, level, url, server, writer, say, yard, roof)
            finally:  # from the records written, so a level whose server died after it shows
                rerender_serving(out_dir)
    finally:
        for held in (yard, roof):
            if held:
                held.close()
        if server:
            server.stop()
    return out_dir / "report.md"


def closes_unit(record) -> bool:
    """A serving run's unit of work is a level: it counts once its level record landed with
    the server alive to its end (the header and the model before the levels stay too)."""
    return (isinstance(record, (rectypes.Header, rectypes.Model))
            or (isinstance(record, rectypes.Level) and record.complete))


def finished_levels(records: Records) -> list[rectypes.Level]:
    """The level records of a serving run (a level cut short has none: its requests are not
    a level's)."""
    return records.of_type(rectypes.Level)


def _costs(run: ServingRun) -> dict:
    """The served file's bytes and FLOPs by tensor type (core/costs.model_costs) and its spec,
    for the roofline; a file whose architecture the harness cannot read keeps the reason."""
    from .weights.gguf_inspect import spec_from_gguf, tensor_table

    path = Path(run.server.model)
    try:
        spec = spec_from_gguf(path)
        return {"type": "model", "key": "served", "path": str(path), "spec": spec.to_dict(),
                **model_costs(tensor_table(path), spec)}
    except (HarnessError, OSError, ValueError) as exc:
        return {"type": "model", "key": "served", "path": str(path), "error": str(exc)}


class _Ceilings:
    """ggml's streaming and compute ceilings for the served model's types, probed at the
    server's threads while it is idle: before every round of a level and after its last.
    Records carry a sequence number, so a round's bound uses the probes either side of it."""

    def __init__(self, costs: dict, threads: int) -> None:
        self.threads, self.error = threads, costs.get("error")
        self.dtypes = sorted(set(costs.get("decode_type_n_bytes") or {})
                             | set(costs.get("matmul_type_n_params") or {}))
        self.prober = None
        if self.error is None:
            try:
                from .engine.probe import Prober

                self.prober = Prober(self.dtypes)
            except (MemoryError, OSError, ValueError, RuntimeError, HarnessError) as exc:
                self.error = f"{type(exc).__name__}: {exc}"

    def probe(self, when: str) -> dict:
        """One probe record; a probe that fails keeps its reason, never a guess."""
        record = {"type": "probe", "when": when, "at": now_iso(),
                  "threads": [self.threads]}
        try:
            if self.prober is None:
                raise RuntimeError(self.error)
            return record | {"result": self.prober.beside(self.threads, self.dtypes,
                                                          ("stream", "compute"))}
        except (MemoryError, OSError, ValueError, RuntimeError, HarnessError) as exc:
            return record | {"error": f"{type(exc).__name__}: {exc}"}

    def close(self) -> None:
        if self.prober is not None:
            self.prober.close()


def _yardstick(run: ServingRun):
    """The served file loaded in this process, for the closed levels' comparison."""
    if not run.compare_inprocess or not any(lv.concurrency for lv in run.levels):
        return None
    from .engine.inprocess import BatchedDecode

    w, spec = run.workload, run.server
    return BatchedDecode(spec.model, w.n_prompt, w.n_generate, spec.ctx // spec.slots,
                         spec.threads, spec.ubatch, seed=w.seed)


def _run_one(run: ServingRun, level: Level, url: str, server: RunningServer | None,
             writer: RunWriter,
             say, yard=None, roof: _Ceilings | None = None) -> dict:
    compare = yard is not None and level.concurrency and level.concurrency <= run.server.slots
    n_rounds = _n_rounds(run, level) if compare else 1
    inprocess = [yard.aggregate_tok_s(level.concurrency)] if compare else []
    shares = [_share(run.workload.n_requests, n_rounds, r) for r in range(n_rounds)]
    raws, probe_seqs = [], []
    for r, n in enumerate(shares):  # in-process, probe, served, in-process, probe, …
        probe_seqs += [_probe(roof, writer, f"{level.key} round {r}")] if roof else []
        w = replace(run.workload, n_requests=n, duration_s=run.workload.duration_s / n_rounds,
                    warmup=run.workload.warmup if r == 0 else 0, pin_slots=_pinned(run, level))
        raws.append(asyncio.run(run_level(url, level, w, first=sum(shares[:r]))))
        if compare:
            inprocess.append(yard.aggregate_tok_s(level.concurrency))
    probe_seqs += [_probe(roof, writer, f"{level.key} after")] if roof else []
    records = [{"round": r} | rec for r, raw in enumerate(raws) for rec in raw["records"]]
    for rec in records:
        writer.append({"type": "request", "level": level.key} | rec)
    round_timings = [timings_of(raw["records"]) for raw in raws]
    timings = [t for each in round_timings for t in each]
    failed = len(records) - len(timings)
    wall_s = sum(raw["wall_s"] for raw in raws)
    decoding = (min(level.concurrency, run.server.slots) if run.server and level.concurrency
                else level.concurrency)  # beyond the slots, the rest wait: no more decode
    record = {"type": "level", "level": level.key, "label": level.label,
              "concurrency": level.concurrency, "rate": level.rate,
              "pinned_slots": _pinned(run, level),
              "summary": level_summary(timings, failed, wall_s, run.slo),
              "server_prompt_ms": _server_ms(records, "prompt_ms"),
              "steady_decode": steady_decode(timings, decoding) if level.concurrency else None,
              "inprocess_decode_tok_s": inprocess or None,
              "rounds": _paired_rounds(round_timings, inprocess, level.concurrency)
              if compare else None,
              "counters": counter_deltas(raws[0]["metrics_before"], raws[-1]["metrics_after"]),
              "errors": sorted({r["error"] for r in records if r["error"]})[:5]}
    if roof:  # the probes either side of each round (the level's own seq places it after)
        record["probe_seqs"] = probe_seqs
    # A level whose server died under it is shown, and run again on resume.
    record["complete"] = server is None or server.alive()
    writer.append(record)
    say(f"{level.label}: {len(timings)} requests, {failed} failed "
        f"[{wall_s:.1f} s{f', {len(raws)} rounds' if len(raws) > 1 else ''}]")
    if server and not server.alive():
        raise MeasurementError(f"the server exited during the level {level.label}: "
                               f"{server.log_tail()}", key="server",
                               fix=f"what was measured is kept; see {server.log_path}")
    if not timings:
        raise MeasurementError(f"no request finished at {level.label}: "
                               f"{'; '.join(record['errors'])}", key="server",
                               fix="check the server and the endpoint")
    return record


def _pinned(run: ServingRun, level: Level) -> bool:
    """Pin each closed-loop worker to a slot of its own (llama-server's id_slot), so the
    requests in flight hold the adjacent slots 0 … c − 1, as the in-process sequences hold
    adjacent streams: left to itself llama-server picks the least recently used slot, and
    with its KV cache split per slot a step's attention spans every slot between the lowest
    and the highest in use (docs/serving.md). Only for a server the harness started."""
    return (run.pin_slots and run.server is not None and bool(level.concurrency)
            and level.concurrency <= run.server.slots)


def _probe(roof: _Ceilings, writer: RunWriter, when: str) -> int:
    """Probe the ceilings now, write the record, and return its sequence number."""
    writer.append(roof.probe(when))
    return writer.records.probes[-1].seq


def _n_rounds(run: ServingRun, level: Level) -> int:
    """Rounds a compared level is split into: as asked, each with at least one request per
    worker, so every round has a window where all of them decode."""
    return max(1, min(run.rounds, run.workload.n_requests // level.concurrency))


def _share(n: int, parts: int, i: int) -> int:
    """Part i of n requests split as evenly as can be into parts."""
    return n // parts + (1 if i < n % parts else 0)


def _paired_rounds(round_timings: list[list[RequestTiming]], inprocess: list[float],
                   concurrency: int) -> dict:
    """Each round's served steady decode against the in-process figures either side of it
    (their geometric mean: the machine's drift over the round cancels to first order), and
    the ratio over the rounds with its interval (core/stats: a paired contrast)."""
    served = [steady_decode(timings, concurrency) for timings in round_timings]
    per_round = [{"served_tok_s": s["tok_s"] if s else None,
                  "inprocess_tok_s": math.sqrt(inprocess[r] * inprocess[r + 1])}
                 for r, s in enumerate(served)]
    ratios = [row["served_tok_s"] / row["inprocess_tok_s"] for row in per_round
              if row["served_tok_s"]]
    return {"per_round": per_round, "served_of_inprocess": ratio_summary(ratios)}


def _server_ms(records: list[dict], key: str) -> list[float]:
    return [float(r["timings"][key]) for r in records
            if not r["error"] and r.get("timings") and key in r["timings"]]


def _header(run: ServingRun, argv: list[str], url: str, server: RunningServer | None,
            env: dict) -> dict:
    return {"type": "header", "kind": "serving", "schema_version": SCHEMA_VERSION,
            "harness": __version__, "env": env,
            "created": now_iso(), "argv": argv, "python": sys.version.split()[0],
            "model": run.model_label, "url": url,
            "server": asdict(run.server) | {"model": str(run.server.model),
                                            "command": server.process.args if server else None,
                                            "server_version": _server_version(run.server),
                                            "build": _server_build(run.server)}
            if run.server else {"endpoint": run.endpoint},
            "workload": asdict(run.workload), "slo": run.slo, "scenario": run.scenario,
            "system_info": _system_info(run, server),
            "levels": [asdict(level) for level in run.levels]}


def _system_info(run: ServingRun, server: RunningServer | None) -> dict:
    """The CPU features of the server's llama.cpp build and of the bindings in this process."""
    if not server:
        return {}
    from .engine.llama import version_info

    ours = version_info()
    return {"server": server_system_info(server), "inprocess": ours["system_info"],
            "inprocess_commit": ours["ggml_commit"]}


def _server_version(spec: ServerSpec) -> str | None:
    """The wheel's version, or the first line of what a binary says to --version."""
    if spec.server != "xllamacpp":
        return server_version_line(spec.server)
    from importlib.metadata import version

    return f"xllamacpp {version('xllamacpp')}"


def _server_build(spec: ServerSpec) -> dict | None:
    """The record of harness server build when the binary served is the cached one."""
    build = cached_build()
    return asdict(build) if build and Path(build.binary) == Path(spec.server) else None


def load_serving_run(run_dir: Path) -> tuple[dict, list[dict]] | None:
    """A serving run's header and level records; None where run_dir holds another kind of run
    (or none)."""
    results = run_dir / RESULTS_FILE if run_dir.is_dir() else run_dir
    if not results.is_file():
        return None
    records = read_records(results)
    if run_kind(records.header) != "serving":
        return None
    return to_dict(records.header), with_roofline(records)


def with_roofline(records: Records) -> list[dict]:
    """The page's rows: each level record with its roofline (analysis/serving.level_roofline)
    where the run probed the ceilings of a model it served."""
    header = records.header
    model = next(iter(records.models.values()), None)
    server = header.server or {}
    rows = []
    for lv in finished_levels(records):
        roof = (level_roofline(lv, model, records.probes, header.workload, server["threads"],
                               server["slots"]) if model and "slots" in server else None)
        rows.append(to_dict(lv) | {"seq": lv.seq} | ({"roofline": roof} if roof else {}))
    return rows


def rerender_serving(run_dir: Path, out: Path | None = None) -> Path:
    """Write a serving run's page (out, by default report.md beside its results) and its
    plots (beside the page) again from its results; returns the page's path."""
    out = out or (run_dir if run_dir.is_dir() else run_dir.parent) / "report.md"
    header, levels = load_serving_run(run_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    plots = write_serving_plots(levels, out.parent)
    write_text_atomically(out, render_serving_page(header, levels, plots))
    return out
