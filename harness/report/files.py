"""Load a run directory and write its report files (the I/O side of report.py)."""

from __future__ import annotations

from pathlib import Path

from ..core.errors import HarnessError
from ..engine.build import write_text_atomically
from ..engine.results import RESULTS_FILE, read_records
from ..study.analyze import analyze_records
from .page import render_csv, render_json, render_markdown, report_data

FORMATS = ("md", "csv", "json")


def load_run(ref: Path):
    """Records of a run directory (or its results.jsonl)."""
    path = ref / RESULTS_FILE if ref.is_dir() else ref
    if not path.exists():
        raise HarnessError("no results here", source=str(ref),
                           fix="pass a run directory made by `harness run`")
    records = read_records(path)
    if records.header is None:
        raise HarnessError("results file is empty", source=str(path),
                           fix="run the scenario again; nothing was measured")
    return path.parent, records


def analysis_of(records) -> dict:
    """The run's analysis, computed from what was measured (complete or not)."""
    return analyze_records(records)


def write_report(run_dir: Path, records, out: Path | None = None, fmt: str = "md",
                 lesson: bool | None = None, analysis: dict | None = None) -> Path:
    """Render a run's report (with plots for markdown) and write it; returns the path. A run
    of a scenario with a `reference:` block (or lesson=True) gets the lesson page; analysis:
    the records' analysis when the caller has just computed it."""
    from ..core.reference import reference_from_header

    analysis = analysis if analysis is not None else analysis_of(records)
    data = report_data(records, analysis)
    reference = reference_from_header(records.header)
    as_lesson = lesson if lesson is not None else reference is not None
    out = out or run_dir / f"report.{fmt}"
    if fmt == "md":
        from .plots import write_plots

        try:
            plots = write_plots(records.measurements, analysis, out.parent, reference)
        except OSError as exc:
            raise HarnessError(f"cannot write plots: {exc.strerror}", source=str(out.parent),
                               fix="choose a writable place with -o, or free some disk"
                               ) from None
        if as_lesson:
            from .lesson import lesson_data, render_lesson

            text = render_lesson(lesson_data(records, analysis, reference), plots)
        else:
            text = render_markdown(data, plots)
        write_text_atomically(out, text)
    elif fmt == "csv":
        write_text_atomically(out, render_csv(data))
    else:
        write_text_atomically(out, render_json(data))
    return out


def run_dirs(paths: list[Path]) -> list[Path]:
    """Run directories under the given paths: a run itself, or a folder of runs (a fleet
    directory, or result folders people sent in), one level deep."""
    out = []
    for p in paths:
        if (p / RESULTS_FILE).exists() or p.suffix == ".jsonl":
            out.append(p)
        elif p.is_dir():
            out += sorted(d for d in p.iterdir() if (d / RESULTS_FILE).exists())
    if not out:
        raise HarnessError("no runs found", source=", ".join(str(p) for p in paths),
                           fix="pass run directories (with results.jsonl) or folders of them")
    return out


def write_gallery(paths: list[Path], out_dir: Path, reference_file: Path | None) -> Path:
    """The gallery page of the runs under paths, with its plot, written into out_dir."""
    from .gallery import gallery_data, load_reference_points, render_gallery, rule_of_thumb_plot

    reference = load_reference_points(reference_file) if reference_file else []
    runs = []
    for run in run_dirs(paths):
        directory, records = load_run(run)
        runs.append((directory.name, records.header.env or {}, analysis_of(records)))
    data = gallery_data(runs, reference)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot = rule_of_thumb_plot(data, out_dir)
    out = out_dir / "gallery.md"
    write_text_atomically(out, render_gallery(data, plot))
    return out
