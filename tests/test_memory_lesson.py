"""The memory lesson: a scenario's `memory:` block measured into footprint records after the
rounds, and the page built from them (formula beside file beside llama.cpp, users that fit,
a quantized cache's decode cost)."""

from __future__ import annotations

import re
import shutil
from dataclasses import replace

import pytest
from conftest import ROOT, measure_scenario

from harness.core.records import Footprint
from harness.report.files import write_report
from harness.report.memory_lesson import memory_lesson, memory_loads
from harness.report.templating import Figure, render

SCENARIO = ROOT / "tests" / "scenarios" / "tiny_memory.yaml"


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("memory")
    plan, records = measure_scenario(SCENARIO, tmp)
    return plan, records, tmp


def test_every_load_of_the_memory_block_is_one_footprint_record(memory_run):
    plan, records, _ = memory_run
    loads = [(f.model, f.dtype, f.kv_type, f.n_users) for f in records.of_type(Footprint)]
    assert loads == plan.memory.loads()
    assert len(loads) == 2 * 2 + 2 + 2  # models × dtypes, + Q8_0 caches, + 4 users each
    assert all(f.footprint and f.error is None and f.weights for f in records.of_type(Footprint))
    assert records.header.scenario["memory"]["weights"] == "q8_0"


def test_each_formula_is_checked_against_llama_cpp(memory_run):
    _, records, _ = memory_run
    lesson = memory_lesson(records, memory_loads(records), None, "full.md")
    assert [(w.model, w.dtype) for w in lesson.weights] == [
        ("tiny-qwen2", "f32"), ("tiny-qwen2", "q8_0"), ("tiny-qwen3", "f32"),
        ("tiny-qwen3", "q8_0")]
    assert lesson.weights_exact and lesson.buffer_gap_max < 0.05
    assert lesson.n_kv_loaded == 4 and lesson.n_kv_equal == 4
    qwen2 = next(r for r in lesson.kv if r.model == "tiny-qwen2" and r.kv_type == "f16")
    assert qwen2.n_bytes_per_token == 2 * 2 * 1 * 32 * 2  # K and V × layers × heads × size × 2
    assert {p.n_users for p in lesson.points} == {1, 4}
    four = [p for p in lesson.points if p.n_users == 4]
    one = {p.model: p for p in lesson.points if p.n_users == 1}
    assert all(p.formula_gib > one[p.model].formula_gib for p in four)
    machines = {r.machine for r in lesson.users}
    assert "this machine (free)" in machines and len(machines) == 3
    assert all(r.users[1] > r.users[0] for r in lesson.users)  # Q8_0 fits more than F16
    assert [c.kv_type for c in lesson.costs] == ["f16", "q8_0"]
    assert lesson.costs[1].against_f16 is not None and lesson.costs[1].paired


def test_the_page_its_plot_and_full_report_are_written(memory_run):
    _, records, tmp = memory_run
    run = tmp / "page"
    shutil.copytree(tmp / "run", run)
    out = write_report(run, records)
    text = out.read_text()
    assert (run / "memory_vs_context.png").stat().st_size > 0 and (run / "full.md").exists()
    for heading in ("## Weights", "## The KV cache", "## Memory against context",
                    "## How many users fit", "## What a quantized cache costs",
                    "## Where llama.cpp's allocation differs"):
        assert heading in text
    assert "in all 4 loads" in text and "gave its tensor bytes to the byte" in text
    assert len(text.split()) <= 1500
    widest = max(line.count("|") - 1 for line in text.splitlines() if line.startswith("|"))
    assert widest <= 8
    assert "{{" not in text and "None" not in text
    full = (run / "full.md").read_text()
    loads = full.split("## Memory: every load")[1].split("\n## ")[0]
    assert loads.count("| tiny-qwen") == len(records.of_type(Footprint))


