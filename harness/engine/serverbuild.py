"""`harness server build`: llama.cpp's llama-server compiled from the very source the installed
llama-cpp-python bindings were built from (the vendored tree of their source package), with the
same CMake flags as `make setup`, so served and in-process figures run the same kernels. The
binary and a record of its build (version, llama.cpp commit, flags, source hash) are cached per
bindings version."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import platformdirs

from ..core.errors import EXIT_FAILURE, HarnessError
from .build import write_text_atomically
from .measure import now_iso
from .server import binary_system_info, binary_version

PACKAGE = "llama-cpp-python"
BINARY = "llama-server"
# The bindings' own flags (Makefile: LLAMA_CMAKE_ARGS) plus what a server alone needs: a static
# binary, no tests or examples, no HTTPS/curl (it serves loopback), no web UI download.
CMAKE_ARGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
              "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
              "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
              "-DLLAMA_USE_PREBUILT_UI=OFF")
# ggml's AMX kernels are left out on x86-64 as in the bindings (llama.cpp issue #20824).
X86_CMAKE_ARGS = ("-DCMAKE_C_FLAGS=-mno-amx-int8", "-DCMAKE_CXX_FLAGS=-mno-amx-int8")
PERCENT = re.compile(r"^\[\s*(\d+)%\]")


class BuildError(HarnessError):
    """A build step failed after the request was accepted (network, compiler)."""

    exit_code = EXIT_FAILURE


@dataclass(frozen=True)
class ServerBuild:
    """A cached llama-server: where it is and what it was built from."""

    binary: str
    llama_cpp_python: str
    llama_cpp_commit: str
    source_sha256: str
    cmake_args: list[str]
    compiler: str
    version_output: str
    system_info: str | None
    built: str
    seconds: float
    cached: bool = False


def servers_dir(override: str | Path | None = None) -> Path:
    """--dir, else $HARNESS_SERVER_DIR, else the user's cache directory."""
    if override:
        return Path(override)
    env = os.environ.get("HARNESS_SERVER_DIR")
    return Path(env) if env else Path(platformdirs.user_cache_dir("harness")) / "servers"


def bindings_version() -> str:
    """The installed llama-cpp-python's version (the source the server is built from)."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise HarnessError(f"{PACKAGE} is not installed", key="server",
                           fix="run make setup") from None


def cmake_args() -> list[str]:
    """The CMake flags of the server build on this machine."""
    return list(CMAKE_ARGS) + (list(X86_CMAKE_ARGS) if platform.machine() == "x86_64" else [])


def build_home(version: str, directory: str | Path | None = None) -> Path:
    return servers_dir(directory) / f"{PACKAGE}-{version}"


def cached_build(version: str | None = None,
                 directory: str | Path | None = None) -> ServerBuild | None:
    """The cached server of this bindings version, or None when none was built."""
    home = build_home(version or bindings_version(), directory)
    try:
        record = json.loads((home / "build.json").read_text())
    except (OSError, ValueError):
        return None
    try:
        build = ServerBuild(**(record | {"cached": True}))
    except TypeError:  # a record of another harness version: build again
        return None
    return build if Path(build.binary).is_file() else None


def built_binary(directory: str | Path | None = None) -> Path:
    """The cached llama-server for the installed bindings, or one line saying how to build it."""
    build = cached_build(directory=directory)
    if build is None:
        raise HarnessError(f"no llama-server built for {PACKAGE} {bindings_version()}",
                           key="server", fix="run harness server build (about 5 min on 2 cores)")
    return Path(build.binary)


def build_server(progress: Callable[[int | None, str], None], jobs: int | None = None,
                 directory: str | Path | None = None, force: bool = False,
                 source: Path | None = None) -> ServerBuild:
    """Download the bindings' source package (or take the one given), compile its llama-server,
    cache it and its record; nothing is left half-written when a step fails."""
    version = bindings_version()
    if source is not None:
        check_source(source, version)
    if not force and (done := cached_build(version, directory)):
        return done
    home = build_home(version, directory)
    home.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="build-", dir=home) as work:
        tree, sha256 = _unpack(source or _download(version, Path(work), progress), Path(work))
        args = cmake_args()
        binary = _compile(tree / "vendor" / "llama.cpp", Path(work) / "build", args,
                          jobs or os.cpu_count() or 1, progress)
        target = home / "bin" / BINARY
        target.parent.mkdir(exist_ok=True)
        tmp = target.with_name(f"{BINARY}.tmp-{os.getpid()}")
        shutil.copy2(binary, tmp)
        os.replace(tmp, target)
        build = ServerBuild(str(target), version, _commit(tree / "vendor" / "llama.cpp"),
                            sha256, args, _compiler(Path(work) / "build"),
                            binary_version(str(target)) or "", binary_system_info(str(target)),
                            now_iso(),
                            round(time.perf_counter() - started, 1))
    write_text_atomically(home / "build.json", json.dumps(asdict(build) | {"cached": False},
                                                          indent=2) + "\n")
    return build


def check_source(source: Path, version: str | None = None) -> None:
    """A source package given by hand must be the installed bindings' own."""
    version = version or bindings_version()
    expected = f"llama_cpp_python-{version}.tar.gz"
    if source.name != expected or not source.is_file():
        raise HarnessError(f"not the source package of the installed bindings ({expected})",
                           source=str(source), key="--source",
                           fix=f"pip download --no-binary :all: --no-deps {PACKAGE}=={version}")


