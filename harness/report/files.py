"""Load a run directory and write its report files (the I/O side of report.py)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..core.errors import HarnessError
from ..engine.build import write_text_atomically
from ..engine.results import RESULTS_FILE, read_records
from ..study.analyze import analyze_records
from .memory_lesson import memory_plan
from .page import render_csv, render_json, report_data
from .templating import SECTION_PAGES

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


FULL_REPORT = "full.md"


def write_report(run_dir: Path, records, out: Path | None = None, fmt: str = "md",
                 lesson: bool | None = None, analysis: dict | None = None,
                 template: str | Path | None = None) -> Path:
    """Render a run's report (with plots for markdown) and write it; returns the path. A run
    of a scenario with a `reference:` block (or lesson=True) gets the course page and its full
    report beside it (full.md); any other run its full report. `template` (a built-in name or
    a file; default the scenario's `template:`) renders report.md instead of the built-in
    page; analysis: the records' analysis when the caller has just computed it."""
    from ..core.reference import reference_from_header

    analysis = analysis if analysis is not None else analysis_of(records)
    reference = reference_from_header(records.header)
    as_lesson = lesson if lesson is not None else reference is not None
    out = out or run_dir / f"report.{fmt}"
    if fmt != "md":
        data = report_data(records, analysis)
        write_text_atomically(out, render_csv(data) if fmt == "csv" else render_json(data))
        return out
    chosen = template or scenario_template(records.header)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the plots are drawn aside until the pages render: a bad template writes nothing
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".plots-") as aside:
        plots = _write_plots(records, analysis, Path(aside), reference)
        if memory_plan(records) and str(chosen) not in SECTION_PAGES:
            pages = _memory_pages(records, analysis, plots, Path(aside), chosen)
        else:
            pages = _pages(records, analysis, reference, plots, chosen, as_lesson)
        for drawn in Path(aside).iterdir():
            os.replace(drawn, out.parent / drawn.name)
    for name, text in pages.items():
        write_text_atomically(out if name is None else out.parent / name, text)
    return out


def _pages(records, analysis: dict, reference: dict | None, plots: list[str],
           template: str | Path | None, as_lesson: bool) -> dict:
    """The pages to write (None: the report itself), each rendered through its template."""
    from .course import course_page, page_plots
    from .lesson import full_sections, lesson_data
    from .page import run_sections
    from .templating import render

    if not as_lesson or str(template) in SECTION_PAGES:
        return {None: render(template or "full",
                             run_sections(report_data(records, analysis), plots))}
    page = course_page(records, analysis, reference, page_plots(records, analysis, plots),
                       FULL_REPORT)
    full = full_sections(lesson_data(records, analysis, reference), plots)
    return {None: render(template or "lesson", page), FULL_REPORT: render("full", full)}


def _memory_pages(records, analysis: dict, plots: list[str], aside: Path,
                  template: str | Path | None) -> dict:
    """A run with a `memory:` block: the memory lesson, and the full report beside it."""
    from dataclasses import replace

    from .memory_lesson import load_table, memory_lesson, memory_loads, write_memory_plot
    from .page import run_sections
    from .templating import Section, render, template_path

    loads = memory_loads(records)
    lesson = memory_lesson(records, loads, None, FULL_REPORT)
    lesson = replace(lesson, plot=write_memory_plot(records, loads, lesson, aside))
    full = run_sections(report_data(records, analysis), plots)
    table = Section("memory_loads",
                    render(template_path("memory_loads"), load_table(records, loads)))
    at = next((i for i, s in enumerate(full.sections) if s.name == "method"),
              len(full.sections))
    full = replace(full, sections=(*full.sections[:at], table, *full.sections[at:]))
    return {None: render(template or "memory_lesson", lesson), FULL_REPORT: render("full", full)}


def _write_plots(records, analysis: dict, out_dir: Path, reference: dict | None) -> list[str]:
    from .plots import write_plots

    try:
        return write_plots(records.measurements, analysis, out_dir, reference)
    except OSError as exc:
        raise HarnessError(f"cannot write plots: {exc.strerror}", source=str(out_dir),
                           fix="choose a writable place with -o, or free some disk") from None


def scenario_template(header) -> str | None:
    """The template a run's scenario names (`template:`: a built-in name or a file), or
    None."""
    return ((header.scenario if header else None) or {}).get("template") or None


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
