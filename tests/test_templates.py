"""Course pages rendered from Jinja2 templates over a typed result of the run: the words change
with the results, template errors are one line naming file and line, a user's template renders
the same numbers, and a bad template writes nothing."""

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import matplotlib.figure
import pytest

from harness.core.errors import HarnessError
from harness.core.reference import reference_from_header
from harness.report.course import Claim, course_page
from harness.report.files import analysis_of, load_run
from harness.report.templating import render, template_text

RUNS = Path(__file__).resolve().parent / "fixtures" / "runs"
GOLDEN = Path(__file__).resolve().parent / "fixtures" / "golden" / "tiny_course.md"


@pytest.fixture(scope="module")
def tiny():
    _, records = load_run(RUNS / "tiny_lesson")
    analysis = analysis_of(records)
    page = course_page(records, analysis, reference_from_header(records.header), {}, "full.md")
    return records, analysis, page


def _tables(text: str) -> list[str]:
    lines = text.splitlines()
    return [line for i, line in enumerate(lines[:-1])
            if line.startswith("|") and lines[i + 1].startswith("|---")]


def test_the_course_page_matches_golden_and_keeps_to_its_limits(tiny):
    _, _, page = tiny
    text = render("lesson", page)
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()
    assert len(text.split()) <= 2000
    assert _tables(text) and all(h.count("|") - 1 <= 8 for h in _tables(text))
    assert len(re.findall(r"!\[", text)) <= 4
    assert text.rstrip().endswith("[the full report](full.md).")
    # every claim the page checks shows its own verdict and reason
    for c in page.claims:
        row = next(line for line in text.splitlines() if line.startswith(f"| {c.claim} |"))
        assert f"**{c.verdict}**" in row and c.why in row


def _flip(page, **parts):
    return dataclasses.replace(page, **{k: dataclasses.replace(getattr(page, k), **v)
                                        for k, v in parts.items()})


def test_no_verdict_sentence_survives_a_flipped_result(tiny):
    _, _, page = tiny
    base = render("lesson", page)
    split = _flip(page, phases={"prefill_compute_share": 0.9, "decode_stream_share": 0.9})
    assert "Prefill is compute-bound and decode memory-bound." in render("lesson", split)
    flipped = render("lesson", _flip(page, phases={"prefill_compute_share": 0.01}))
    assert "did not split that way" in flipped and "compute-bound" not in flipped
    assert "prefill used less than half of it" in base
    # the quantization sentence exists only where bytes and ceilings predict less than bytes
    assert "Decode gained less than the bytes" in base
    more = render("lesson", _flip(page, quant={"predicted_decode": page.quant.bytes_ratio}))
    assert "Decode gained less than the bytes" not in more
    # a claim's verdict and reason are the result's own
    claims = tuple(Claim(c.claim, c.published, c.measured, "does not hold", f"because {i}",
                         False, "")
                   for i, c in enumerate(page.claims))
    turned = render("lesson", dataclasses.replace(page, claims=claims))
    for old, new in zip(page.claims, claims, strict=True):
        row = next(line for line in turned.splitlines() if line.startswith(f"| {old.claim} |"))
        assert "**does not hold**" in row and new.why in row and old.why not in row
    # a workload within reach shows its share, not "not tested"
    near = tuple(dataclasses.replace(w, beyond=None) for w in page.workloads)
    shown = render("lesson", dataclasses.replace(page, workloads=near))
    assert "not tested †" in base and "not tested" not in shown.split("## The course")[0]
    # the time budget's bullet only where the budget stopped measurements
    budget = "stopped at the run's time budget"
    assert (budget in base) == bool(page.pitfalls.n_at_budget)
    assert budget not in render("lesson", _flip(page, pitfalls={"n_at_budget": 0}))
    assert "3 of 9 measurements stopped at the run's time budget before their intervals " \
        "reached ±3%" in render("lesson", _flip(page, pitfalls={"n_at_budget": 3, "n_cells": 9,
                                                                "target": 0.03}))


def test_a_template_error_names_the_file_its_line_and_the_name(tiny, tmp_path):
    _, _, page = tiny
    bad = tmp_path / "page.md.j2"
    bad.write_text("# {{ title }}\n\n{{ phases.modle }}\n")
    with pytest.raises(HarnessError) as exc:
        render(bad, page)
    assert exc.value.render().startswith(f"{bad}:3: ") and "modle" in exc.value.render()
    bad.write_text("line\n{% if title %}\n{{ title }\n")
    with pytest.raises(HarnessError) as exc:
        render(bad, page)
    assert exc.value.render().startswith(f"{bad}:3: template syntax error")
    bad.write_text("a\nb\n{{ nothing_here }}\n")
    with pytest.raises(HarnessError, match=r":3: 'nothing_here' is undefined"):
        render(bad, page)


def test_a_user_template_with_another_heading_renders_the_same_numbers(tiny, tmp_path):
    _, _, page = tiny
    mine = tmp_path / "mine.md.j2"
    mine.write_text(template_text("lesson").replace("## Two phases", "## Zwei Phasen"))
    ours, theirs = render("lesson", page), render(mine, page)
    assert "## Zwei Phasen" in theirs and "## Two phases" not in theirs
    assert theirs.replace("## Zwei Phasen", "## Two phases") == ours


