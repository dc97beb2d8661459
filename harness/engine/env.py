"""The machine the numbers come from: CPU, cores, memory, OS and library versions."""

from __future__ import annotations

import os
import platform
import socket
from importlib import metadata
from pathlib import Path

from .. import __version__


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def physical_cores() -> int:
    """Distinct (package, core) pairs; hyper-threads share a core and its memory path."""
    pairs, phys = set(), "0"
    for line in _read("/proc/cpuinfo").splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "physical id":
            phys = value.strip()
        elif key == "core id":
            pairs.add((phys, value.strip()))
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(len(pairs), usable or 1) if pairs else (usable or 1)


def logical_cores() -> int:
    return os.cpu_count() or 1


def meminfo_bytes() -> dict[str, int]:
    """MemTotal and MemAvailable from /proc/meminfo, in bytes."""
    out = {}
    for line in _read("/proc/meminfo").splitlines():
        key, _, value = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            out[key] = int(value.split()[0]) * 1024
    return out


def available_ram_bytes() -> int | None:
    return meminfo_bytes().get("MemAvailable")


def last_level_cache_bytes() -> int | None:
    """Size of the largest CPU cache sysfs reports for cpu0."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        text = _read(str(index / "size")).strip()
        if text.endswith("K"):
            sizes.append(int(text[:-1]) * 1024)
        elif text.endswith("M"):
            sizes.append(int(text[:-1]) * 1024 * 1024)
    return max(sizes) if sizes else None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def harness_provenance() -> dict:
    """The harness version and, when it runs from a git checkout, its commit and whether the
    working tree had changes (results tie to the code that made them)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    out = {"version": __version__, "commit": None, "dirty": None}
    if not (root / ".git").exists():
        return out
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], text=True,
                                capture_output=True, timeout=5)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                 "--untracked-files=no"], text=True, capture_output=True,
                                timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return out
    if commit.returncode == 0:
        out["commit"] = commit.stdout.strip()
        out["dirty"] = bool(status.stdout.strip()) if status.returncode == 0 else None
    return out


def collect_env() -> dict:
    """Everything `harness env` shows and every result embeds."""
    from . import llama  # imported late: it loads llama.cpp's shared library

    mem = meminfo_bytes()
    return {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "physical_cores": physical_cores(),
        "logical_cores": logical_cores(),
        "ram_total_bytes": mem.get("MemTotal"),
        "ram_available_bytes": mem.get("MemAvailable"),
        "last_level_cache_bytes": last_level_cache_bytes(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "harness": __version__,
        "harness_source": harness_provenance(),
        "gguf": _version("gguf"),
        "numpy": _version("numpy"),
        "llama": llama.version_info(),
    }
