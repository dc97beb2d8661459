"""The harness command line: parse, call, print."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .core.errors import (
    EXIT_DISK_FULL,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    HarnessError,
    is_disk_full,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="harness")
def cli() -> None:
    """Measure how LLM inference uses this machine: prefill vs decode on synthetic models."""


@cli.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def models(ctx: click.Context, as_json: bool) -> None:
    """List every model spec: shapes, parameters, sizes and bytes per token."""
    if ctx.invoked_subcommand:
        return
    from .core.specs import all_specs
    from .report.tables import models_rows, render_models_table

    rows = models_rows(all_specs())
    click.echo(json.dumps(rows, indent=1) if as_json else render_models_table(rows))


@models.command("import")
@click.argument("config")
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path),
              help="Spec file to write (default: models/NAME.yaml).")
@click.option("--name", help="Spec name (default: from the repo id, folder or file).")
@click.option("--force", is_flag=True, help="Overwrite an existing spec file.")
def models_import(config: str, out: Path | None, name: str | None, force: bool) -> None:
    """Write a spec YAML from a Hugging Face config.json (a path or a hub repo id) or from a
    GGUF file's header (offline)."""
    from .core.specs import models_dir
    from .core.yamlio import is_name, not_a_name, safe_name
    from .engine.build import write_text_atomically
    from .weights.gguf_inspect import is_gguf, spec_from_gguf
    from .weights.hfimport import load_config, render_spec_yaml, spec_dict_from_config

    if name is not None and not is_name(name):
        raise HarnessError(not_a_name(name), key="--name",
                           fix=f"e.g. --name {safe_name(name)}")
    if is_gguf(Path(config)) or Path(config).suffix == ".gguf":  # a missing .gguf: said so
        spec = spec_from_gguf(Path(config), name or safe_name(Path(config).stem.lower()))
        spec = spec.to_dict()
    else:
        data, default_name, source = load_config(config)
        spec = spec_dict_from_config(data, name or safe_name(default_name), source, config)
    out = out or models_dir() / f"{spec['name']}.yaml"
    if out.exists() and not force:
        raise HarnessError("spec file exists already", source=str(out),
                           fix="pass --force to overwrite or -o to write elsewhere")
    write_text_atomically(out, render_spec_yaml(spec))
    click.echo(str(out))


def _levels(concurrency: str | None, rate: str | None):
    """harness serve's --concurrency and --rate lists as load levels (servescenario's rule)."""
    from .servescenario import make_levels

    try:
        closed = [int(x) for x in (concurrency or "").split(",") if x]
        opened = [float(x) for x in (rate or "").split(",") if x]
    except ValueError:
        raise HarnessError("takes numbers separated by commas", key="--concurrency/--rate",
                           fix="e.g. --concurrency 1,2,4 or --rate 0.5,1") from None
    return make_levels(closed or ([] if opened else [1]), opened)


@cli.group()
def server() -> None:
    """llama.cpp's llama-server built from the bindings' own source."""


@server.command("build")
@click.option("--jobs", "-j", type=click.IntRange(1, 1024),
              help="Compile jobs (default: all cores).")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path),
              help="Where servers are cached (default: $HARNESS_SERVER_DIR or the user cache "
                   "dir).")
@click.option("--force", is_flag=True, help="Build again even when one is cached.")
@click.option("--source", type=click.Path(dir_okay=False, path_type=Path),
              help="The bindings' source package (llama_cpp_python-VERSION.tar.gz) instead of "
                   "downloading it.")
def server_build(jobs: int | None, directory: Path | None, force: bool,
                 source: Path | None) -> None:
    """Compile llama-server from the installed llama-cpp-python's source package (same
    llama.cpp commit and flags as the bindings), cache it and print its path (--server built)."""
    from .engine.serverbuild import build_server, check_source

    if source is not None:  # refused before the progress bar shows
        check_source(source)
    with click.progressbar(length=100, label="llama-server", file=sys.stderr) as bar:
        def progress(percent: int | None, line: str) -> None:
            if percent is None:  # a step, not a compile line
                bar.label = f"llama-server: {line}"
                bar.render_progress()
            else:
                bar.update(max(0, percent - bar.pos))
        built = build_server(progress, jobs, directory, force, source)
    note = "cached" if built.cached else f"built in {built.seconds / 60:.1f} min"
    click.echo(built.binary)
    click.echo(f"llama-server from {built.llama_cpp_python} (llama.cpp {built.llama_cpp_commit[:9]}"
               f"), {note}", err=True)


def _serve_number(flag: str, key: str, help_text: str | None = None):
    """A harness serve option with the default and bounds of its serve: key (core.options)."""
    from .core.options import SERVE_NUMBERS

    field, value, low, high = SERVE_NUMBERS[key]
    kind = (click.FloatRange(low, high) if isinstance(value, float)
            else click.IntRange(low, high))
    return click.option(flag, field, default=value, show_default=True, type=kind,
                        help=help_text)


def _serve_flag(flag: str, key: str, help_text: str):
    """An on/off harness serve option with its serve: key's default (core.options)."""
    from .core.options import SERVE_FLAGS

    on = SERVE_FLAGS[key]
    name = flag.removeprefix("--")
    decls = f"{flag}/--no-{name}" if on else flag
    return click.option(decls, key, default=on, show_default=on, is_flag=not on or None,
                        help=help_text)