@pytest.fixture
def run_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, path, *a, **k: Path(path).write_bytes(b"plot"))
    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(RUNS / "tiny_lesson" / "results.jsonl", out / "results.jsonl")
    return out


def test_the_cli_prints_templates_and_a_bad_one_writes_nothing(run_cli, run_copy, tmp_path):
    printed = run_cli("template", "lesson")
    assert printed.exit_code == 0 and printed.stdout == template_text("lesson")
    assert run_cli("template", "full").stdout.startswith("{#- The full report")
    refused = run_cli("template", "course")
    assert refused.exit_code == 2 and "no built-in template 'course'" in refused.stderr
    bad = tmp_path / "bad.md.j2"
    bad.write_text("# {{ title }}\n{{ no_such_name }}\n")
    result = run_cli("report", str(run_copy), "--template", str(bad))
    assert result.exit_code == 2 and f"{bad}:2: 'no_such_name' is undefined" in result.stderr
    assert sorted(p.name for p in run_copy.iterdir()) == ["results.jsonl"]
    good = run_cli("report", str(run_copy))
    assert good.exit_code == 0, good.stderr
    text = (run_copy / "report.md").read_text()
    plots = re.findall(r"\n\n!\[[^\]]+\]\(([a-z_]+\.png)\)", text)
    assert plots and all((run_copy / p).exists() for p in plots)
    # the plots the run drew are placed in the page, the rest is the golden page
    assert re.sub(r"\n\n!\[[^\]]+\]\([a-z_]+\.png\)", "", text) == GOLDEN.read_text()
    assert (run_copy / "full.md").read_text().startswith("# A tiny lesson page: the full report")


def test_a_scenario_names_its_template(run_cli, run_copy, tmp_path):
    from harness.engine.scenario import load_scenario

    page = tmp_path / "mine.md.j2"
    page.write_text("# {{ title }}, our way\n\nDecode ran at "
                    "{{ decode[0].tok_s.value|tok_s }} tok/s.\n")
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: t\nmodels: [tiny-qwen2]\ntemplate: mine.md.j2\n"
                        "tests:\n  - {prompt: 8, generate: 4}\n")
    assert load_scenario(scenario, 2).template == str(page)
    lines = (run_copy / "results.jsonl").read_text().splitlines(keepends=True)
    header = json.loads(lines[0])
    header["scenario"]["template"] = str(page)
    (run_copy / "results.jsonl").write_text(json.dumps(header) + "\n" + "".join(lines[1:]))
    assert run_cli("report", str(run_copy)).exit_code == 0
    text = (run_copy / "report.md").read_text()
    assert text.startswith("# A tiny lesson page, our way") and "tok/s." in text
    page.write_text("{% if title %}\n{{ title }\n")
    with pytest.raises(HarnessError, match=r"mine.md.j2:2: the template does not parse"):
        load_scenario(scenario, 2)


def template_names_of(kind: type) -> list[str]:
    """A typed result's fields and properties, the names a template sees."""
    return [f.name for f in dataclasses.fields(kind)] + [
        n for n in dir(kind) if isinstance(getattr(kind, n), property)]


def test_the_docs_list_every_name_a_template_can_use():
    from harness.report import course

    docs = (Path(__file__).resolve().parent.parent / "docs" / "templates.md").read_text()
    types = [course.CoursePage, course.Provenance, course.Reference, course.TwoPhases,
             course.PrefillRow, course.DecodeRow, course.Yardstick, course.DecodeModel,
             course.Quant, course.Batching, course.LongPrompt, course.KvCache, course.Hardware,
             course.Workload, course.Claim, course.Untested, course.Pitfalls, course.Plot,
             course.Figure]
    from harness.report import memory_lesson as ml

    types += [ml.MemoryLesson, ml.WeightRow, ml.KvRow, ml.Point, ml.UsersRow, ml.CacheCost,
              ml.Overheads]
    missing = [f"{t.__name__}.{name}" for t in types for name in template_names_of(t)
               if f"`{name}`" not in docs]
    assert not missing
    from harness.report.templating import FILTERS

    assert all(f"`{name}" in docs for name in FILTERS)



def test_a_lever_page_keeps_its_own_tables(run_cli, tmp_path, monkeypatch):
    from harness.core.options import PAGE_TEMPLATES
    from harness.levers import LEVERS

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: None)
    assert set(PAGE_TEMPLATES) == ({"lesson", "memory_lesson", "full"}
                                   | {lever.name for lever in LEVERS})
    for lever in LEVERS:  # each lever's page names its own tables
        text = template_text(lever.name)
        assert all(f"'{name}'" in text for name in lever.table_names)
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(RUNS / "tiny_lesson" / "results.jsonl", run / "results.jsonl")
    assert run_cli("report", str(run), "--full").exit_code == 0
    full = (run / "report.md").read_text()
    assert "### Batching: independent sequences decoded together" in full
    assert "### Repetitions: how each measurement ended" in full
    result = run_cli("report", str(run), "--template", "batching")
    assert result.exit_code == 0, result.stderr
    page = (run / "report.md").read_text()
    assert "### Batching: independent sequences decoded together" in page
    assert "### Repetitions" not in page and "## Reproduce" in page
    missing = run_cli("report", str(run), "--template", "batchin")
    assert missing.exit_code == 2 and "batchin: --template: no template file here" in \
        missing.stderr
