"""Ctrl-C and SIGTERM with a real subprocess: stop within a second, keep, resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

SCENARIO = Path(__file__).resolve().parent / "scenarios" / "long_tiny.yaml"


def _measurements(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines()
               if line.endswith("}") and json.loads(line)["type"] == "measurement")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupt_stops_within_a_second_and_resume_completes(tmp_path, sig):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "harness", "run", str(SCENARIO), "--out", str(out)]
    env = os.environ | {"HARNESS_PROBE_MIB": "8"}  # the ceilings are not under test here
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    results = out / "results.jsonl"
    deadline = time.monotonic() + 60
    while _measurements(results) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _measurements(results) == 1, "the first measurement never appeared"
    time.sleep(0.5)  # now inside the long decode measurement
    sent = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=10)
    assert time.monotonic() - sent < 1.0
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "--resume" in err
    assert _measurements(results) == 1  # kept, and nothing half-written
    resumed = subprocess.run(cmd + ["--resume"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert _measurements(results) == 2