@cli.command()
@click.argument("model")
@click.option("--dtype", default="f16", show_default=True, help="Weight type of a built spec.")
@click.option("--server", default="xllamacpp", show_default=True,
              help="built (harness server build), xllamacpp (the wheel's server) or the path "
                   "of a llama-server binary.")
@click.option("--endpoint", help="Load a server already running at this URL instead (this "
                                 "machine's, unless --allow-remote).")
@click.option("--allow-remote", is_flag=True,
              help="Let --endpoint name a server on another machine (it will be loaded).")
@_serve_number("--slots", "slots")
@click.option("--concurrency", default="1,2,4", show_default=True,
              help="Closed-loop levels: requests in flight, comma-separated.")
@click.option("--rate", help="Open-loop levels: Poisson arrivals per second, comma-separated.")
@_serve_number("--requests", "requests", "Requests per level at most.")
@_serve_number("--duration", "duration_s", "Seconds per level at most.")
@_serve_number("--prompt", "prompt")
@_serve_number("--generate", "generate")
@_serve_number("--warmup", "warmup")
@_serve_number("--threads", "threads",
               "Threads of the server and of the in-process yardstick (0: physical cores).")
@click.option("--slo-ttft-ms", type=click.FloatRange(min=0, min_open=True))
@click.option("--slo-tpot-ms", type=click.FloatRange(min=0, min_open=True))
@_serve_flag("--prefix-cache", "prefix_cache", "Let the server reuse cached prompt prefixes.")
@_serve_flag("--inprocess", "inprocess",
             "Time the same file's batched decode in-process beside each closed level.")
@_serve_flag("--pin-slots", "pin_slots",
             "Closed loop: worker k's requests ask for slot k (llama-server's id_slot).")
@_serve_number("--rounds", "rounds",
               "Rounds a compared level alternates served and in-process decode in.")
@_serve_number("--timeout", "timeout_s", "Seconds a request may stall before it fails.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path))
def serve(model: str, dtype: str, server: str, endpoint: str | None, concurrency: str,
          rate: str | None, slo_ttft_ms: float | None, slo_tpot_ms: float | None,
          allow_remote: bool, out: Path | None, cache_dir: Path | None, **options) -> None:
    """Load a llama.cpp server serving MODEL (a spec or a .gguf) at each level and report
    TTFT, TPOT, ITL and end-to-end percentiles, throughput and goodput."""
    from .core.specs import looks_like_path
    from .core.yamlio import safe_name
    from .engine.http import check_endpoint
    from .servescenario import ServePlan, check_plan

    endpoint = check_endpoint(endpoint, allow_remote) if endpoint else None
    slo = {k: v for k, v in (("ttft_ms", slo_ttft_ms), ("tpot_ms", slo_tpot_ms)) if v}
    label = safe_name(Path(model).stem) if looks_like_path(model) else safe_name(model)
    plan = ServePlan(path=None, name=f"serve-{label}", title=f"Serving {label}",
                     description="", model=model, dtype=dtype, seed=0,
                     levels=_levels(concurrency, rate), server=_server_option(server),
                     endpoint=endpoint, slo=slo, **options)
    check_plan(plan)  # what the run would refuse once started, refused before anything is
    _serve(plan, out or default_run_dir(plan.name, False), cache_dir, resume=False)


def _server_option(server: str) -> str:
    """--server: built, xllamacpp, or the path of an executable file given on the command line
    (absolute from here on, so no later look-up through PATH finds another)."""
    if server in ("built", "xllamacpp"):
        return server
    import os

    binary = Path(server).expanduser()
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise HarnessError(f"no executable file at {server}", key="--server",
                           fix="give the path of a llama-server binary, or built or xllamacpp")
    return str(binary.resolve())


def _serve(plan, out: Path, cache_dir: Path | None, resume: bool) -> None:
    """Run a serving plan into out and print the report's path."""
    from dataclasses import replace

    from .engine.env import physical_cores
    from .engine.results import check_folder
    from .engine.serverbuild import built_binary
    from .servescenario import preflight_plan
    from .serving import run_serving, serving_run

    check_folder(out, resume=resume, kind="serving")  # before the model is built
    preflight_plan(plan, cache_dir)  # RAM and disk, refused before the model is built
    if plan.server == "built" and not plan.endpoint:
        plan = replace(plan, server=str(built_binary()))
    path, n_vocab = _served_model(plan.model, plan.dtype, cache_dir)
    run = serving_run(plan, path, n_vocab, physical_cores())
    try:
        report = run_serving(run, out, sys.argv, say=lambda line: click.echo(line, err=True),
                             resume=resume)
    except (HarnessError, OSError) as exc:
        if plan.path is not None and is_disk_full(exc):
            click.echo(f"stopped: the disk is full; the finished levels are kept in {out}; "
                       f"free some disk, then resume with: harness run {plan.path} --out {out} "
                       "--resume", err=True)
        raise
    click.echo(str(report))


def _served_model(model: str, dtype: str, cache_dir: Path | None) -> tuple[Path, int]:
    """The file to serve and its vocabulary size (prompts are random ids below it)."""
    from .core.dtypes import get_dtype
    from .engine.build import build as build_model

    spec, dtype_name, path = _model_file(model, dtype)
    if path is None:
        path = build_model(spec, get_dtype(dtype_name), directory=cache_dir).path
    return path, spec.vocab_size


@cli.command()
@click.argument("model")
@click.option("--dtype", default="f32", show_default=True, help="Weight type, e.g. f16, q4_k_m.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="Write here instead of the cache.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1))
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Model cache (default: $HARNESS_CACHE_DIR or the user cache dir).")
def build(model: str, dtype: str, out: Path | None, seed: int, cache_dir: Path | None) -> None:
    """Write a random-weight GGUF of MODEL (a spec name or spec file) and print its path."""
    from .core.dtypes import get_dtype
    from .core.specs import resolve_spec

    spec, kind = resolve_spec(model), get_dtype(dtype, key="--dtype")
    built = _build_with_progress(spec, kind.name, seed, cache_dir, out)
    note = "cached" if built.cached else f"built in {built.seconds:.1f} s"
    click.echo(f"{built.path}", nl=True)
    click.echo(f"{spec.name} {kind.name}: {built.n_bytes / 2**30:.3f} GiB, {note}", err=True)