def _download(version: str, work: Path, progress: Callable[[int | None, str], None]) -> Path:
    """pip download of the source package from the configured index."""
    progress(None, f"downloading the {PACKAGE} {version} source package")
    _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
          "--disable-pip-version-check", f"{PACKAGE}=={version}", "-d", str(work)],
         "pip download", work)
    archive = next(work.glob("*.tar.gz"), None)
    if archive is None:
        raise BuildError(f"pip download gave no source package of {PACKAGE} {version}",
                         key="server", fix="check the package index (pip config list)")
    return archive


def _unpack(archive: Path, work: Path) -> tuple[Path, str]:
    """The unpacked source tree and the archive's SHA-256."""
    sha256 = hashlib.sha256(archive.read_bytes()).hexdigest()
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    return work / archive.name.removesuffix(".tar.gz"), sha256


def _compile(source: Path, build: Path, args: list[str], jobs: int,
             progress: Callable[[int | None, str], None]) -> Path:
    progress(None, "configuring llama.cpp (cmake)")
    _run(["cmake", "-S", str(source), "-B", str(build), *args], "cmake configure", build.parent)
    progress(None, f"compiling {BINARY} ({jobs} jobs)")
    cmd = ["cmake", "--build", str(build), "--target", BINARY, "-j", str(jobs)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as proc:
        tail = []
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-20:]
            if m := PERCENT.match(line):
                progress(int(m.group(1)), line.strip())
    if proc.returncode:
        said = [t for t in tail if "error" in t.lower()] or tail[-3:]
        raise BuildError(f"compiling {BINARY} failed (status {proc.returncode}): "
                         + " | ".join(said)[-400:],
                         key="server", fix="install a C++17 compiler and cmake ≥ 3.14")
    found = next((p for p in build.rglob(BINARY) if p.is_file()), None)
    if found is None:
        raise BuildError(f"the build finished without a {BINARY}", key="server",
                         fix=f"see {build}")
    return found


def _run(cmd: list[str], what: str, cwd: Path) -> str:
    """Run a build step; its failure is one line with the step's last words."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, check=False)
    except FileNotFoundError:
        raise BuildError(f"{what}: {cmd[0]} is not installed", key="server",
                         fix=f"install {cmd[0]}") from None
    if done.returncode:
        last = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise BuildError(f"{what} failed: {' '.join(last)[-400:]}", key="server",
                         fix="check the network to the package index and the build tools")
    return done.stdout


def _commit(tree: Path) -> str:
    """The vendored llama.cpp's commit (its source package ships the .git directory)."""
    try:
        return subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _compiler(build: Path) -> str:
    cache = (build / "CMakeCache.txt").read_text(errors="replace")
    m = re.search(r"^CMAKE_CXX_COMPILER:\w+=(.*)$", cache, re.M)
    return m.group(1) if m else "unknown"
