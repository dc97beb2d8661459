"""The edges of the newer features: limits on what is read, confined names, servers started only
from trusted places and dying with harness, endpoints on this machine unless asked, bounded
waits on a silent server, a full disk, and the machine identity of fleet nodes."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, assert_user_error

from harness.core.errors import (
    EXIT_BUSY,
    EXIT_DISK_FULL,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    HarnessError,
)

STUB = Path(__file__).resolve().parent / "fixtures" / "stub_server.py"


def _wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead: its parent (init here) has not reaped it yet
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _stub_binary(tmp_path: Path) -> Path:
    """An executable llama-server stand-in (a shell script running the stub)."""
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {STUB} \"$@\"\n")
    binary.chmod(0o755)
    return binary


@pytest.fixture
def stub_endpoint(tmp_path):
    """Start the stub on a free loopback port in a mode; yield its URL; stop it."""
    procs = []

    def start(mode: str) -> str:
        pid_file = tmp_path / f"stub-{mode}.pid"
        env = os.environ | {"STUB_MODE": mode, "STUB_PID_FILE": str(pid_file),
                            "STUB_LIFETIME_S": "60"}
        procs.append(subprocess.Popen([sys.executable, str(STUB)], env=env))
        assert _wait_for(pid_file.exists, 20), "the stub did not start"
        time.sleep(0.05)
        return f"http://127.0.0.1:{pid_file.read_text().split()[1]}"

    yield start
    for p in procs:
        p.kill()
        p.wait(10)


# --- YAML and files: limits ------------------------------------------------------------------

def test_a_file_above_the_size_limit_is_refused_unparsed(run_cli, tmp_path):
    from harness.core.yamlio import MAX_FILE_BYTES

    big = tmp_path / "big.yaml"
    big.write_text("name: t\n# " + "x" * MAX_FILE_BYTES + "\n")
    result = run_cli("check", str(big))
    assert_user_error(result, "big.yaml", f"above the limit of {MAX_FILE_BYTES:,}")


def test_limits_are_named_and_ordinary_files_load():
    from harness.core.yamlio import MAX_DEPTH, parse_yaml

    ok = "a: " + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1)
    assert parse_yaml(ok, "x.yaml").data["a"] is not None
    with pytest.raises(HarnessError, match=f"nested deeper than {MAX_DEPTH} levels"):
        parse_yaml("a: " + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "x.yaml")
    with pytest.raises(HarnessError, match="nested deeper"):  # an anchor holding itself
        parse_yaml("a: &a [*a]", "x.yaml")


def test_a_spec_file_is_never_echoed(run_cli, tmp_path):
    secret = tmp_path / "notes.yaml"
    secret.write_text("- my-private-token-12345\n")
    result = run_cli("build", str(secret))
    assert_user_error(result, "expected a mapping of keys to values, got list")
    assert "private" not in result.stderr


# --- names ---------------------------------------------------------------------------------

def test_names_and_safe_names():
    from harness.core.yamlio import is_name, safe_name

    assert all(is_name(n) for n in ("qwen2.5-0.5b", "a_b", "X1"))
    assert not any(is_name(n) for n in ("", ".x", "-x", "a/b", "..", "a b", "a\\b", "x" * 101))
    assert safe_name("../../My Model!") == "My-Model"
    assert safe_name("qwen2.5-0.5b") == "qwen2.5-0.5b"
    assert is_name(safe_name("///")) and is_name(safe_name(".hidden"))


def test_a_gguf_with_an_odd_file_name_builds_under_the_cache(tmp_path):
    from dataclasses import replace

    from harness.core.dtypes import DTYPES
    from harness.core.specs import resolve_spec
    from harness.engine.build import cache_target

    spec = replace(resolve_spec("tiny-qwen2"), name="../../escape")
    target = cache_target(spec, DTYPES["f32"], 0, tmp_path)
    assert target.parent == tmp_path and target.name.startswith("escape-")


# --- servers: only trusted ones, dying with harness ------------------------------------------

def test_a_killed_harness_leaves_no_server(tmp_path):
    pid_file = tmp_path / "stub.pid"
    env = os.environ | {"STUB_MODE": "silent", "STUB_PID_FILE": str(pid_file),
                        "STUB_LIFETIME_S": "60", "HARNESS_CACHE_DIR": str(tmp_path / "cache"),
                        "HARNESS_PROBE_MIB": "1"}
    harness = subprocess.Popen(
        [sys.executable, "-m", "harness", "serve", "tiny-qwen2", "--server",
         str(_stub_binary(tmp_path)), "--no-inprocess", "--concurrency", "1", "--requests", "1",
         "--out", str(tmp_path / "run")], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        assert _wait_for(pid_file.exists, 60), "the server never started"
        time.sleep(0.05)
        server_pid = int(pid_file.read_text().split()[0])
        assert _alive(server_pid)
        harness.send_signal(signal.SIGKILL)
        harness.wait(10)
        assert _wait_for(lambda: not _alive(server_pid), 10), "the server outlived harness"
    finally:
        harness.kill()
        harness.wait(10)


def test_a_serving_scenario_runs_the_command_lines_server(run_cli, tmp_path):
    scenario = tmp_path / "serve.yaml"
    scenario.write_text("name: t\nmodel: tiny-qwen2\nserve: {concurrency: [1]}\n")
    result = run_cli("check", str(scenario), "--server", str(tmp_path / "nothing"))
    assert_user_error(result, "--server", "no executable file at")
    ok = run_cli("check", str(scenario), "--server", str(_stub_binary(tmp_path)))
    assert ok.exit_code == 0, ok.stderr
    plain = ROOT / "scenarios" / "quick.yaml"
    assert_user_error(run_cli("check", str(plain), "--allow-remote"), "serving scenarios")


def test_the_command_lines_server_stands_in_for_a_build_not_made(run_cli, tmp_path,
                                                                 monkeypatch):
    monkeypatch.setenv("HARNESS_SERVER_DIR", str(tmp_path / "no-builds"))
    scenario = tmp_path / "serve.yaml"
    scenario.write_text("name: t\nmodel: tiny-qwen2\nserve: {server: built}\n")
    assert_user_error(run_cli("check", str(scenario)), "serve.server",
                      "no llama-server built", "harness server build")
    ok = run_cli("check", str(scenario), "--server", str(_stub_binary(tmp_path)))
    assert ok.exit_code == 0, ok.stderr


# --- endpoints: this machine unless asked; bounded waits --------------------------------------

def test_endpoints_on_this_machine_only_unless_allowed():
    from harness.engine.http import check_endpoint, is_loopback_host

    assert all(is_loopback_host(h) for h in ("127.0.0.1", "127.8.9.10", "localhost", "::1",
                                             "[::1]"))
    assert not any(is_loopback_host(h) for h in ("10.0.0.1", "192.168.1.2", "example.org",
                                                 "0.0.0.0", "localhost.example.org"))
    assert check_endpoint("http://127.0.0.1:8080/") == "http://127.0.0.1:8080"
    assert check_endpoint("http://10.1.2.3:80", allow_remote=True) == "http://10.1.2.3:80"
    for bad in ("http://10.1.2.3:80", "http://127.0.0.1:99999", "ftp://127.0.0.1", "http://"):
        with pytest.raises(HarnessError):
            check_endpoint(bad)


def test_connects_time_out_in_ten_seconds_at_most():
    from harness.engine.http import CONNECT_TIMEOUT_S, client_timeout

    timeout = client_timeout(300.0)
    assert CONNECT_TIMEOUT_S <= 10 and timeout.connect == CONNECT_TIMEOUT_S
    assert timeout.read == 300.0


def _endpoint_scenario(tmp_path: Path, url: str, warmup: int) -> Path:
    path = tmp_path / "endpoint.yaml"
    path.write_text(f"name: t\nmodel: tiny-qwen2\nserve:\n  endpoint: {url}\n  warmup: {warmup}"
                    "\n  timeout_s: 1\n  requests: 2\n  concurrency: [1]\n")
    return path


def test_a_silent_server_ends_the_level_after_one_warm_up(run_cli, tmp_path, stub_endpoint):
    url = stub_endpoint("silent")
    started = time.monotonic()
    result = run_cli("run", str(_endpoint_scenario(tmp_path, url, warmup=3)), "--out",
                     str(tmp_path / "run"))
    assert time.monotonic() - started < 30
    assert result.exit_code == EXIT_FAILURE, result.stderr
    assert "warm-up request at 1 in flight failed: no answer within 1 s" in result.stderr
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("mode", ["nonsense", "malformed"])
def test_a_server_answering_nonsense_fails_its_requests(run_cli, tmp_path, stub_endpoint,
                                                       mode):
    url = stub_endpoint(mode)
    result = run_cli("run", str(_endpoint_scenario(tmp_path, url, warmup=0)), "--out",
                     str(tmp_path / "run"))
    assert result.exit_code == EXIT_FAILURE, result.stderr
    assert "no request finished at 1 in flight" in result.stderr
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr
    assert (tmp_path / "run" / "report.md").exists()  # the run's page names what happened
    assert url in (tmp_path / "run" / "report.md").read_text()


# --- a full disk --------------------------------------------------------------------------------

def test_a_full_disk_has_its_own_exit_status_and_the_resume_command(run_cli, tmp_path,
                                                                     monkeypatch):
    from harness import runner

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run"))

    monkeypatch.setattr(runner, "run_scenario", full)
    scenario = ROOT / "tests" / "scenarios" / "tiny.yaml"
    result = run_cli("run", str(scenario), "--out", str(tmp_path / "run"))
    assert result.exit_code == EXIT_DISK_FULL, result.stderr
    assert "the disk is full" in result.stderr
    assert f"--out {tmp_path / 'run'} --resume" in result.stderr
    assert "No space left on device" in result.stderr.strip().splitlines()[-1]


def test_a_full_disk_while_building(run_cli, tmp_path, monkeypatch):
    from harness.engine import build

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(build, "build", full)
    result = run_cli("build", "tiny-qwen2")
    assert result.exit_code == EXIT_DISK_FULL
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_readme_lists_every_exit_status():
    text = (ROOT / "README.md").read_text()
    table = text.split("## Errors and exit statuses", 1)[1].split("\n\n")[1]
    statuses = {int(m) for m in re.findall(r"^\| (\d+) \|", table, re.M)}
    assert statuses == {EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_BUSY, EXIT_DISK_FULL,
                        EXIT_INTERRUPTED}
    from harness.runner import NoisyMachine

    assert NoisyMachine.exit_code == EXIT_BUSY


# --- fleets -------------------------------------------------------------------------------------

def test_a_node_on_another_machine_of_the_same_name_is_another_machine():
    from harness.fleet import identity_differences, machine_identity

    env = {"hostname": "pod-0", "machine_id": "aaaa", "cpu_model": "X", "physical_cores": 2,
           "ram_total_bytes": 2**34, "llama": {"ggml_commit": "c"}}
    same = machine_identity(env)
    moved = machine_identity(env | {"machine_id": "bbbb"})
    assert identity_differences(same, machine_identity(env)) == []
    assert identity_differences(moved, same) == ["machine_id bbbb (was aaaa)"]
    old = machine_identity({k: v for k, v in env.items() if k != "machine_id"})
    assert identity_differences(same, old) == []  # recorded before the id was kept


def test_machine_id_is_hashed():
    from harness.engine.env import machine_id

    value = machine_id()
    raw = Path("/etc/machine-id").read_text().strip() if Path("/etc/machine-id").exists() else ""
    assert value is None or (len(value) == 16 and value not in raw)


def test_ray_local_advertises_loopback_and_asks_for_a_token(monkeypatch):
    pytest.importorskip("ray")
    import types

    from harness.fleet import connect

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    reread = []  # Ray's cached configuration is left alone: other tests start real clusters
    config = types.SimpleNamespace(initialize=lambda text: reread.append(text))
    monkeypatch.setitem(sys.modules, "ray._raylet", types.SimpleNamespace(Config=config))

    calls = []

    class FakeRay:
        def init(self, **kwargs):
            calls.append(kwargs)

    connect(FakeRay(), "local")
    assert calls[0]["_node_ip_address"] == "127.0.0.1"
    assert calls[0]["include_dashboard"] is False
    assert os.environ["RAY_AUTH_MODE"] == "token" and len(os.environ["RAY_AUTH_TOKEN"]) == 64
    assert reread == [""]


def test_a_served_model_that_does_not_fit_is_refused_before_it_is_built(run_cli, tmp_path,
                                                                       monkeypatch):
    from harness.engine import env

    monkeypatch.setattr(env, "available_ram_bytes", lambda: 1 << 10)
    scenario = tmp_path / "serve.yaml"
    scenario.write_text("name: t\nmodel: tiny-qwen2\nserve: {slots: 2, concurrency: [1, 2]}\n")
    cache = tmp_path / "cache"
    said = []
    for command in (["check", str(scenario)], ["run", str(scenario), "--out", str(tmp_path / "r")],
                    ["serve", "tiny-qwen2", "--out", str(tmp_path / "s")]):
        result = run_cli(*command, "--cache-dir", str(cache))
        assert_user_error(result, "MODEL", "needs at least", "GiB of RAM", "0.00 GiB is available")
        said.append(result.stderr)
    # two slots, and two sequences in-process beside them, of 128 + 64 + 16 tokens
    assert "the KV cache of 4 sequences of 208 tokens" in said[0]
    assert not (tmp_path / "r").exists() and not (tmp_path / "s").exists()
    assert not cache.exists() or not list(cache.rglob("*.gguf"))


# --- a serving run never writes over another run ------------------------------------------------

def test_serving_into_a_folder_of_results_is_refused_and_the_results_stay(run_cli, tmp_path):
    run = tmp_path / "measured"
    run.mkdir()
    results = run / "results.jsonl"
    results.write_text(json.dumps({"type": "header", "scenario": {}, "env": {}}) + "\n")
    before = results.read_bytes()
    refused = run_cli("serve", "tiny-qwen2", "--out", str(run))
    assert_user_error(refused, "holds a measurement run's results, not a serving run's",
                      "choose another --out")
    assert results.read_bytes() == before
    served = tmp_path / "served"
    served.mkdir()
    (served / "results.jsonl").write_text(json.dumps(
        {"type": "header", "workload": {}, "server": {}}) + "\n")
    assert_user_error(run_cli("serve", "tiny-qwen2", "--out", str(served)),
                      "already holds results", "--resume")


def test_a_serving_results_file_cut_short_keeps_its_finished_levels(tmp_path):
    from harness.engine.results import RunWriter, read_records
    from harness.serving import closes_unit, finished_levels

    results = tmp_path / "results.jsonl"
    lines = [{"type": "header", "kind": "serving", "workload": {}},
             {"type": "request", "level": "c1"}, {"type": "level", "level": "c1"},
             {"type": "request", "level": "c2"}]
    text = "\n".join(json.dumps(x) for x in lines) + "\n"
    results.write_text(text + '{"type": "level", "lev')
    kept = finished_levels(read_records(results))
    assert [r.level for r in kept] == ["c1"]
    with RunWriter(tmp_path, resume=True, kind="serving") as writer:
        writer.keep_through(closes_unit)  # c2's request and the cut line go
    assert results.read_text() == "\n".join(json.dumps(x) for x in lines[:3]) + "\n"
    results.write_text('{"type": "header"}\nnot json\n' + text)
    with pytest.raises(HarnessError, match="corrupt results line"):
        read_records(results)