def _serving_options(fn):
    """--server and --allow-remote, which `run` and `check` take for a serving scenario."""
    fn = click.option("--allow-remote", is_flag=True,
                      help="A serving scenario's endpoint may be another machine's server "
                           "(it will be loaded).")(fn)
    return click.option("--server", "server", metavar="PATH",
                        help="A serving scenario: run this llama-server binary instead of the "
                             "scenario's server (a scenario names only xllamacpp or built)."
                        )(fn)


@cli.command()
@click.argument("scenario", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Run directory (default: reports/runs/NAME-TIMESTAMP).")
@click.option("--resume", is_flag=True, help="Continue an interrupted run, skipping what it has.")
@click.option("--strict", is_flag=True, help="Abort when other processes load the CPU.")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Model cache (default: $HARNESS_CACHE_DIR or the user cache dir).")
@click.option("--ray", "ray_address", metavar="ADDRESS",
              help="Run on every node of a Ray cluster: HOST:PORT, auto (the cluster this "
                   "machine belongs to) or local (a one-node cluster here). Needs "
                   "harness[ray].")
@click.option("--nodes", multiple=True, metavar="LABEL|ID",
              help="With --ray: only these nodes (labels or node ids; repeat or comma-separate).")
@click.option("--relabel", is_flag=True,
              help="With --ray --resume: a node that is another machine than its label's earlier "
                   "results is recorded under a new label (LABEL.2, ...) instead of refused.")
@_serving_options
def run(scenario: Path, out: Path | None, resume: bool, strict: bool,
        cache_dir: Path | None, ray_address: str | None, nodes: tuple[str, ...],
        relabel: bool, server: str | None = None, allow_remote: bool = False) -> None:
    """Measure prefill and decode for every cell of SCENARIO (a YAML file; one with a
    `serve:` block is a serving run, see docs/serving.md)."""
    if relabel and not (ray_address and resume):
        raise HarnessError("--relabel renames resumed fleet nodes that are other machines",
                           key="--relabel", fix="use it with --ray ADDRESS --resume, or drop it")
    from .servescenario import is_serving_scenario

    if is_serving_scenario(scenario) and (ray_address or nodes):
        raise HarnessError("a serving scenario runs on this machine", key="--ray",
                           fix="drop --ray/--nodes, or start harness serve on each machine")
    _serving_only(scenario, server, allow_remote)
    if ray_address:
        return _run_fleet(scenario, ray_address, nodes, out, resume, strict, cache_dir,
                          relabel)
    if nodes:
        raise HarnessError("--nodes chooses nodes of a Ray cluster", key="--nodes",
                           fix="add --ray ADDRESS (or --ray local), or drop --nodes")
    if is_serving_scenario(scenario):
        plan = _serving_plan(scenario, server, allow_remote)
        return _serve(plan, out or default_run_dir(plan.name, resume), cache_dir, resume)
    _run_here(scenario, out, resume, strict, cache_dir)


def _run_here(scenario: Path, out: Path | None, resume: bool, strict: bool,
              cache_dir: Path | None) -> None:
    """A measurement run on this machine: checked, run, summarized, its report written."""
    from .engine.env import collect_env, physical_cores
    from .engine.results import RunWriter
    from .engine.scenario import load_scenario
    from .runner import preflight, run_scenario, write_header

    plan = load_scenario(scenario, physical_cores())
    run_dir = out or default_run_dir(plan.name, resume)
    preflight(plan, list(plan.measurements), cache_dir)  # refuse before the run dir exists
    env_info = collect_env()
    with RunWriter(run_dir, resume=resume) as writer:
        write_header(plan, writer, env_info, sys.argv)  # a resume that differs ends here
        done = len(writer.records.measured_ids & {m.id for m in plan.measurements})
        click.echo(f"{plan.title}: {len(plan.measurements)} measurements ({done} done) "
                   f"-> {run_dir}", err=True)
        try:
            analysis = _interruptible(lambda: run_scenario(
                plan, writer, env_info, strict=strict, cache_dir=cache_dir,
                console=_console(), argv=sys.argv))
        except (KeyboardInterrupt, HarnessError, OSError) as exc:
            click.echo(_stopped_line(exc, writer, len(plan.measurements), scenario), err=True)
            raise
        failures = _finished(writer, analysis)
    click.echo(str(run_dir))
    if failures:
        sys.exit(EXIT_FAILURE)


def _console():
    """The runner's console: warnings, progress and one line per round, on stderr."""
    from .report.tables import round_line
    from .runner import Console

    return Console(warn=lambda msg: click.echo(f"warning: {msg}", err=True),
                   info=lambda msg: click.echo(msg, err=True),
                   round=lambda progress: click.echo(round_line(progress), err=True))


def _stopped_line(exc: BaseException, writer, n_planned: int, scenario: Path) -> str:
    """What an interrupted or stopped run kept, and the command that resumes it."""
    what = ("interrupted" if isinstance(exc, KeyboardInterrupt) else
            "stopped: the disk is full (free some, then resume)" if is_disk_full(exc)
            else "stopped")
    return (f"\n{what}: {len(writer.records.measured_ids)} of {n_planned} measurements and "
            f"{len(writer.records.repetitions)} repetitions kept in {writer.dir}; "
            f"resume with: harness run {scenario} --out {writer.dir} --resume")


def _finished(writer, analysis: dict) -> list:
    """A finished run's summary, analysis and report; returns its failures."""
    from .report.console import render_console
    from .report.files import write_report

    click.echo(render_console(writer.records.measurements, analysis))
    path = write_report(writer.dir, writer.records, analysis=analysis)
    click.echo(f"\nthe full tables are in the report:\n{path}")
    if writer.records.failures:
        click.echo(f"{len(writer.records.failures)} model(s) failed; see {writer.path}",
                   err=True)
    return writer.records.failures


def _serving_plan(scenario: Path, server: str | None, allow_remote: bool):
    """A serving scenario, validated, with the command line's --server."""
    from .servescenario import load_serving_scenario

    return load_serving_scenario(scenario, allow_remote,
                                 _server_option(server) if server else None)


def _serving_only(scenario: Path, server: str | None, allow_remote: bool) -> None:
    """--server and --allow-remote belong to serving scenarios."""
    from .servescenario import is_serving_scenario

    if (server or allow_remote) and not is_serving_scenario(scenario):
        raise HarnessError("--server and --allow-remote are for serving scenarios",
                           key="--server" if server else "--allow-remote", fix="drop it")


@cli.command()
@click.argument("real", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Run directory (default: reports/runs/twin-STEM-TIMESTAMP).")
@click.option("--threads", default="auto", show_default=True,
              help="Threads: a count, or auto (the physical cores).")
@click.option("--prompt", default=128, show_default=True, type=click.IntRange(1, 1 << 20),
              help="Prompt tokens prefilled per repetition.")
@click.option("--generate", default=64, show_default=True, type=click.IntRange(1, 1 << 20),
              help="Tokens decoded per repetition.")
@click.option("--repetitions", default="auto", show_default=True,
              help="Rounds: a count, or auto (until twin ÷ real is within --target-ci).")
@click.option("--min-repetitions", default=10, show_default=True, type=click.IntRange(3, 1000))
@click.option("--max-repetitions", default=40, show_default=True, type=click.IntRange(3, 1000))
@click.option("--target-ci", default=0.01, show_default=True, type=click.FloatRange(0.001, 1),
              help="auto: stop when the 95% intervals of twin ÷ real are within ±this.")
@click.option("--mmap/--no-mmap", default=True, show_default=True,
              help="Read the weights from the mapped files (llama.cpp's default) or copy them "
                   "into memory at load.")
@click.option("--against", "against", default="twin", show_default=True,
              type=click.Choice(["twin", "built", "both"]),
              help="The random-weight file: the twin (the file's own table and block "
                   "magnitudes), built (the builder's file of the header's spec, as every run "
                   "times), or both.")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Model cache (default: $HARNESS_CACHE_DIR or the user cache dir).")
@click.pass_context
def twin(ctx: click.Context, real: Path, out: Path | None, threads: str, prompt: int,
         generate: int, repetitions: str, min_repetitions: int, max_repetitions: int,
         target_ci: float, mmap: bool, against: str, cache_dir: Path | None) -> None:
    """Time REAL (a GGUF file) beside its random-weight twin: twin ÷ real per phase."""
    from .core.yamlio import safe_name
    from .engine.build import check_gguf_file, write_text_atomically
    from .engine.scenario import twin_scenario_text
    from .weights.gguf_inspect import file_dtype, spec_from_gguf

    check_gguf_file(real)
    spec_from_gguf(real)  # a header the run would refuse is refused before anything is written
    if against != "twin":
        file_dtype(real)
    threads_value = threads if threads == "auto" else _whole(threads, "--threads")
    reps = repetitions if repetitions == "auto" else _whole(repetitions, "--repetitions")
    random = ("twin", "built") if against == "both" else (against,)
    text = twin_scenario_text(real, threads_value, prompt, generate, reps, min_repetitions,
                              max_repetitions, target_ci, mmap, random)
    run_dir = out or default_run_dir(f"twin-{safe_name(real.stem)}", False)
    scenario = run_dir / "twin.yaml"
    if scenario.exists() and scenario.read_text() != text:
        raise HarnessError("the run directory holds another twin scenario", source=str(run_dir),
                           fix="choose another --out")
    write_text_atomically(scenario, text)
    ctx.invoke(run, scenario=scenario, out=run_dir, resume=False, strict=False,
               cache_dir=cache_dir, ray_address=None, nodes=(), relabel=False)
    from .engine.results import read_records
    from .levers.twins import twin_sentence
    from .study.analyze import analyze_records

    for row in analyze_records(read_records(run_dir / "results.jsonl"))["twins"]:
        click.echo(twin_sentence(row))


def _whole(value: str, key: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise HarnessError(f"expected a whole number or auto, got {value!r}", key=key,
                           fix=f"write {key} auto or a count such as 10")
    return int(value)


@cli.command()
@click.argument("model")
@click.option("--dtype", default="f32", show_default=True, help="Weight type to build a spec at.")
@click.option("--prompt", default=512, show_default=True, type=click.IntRange(1, 1 << 16),
              help="Prompt tokens, prefilled in one ubatch.")
@click.option("--generate", default=32, show_default=True, type=click.IntRange(2, 1 << 16),
              help="Tokens decoded one at a time after the prompt.")
@click.option("--threads", default=0, type=click.IntRange(0, 1024),
              help="Threads (default: the physical cores).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1))
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Model cache (default: $HARNESS_CACHE_DIR or the user cache dir).")
def routing(model: str, dtype: str, prompt: int, generate: int, threads: int, seed: int,
            cache_dir: Path | None) -> None:
    """Which experts MODEL's tokens pick, per layer (a mixture of experts: spec or .gguf)."""
    from .core.dtypes import get_dtype
    from .engine.build import build as build_model
    from .engine.env import physical_cores
    from .engine.routing import expert_selections, routing_stats
    from .levers.experts import routing_table
    from .render.tabular import markdown_table

    spec, dtype_name, path = _model_file(model, dtype)
    if path is None:
        path = build_model(spec, get_dtype(dtype_name), seed, directory=cache_dir).path
    if not spec.is_moe:
        raise HarnessError(f"{spec.name} has no experts", key="MODEL",
                           fix="name a mixture of experts, e.g. granite-3.0-1b-a400m")
    from .engine.llama import Model

    with Model(path) as loaded:
        chosen = expert_selections(loaded, prompt, generate, threads or physical_cores(), seed)
    click.echo(markdown_table(routing_table(routing_stats(chosen, spec), spec.name)))


@cli.command()
@click.argument("scenario", type=click.Path(path_type=Path))
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Model cache (default: $HARNESS_CACHE_DIR or the user cache dir).")
@_serving_options
def check(scenario: Path, cache_dir: Path | None, server: str | None = None,
          allow_remote: bool = False) -> None:
    """Validate SCENARIO and list what `run` would measure, without running anything."""
    from .engine.env import physical_cores
    from .engine.scenario import load_scenario
    from .report.tables import repetitions_label
    from .runner import plan_summary, preflight
    from .servescenario import is_serving_scenario

    _serving_only(scenario, server, allow_remote)
    if is_serving_scenario(scenario):
        from .servescenario import preflight_plan

        serve = _serving_plan(scenario, server, allow_remote)
        preflight_plan(serve, cache_dir)
        levels = ", ".join(level.label for level in serve.levels)
        where = serve.endpoint or f"{serve.server}, {serve.slots} slots"
        click.echo(f"{serve.title}: serving {serve.model} ({serve.dtype}) on {where}; levels "
                   f"{levels}; at most {serve.n_requests} requests or {serve.duration_s:g} s "
                   f"each. OK.", err=True)
        return
    plan = load_scenario(scenario, physical_cores())
    preflight(plan, list(plan.measurements), cache_dir)
    for m in plan.measurements:
        policy = repetitions_label(m.settings.policy, plan.target)
        click.echo(f"{m.id}  ({m.model.label} {m.model.dtype}, {m.settings.threads} threads, "
                   f"{m.cell.test}, {policy} + "
                   f"{m.settings.warmup} warm-up)")
    summary = plan_summary(plan, cache_dir)
    click.echo(f"{plan.title}: {len(plan.measurements)} measurements of "
               f"{summary['n_models']} model file(s); at most {summary['ram_gib']:.2f} GiB of "
               f"RAM at once; {summary['build_gib']:.2f} GiB still to build. OK.", err=True)


def _run_fleet(scenario: Path, address: str, nodes: tuple[str, ...], out: Path | None,
               resume: bool, strict: bool, cache_dir: Path | None, relabel: bool) -> None:
    """`harness run --ray`: one run directory per node under one fleet directory."""
    from .engine.env import physical_cores
    from .engine.results import read_records
    from .engine.scenario import load_scenario
    from .fleet import FleetRequest, run_fleet
    from .report.files import write_report

    plan = load_scenario(scenario, physical_cores())  # bad input stops here; each node checks too
    fleet_dir = out or default_run_dir(plan.name, resume, base=Path("reports") / "fleets")
    wanted = [w.strip() for item in nodes for w in item.split(",") if w.strip()]
    req = FleetRequest(scenario, address, wanted, fleet_dir, resume, strict, cache_dir,
                       relabel)
    resume_cmd = (f"harness run {scenario} --ray {address} --out {fleet_dir} --resume"
                  + "".join(f" --nodes {w}" for w in wanted) + (" --relabel" if relabel else ""))
    echo = lambda line: click.echo(line, err=True)  # noqa: E731
    try:
        states = run_fleet(req, plan, echo)  # in this thread: Ctrl-C cancels the node tasks
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted: what the nodes sent is kept in {fleet_dir}; resume with: "
                   f"{resume_cmd}", err=True)
        raise
    for label, s in states.items():
        if s.writer.records.measurements:
            report = write_report(s.writer.dir, read_records(s.writer.path))
            click.echo(f"[{label}] {s.status}: {len(s.writer.records.measured_ids)} of "
                       f"{s.total} measurements; report: {report}", err=True)
    failed = {k: s for k, s in states.items() if s.status != "done"}
    for label, s in failed.items():
        click.echo(f"[{label}] {s.status}: {s.error}", err=True)
    click.echo(f"compare the machines: harness gallery {fleet_dir}", err=True)
    click.echo(str(fleet_dir))
    if failed:
        click.echo(f"{len(failed)} node(s) did not finish; continue them with: {resume_cmd}",
                   err=True)
        sys.exit(EXIT_FAILURE)


def default_run_dir(name: str, resume: bool, base: Path | None = None) -> Path:
    """BASE/NAME-TIMESTAMP (BASE: reports/runs), or with --resume the newest run of that
    scenario."""
    import datetime as dt

    from .core.yamlio import is_name, not_a_name

    base = base or Path("reports") / "runs"
    if not is_name(name):  # the loaders refuse such names; a folder must stay in base
        raise HarnessError(not_a_name(name), key="name", fix="rename it")
    if resume:
        runs = sorted(base.glob(f"{name}-*"))
        if not runs:
            raise HarnessError(f"no earlier run of {name!r} under {base}",
                               fix="pass --out RUN_DIR or drop --resume")
        return runs[-1]
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return base / f"{name}-{stamp}"


def _interruptible(fn):
    """Run fn in a worker thread so Ctrl-C reaches us even inside a long llama.cpp call."""
    import threading

    from .engine.llama import clear_abort, request_abort

    outcome: dict = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the main thread below
            outcome["error"] = exc

    clear_abort()
    worker = threading.Thread(target=target, name="harness-run", daemon=True)
    worker.start()
    try:
        worker.join()
    except KeyboardInterrupt:
        request_abort()  # llama_decode returns at its next graph node
        worker.join(timeout=10)
        raise
    if "error" in outcome:
        error = outcome["error"]
        if type(error).__name__ == "Interrupted":
            raise KeyboardInterrupt from None
        raise error
    return outcome.get("value")


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path),
              help="File to write (default: RUN/report.FORMAT).")
@click.option("--format", "fmt", type=click.Choice(["md", "csv", "json"]), default="md",
              show_default=True)
@click.option("--lesson/--full", default=None,
              help="The lesson page (findings first, claims checked) or the full report; "
                   "default: the lesson page when the scenario has a reference block.")
@click.option("--template", default=None,
              help="A built-in page (lesson, full, or a lever's: experts, quant, kv_depth, "
                   "batching, threads, prefix, twins) or a Jinja2 template file (start from "
                   "`harness template lesson`); default: the scenario's `template:`.")
def report(run_dir: Path, out: Path | None, fmt: str, lesson: bool | None,
           template: str | None) -> None:
    """Re-render the report of a run (also of an interrupted one) from its stored results."""
    from .report.files import load_run, write_report
    from .serving import load_serving_run, rerender_serving

    if load_serving_run(run_dir) is not None:
        if fmt != "md":
            raise HarnessError("a serving run's page is markdown only", key="--format",
                               fix="drop --format (its records are in results.jsonl)")
        click.echo(str(rerender_serving(run_dir, out)))
        return

    from .core.options import PAGE_TEMPLATES

    if template is not None and template not in PAGE_TEMPLATES and not Path(template).is_file():
        raise HarnessError("no template file here", source=template, key="--template",
                           fix="name a built-in page (" + ", ".join(PAGE_TEMPLATES) + ") or "
                               "print one to edit with `harness template lesson > FILE`")
    directory, records = load_run(run_dir)
    click.echo(str(write_report(directory, records, out, fmt, lesson, template=template)))


@cli.command()
@click.argument("name")
def template(name: str) -> None:
    """Print a built-in page template (lesson, full, or a lever's) to start a page of your
    own."""
    from .report.templating import template_text

    click.echo(template_text(name), nl=False)


@cli.command()
@click.argument("run_dir", required=False, type=click.Path(path_type=Path))
@click.argument("model", required=False)
@click.option("--dtype", default="f32", show_default=True, help="Weight type, e.g. q4_0.")
@click.option("--context", default=0, show_default=True, type=click.IntRange(0, 1 << 24),
              help="Tokens already in the KV cache when decoding.")
@click.option("--prompt", "n_prompt", default=512, show_default=True,
              type=click.IntRange(1, 1 << 24), help="Prompt length of the prefill estimate.")
@click.option("--threads", type=click.IntRange(1, 4096), default=None,
              help="Thread count (default: the most the run measured).")
@click.option("--hardware", default="this", show_default=True,
              help="A name from --list-hardware.")
@click.option("--list-hardware", is_flag=True, help="List the hardware names and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def estimate(run_dir: Path | None, model: str | None, dtype: str, context: int, n_prompt: int,
             threads: int | None, hardware: str, list_hardware: bool, as_json: bool) -> None:
    """Estimate decode and prefill of any model and weight type from a run's model of its
    machine (or on reference hardware), or say why it cannot (it does not fit)."""
    from .report.estimate import hardware_list, render_estimate, run_estimate

    if list_hardware:
        rows = hardware_list()
        click.echo(json.dumps(rows, indent=1) if as_json else
                   "\n".join(f"{r['name']:<18} {r['what']}" for r in rows))
        return
    if run_dir is None or model is None:
        raise HarnessError("estimate needs a run and a model", key="RUN MODEL",
                           fix="harness estimate RUN_DIR MODEL [--dtype q4_0]")
    from .report.files import analysis_of, load_run

    _, records = load_run(run_dir)
    e = run_estimate(analysis_of(records), model, dtype.lower(), context, n_prompt, threads,
                     hardware)
    click.echo(json.dumps(e, indent=1, default=str) if as_json else render_estimate(e))


@cli.command()
@click.argument("model")
@click.option("--dtype", default="f32", show_default=True,
              help="Weight type to build (a .gguf file keeps its own).")
@click.option("--context", "n_ctx", default=4096, show_default=True, type=int,
              help="Tokens each sequence's cache holds.")
@click.option("--kv-type", default="f16", show_default=True,
              help="KV cache type: f32, f16, q8_0 or q4_0.")
@click.option("--parallel", "n_seq", default=1, show_default=True, type=int,
              help="Sequences, each with a cache of --context tokens.")
@click.option("--mmap", type=click.Choice(["both", "on", "off"]), default="both",
              show_default=True, help="Load with mmap on, off, or both (one process each).")
@click.option("--fill", is_flag=True,
              help="Prefill every sequence to its context before the last reading.")
@click.option("--ram", help="Memory the users must fit in, e.g. 16GB (default: available RAM).")
@click.option("--hardware", help="Fit the users in a catalogue machine's memory instead "
                                 "(harness estimate --list-hardware).")
@click.option("--threads", type=click.IntRange(1, 4096), default=None,
              help="Threads (default: the physical cores).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def memory(model: str, dtype: str, n_ctx: int, kv_type: str, n_seq: int, mmap: str,
           fill: bool, ram: str | None, hardware: str | None, threads: int | None,
           as_json: bool) -> None:
    """What MODEL (a name, a spec file or a .gguf) and its KV cache take once llama.cpp has
    loaded them: each formula beside llama.cpp's buffers and the resident memory, and how many
    users fit."""
    from .engine.env import physical_cores
    from .report.memory import (
        Request,
        check_request,
        memory_json,
        ram_budget,
        render_memory,
        run_memory,
    )

    spec, dtype_name, path = _model_file(model, dtype)
    kv_type = kv_type.lower()
    check_request(spec, n_ctx, n_seq, kv_type)
    budget = ram_budget(ram, hardware)
    if path is None:
        path = _build_with_progress(spec, dtype_name).path
    from .weights.gguf_inspect import tensor_table

    req = Request(spec, dtype_name, path, n_ctx, n_seq, kv_type, threads or physical_cores(),
                  {"both": (True, False), "on": (True,), "off": (False,)}[mmap], fill)
    m = run_memory(req, budget, tensor_table(path))
    click.echo(json.dumps(memory_json(m), indent=1) if as_json else render_memory(m), nl=False)


def _model_file(model: str, dtype: str):
    """A MODEL argument (a .gguf file, a spec name or a spec file) as (spec, type name, the
    file, or None where it is still to build at that type), checked before anything is built."""
    from .core.dtypes import get_dtype
    from .core.specs import resolve_spec

    if model.endswith(".gguf"):
        from .engine.build import check_gguf_file
        from .weights.gguf_inspect import spec_from_gguf

        path = Path(model)
        check_gguf_file(path)
        return spec_from_gguf(path), "file", path
    return resolve_spec(model), get_dtype(dtype, key="--dtype").name, None


def _build_with_progress(spec, dtype_name: str, seed: int = 0, cache_dir: Path | None = None,
                         out: Path | None = None):
    """The cached file of spec at a type, built with a progress bar where it is missing."""
    from .core.dtypes import get_dtype
    from .engine.build import build as build_model

    with _ByteProgress(f"building {spec.name} {dtype_name}") as bar:
        return build_model(spec, get_dtype(dtype_name), seed, directory=cache_dir, out=out,
                           progress=bar.update)


@cli.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the markdown here instead of printing it.")
def compare(runs: tuple[Path, ...], out: Path | None) -> None:
    """Compare runs: the same measurements side by side, ratios, and what exceeds the noise."""
    from .engine.build import write_text_atomically
    from .report.compare import compare_runs, render_compare_markdown
    from .report.files import analysis_of, load_run

    if len(runs) < 2:
        raise HarnessError("compare needs at least two runs", fix="harness compare RUN_A RUN_B")
    from .report.serving import render_serving_compare
    from .serving import load_serving_run

    served = [load_serving_run(r) for r in runs]
    if any(served):
        if not all(served):
            raise HarnessError("serving runs compare only with serving runs", key="RUNS",
                               fix="name serving runs only, or measurement runs only")
        text = render_serving_compare([(Path(r).name, *s) for r, s in zip(runs, served,
                                                                          strict=True)])
        if out:
            write_text_atomically(out, text)
            click.echo(str(out))
        else:
            click.echo(text)
        return
    loaded = []
    for r in runs:
        directory, records = load_run(r)
        loaded.append((directory.name, records))
    text = render_compare_markdown(compare_runs(loaded, [analysis_of(rec) for _, rec in loaded]))
    if out:
        write_text_atomically(out, text)
        click.echo(str(out))
    else:
        click.echo(text)


@cli.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path),
              default=Path("reports/gallery"), show_default=True,
              help="Folder for gallery.md and its plot.")
