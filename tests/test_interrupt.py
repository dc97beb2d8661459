"""Ctrl-C and SIGTERM with a real subprocess: stop within a second, keep, resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, ctrl_c_reaches_child

SCENARIO = Path(__file__).resolve().parent / "scenarios" / "long_tiny.yaml"


def _count(path: Path, kind: str) -> int:
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines()
               if line.endswith("}") and json.loads(line)["type"] == kind)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupt_stops_within_a_second_and_resume_completes(tmp_path, sig):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "harness", "run", str(SCENARIO), "--out", str(out)]
    env = dict(os.environ)  # HARNESS_PROBE_MIB=1 (conftest): the ceilings are not under test
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, preexec_fn=ctrl_c_reaches_child)
    results = out / "results.jsonl"
    deadline = time.monotonic() + 60
    while _count(results, "repetition") < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _count(results, "repetition") >= 2, "the first round never ended"
    sent = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=10)
    assert time.monotonic() - sent < 1.0
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "--resume" in err
    kept = _count(results, "repetition")
    assert 2 <= kept < 16 and _count(results, "measurement") == 0  # kept, none half-written
    for line in results.read_text().splitlines():
        json.loads(line)
    resumed = subprocess.run(cmd + ["--resume"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert _count(results, "measurement") == 2 and _count(results, "repetition") == 16
