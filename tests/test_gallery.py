"""The gallery: machines compared from stored runs. Three machines are made from one stored
fixture run by giving its header three different environments (what a lab's laptops send in);
the page's numbers are checked against each run's own analysis."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness.core.errors import HarnessError
from harness.core.stats import center
from harness.report.files import analysis_of, load_run, write_gallery
from harness.report.gallery import load_reference_points

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "runs" / "tiny_v2"
REFERENCE = Path(__file__).resolve().parents[1] / "data" / "reference_points.yaml"
MACHINES = [("lab-a", "Intel Core i7", 4), ("lab-b", "Apple M2", 8), ("lab-c", "AMD Ryzen", 6)]


def _machine_run(root: Path, host: str, cpu: str, cores: int) -> Path:
    run = root / host
    run.mkdir(parents=True)
    lines = (FIXTURE / "results.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    header["env"] |= {"hostname": host, "cpu_model": cpu, "physical_cores": cores}
    (run / "results.jsonl").write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    return run


@pytest.fixture
def fleet(tmp_path):
    for host, cpu, cores in MACHINES:
        _machine_run(tmp_path / "fleet", host, cpu, cores)
    return tmp_path / "fleet"


def test_gallery_compares_every_machine_with_its_own_numbers(fleet, tmp_path):
    page = write_gallery([fleet], tmp_path / "out", REFERENCE).read_text()
    assert page.startswith("# Machines compared") and "3 machines" in page
    _, records = load_run(fleet / "lab-a")
    decode = analysis_of(records)["decode"]
    for host, cpu, cores in MACHINES:
        assert f"| {host} | {cpu} | 1 of {cores} |" in page
        for r in decode:
            row = (f"| {host} | {r['model']} | {r['dtype']} | {r['threads']} | "
                   f"{center(r['tok_s']):.2f} (")
            assert row in page, row
    assert (tmp_path / "out" / "rule_of_thumb.png").stat().st_size > 0
    assert "not measured by this harness" in page and "PR #4766" in page


def test_a_machine_with_nothing_in_common_is_listed_not_dropped(tmp_path):
    for host, cpu, cores in MACHINES[:2]:
        _machine_run(tmp_path / "runs", host, cpu, cores)
    odd = _machine_run(tmp_path / "odd", "lab-z", "RISC-V", 4)
    text = (odd / "results.jsonl").read_text().replace("tiny-qwen2", "tiny-other").replace(
        "tiny-llama", "tiny-other2")
    (odd / "results.jsonl").write_text(text)
    page = write_gallery([tmp_path / "runs", odd], tmp_path / "out", None).read_text()
    assert "listed, not compared): lab-z\n" in page
    assert "| lab-z | RISC-V |" in page


def test_reference_points_need_every_key_and_positive_numbers(tmp_path):
    assert len(load_reference_points(REFERENCE)) == 4
    bad = tmp_path / "ref.yaml"
    bad.write_text("points:\n  - {hardware: x, model: y, size_gib: 0, tok_s: 5, "
                   "bandwidth_gb_s: 100, source: z}\n")
    with pytest.raises(HarnessError) as err:
        load_reference_points(bad)
    assert "size_gib" in str(err.value) and "positive" in str(err.value)
    bad.write_text("points:\n  - {hardware: x}\n")
    with pytest.raises(HarnessError, match="lacks model"):
        load_reference_points(bad)


def test_gallery_cli_bad_input_is_one_line_and_exit_2(run_cli, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_cli("gallery", str(empty), "--out", str(tmp_path / "g"))
    assert result.exit_code == 2 and "no runs found" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_gallery_cli_writes_the_page(run_cli, fleet, tmp_path):
    shutil.rmtree(fleet / "lab-c")
    result = run_cli("gallery", str(fleet), "--out", str(tmp_path / "g"))
    assert result.exit_code == 0 and result.stdout.strip().endswith("gallery.md")
    assert "2 machines" in (tmp_path / "g" / "gallery.md").read_text()


def test_a_decode_above_its_ceiling_is_said_in_its_row(fleet, tmp_path, monkeypatch):
    from harness.report import gallery

    page = write_gallery([fleet], tmp_path / "plain", None).read_text()
    assert "above ceiling" not in page and "| notes |" not in page
    original = gallery.decode_table

    def one_flagged(data):
        first = next(iter(data["machines"].values()))
        row = next(iter(first["decode"].values()))
        row["flags"] = [*row["flags"], "above-ceiling"]
        return original(data)

    monkeypatch.setattr(gallery, "decode_table", one_flagged)
    page = write_gallery([fleet], tmp_path / "flagged", None).read_text()
    assert "| notes |" in page and page.count("| above ceiling |") == 1
    assert "flagged above-ceiling when its whole 95% interval lies above 100%" in page
