import csv
import io
import json
import math
import os
import shutil
import statistics
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
from scipy.stats import t as t_dist

from harness.report.compare import beyond_noise, compare_runs, render_compare_markdown
from harness.report.files import analysis_of, load_run, write_report
from harness.report.page import render_csv, render_json, render_markdown, report_data

RUNS = Path(__file__).resolve().parent / "fixtures" / "runs"
GOLDEN = Path(__file__).resolve().parent / "fixtures" / "golden"
PLOTS = ["decode_vs_bytes.png", "prefill_vs_prompt.png", "decode_per_token.png"]


def rendered(name: str) -> str:
    _, records = load_run(RUNS / name)
    return render_markdown(report_data(records, analysis_of(records)), PLOTS)


@pytest.mark.parametrize("name", ["tiny", "tiny_partial", "tiny_v2"])
def test_markdown_matches_golden(name):
    golden = GOLDEN / f"{name}.md"
    text = rendered(name)
    if os.environ.get("UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text()


def test_full_report_sections():
    text = rendered("tiny_v2")
    for heading in ("# Tiny end-to-end run", "### Prefill: time to first token",
                    "### Decode against model size", "### The rule of thumb",
                    "### Measured ceilings of this machine", "Estimates, not measurements",
                    "## Method", "## Environment", "## Reproduce", "ggml F32 streaming GB/s",
                    "harness run tests/scenarios/tiny.yaml", "![Decode tok/s"):
        assert heading in text, heading
    assert "Incomplete run" not in text


def _table_rows(text: str, title: str) -> list[list[str]]:
    lines = text.split(f"### {title}\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def test_decode_table_numbers_follow_from_the_raw_samples():
    """Every decode row recomputed here from the fixture's raw samples and probe records."""

    from harness.analysis.ceilings import ceiling_near, span
    from harness.core.costs import mean_decode_context

    _, records = load_run(RUNS / "tiny_v2")
    rows = {(r[0], r[1]): r for r in _table_rows(rendered("tiny_v2"),
                                                  "Decode against model size")}
    assert len(rows) == 4
    for m in records.measurements:
        if not m.n_gen:
            continue
        model = records.models[m.model_key]
        rates = [m.n_gen / sum(d) for d in m.samples["decode_s"]]
        rate = statistics.median(rates)
        n_bytes = model.decode_weight_n_bytes + model.kv_n_bytes_per_token_f16 * \
            mean_decode_context(m.n_prompt, m.n_gen)
        effective = rate * n_bytes / 1e9
        times = sum(n / ceiling_near(records.probes, span(m), m.threads,
                                     ("ggml", t, "stream_gb_s"))["value"]
                    for t, n in model.decode_type_n_bytes.items())
        stream = sum(model.decode_type_n_bytes.values()) / times
        row = rows[(m.model, m.dtype)]
        assert row[6].startswith(f"{rate:.2f} (")
        # 3 repetitions: median ± t(0.975, 2) · √(π/2) · sd / √3 of the log rates
        logs = [math.log(x) for x in rates]
        half = t_dist.ppf(0.975, 2) * math.sqrt(math.pi / 2) * statistics.stdev(logs) / math.sqrt(3)
        lo, hi = rate * math.exp(-half), rate * math.exp(half)
        assert row[6] == f"{rate:.2f} ({lo:.2f}–{hi:.2f})"
        assert row[7] == f"{1000 / rate:.1f} ({1000 / hi:.1f}–{1000 / lo:.1f})"  # inverse
        assert row[8] == f"{effective:.1f}" and row[9] == f"{stream:.1f}"
        # the share, round by round: each repetition ÷ the ceiling probed before its round
        beside = {p.round: p for p in records.probes if p.when == "beside"}
        shares = []
        for rnd, d in zip(m.samples["rounds"], m.samples["decode_s"], strict=True):
            t_s = sum(n / ceiling_near([beside[rnd]], beside[rnd].seq + 1, m.threads,
                                        ("ggml", t, "stream_gb_s"))["value"]
                      for t, n in model.decode_type_n_bytes.items())
            shares.append(m.n_gen / sum(d) * n_bytes / 1e9 * t_s
                          / sum(model.decode_type_n_bytes.values()))
        share = math.exp(statistics.fmean(math.log(x) for x in shares))
        assert row[10].startswith(f"{share:.0%} (")


def test_partial_run_says_what_is_missing():
    _, records = load_run(RUNS / "tiny_partial")
    assert records.truncated_bytes > 0 and len(records.measurements) == 3
    text = rendered("tiny_partial")
    assert "**Incomplete run:** 9 planned measurement(s) are missing" in text


def test_csv_and_json_exports_hold_the_same_tables():
    _, records = load_run(RUNS / "tiny")
    data = report_data(records, analysis_of(records))
    rows = list(csv.reader(io.StringIO(render_csv(data))))
    prefill = [r for r in rows if r[0] == "prefill"]
    assert len(prefill) == 8  # one row per prefill-only measurement (2 prompts x 4 models)
    header = rows[rows.index(prefill[0]) - 1]
    assert header[:2] == ["table", "model"] and "tok_s_ci_low" in header
    exported = json.loads(render_json(data))
    assert len(exported["tables"]["prefill"]["rows"]) == 8
    first = exported["tables"]["prefill"]["rows"][0]
    assert float(prefill[0][header.index("tok_s")]) == pytest.approx(first["tok_s"]["median"])
    assert exported["tables"]["decode"]["rows"][0]["gb_s"] > 0


def test_plots_are_written_and_non_empty(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUNS / "tiny", run)
    directory, records = load_run(run)
    out = write_report(directory, records)
    assert out == run / "report.md"
    for name in PLOTS:
        for ext in ("png", "svg"):
            f = run / name.replace(".png", f".{ext}")
            assert f.stat().st_size > 1000, f
        assert f"]({name})" in out.read_text()


def test_report_cli_formats(run_cli, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUNS / "tiny", run)
    r = run_cli("report", str(run), "--format", "json", "-o", str(tmp_path / "r.json"))
    assert r.exit_code == 0 and json.loads((tmp_path / "r.json").read_text())["tables"]
    assert run_cli("report", str(tmp_path / "nothing")).exit_code == 2


def test_compare_two_runs():

    _, full = load_run(RUNS / "tiny")
    _, partial = load_run(RUNS / "tiny_partial")
    c = compare_runs([("full", full), ("partial", partial)],
                     [analysis_of(full), analysis_of(partial)])
    matched = [r for r in c["rows"] if r["others"][0]["summary"]]
    assert len({r["id"] for r in matched}) == 3
    assert all(r["others"][0]["ratio"]["ratio"] == 1.0 for r in matched)
    assert all(not r["others"][0]["exceeds_noise"] for r in matched)
    text = render_compare_markdown(c)
    assert "missing" in text and "same machine" in text and "unpaired" in text


def test_a_difference_beyond_the_noise_is_one_whose_interval_excludes_1():
    from harness.core.stats import unpaired

    a = {"n": 6, "median": 10.0, "median_ci95": [9.9, 10.1]}
    b = {"n": 6, "median": 12.0, "median_ci95": [11.9, 12.1]}
    assert beyond_noise(unpaired(b, a)) is True
    assert beyond_noise(unpaired(a, dict(a))) is False
    wide = {"n": 6, "median": 12.0, "median_ci95": [8.0, 16.0]}
    assert beyond_noise(unpaired(wide, a)) is False


def test_every_share_above_100_percent_is_explained():
    from harness.render.tabular import ABOVE_CEILING_NOTE, ceiling_share_notes

    assert ceiling_share_notes([(0.9, 0.05, False), (1.0004, 0.05, False)]) == []
    flagged = ceiling_share_notes([(1.2, 0.05, True)])
    assert flagged == [ABOVE_CEILING_NOTE]
    within = ceiling_share_notes([(1.02, 0.05, False), (1.01, 0.03, False), (0.8, 0.0, False)])
    assert len(within) == 1 and within[0].startswith("Shares of 101.0%, 102.0% exceed 100% but "
                                                     "their 95% intervals")
    both = ceiling_share_notes([(1.3, 0.05, True), (1.04, 0.05, False)])
    assert both[0] == ABOVE_CEILING_NOTE and "104.0%" in both[1]


def test_compare_never_pairs_cells_run_at_other_contexts():
    """The same cell at another n_ctx (or from a run before contexts were recorded) is named,
    not compared: the context alone changes prefill speed."""
    _, full = load_run(RUNS / "tiny")
    _, other = load_run(RUNS / "tiny")
    first = other.measurements[0]
    other.measurements[0] = msgspec.structs.replace(first, n_ctx=512,
                                                    id=str(replace(first.cell, n_ctx=512)))
    _, mine = load_run(RUNS / "tiny")
    mine.measurements[0] = msgspec.structs.replace(first, n_ctx=256,
                                                   id=str(replace(first.cell, n_ctx=256)))
    c = compare_runs([("mine", mine), ("other", other), ("old", full)])
    row = next(r for r in c["rows"] if r["id"] == mine.measurements[0].id)
    assert [o["summary"] for o in row["others"]] == [None, None]
    assert [o["other_context"] for o in row["others"]] == ["n_ctx 512", "n_ctx not recorded"]
    text = render_compare_markdown(c)
    assert "only at n_ctx 512 | not compared" in text and "same context size" in text
