"""The one store every run writes through (harness.engine.results): its refusals, a failed
append taken back, and the resume rule."""

import json
import os
from pathlib import Path

import msgspec
import pytest
from conftest import assert_user_error

from harness.core.errors import HarnessError
from harness.engine import results
from harness.engine.results import SCHEMA_VERSION, RunWriter, read_records

ROOT = Path(__file__).resolve().parent.parent
ENV = {"hostname": "lab", "machine_id": "aaaa", "cpu_model": "EPYC", "physical_cores": 2,
       "ram_total_bytes": 24 * 2**30, "llama": {"ggml_commit": "abc"}}


def header(kind="measurement", **fields):
    base = {"type": "header", "kind": kind, "schema_version": SCHEMA_VERSION, "env": ENV,
            "created": "now"}
    if kind == "measurement":
        base["scenario"] = {"sha256": "s1"}
    else:
        base |= {"model": "m", "server": {"slots": 2, "command": ["x", "--port", "1"]},
                 "workload": {"n_prompt": 128}, "slo": None}
    return base | fields


def started(tmp_path, kind="measurement", **fields):
    with RunWriter(tmp_path, resume=False, kind=kind) as w:
        w.begin(header(kind, **fields), ["harness"])
        w.append({"type": "round", "round": 0})


def test_a_failed_append_is_taken_back_to_the_last_whole_line(tmp_path, monkeypatch):
    started(tmp_path)
    path = tmp_path / "results.jsonl"
    before = path.read_bytes()
    real = os.write

    def half_then_full(fd, data):
        real(fd, bytes(data[: len(data) // 2]))
        raise OSError(28, "No space left on device")

    with RunWriter(tmp_path, resume=True) as w:
        monkeypatch.setattr(results.os, "write", half_then_full)
        with pytest.raises(OSError):
            w.append({"type": "round", "round": 1})
        assert path.read_bytes() == before  # no fragment left behind
        monkeypatch.setattr(results.os, "write", real)
        w.append({"type": "node_failure", "error": "disk"})  # the next append is a whole line
    assert [type(r).__name__ for r in read_records(path).other] == ["NodeFailure"]


def test_resume_on_another_machine_is_refused_naming_what_differs(tmp_path):
    started(tmp_path)
    with RunWriter(tmp_path, resume=True) as w, pytest.raises(HarnessError) as err:
        w.begin(header(env=ENV | {"hostname": "pi", "machine_id": "bbbb"}), ["harness"])
    assert "hostname pi (was lab)" in str(err.value) and "machine_id bbbb (was aaaa)" in str(
        err.value)
    assert read_records(tmp_path / "results.jsonl").other == []  # nothing written


def test_resume_of_a_changed_serving_plan_is_refused(tmp_path):
    started(tmp_path, "serving")
    with RunWriter(tmp_path, resume=True, kind="serving") as w:
        # another port in the server's command is not another server
        w.begin(header("serving", server={"slots": 2, "command": ["x", "--port", "2"]}), [])
    with RunWriter(tmp_path, resume=True, kind="serving") as w, pytest.raises(
            HarnessError, match=r"workload.n_prompt 512 \(was 128\)"):
        w.begin(header("serving", workload={"n_prompt": 512}), [])


def test_a_folder_of_another_kind_or_schema_is_refused(tmp_path):
    started(tmp_path, "serving")
    with pytest.raises(HarnessError, match="holds a serving run's results, not a measurement"):
        RunWriter(tmp_path, resume=True)
    old = tmp_path / "old"
    started(old)
    with RunWriter(old, resume=True) as w, pytest.raises(HarnessError, match="schema 1"):
        w.records.header = msgspec.structs.replace(w.records.header, schema_version=1)
        w.begin(header(), [])


def test_a_schema_1_serving_file_is_read_as_a_serving_run(tmp_path):
    path = tmp_path / "results.jsonl"
    lines = [{"type": "header", "schema_version": 1, "workload": {}},
             {"type": "model", "path": "m.gguf"}, {"type": "probe", "seq": 1, "when": "c1"}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    records = read_records(path)
    assert records.header.kind == "serving" and list(records.models) == ["served"]
    assert records.probes[0].seq == 1


def test_every_record_kind_round_trips_through_its_type():
    from harness.core.records import RECORD_TYPES, to_dict, typed

    required = {"header": {"kind": "serving"}, "model": {"key": "m|f32"},
                "measurement": {"id": "m", "model": "m", "model_key": "m|f32", "dtype": "f32",
                                "threads": 1, "n_prompt": 8, "n_gen": 4},
                "repetition": {"id": "m", "round": 0, "rep": {"decode_s": [0.1]}},
                "round": {"round": 0}, "probe": {"when": "before"},
                "failure": {"model_key": "m|f32", "error": "x"}, "grouping": {"groups": [["a"]]},
                "request": {"level": "c1"}, "level": {"level": "c1"},
                "footprint": {"model": "m", "dtype": "f32", "kv_type": "f16", "n_users": 1,
                              "context": 256, "path": "m.gguf", "file_n_bytes": 1}}
    for kind in RECORD_TYPES:
        tag = kind.__struct_config__.tag
        record = typed({"type": tag, **required.get(tag, {})})
        assert type(record) is kind
        written = to_dict(record)
        assert written["type"] == tag and "seq" not in written
        assert typed(json.loads(json.dumps(written))) == record


def _foreign_run(tmp_path, **env):
    """A results folder of the tiny scenario whose header names another machine."""
    from harness.engine.scenario import load_scenario

    scenario = ROOT / "tests" / "scenarios" / "tiny.yaml"
    plan = load_scenario(scenario, 1)
    out = tmp_path / "run"
    with RunWriter(out, resume=False) as w:
        w.begin({"type": "header", "kind": "measurement", "schema_version": SCHEMA_VERSION,
                 "scenario": {"sha256": plan.sha256}, "env": ENV | env}, [])
    return scenario, out


def test_harness_run_resume_on_another_machine_exits_2_and_writes_nothing(run_cli, tmp_path):
    scenario, out = _foreign_run(tmp_path)
    before = (out / "results.jsonl").read_bytes()
    result = run_cli("run", str(scenario), "--out", str(out), "--resume")
    assert_user_error(result, "cannot resume", "hostname", "(was lab)", "start a new run")
    assert (out / "results.jsonl").read_bytes() == before


def test_harness_run_into_a_serving_runs_folder_exits_2(run_cli, tmp_path):
    started(tmp_path / "served", "serving")
    scenario = ROOT / "tests" / "scenarios" / "tiny.yaml"
    result = run_cli("run", str(scenario), "--out", str(tmp_path / "served"), "--resume")
    assert_user_error(result, "holds a serving run's results, not a measurement run's",
                      "choose another --out")


def test_a_cell_id_is_printed_and_parsed_in_one_place():
    from harness.core.cell import CellId
    from harness.engine.scenario import load_scenario

    plan = load_scenario(ROOT / "tests" / "scenarios" / "tiny.yaml", 1)
    for m in plan.measurements:
        assert CellId.parse(m.id) == m.cell and str(m.cell) == m.id
    lever = CellId("m", "f32", 2, 2048, 512, True, 512, 16, 32, depth=1024, kv_type="q8_0",
                   parallel=4, shared_prefix=64)
    assert str(lever) == "m|f32|t2|b2048|ub512|fa-on|ctx512|pp16|tg32|d1024|kv-q8_0|np4|px64"
    assert CellId.parse(str(lever)) == lever
    assert lever.test == "px64+pp16+tg32@d1024 x4 kv=q8_0"
    old = CellId.parse("tiny-qwen2|f32|t1|b2048|ub512|fa-auto|pp32|tg0")  # before contexts
    assert old.n_ctx is None and old.test == "pp32" and old == lever.__class__.parse(str(old))
    with pytest.raises(ValueError):
        CellId.parse("m|f32|t1|zz9|pp1|tg1")
