"""A server the harness starts and stops: llama.cpp's server from the xllamacpp wheel, or a
llama-server binary the user names, bound to 127.0.0.1 on a free port, health-checked before
any load, and stopped with its whole process group on success, failure and Ctrl-C."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import HarnessError, MeasurementError
from .http import healthy

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class ServerSpec:
    """What to start: "xllamacpp" (the wheel) or a path to a llama-server binary."""

    server: str
    model: Path
    slots: int = 1
    ctx: int = 4096  # all slots together, as llama-server's -c
    threads: int = 0
    ubatch: int = 512

    def command(self, port: int) -> list[str]:
        if self.server == "xllamacpp":
            return [sys.executable, "-m", "harness.engine.xserver", str(self.model),
                    "--port", str(port), "--slots", str(self.slots), "--ctx", str(self.ctx),
                    "--threads", str(self.threads), "--ubatch", str(self.ubatch)]
        binary = shutil.which(self.server) or self.server
        cmd = [binary, "-m", str(self.model), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(self.slots), "-c", str(self.ctx), "-ub", str(self.ubatch),
               "--metrics", "--no-warmup"]
        return cmd + (["-t", str(self.threads)] if self.threads else [])


@dataclass
class RunningServer:
    """A started server: its URL, process and log file."""

    url: str
    process: subprocess.Popen
    log_path: Path
    spec: ServerSpec
    started_s: float = field(default_factory=time.perf_counter)

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n_chars: int = 400) -> str:
        return self.log_text()[-n_chars:].strip()

    def stop(self) -> None:
        """SIGTERM to the whole process group, SIGKILL if it outlives STOP_TIMEOUT_S."""
        if self.alive():
            _signal_group(self.process, signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _signal_group(self.process, signal.SIGKILL)
                self.process.wait(STOP_TIMEOUT_S)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent_pid: int):
    """preexec_fn: the server gets SIGKILL when harness dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG; its own session keeps it from terminal signals, so without this a killed
    harness would leave it loading the CPU under every later measurement). The signal comes
    when the thread that started it ends: servers are started from the main thread."""
    def arm() -> None:
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent_pid:  # harness died before the line above
                os._exit(1)
    return arm


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


def server_system_info(running: RunningServer) -> str | None:
    """llama.cpp's system info line of the server's build (the CPU features its kernels use):
    from the server's log where it printed one, else asked of the binary or the wheel."""
    if line := _system_info_line(running.log_text()):
        return line
    if running.spec.server != "xllamacpp":
        return binary_system_info(running.spec.server)
    code = "import xllamacpp; print(xllamacpp.get_system_info())"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60, check=True)
    except (subprocess.SubprocessError, OSError):
        return None
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else None


def binary_system_info(binary: str) -> str | None:
    """A llama-server binary's system info: it prints the line at trace verbosity (-lv 4)
    before loading its model, so a model that does not exist ends it right after."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [shutil.which(binary) or binary, "-lv", "4", "-m", str(Path(tmp) / "none.gguf"),
               "--host", "127.0.0.1", "--port", str(free_port())]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                                  stdin=subprocess.DEVNULL)
        except (subprocess.SubprocessError, OSError):
            return None
    return _system_info_line(done.stdout + done.stderr)


def _system_info_line(text: str) -> str | None:
    for line in text.splitlines():
        if "system_info:" in line and "CPU :" in line:
            return "CPU : " + line.split("CPU :", 1)[1].strip()
    return None


def binary_version(binary: str) -> str | None:
    """What a llama-server binary prints for --version (version, commit, compiler)."""
    try:
        done = subprocess.run([shutil.which(binary) or binary, "--version"], capture_output=True,
                              text=True, timeout=60)
    except (subprocess.SubprocessError, OSError):
        return None
    return (done.stdout + done.stderr).strip()


def server_version_line(binary: str) -> str | None:
    """The line of --version that names the version and commit."""
    lines = [ln for ln in (binary_version(binary) or "").splitlines() if ln.startswith("version")]
    return lines[0].strip() if lines else None


def start_server(spec: ServerSpec, start_timeout_s: float = START_TIMEOUT_S) -> RunningServer:
    """Start the server in a new session (its own process group) and wait until /health
    answers; a server that exits or stays silent is stopped and named in one line."""
    if spec.server == "xllamacpp" and importlib.util.find_spec("xllamacpp") is None:
        raise HarnessError("the xllamacpp wheel is not installed", key="server",
                           fix="pip install -e '.[serve]', or give a llama-server binary")
    if spec.server != "xllamacpp" and shutil.which(spec.server) is None:
        raise HarnessError(f"no server binary at {spec.server}", key="server",
                           fix="give the path of a llama-server binary, or server: xllamacpp")
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="harness-server-", suffix=".log")[1])
    with log.open("wb") as out:
        process = subprocess.Popen(spec.command(port), stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True,
                                   preexec_fn=_die_with_parent(os.getpid()))
    running = RunningServer(f"http://127.0.0.1:{port}", process, log, spec)
    try:
        _wait_healthy(running, start_timeout_s)
    except BaseException:
        running.stop()
        raise
    return running


def _wait_healthy(running: RunningServer, timeout_s: float) -> None:
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if not running.alive():
            status = running.process.returncode
            raise MeasurementError(f"the server exited (status {status}) before answering: "
                                   f"{running.log_tail()}", key="server",
                                   fix=f"check the model file {running.spec.model} and the "
                                       f"log {running.log_path}")
        if healthy(running.url):
            return
        time.sleep(0.2)
    raise MeasurementError(f"the server did not answer /health within {timeout_s:g} s",
                       key="server", fix=f"see its log {running.log_path}")
