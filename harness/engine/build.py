"""Build synthetic GGUF files into a content-keyed cache, atomically and under a file lock."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import platformdirs
from filelock import FileLock

from ..core.dtypes import DTYPES, QUANT_SOURCE, DType
from ..core.errors import DiskFull, HarnessError, is_disk_full
from ..core.specs import ModelSpec, n_params
from ..core.yamlio import safe_name
from ..weights.gguf_build import builder_version, file_n_bytes, write_gguf

GGUF_MAGIC = b"GGUF"
DISK_MARGIN_BYTES = 64 << 20
Progress = Callable[[int, int], None]  # (bytes done, bytes total)


@dataclass(frozen=True)
class BuiltModel:
    """A GGUF file on disk and what it was made from."""

    path: Path
    spec: ModelSpec
    dtype: str
    seed: int
    n_bytes: int
    cached: bool
    seconds: float


def cache_dir(override: str | Path | None = None) -> Path:
    """--cache-dir, else $HARNESS_CACHE_DIR, else the user's cache directory."""
    if override:
        return Path(override)
    env = os.environ.get("HARNESS_CACHE_DIR")
    return Path(env) if env else Path(platformdirs.user_cache_dir("harness")) / "models"


def _spread(dtype: DType, spread: bool | None) -> bool:
    """Whether a build's values have trained weights' block spread: a quantized type's always
    (made from such a source), a direct type's only as that source."""
    return not dtype.direct if spread is None else spread


def cache_key(spec: ModelSpec, dtype: DType, seed: int, spread: bool | None = None) -> str:
    """Spec content, dtype, seed, builder version (and the quantizer's llama.cpp commit)."""
    spread = _spread(dtype, spread)
    parts = [spec.content_hash(), dtype.name, str(seed), str(builder_version(spec, spread))]
    if spread:
        parts.append("spread")
    if not dtype.direct:
        from .llama import version_info

        parts.append(version_info()["ggml_commit"])
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def estimated_n_bytes(spec: ModelSpec, dtype: DType, spread: bool = False) -> int:
    """Exact for written types; for quantized ones an upper estimate (recipes mix in types)."""
    if dtype.direct:
        return file_n_bytes(spec, dtype, spread)
    bits = max(dtype.bits_per_weight, 6.5625)  # output/attn_v tensors are often kept at Q6_K
    return int(n_params(spec) * bits / 8 * 1.1) + (16 << 20)


def cache_target(spec: ModelSpec, dtype: DType, seed: int, directory: Path,
                 spread: bool | None = None) -> Path:
    """Where the cache keeps this build (a quantized build's source named -f16-spread)."""
    key = cache_key(spec, dtype, seed, spread)[:16]
    kind = "-spread" if dtype.direct and _spread(dtype, spread) else ""
    return directory / f"{safe_name(spec.name)}-{dtype.name}{kind}-s{seed}-{key}.gguf"


def missing_build_n_bytes(spec: ModelSpec, dtype: DType, seed: int,
                          directory: Path | None = None, spread: bool | None = None) -> int:
    """Disk a build would still need: 0 when cached (a quantized type also needs its source)."""
    directory = cache_dir(directory)
    need = 0
    if not valid_cache_entry(cache_target(spec, dtype, seed, directory, spread)):
        need += estimated_n_bytes(spec, dtype, _spread(dtype, spread))
        if not dtype.direct:
            need += missing_build_n_bytes(spec, DTYPES[QUANT_SOURCE], seed, directory, True)
    return need


def check_build_space(need_bytes: int, directory: Path | None = None) -> None:
    """Refuse builds that cannot be written before any of them starts."""
    if need_bytes:
        directory = cache_dir(directory)
        _ensure_writable_dir(directory, "cache directory", "--cache-dir or HARNESS_CACHE_DIR")
        _ensure_free_space(directory, need_bytes)


def build(spec: ModelSpec, dtype: DType, seed: int = 0, *, directory: Path | None = None,
          out: Path | None = None, progress: Progress | None = None,
          spread: bool | None = None) -> BuiltModel:
    """Return the cached file, or build it (or write it to out, bypassing the cache); spread
    (a direct type only): write the block-spread values quantized builds are made from."""
    directory = cache_dir(directory)
    _ensure_writable_dir(directory, "cache directory", "--cache-dir or HARNESS_CACHE_DIR")
    spread = _spread(dtype, spread)
    target = out or cache_target(spec, dtype, seed, directory, spread)
    if out:
        _ensure_writable_dir(out.parent, "output directory", "choose another --out")
    with FileLock(str(directory / (target.name + ".lock"))):
        if not out and valid_cache_entry(target):
            return BuiltModel(target, spec, dtype.name, seed, target.stat().st_size, True, 0.0)
        start = time.perf_counter()
        source = None if dtype.direct else build(spec, DTYPES[QUANT_SOURCE], seed,
                                                 directory=directory, progress=progress,
                                                 spread=True)
        _ensure_free_space(target.parent, estimated_n_bytes(spec, dtype, spread))
        n_bytes = _write_atomically(target, spec, dtype, seed, source, progress, spread)
        if not out:
            _write_manifest(target, spec, dtype, seed, n_bytes, spread)
            file_sha256(target)  # while its pages are cached: a run then reads it from here
        return BuiltModel(target, spec, dtype.name, seed, n_bytes, False,
                          time.perf_counter() - start)


