"""Every committed report re-renders byte for byte from its stored records: records of every
schema they were written in are migrated on read, typed, and analysed again (the analysis is
never stored), and the page and its plots come out the same."""

import shutil
from pathlib import Path

import matplotlib.figure
import pytest

from harness.engine.results import read_records
from harness.report.files import write_report
from harness.serving import rerender_serving

REPORTS = Path(__file__).resolve().parent.parent / "reports"
RUNS = sorted(p.parent for p in REPORTS.rglob("results.jsonl") if (p.parent / "report.md").exists())


def _rendered(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / run.name
    out.mkdir()
    shutil.copy(run / "results.jsonl", out / "results.jsonl")
    records = read_records(out / "results.jsonl")
    if records.header.kind == "serving":
        rerender_serving(out)
    else:
        write_report(out, records)
    return out


def test_every_committed_run_is_found():
    assert len(RUNS) >= 20 and REPORTS / "lesson" in RUNS and REPORTS / "serving" in RUNS


@pytest.mark.parametrize("run", RUNS, ids=lambda p: str(p.relative_to(REPORTS)))
def test_a_committed_page_re_renders_byte_for_byte(run, tmp_path, monkeypatch):
    # the plots are drawn but not encoded (the slow part): their bytes are checked below
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: None)
    out = _rendered(run, tmp_path)
    assert (out / "report.md").read_bytes() == (run / "report.md").read_bytes()
    # a course page's full report beside it, where the run has one
    assert (out / "full.md").exists() == (run / "full.md").exists()
    if (run / "full.md").exists():
        assert (out / "full.md").read_bytes() == (run / "full.md").read_bytes()


@pytest.mark.parametrize("name", ["quick", "serving"])
def test_committed_plots_re_render_byte_for_byte(name, tmp_path):
    run = REPORTS / name
    out = _rendered(run, tmp_path)
    plots = sorted(p.name for p in run.iterdir() if p.suffix in (".png", ".svg"))
    assert plots and plots == sorted(p.name for p in out.iterdir() if p.suffix in (".png",
                                                                                 ".svg"))
    for plot in plots:
        assert (out / plot).read_bytes() == (run / plot).read_bytes(), plot


def test_a_serving_page_renders_where_it_is_asked_to(run_cli, tmp_path, monkeypatch):
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: None)
    page = tmp_path / "pages" / "serving.md"
    result = run_cli("report", str(REPORTS / "serving"), "-o", str(page))
    assert result.exit_code == 0, result.stderr
    assert page.read_bytes() == (REPORTS / "serving" / "report.md").read_bytes()
    refused = run_cli("report", str(REPORTS / "serving"), "--format", "csv")
    assert refused.exit_code == 2 and "markdown only" in refused.stderr
