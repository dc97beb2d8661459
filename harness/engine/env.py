"""The machine the numbers come from: CPU, cores, memory, OS and library versions."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import socket
from importlib import metadata
from pathlib import Path

import psutil

from .. import __version__


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict:
    """py-cpuinfo's record of this CPU (brand, flags, caches) on any OS; {} if it fails.
    Cached: it takes about a second (it may run CPUID in a subprocess)."""
    try:
        import cpuinfo

        return cpuinfo.get_cpu_info() or {}
    except Exception:  # noqa: BLE001 - a CPU it cannot read is recorded as missing, never fatal
        return {}


def cpu_model() -> str | None:
    return cpu_info().get("brand_raw") or platform.processor() or platform.machine() or None


def cpu_flags() -> list[str]:
    return sorted(cpu_info().get("flags") or [])


def _usable_cpus() -> int | None:
    """CPUs this process may run on (its affinity), where the OS can say (not macOS)."""
    try:
        return len(psutil.Process().cpu_affinity())
    except (AttributeError, NotImplementedError, psutil.Error, OSError):
        return None


def physical_cores() -> int:
    """Physical cores this process may use; hyper-threads share a core and its memory path.
    Falls back to logical CPUs where the OS does not report physical cores."""
    physical = psutil.cpu_count(logical=False)
    usable = _usable_cpus()
    counts = [n for n in (physical, usable) if n]
    return min(counts) if counts else logical_cores()


def logical_cores() -> int:
    return psutil.cpu_count(logical=True) or os.cpu_count() or 1


def memory_bytes() -> dict[str, int | None]:
    """Total and available RAM in bytes (None where the OS does not tell)."""
    try:
        vm = psutil.virtual_memory()
        return {"total": vm.total, "available": vm.available}
    except (psutil.Error, OSError, RuntimeError):
        return {"total": None, "available": None}


def available_ram_bytes() -> int | None:
    return memory_bytes()["available"]


def cpu_freq_mhz() -> dict[str, float] | None:
    """Current, min and max clock in MHz; None where the OS does not report them (a 0 from
    psutil means unknown, so it is left out)."""
    try:
        freq = psutil.cpu_freq()
    except (psutil.Error, OSError, NotImplementedError, RuntimeError):
        return None
    if freq is None:
        return None
    out = {k: v for k, v in freq._asdict().items() if v}
    return out or None


def last_level_cache_bytes() -> int | None:
    """Size of the largest CPU cache sysfs reports for cpu0."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        text = _read(str(index / "size")).strip()
        if text.endswith("K"):
            sizes.append(int(text[:-1]) * 1024)
        elif text.endswith("M"):
            sizes.append(int(text[:-1]) * 1024 * 1024)
    if sizes:
        return max(sizes)
    info = cpu_info()  # macOS and Windows: no sysfs; py-cpuinfo reads the CPU's own tables
    return info.get("l3_cache_size") or info.get("l2_cache_size") or None


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


def machine_id() -> str | None:
    """This OS install's identity (/etc/machine-id, kept across reboots, new on a new machine
    or image), hashed with the harness' own key as machine-id(5) asks of anything that shows
    it; None where the file is absent."""
    raw = (_read("/etc/machine-id") or _read("/var/lib/dbus/machine-id")).strip()
    if not raw:
        return None
    return hashlib.sha256(f"harness machine id:{raw}".encode()).hexdigest()[:16]


def collect_env() -> dict:
    """Everything `harness env` shows and every result embeds."""
    from . import llama  # imported late: it loads llama.cpp's shared library

    mem = memory_bytes()
    env = {
        "hostname": socket.gethostname(),
        "machine_id": machine_id(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_freq_mhz": cpu_freq_mhz(),
        "physical_cores": physical_cores(),
        "logical_cores": logical_cores(),
        "ram_total_bytes": mem["total"],
        "ram_available_bytes": mem["available"],
        "last_level_cache_bytes": last_level_cache_bytes(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "harness": __version__,
        "harness_source": harness_provenance(),
        "gguf": _version("gguf"),
        "numpy": _version("numpy"),
        "psutil": _version("psutil"),
        "llama": llama.version_info(),
    }
    return env | {"missing": missing_figures(env)}


# What a platform may lack; recorded as missing rather than guessed.
OPTIONAL_FIGURES = ("cpu_model", "cpu_flags", "cpu_freq_mhz", "ram_total_bytes",
                    "ram_available_bytes", "last_level_cache_bytes")


def missing_figures(env: dict) -> list[str]:
    return [k for k in OPTIONAL_FIGURES if not env.get(k)]