@click.option("--reference", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Published points to draw beside the runs (e.g. data/reference_points.yaml).")
def gallery(runs: tuple[Path, ...], out: Path, reference: Path | None) -> None:
    """One page comparing machines from any runs: run folders, or folders of them."""
    from .report.files import write_gallery

    click.echo(str(write_gallery(list(runs), out, reference)))


@cli.command()
@click.option("--threads", "thread_list", default=None,
              help="Comma-separated thread counts (default: 1 and the physical cores).")
@click.option("--size-mib", type=click.IntRange(1, 1 << 20), default=None,
              help="Array size (default: 1 GiB or 4x the last-level cache, whichever is larger).")
@click.option("--dtypes", "dtype_list", default="f32,f16,q8_0,q4_0", show_default=True,
              help="Comma-separated weight types for ggml's streaming and compute figures.")
@click.option("--passes", type=click.IntRange(5, 1000), default=7, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def probe(thread_list: str | None, size_mib: int | None, dtype_list: str, passes: int,
          as_json: bool) -> None:
    """Measure this machine's ceilings: numpy read and copy bandwidth, and per weight type
    ggml's streaming bandwidth (matrix-vector) and compute peak (matrix-matrix)."""
    from .engine.env import physical_cores
    from .engine.probe import probe as run_probe
    from .engine.probe import probe_dtypes
    from .report.tables import render_probe

    threads = sorted({1, physical_cores()})
    if thread_list:
        try:
            threads = sorted({int(t) for t in thread_list.split(",")})
        except ValueError:
            raise HarnessError(f"not a list of whole numbers: {thread_list!r}", key="--threads",
                               fix="e.g. --threads 1,2,4") from None
        if min(threads) < 1:
            raise HarnessError("thread counts must be at least 1", key="--threads",
                               fix="e.g. --threads 1,2")
    dtypes = [d.strip().lower() for d in dtype_list.split(",") if d.strip()]
    known = probe_dtypes()
    for d in dtypes:
        if d not in known:
            raise HarnessError(f"unknown weight type {d!r}", key="--dtypes",
                               fix="choose from " + ", ".join(known))
    result = run_probe(threads, dtypes, size_mib << 20 if size_mib else None, passes)
    click.echo(json.dumps(result, indent=1) if as_json else render_probe(result))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def env(as_json: bool) -> None:
    """Describe this machine and the library versions results are measured with."""
    from .engine.env import collect_env
    from .report.tables import render_env

    info = collect_env()
    click.echo(json.dumps(info, indent=1) if as_json else render_env(info))


class _ByteProgress:
    """A progress bar on stderr fed with (done, total) byte counts; silent when not a TTY."""

    def __init__(self, label: str) -> None:
        self.label, self.bar, self.last = label, None, 0

    def update(self, done: int, total: int) -> None:
        if not sys.stderr.isatty():
            return
        if self.bar is None:
            self.bar = click.progressbar(length=total, label=self.label, file=sys.stderr)
            self.bar.__enter__()
        self.bar.update(done - self.last)
        self.last = done

    def __enter__(self) -> _ByteProgress:
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one line on stderr and exit status 2."""
    import signal

    # SIGTERM stops a run as cleanly as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        cli.main(args=argv, prog_name="harness", standalone_mode=False)
    except HarnessError as exc:
        click.echo(f"error: {exc.render()}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except (KeyboardInterrupt, click.exceptions.Abort):
        click.echo("interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except MemoryError:
        click.echo("error: out of memory (use a smaller model or context, or free RAM)",
                   err=True)
        sys.exit(2)
    except OSError as exc:  # a disk filling up or a file vanishing mid-way
        where = f"{exc.filename}: " if exc.filename else ""
        if is_disk_full(exc):
            click.echo(f"error: {where}{exc.strerror or exc} (free some disk; a run keeps "
                       "what it finished: resume it with --resume)", err=True)
            sys.exit(EXIT_DISK_FULL)
        click.echo(f"error: {where}{exc.strerror or exc} (check the path and its "
                   "permissions)", err=True)
        sys.exit(EXIT_USAGE)
    except Exception as exc:
        import os

        if os.environ.get("HARNESS_DEBUG"):
            raise
        click.echo(f"error: internal error ({type(exc).__name__}: {exc}); this is a bug in "
                   "harness, please report it with the command you ran (HARNESS_DEBUG=1 "
                   "shows the traceback)", err=True)
        sys.exit(EXIT_FAILURE)
