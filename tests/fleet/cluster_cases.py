"""Ray cluster cases for tests/test_fleet.py, run as `cluster_cases.py CASE TMP SCENARIO`
inside a network namespace with only loopback up. Each case starts its cluster on
127.0.0.1, drives `harness run --ray` (in this process or as a subprocess), checks what it
wrote, shuts every Ray process down and writes TMP/summary.json."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness import fleet
from harness.cli import main
from harness.core.records import NodeFailure, Resume
from harness.engine.results import RunWriter, read_records

LOOPBACK = {"node_ip_address": "127.0.0.1", "include_dashboard": False}



def finished(records) -> bool:
    """A run wrote its last record: the probe after the measurements."""
    return any(p.when == "after" for p in records.probes)

def start_cluster(labels: list[str]):
    """A head node and a worker per further label, one CPU each, all on 127.0.0.1."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=LOOPBACK | {
        "num_cpus": 1, "labels": {fleet.LABEL_KEY: labels[0]}})
    workers = [cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1",
                                labels={fleet.LABEL_KEY: label}) for label in labels[1:]]
    cluster.wait_for_nodes()
    return cluster, workers


def harness(*args: str) -> tuple[int, str]:
    """Run the CLI in this process: (exit status, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, err.getvalue()


def complete(run_dir: Path, n: int) -> bool:
    records = read_records(run_dir / "results.jsonl")
    return len(records.measured_ids) == n and finished(records)


def case_local(tmp: Path, scenario: Path) -> None:
    """--ray local: a one-node cluster here gives one run directory with a local run's JSONL
    and a report."""
    start = time.perf_counter()
    code, err = harness("run", str(scenario), "--ray", "local", "--out", str(tmp / "f"))
    assert code == 0, err
    (label,) = [p.name for p in (tmp / "f").iterdir() if p.is_dir()]
    assert complete(tmp / "f" / label, 2) and (tmp / "f" / label / "report.md").exists()
    status = json.loads((tmp / "f" / "fleet.json").read_text())["nodes"][label]["status"]
    assert status == "done", status
    print(f"--ray local took {time.perf_counter() - start:.1f} s")


def case_pair(tmp: Path, scenario: Path) -> None:
    """The cases of a two-node cluster, one after the other on one cluster (a cluster takes
    seconds to start): two nodes, then a node whose records cannot be appended."""
    cluster, _ = start_cluster(["lab-a", "lab-b"])
    try:
        two_nodes(tmp / "two", scenario, cluster)
        writer_failure(tmp / "writer", scenario, cluster)
    finally:
        cluster.shutdown()


def case_single(tmp: Path, scenario: Path) -> None:
    """The cases of a one-node cluster on one cluster: refusals, then a replaced machine."""
    cluster, _ = start_cluster(["lab-a"])
    try:
        refusals(tmp / "refusals", scenario, cluster)
        replaced_machine(tmp / "replaced", scenario, cluster)
    finally:
        cluster.shutdown()


def two_nodes(tmp: Path, scenario: Path, cluster) -> None:
    """Two nodes on one machine: two run directories named by their labels; --nodes picks."""
    code, err = harness("run", str(scenario), "--ray", cluster.address, "--out",
                        str(tmp / "f"))
    assert code == 0, err
    assert sorted(p.name for p in (tmp / "f").iterdir() if p.is_dir()) == ["lab-a", "lab-b"]
    assert complete(tmp / "f" / "lab-a", 2) and complete(tmp / "f" / "lab-b", 2)
    assert "[lab-a] " in err and "[lab-b] " in err
    assert f"harness gallery {tmp / 'f'}" in err
    code, err = harness("gallery", str(tmp / "f"), "--out", str(tmp / "gallery"))
    assert code == 0 and (tmp / "gallery" / "gallery.md").exists(), err
    code, err = harness("run", str(scenario), "--ray", cluster.address, "--nodes", "lab-b",
                        "--out", str(tmp / "g"))
    assert code == 0, err
    assert [p.name for p in (tmp / "g").iterdir() if p.is_dir()] == ["lab-b"]


def refusals(tmp: Path, scenario: Path, cluster) -> None:
    """A node filter matching nothing, and a node with other versions: exit 2, one line."""
    code, err = harness("run", str(scenario), "--ray", cluster.address, "--nodes", "lab-z",
                        "--out", str(tmp / "f"))
    assert code == 2 and "'lab-z' matches no alive node" in err and "lab-a" in err, err
    assert len(err.strip().splitlines()) == 1, err
    real = fleet.versions
    fleet.versions = lambda: real() | {"harness": "0.0.0-other"}  # the driver differs
    try:
        code, err = harness("run", str(scenario), "--ray", cluster.address, "--out",
                            str(tmp / "g"))
    finally:
        fleet.versions = real
    assert code == 2 and "node lab-a" in err and "refused" in err and "0.0.0-other" in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp / "g").exists()


def case_fault_and_resume(tmp: Path, scenario: Path) -> None:
    """A node removed mid-run: its failure is recorded, the other finishes, exit 1 with the
    --resume command; a node rejoining with the same label then completes its cells."""
    cluster, (worker,) = start_cluster(["lab-a", "lab-b"])
    try:
        out = tmp / "f"
        cmd = [sys.executable, "-m", "harness", "run", str(scenario), "--ray", cluster.address,
               "--out", str(out)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        b = out / "lab-b" / "results.jsonl"
        deadline = time.time() + 90
        while time.time() < deadline and not (
                b.exists() and read_records(b).repetitions):
            time.sleep(0.1)
        kept = len(read_records(b).repetitions)
        assert kept, "node lab-b never started measuring"
        cluster.remove_node(worker)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err
        records = read_records(b)
        failure = records.of_type(NodeFailure)
        assert failure and failure[0].status == "failed", err
        assert len(records.repetitions) >= kept and not finished(records)
        assert complete(out / "lab-a", 2), err
        assert "--resume" in err and "did not finish" in err
        print(f"removed lab-b after {kept} repetition(s); the driver said:")
        print("\n".join(line for line in err.splitlines() if not line.startswith("[20")))
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1",
                         labels={fleet.LABEL_KEY: "lab-b"})
        cluster.wait_for_nodes()
        code, err = harness("run", str(scenario), "--ray", cluster.address, "--out", str(out),
                            "--resume")
        assert code == 0, err
        assert complete(out / "lab-b", 2) and complete(out / "lab-a", 2)
        resumed = read_records(b)
        assert len(resumed.repetitions) >= len(records.repetitions)
        assert resumed.of_type(Resume)
    finally:
        cluster.shutdown()


def case_interrupt(tmp: Path, scenario: Path) -> None:
    """Ctrl-C on the driver: the node task is cancelled, what arrived is kept, and the
    --resume command is printed."""
    out = tmp / "f"
    cmd = [sys.executable, "-m", "harness", "run", str(scenario), "--ray", "local", "--out",
           str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 90
    while time.time() < deadline and not [
            p for p in out.glob("*/results.jsonl") if read_records(p).repetitions]:
        time.sleep(0.1)
    (results,) = out.glob("*/results.jsonl")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err)
    assert "interrupted" in err and "--resume" in err, err
    kept = read_records(results)
    assert kept.repetitions and not finished(kept)
    (status,) = json.loads((out / "fleet.json").read_text())["nodes"].values()
    assert status["status"] == "cancelled", status
    print(f"interrupted after {len(kept.repetitions)} repetition(s)")


def replaced_machine(tmp: Path, scenario: Path, cluster) -> None:
    """A label whose earlier results came from another machine: --resume is refused (exit 2,
    one line naming what differs, nothing written); with --relabel this machine is recorded
    under LABEL.2, and a later --relabel resume finds it there again."""
    out = tmp / "f"
    code, err = harness("run", str(scenario), "--ray", cluster.address, "--out", str(out))
    assert code == 0, err
    results = out / "lab-a" / "results.jsonl"
    lines = results.read_text().splitlines()
    header = json.loads(lines[0])
    header["env"]["hostname"] = "another-host"  # as if lab-a's records came from elsewhere
    results.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    before = results.read_bytes()
    resume = ["run", str(scenario), "--ray", cluster.address, "--out", str(out), "--resume"]
    code, err = harness(*resume)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert "node lab-a is not the machine" in err and "(was another-host)" in err, err
    assert "--relabel" in err, err
    assert results.read_bytes() == before
    code, err = harness(*resume, "--relabel")
    assert code == 0, err
    assert "recorded as lab-a.2" in err, err
    assert complete(out / "lab-a.2", 2) and results.read_bytes() == before
    code, err = harness(*resume, "--relabel")
    assert code == 0, err
    assert not (out / "lab-a.3").exists()
    print(err.strip().splitlines()[0])


def writer_failure(tmp: Path, scenario: Path, cluster) -> None:
    """Appending a node's records fails (a full disk): that node's task is cancelled, what it
    wrote before stays, the driver says so, and the other node finishes."""
    import ray

    real_append, real_cancel, cancelled = RunWriter.append, ray.cancel, []

    def append(self, record):
        if self.dir.name == "lab-b" and record.get("type") == "repetition":
            raise OSError(28, "No space left on device")
        real_append(self, record)

    def cancel(ref, **kwargs):
        cancelled.append(ref)
        return real_cancel(ref, **kwargs)

    RunWriter.append, ray.cancel = append, cancel
    try:
        out = tmp / "f"
        code, err = harness("run", str(scenario), "--ray", cluster.address, "--out", str(out))
    finally:
        RunWriter.append, ray.cancel = real_append, real_cancel
    assert code == 1, err
    assert "[lab-b] failed: could not append its records" in err, err
    assert "No space left on device" in err and "its task is cancelled" in err, err
    assert "written before are kept" in err, err
    assert len(cancelled) == 1, cancelled
    kept = read_records(out / "lab-b" / "results.jsonl")
    assert kept.header and not kept.repetitions and not finished(kept)
    (failure,) = kept.of_type(NodeFailure)
    assert failure.status == "failed" and "cancelled" in failure.error
    assert complete(out / "lab-a", 2), err
    print("\n".join(line for line in err.splitlines() if line.startswith("[lab-b] failed")))


if __name__ == "__main__":
    case, tmp, scenario = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    globals()[f"case_{case}"](tmp, scenario)
    (tmp / "summary.json").write_text(json.dumps({"case": case, "ok": True}))
