"""Shared fixtures: an isolated model cache and a CLI runner that goes through main()."""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def ctrl_c_reaches_child() -> None:
    """preexec_fn: SIGINT as a terminal delivers it. A shell starts a background job (CI
    launched with `&` or nohup) with SIGINT ignored, Python then installs no KeyboardInterrupt
    handler, and the children inherit that; a test of Ctrl-C must undo it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch) -> Path:
    """Every test builds into its own cache, never the user's."""
    cache = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(cache))
    return cache


@pytest.fixture(autouse=True)
def small_probe(monkeypatch):
    """Runs probe their ceilings; in tests the real probes run on 1 MiB matrices and arrays
    (no timing is asserted)."""
    monkeypatch.setenv("HARNESS_PROBE_MIB", "1")


@dataclass
class Result:
    exit_code: int
    stdout: str
    stderr: str


@pytest.fixture
def run_cli(capsys):
    """Run harness in-process through main(), as the console script does."""
    from harness.cli import main

    def run(*args: str) -> Result:
        capsys.readouterr()
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        out = capsys.readouterr()
        return Result(code, out.out, out.err)

    return run


def measure_scenario(scenario: Path, tmp: Path):
    """Run a tiny scenario in-process into tmp/run (own cache, 1 MiB probes, the noise guard
    reading an idle machine) and return its records."""
    from harness import runner
    from harness.engine.results import RunWriter, read_records
    from harness.engine.scenario import load_scenario

    mp = pytest.MonkeyPatch()
    mp.setenv("HARNESS_CACHE_DIR", str(tmp / "cache"))
    mp.setattr(runner.noise, "idle_reading", lambda seconds=0.3: 0.0)
    mp.setenv("HARNESS_PROBE_MIB", "1")
    try:
        plan = load_scenario(scenario, physical_cores=2)
        with RunWriter(tmp / "run", resume=False) as writer:
            runner.run_scenario(plan, writer, {"test": True},
                                console=runner.Console(warn=lambda m: None, info=lambda m: None))
    finally:
        mp.undo()
    return plan, read_records(tmp / "run" / "results.jsonl")


def measurement_record(**fields):
    """A typed Measurement record (harness.core.records) with what a test leaves out filled."""
    from harness.core.records import typed

    base = {"type": "measurement", "id": "m", "model": "m", "model_key": "m|f32",
            "dtype": "f32", "threads": 1, "n_prompt": 0, "n_gen": 0}
    return typed(base | fields)


def probe_record(**fields):
    """A typed Probe record: a full probe before the measurements unless told otherwise."""
    from harness.core.records import typed

    return typed({"type": "probe", "when": "before"} | fields)


def run_subprocess(*args: str, env: dict | None = None, timeout: float = 60) -> Result:
    """Run the real console entry point in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def assert_user_error(result: Result, *needles: str) -> None:
    """Exit status 2, one line on stderr, no traceback, and the expected words in it."""
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# --- the suite leaves the tree as it found it ------------------------------------------------

# What a test run may leave in the checkout: the environment and the tools' own caches.
TOOL_CACHES = (".venv/", ".pytest_cache/", ".ruff_cache/", ".hypothesis/", ".import_linter_cache/")


def _tree_entries() -> set[str] | None:
    """`git status --porcelain --ignored` of the checkout, less the tool caches; None outside
    a git checkout."""
    try:
        done = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    entries = {line[3:] for line in done.stdout.splitlines() if line.strip()}
    return {e for e in entries if not e.startswith(TOOL_CACHES)
            and "__pycache__" not in e and not e.endswith(".egg-info/")}


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")  # the controller alone sees the whole run


def pytest_sessionstart(session):
    if not _is_xdist_worker(session.config):
        session.config._tree_before = _tree_entries()


def pytest_sessionfinish(session, exitstatus):
    if _is_xdist_worker(session.config):
        return
    before, after = session.config._tree_before, _tree_entries()
    if before is None or after is None:
        return
    left = sorted(after - before)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"the tests left files in the checkout: {', '.join(left)}",
                                red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

