"""llama.cpp loaded once: its log (the last errors kept for messages), the abort flag Ctrl-C
sets, the build and version it reports, quantizing a file."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import llama_cpp as L

from ...core.errors import Interrupted, MeasurementError

_LOG_LOCK = threading.Lock()
_LOG_TAIL: deque[tuple[int, str]] = deque(maxlen=40)
_FA_LINES: deque[str] = deque(maxlen=8)
_ERROR_LEVEL = 4  # GGML_LOG_LEVEL_ERROR in ggml.h (NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4)
_state = {"ready": False, "n_errors": 0}
_CAPTURES: list[list[str]] = []  # open captured_log() blocks, each gathering every log piece

# Ctrl-C must stop a long prefill within a second, but Python cannot interrupt a C call, and a
# Python abort callback would cost ~1 us per graph node. ggml calls abort_callback(data) after
# every node; libc's strlen(data) is a C function that returns nonzero exactly when the first
# byte of the buffer is set, so the check costs nanoseconds and needs no Python.
_ABORT_FLAG = ctypes.create_string_buffer(2)


def libc_strlen():
    """The C library's strlen on any OS: the process's own symbols on POSIX (CDLL(None)), the C
    runtime DLL on Windows, where CDLL(None) fails."""
    if sys.platform == "win32":
        return ctypes.cdll.msvcrt.strlen
    return ctypes.CDLL(None).strlen


_ABORT_CALLBACK = ctypes.cast(libc_strlen(), L.ggml_abort_callback)
DECODE_ABORTED = 2  # llama_decode's return value when the abort callback fired


def request_abort() -> None:
    """Make every running llama_decode return at its next graph node (thread-safe)."""
    _ABORT_FLAG[0] = b"\x01"


def clear_abort() -> None:
    _ABORT_FLAG[0] = b"\x00"


def abort_requested() -> bool:
    return _ABORT_FLAG[0] != b"\x00"


def check_abort() -> None:
    """Raise Interrupted at a safe point if the user asked to stop."""
    if abort_requested():
        raise Interrupted()


@L.llama_log_callback
def _log_callback(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    # llama.cpp keeps this pointer: the module-level name keeps the callback alive.
    if _CAPTURES:
        with _LOG_LOCK:
            for pieces in _CAPTURES:
                pieces.append(text.decode("utf-8", "replace"))
    if b"Flash Attention" in text:  # how llama.cpp resolved flash_attn "auto" for a context
        with _LOG_LOCK:
            _FA_LINES.append(text.decode("utf-8", "replace").strip())
    if level == _ERROR_LEVEL:
        with _LOG_LOCK:
            _state["n_errors"] += 1
            _LOG_TAIL.append((_state["n_errors"], text.decode("utf-8", "replace").strip()))


def _init() -> None:
    if not _state["ready"]:
        L.llama_log_set(_log_callback, ctypes.c_void_p(0))
        L.llama_backend_init()
        _state["ready"] = True


@contextlib.contextmanager
def captured_log() -> Iterator[list[str]]:
    """Every line llama.cpp logs inside the block (its buffer sizes are logged, not returned)."""
    _init()
    pieces: list[str] = []
    lines: list[str] = []
    with _LOG_LOCK:
        _CAPTURES.append(pieces)
    try:
        yield lines
    finally:
        with _LOG_LOCK:
            _CAPTURES.remove(pieces)
        lines.extend("".join(pieces).splitlines())


def _log_mark() -> int:
    with _LOG_LOCK:
        return _state["n_errors"]


def first_error_since(mark: int) -> str:
    """The first error llama.cpp logged after mark: the cause, not the follow-ups."""
    with _LOG_LOCK:
        lines = [line for n, line in _LOG_TAIL if n > mark and line]
    return lines[0] if lines else "llama.cpp logged no reason"


def version_info() -> dict:
    """llama-cpp-python version, the ggml commit it vendors and llama.cpp's system info."""
    _init()
    commit = L.llama_cpp._lib.ggml_commit
    commit.restype = ctypes.c_char_p
    version = L.llama_cpp._lib.ggml_version
    version.restype = ctypes.c_char_p
    return {
        "llama_cpp_python": L.__version__,
        "ggml_commit": commit().decode(),
        "ggml_version": version().decode(),
        "system_info": L.llama_print_system_info().decode().strip(),
    }


AMX_REBUILD = ("CMAKE_ARGS='-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8' "
               "pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python "
               "(make setup does this)")


@functools.lru_cache(maxsize=1)
def build_problem() -> str | None:
    """Why this llama.cpp build cannot measure, or None: ggml's AMX kernels (compiled in by
    -march=native on Sapphire Rapids-class CPUs) segfault in the first multi-token matrix
    product of Q8_0 weights here (llama.cpp issue #20824, open at the pinned commit)."""
    _init()
    if "AMX_INT8 = 1" in L.llama_print_system_info().decode():
        return "this llama.cpp was built with ggml's AMX kernels, which crash on quantized weights"
    return None


def quantize(src: Path, dst: Path, file_type: int, n_threads: int = 0,
             allow_requantize: bool = False) -> None:
    """Run llama.cpp's own quantizer (all cores when n_threads is 0); allow_requantize lets it
    convert an already quantized file (dequantized first, as llama-quantize --allow-requantize)."""
    _init()
    params = L.llama_model_quantize_default_params()
    params.ftype = file_type
    params.nthread = n_threads
    params.allow_requantize = allow_requantize
    mark = _log_mark()
    rc = L.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise MeasurementError(f"llama.cpp's quantizer failed ({first_error_since(mark)})",
                               source=str(src))