def _write_atomically(target: Path, spec: ModelSpec, dtype: DType, seed: int,
                      source: BuiltModel | None, progress: Progress | None,
                      spread: bool = False) -> int:
    def write(tmp: Path) -> None:
        if source is None:
            write_gguf(spec, dtype, seed, tmp,
                       _stepper(file_n_bytes(spec, dtype, spread), progress), spread)
        else:
            from .llama import quantize

            quantize(source.path, tmp, int(dtype.file_type))
            _fsync(tmp)

    return _atomically(target, write)


def _stepper(total: int, progress: Progress | None) -> Callable[[int], None]:
    """A per-tensor byte count turned into (done, total) progress calls."""
    done = [0]

    def step(n: int) -> None:
        done[0] += n
        if progress:
            progress(done[0], total)

    return step


def _atomically(target: Path, write: Callable[[Path], None]) -> int:
    """Run write(tmp) and rename tmp into place; return the file's size."""
    for stale in target.parent.glob(target.name + ".tmp-*"):
        stale.unlink(missing_ok=True)  # left by a killed build; we hold the lock
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, target)
        return target.stat().st_size
    except OSError as exc:
        raise HarnessError(f"writing the model failed: {exc.strerror or exc}",
                           source=str(target), fix="check free disk space and permissions"
                           ) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def manifest_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _write_manifest(path: Path, spec: ModelSpec, dtype: DType, seed: int, n_bytes: int,
                    spread: bool = False) -> None:
    """Written after the rename: a GGUF without its manifest is never taken as a hit."""
    record = {"builder_version": builder_version(spec, spread), "spread": spread,
              "spec": spec.to_dict(), "dtype": dtype.name, "seed": seed, "n_bytes": n_bytes,
              "n_params": n_params(spec), "sha256": None}
    write_json_atomically(manifest_path(path), record)


def read_manifest(path: Path) -> dict | None:
    try:
        return json.loads(manifest_path(path).read_text())
    except (OSError, ValueError):
        return None


def valid_cache_entry(path: Path) -> bool:
    """A hit needs the manifest, the recorded size and a GGUF header."""
    manifest = read_manifest(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
    except OSError:
        return False
    return (manifest is not None and manifest.get("n_bytes") == size
            and head[:4] == GGUF_MAGIC and struct.unpack("<I", head[4:8])[0] in (2, 3))


_SHA256_SEEN: dict[tuple, str] = {}  # (path, size, mtime) -> digest, for files with no manifest


def file_sha256(path: Path) -> str:
    """SHA-256 of a model file, remembered in its cache manifest once computed (a file outside
    the cache, such as a real model a twin copies, for the life of the process while its size
    and modification time stay the same)."""
    manifest = read_manifest(path)
    stat = path.stat()
    if manifest and manifest.get("sha256") and manifest.get("n_bytes") == stat.st_size:
        return manifest["sha256"]
    seen = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if not manifest and seen in _SHA256_SEEN:
        return _SHA256_SEEN[seen]
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    if manifest:
        manifest["sha256"] = digest.hexdigest()
        with contextlib.suppress(OSError):
            write_json_atomically(manifest_path(path), manifest)
    else:
        _SHA256_SEEN[seen] = digest.hexdigest()
    return digest.hexdigest()


def write_json_atomically(path: Path, record: dict) -> None:
    write_text_atomically(path, json.dumps(record, indent=1, sort_keys=True) + "\n")


def write_text_atomically(path: Path, text: str) -> None:
    """Write via a temporary file and a rename, so readers never see half a file."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        kind = DiskFull if is_disk_full(exc) else HarnessError
        raise kind(f"cannot write: {exc.strerror or exc}", source=str(path),
                   fix="choose a writable place with -o, or free some disk") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def check_gguf_file(path: Path) -> None:
    """Refuse a path that is missing, a directory, or not a GGUF file."""
    if not path.exists():
        raise HarnessError("model file not found", source=str(path), fix="check the path")
    if path.is_dir():
        raise HarnessError("is a directory, expected a .gguf file", source=str(path),
                           fix="name the .gguf file inside it")
    if not path.is_file():  # a FIFO or a device would block or never end
        raise HarnessError("is not a regular file (a device, pipe or socket)",
                           source=str(path), fix="name a .gguf file")
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise HarnessError(f"cannot read model file: {exc.strerror}", source=str(path),
                           fix="check its permissions") from None
    if head != GGUF_MAGIC:
        raise HarnessError("not a GGUF file (no GGUF magic at the start)", source=str(path),
                           fix="pass a .gguf model, a spec name or a spec .yaml")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _ensure_writable_dir(directory: Path, what: str, fix: str) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise HarnessError(f"{what} is not writable ({exc.strerror or exc})",
                           source=str(directory), fix=f"choose another with {fix}") from None


def _ensure_free_space(directory: Path, need_bytes: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < need_bytes + DISK_MARGIN_BYTES:
        raise HarnessError(f"not enough free disk: the build needs {need_bytes / 2**30:.2f} GiB "
                           f"(+ {DISK_MARGIN_BYTES / 2**30:.1f} GiB margin), "
                           f"{free / 2**30:.2f} GiB is free", source=str(directory),
                           fix="free some space or choose another --cache-dir")