def test_a_resumed_run_loads_only_what_is_missing(memory_run, tmp_path, monkeypatch):
    from harness import runner
    from harness.engine.results import RunWriter

    plan, records, tmp = memory_run
    run = tmp_path / "run"
    run.mkdir()
    lines = (tmp / "run" / "results.jsonl").read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if '"n_users":4' not in ln]
    (run / "results.jsonl").write_text("".join(kept))
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp / "cache"))
    with RunWriter(run, resume=True) as writer:
        runner.measure_memory(plan.memory, writer, 0, None, runner.Console(info=lambda m: None))
        again = [(f.model, f.n_users) for f in writer.records.of_type(Footprint)]
    assert again[-2:] == [("tiny-qwen2", 4), ("tiny-qwen3", 4)]
    assert len(again) == len(plan.memory.loads())


def test_a_load_that_fails_is_recorded_and_named_on_the_page(memory_run, tmp_path,
                                                             monkeypatch):
    from harness import runner
    from harness.engine import footprint
    from harness.engine.results import RunWriter, read_records

    plan, _, tmp = memory_run
    run = tmp_path / "run"
    run.mkdir()
    header = (tmp / "run" / "results.jsonl").read_text().splitlines(keepends=True)[0]
    (run / "results.jsonl").write_text(header)

    def refuse(path, params, use_mmap, fill, prefill=True):
        if params.n_seq_max == 4:
            raise RuntimeError("failed to create the context")
        return footprint.measure(path, params, use_mmap, fill, prefill)

    monkeypatch.setattr(footprint, "measure_in_fresh_process", refuse)
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp / "cache"))
    with RunWriter(run, resume=True) as writer:
        runner.measure_memory(plan.memory, writer, 0, None, runner.Console(info=lambda m: None))
    records = read_records(run / "results.jsonl")
    failed = [f for f in records.of_type(Footprint) if f.error]
    assert [(f.model, f.n_users) for f in failed] == [("tiny-qwen2", 4), ("tiny-qwen3", 4)]
    lesson = memory_lesson(records, memory_loads(records), None, None)
    text = render("memory_lesson", lesson)
    assert text.count("> **Failed:**") == 2 and "failed to create the context" in text
    assert {p.n_users for p in lesson.points} == {1}  # the points are the loads measured
    assert "crosses: RSS; measured with caches for 1 user of 256 tokens." in text


@pytest.mark.parametrize(("against", "words"), [
    (Figure(0.80, 0.75, 0.85), "20% fewer tokens per second than F16"),
    (Figure(1.10, 1.05, 1.15), "10% more tokens per second than F16"),
    (Figure(0.99, 0.90, 1.08), "no difference from F16 within the interval."),
])
def test_the_cost_sentence_follows_the_measurement(memory_run, against, words):
    _, records, _ = memory_run
    lesson = memory_lesson(records, memory_loads(records), None, None)
    costs = (lesson.costs[0], replace(lesson.costs[1], against_f16=against))
    text = render("memory_lesson", replace(lesson, costs=costs))
    assert f"Q8_0: {words}" in text


def test_a_kv_buffer_the_formula_misses_is_not_called_equal(memory_run):
    _, records, _ = memory_run
    lesson = memory_lesson(records, memory_loads(records), None, None)
    kv = (replace(lesson.kv[0], equal=False), *lesson.kv[1:])
    text = render("memory_lesson", replace(lesson, kv=kv))
    assert "in 3 of 4 loads" in text and "in all 4 loads" not in text
    weights = (replace(lesson.weights[0], formula_n_bytes=lesson.weights[0].formula_n_bytes + 32),
               *lesson.weights[1:])
    text = render("memory_lesson", replace(lesson, weights=weights))
    assert "to the byte" not in text.split("## The KV cache")[0]
    assert re.search(r"differ where the table shows it", text)


def test_a_run_stopped_before_its_loads_says_so(memory_run, tmp_path):
    from harness.engine.results import read_records

    _, _, tmp = memory_run
    lines = (tmp / "run" / "results.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "results.jsonl").write_text(
        "".join(ln for ln in lines if '"type":"footprint"' not in ln))
    records = read_records(tmp_path / "results.jsonl")
    text = render("memory_lesson", memory_lesson(records, memory_loads(records), None, None))
    assert "**Not measured yet:**" in text and "## Weights" not in text
    assert "## How many users fit" not in text and "## What a quantized cache costs" in text
