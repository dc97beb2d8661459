"""Fleet runs on Ray: the node side and the driver's choices without a cluster, then real
clusters (one node, two nodes, a node removed mid-run and resumed) inside a network namespace
with only loopback up, so no test traffic leaves the machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import ROOT, assert_user_error, ctrl_c_reaches_child

from harness import fleet, runner
from harness.core.errors import HarnessError
from harness.engine.results import RunWriter, read_records

SCENARIO = Path(__file__).resolve().parent / "scenarios" / "fleet.yaml"
CASES = Path(__file__).resolve().parent / "fleet" / "cluster_cases.py"


def _raw(node_id, host, cpus=2, alive=True, label=None, port=1):
    return {"NodeID": node_id, "Alive": alive, "NodeManagerHostname": host,
            "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": port,
            "Resources": {"CPU": cpus}, "Labels": {fleet.LABEL_KEY: label} if label else {}}


def test_nodes_are_labelled_by_host_and_index_or_their_own_label():
    nodes = fleet.alive_nodes([_raw("b" * 56, "lab", port=2), _raw("a" * 56, "lab", port=1),
                               _raw("c" * 56, "lab", alive=False),
                               _raw("d" * 56, "pi", label="desk-3")])
    assert [(n.label, n.node_id[0]) for n in nodes] == [("lab-0", "a"), ("lab-1", "b"),
                                                        ("desk-3", "d")]
    assert fleet.select_nodes(nodes, ["desk-3", "bbbbbbbb"]) == [nodes[2], nodes[1]]
    with pytest.raises(HarnessError) as info:
        fleet.select_nodes(nodes, ["lab-7"])
    assert "--nodes" in info.value.render() and "lab-0" in info.value.render()
    with pytest.raises(HarnessError):
        fleet.alive_nodes([_raw("e" * 56, "x", label="../up")])


def test_a_node_with_other_versions_is_named():
    own = {"harness": "0.2.0", "llama_cpp_python": "0.3.36", "ggml_commit": "abc"}
    assert fleet.version_mismatch(own, dict(own)) is None
    said = fleet.version_mismatch(own, own | {"harness": "9.9"})
    assert said == "harness 0.2.0 (driver: 9.9)"


def test_node_run_streams_records_that_make_a_local_run(tmp_path, monkeypatch):
    """The node side without Ray: every record it yields, appended by the driver's writer,
    gives the same JSONL structure as a local run of the scenario."""
    monkeypatch.setattr(runner.noise, "idle_reading", lambda seconds=0.3: 0.0)
    text = SCENARIO.read_text()
    with RunWriter(tmp_path / "node", resume=False) as writer:
        items = list(fleet.node_run(text, str(SCENARIO), [], "lab-0", False, None))
        for item in items:
            if item["type"] != "console":
                writer.append(item)
    streamed = read_records(tmp_path / "node" / "results.jsonl")
    assert any(i["type"] == "console" for i in items)
    assert not [i for i in items if i["type"] == "node_error"]
    local = tmp_path / "local"
    assert runner_local(local) == 0
    plain = read_records(local / "results.jsonl")
    assert [m.id for m in streamed.measurements] == [m.id for m in plain.measurements]
    kinds = lambda r: sorted({type(x).__name__ for x in [  # noqa: E731
        r.header, *r.measurements, *r.probes, *r.rounds, *r.repetitions, *r.other]})
    assert kinds(streamed) == kinds(plain)


IDENTITY = {"hostname": "lab", "machine_id": "5f0c2b1e9d3a4c77", "cpu_model": "EPYC",
            "physical_cores": 2, "ram_total_bytes": 24 * 2**30, "ggml_commit": "0c1e570"}


def test_a_machine_is_known_by_host_cpu_cores_ram_and_ggml():
    env = {k: v for k, v in IDENTITY.items() if k != "ggml_commit"} | {
        "llama": {"ggml_commit": "0c1e570"}, "ram_available_bytes": 1}
    assert fleet.machine_identity(env) == IDENTITY
    # the kernel's reserved memory moves total RAM a little between boots of one machine
    assert fleet.identity_differences(IDENTITY | {"ram_total_bytes": 24 * 2**30 - 2**26},
                                      IDENTITY) == []
    said = fleet.identity_differences(IDENTITY | {"hostname": "pi", "ram_total_bytes": 2**33},
                                      IDENTITY)
    assert said == ["hostname pi (was lab)", "ram_total_bytes 8.0 GiB (was 24.0 GiB)"]
    assert fleet.identity_differences(IDENTITY | {"ggml_commit": "abc"}, IDENTITY) == [
        "ggml_commit abc (was 0c1e570)"]


def _stored_header(run_dir: Path, identity: dict) -> None:
    env = identity | {"llama": {"ggml_commit": identity["ggml_commit"]}}
    run_dir.mkdir(parents=True)
    header = {"type": "header", "kind": "measurement", "scenario": {}, "env": env}
    (run_dir / "results.jsonl").write_text(json.dumps(header) + "\n")


def test_a_resumed_label_on_another_machine_is_refused_or_relabelled(tmp_path):
    _stored_header(tmp_path / "lab-0", IDENTITY)
    _stored_header(tmp_path / "lab-0.2", IDENTITY | {"hostname": "third"})
    nodes = [fleet.Node("a" * 56, "lab-0", "pi", 2.0)]
    req = fleet.FleetRequest(SCENARIO, "auto", [], tmp_path, True, False, None)
    said = []
    assert fleet.same_machines(nodes, {"lab-0": IDENTITY}, req, said.append) == nodes
    other = IDENTITY | {"hostname": "pi", "cpu_model": "Xeon"}
    with pytest.raises(HarnessError) as info:
        fleet.same_machines(nodes, {"lab-0": other}, req, said.append)
    text = info.value.render()
    assert "node lab-0 is not the machine" in text and "hostname pi (was lab)" in text
    assert "cpu_model Xeon (was EPYC)" in text and "--relabel" in text
    relabel = replace(req, relabel=True)
    (moved,) = fleet.same_machines(nodes, {"lab-0": other}, relabel, said.append)
    assert moved.label == "lab-0.3"  # lab-0.2 holds a third machine's records
    assert said == ["[lab-0] another machine than before (hostname pi (was lab), cpu_model "
                    "Xeon (was EPYC)): recorded as lab-0.3"]
    assert fleet.same_machines(nodes, {"lab-0": IDENTITY | {"hostname": "third"}}, relabel,
                               said.append)[0].label == "lab-0.2"  # found again where it was
    fresh = replace(req, resume=False)  # a new run checks nothing against old records
    assert fleet.same_machines(nodes, {"lab-0": other}, fresh, said.append) == nodes


class _FakeRay:
    def __init__(self):
        self.cancelled = []

    def get(self, ref):
        return ref

    def cancel(self, ref, force=False):
        self.cancelled.append((ref, force))


def test_a_failed_append_cancels_the_node_task_and_keeps_what_was_written(tmp_path,
                                                                         monkeypatch):
    ray = _FakeRay()
    writer = RunWriter(tmp_path / "lab-0", resume=False)
    real, calls = writer.append, []

    def append(record):
        calls.append(record["type"])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(record)

    monkeypatch.setattr(writer, "append", append)
    items = [{"type": "header", "kind": "measurement", "scenario": {}, "argv": ["n"]},
             {"type": "repetition", "id": "x", "round": 0, "rep": {}},
             {"type": "repetition", "id": "y"}]
    task = iter(items)
    state = fleet.NodeState(fleet.Node("a" * 56, "lab-0", "pi", 2.0), writer, 2, task=task)
    said = []
    fleet._consume(ray, state, said.append)
    writer.close()
    assert ray.cancelled == [(task, True)]
    assert state.status == "failed" and "No space left on device" in state.error
    assert "its task is cancelled" in state.error and "written before are kept" in state.error
    assert said == [f"[lab-0] failed: {state.error}; the other nodes go on"]
    assert calls == ["header", "repetition", "node_failure"]  # nothing after the failure
    kept = read_records(tmp_path / "lab-0" / "results.jsonl")
    assert kept.header.argv == ["n"]
    assert [type(r).__name__ for r in kept.other] == ["NodeFailure"]


def runner_local(out: Path) -> int:
    proc = subprocess.run([sys.executable, "-m", "harness", "run", str(SCENARIO), "--out",
                           str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=os.environ | {"HARNESS_PROBE_MIB": "1"})
    return proc.returncode


def test_ray_missing_says_how_to_install(run_cli, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    r = run_cli("run", str(SCENARIO), "--ray", "local", "--out", str(tmp_path / "f"))
    assert_user_error(r, "--ray", "not installed", "pip install 'harness[ray]'")
    assert not (tmp_path / "f").exists()


def test_nodes_without_ray_is_refused(run_cli):
    assert_user_error(run_cli("run", str(SCENARIO), "--nodes", "lab-0"), "--nodes", "--ray")


def test_unreachable_address_is_refused_fast(run_cli, tmp_path):
    pytest.importorskip("ray")
    r = run_cli("run", str(SCENARIO), "--ray", "127.0.0.1:9", "--out", str(tmp_path / "f"))
    assert_user_error(r, "--ray", "nothing answers at 127.0.0.1:9")
    r = run_cli("run", str(SCENARIO), "--ray", "nohost", "--out", str(tmp_path / "f"))
    assert_user_error(r, "--ray", "not HOST:PORT")


# --- real clusters, in a network namespace -------------------------------------------------

def _namespace_ok() -> str | None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs unshare and ip (util-linux, iproute2)"
    if os.geteuid() != 0:
        return "needs root to make a network namespace"
    try:
        import ray  # noqa: F401
    except ImportError:
        return "needs Ray (pip install 'harness[ray]')"
    return None


@pytest.mark.parametrize("case", ["pair", "single", "fault_and_resume", "local", "interrupt"])
def test_cluster_case(case, tmp_path):
    why = _namespace_ok()
    if why:
        pytest.skip(why)
    script = (f"ip link set lo up && exec {sys.executable} {CASES} {case} {tmp_path} "
              f"{SCENARIO}")
    # -n: only loopback; --pid --fork --mount-proc: every Ray process dies with the script;
    # a Ray folder of its own (short: it holds Unix sockets), so cases can run side by side
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    try:
        proc = subprocess.run(["unshare", "-n", "--pid", "--fork", "--mount-proc", "sh", "-c",
                               script], capture_output=True, text=True, timeout=240, cwd=ROOT,
                              preexec_fn=ctrl_c_reaches_child,
                              env=os.environ | {"HARNESS_PROBE_MIB": "1", "RAY_TMPDIR": ray_tmp,
                                                "RAY_USAGE_STATS_ENABLED": "0"})
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["case"] == case and summary["ok"]


def test_relabel_without_a_fleet_resume_is_refused(run_cli):
    assert_user_error(run_cli("run", str(SCENARIO), "--relabel"), "--relabel", "--resume")
