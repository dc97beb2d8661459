"""The one module that talks to llama.cpp (through llama-cpp-python's C bindings)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import llama_cpp as L
import numpy as np

from ..core.dtypes import KV_CACHE_TYPES
from ..core.errors import Interrupted, MeasurementError

_LOG_LOCK = threading.Lock()
_LOG_TAIL: deque[tuple[int, str]] = deque(maxlen=40)
_FA_LINES: deque[str] = deque(maxlen=8)
_ERROR_LEVEL = 4  # GGML_LOG_LEVEL_ERROR in ggml.h (NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4)
_state = {"ready": False, "n_errors": 0}

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


@dataclass(frozen=True)
class ModelInfo:
    """What llama.cpp itself reports about a loaded model."""

    description: str
    n_params: int
    n_bytes: int
    n_ctx_train: int
    n_vocab: int


class Model:
    """A loaded llama.cpp model; close() or use as a context manager."""

    def __init__(self, path: Path, use_mmap: bool = True) -> None:
        problem = build_problem()
        if problem:  # a clear refusal, never a segfault mid-run
            raise MeasurementError(problem, source="llama-cpp-python", fix=AMX_REBUILD)
        params = L.llama_model_default_params()
        params.n_gpu_layers = 0
        # llama.cpp replaced use_mmap by load_mode; ctypes would take the old name silently
        # (a Python attribute the C side never reads), so set the field it has.
        params.load_mode = L.LLAMA_LOAD_MODE_MMAP if use_mmap else L.LLAMA_LOAD_MODE_NONE
        self.path, self.use_mmap = path, use_mmap
        mark = _log_mark()
        self.ptr = L.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            raise MeasurementError(f"llama.cpp could not load the model "
                                   f"({first_error_since(mark)})",
                                   source=str(path), fix="check that it is a complete GGUF file")

    def info(self) -> ModelInfo:
        buf = ctypes.create_string_buffer(256)
        L.llama_model_desc(self.ptr, buf, len(buf))
        vocab = L.llama_model_get_vocab(self.ptr)
        return ModelInfo(description=buf.value.decode(),
                         n_params=int(L.llama_model_n_params(self.ptr)),
                         n_bytes=int(L.llama_model_size(self.ptr)),
                         n_ctx_train=int(L.llama_model_n_ctx_train(self.ptr)),
                         n_vocab=int(L.llama_vocab_n_tokens(vocab)))

    def close(self) -> None:
        if self.ptr:
            L.llama_model_free(self.ptr)
            self.ptr = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class ContextParams:
    """Everything that shapes a llama.cpp context (and so must match to reuse one)."""

    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_threads: int
    flash_attn: bool | None = None  # None lets llama.cpp decide
    type_k: str = "f16"
    type_v: str = "f16"
    n_seq_max: int = 1
    kv_unified: bool = False  # one cache buffer for all sequences (needed to share a prefix)


_KV_TYPES = {"f32": L.GGML_TYPE_F32, "f16": L.GGML_TYPE_F16, "q8_0": L.GGML_TYPE_Q8_0,
             "q4_0": L.GGML_TYPE_Q4_0}
assert set(_KV_TYPES) == set(KV_CACHE_TYPES)


@dataclass
class PerfCounters:
    """llama.cpp's own timing counters (llama_perf_context)."""

    t_p_eval_ms: float
    n_p_eval: int
    t_eval_ms: float
    n_eval: int


class Context:
    """A llama.cpp context with the timed primitives the runner needs."""

    def __init__(self, model: Model, params: ContextParams,
                 trace: GraphTrace | None = None) -> None:
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch = params.n_ctx, params.n_batch, params.n_ubatch
        p.n_threads = p.n_threads_batch = params.n_threads
        p.n_seq_max = params.n_seq_max
        p.kv_unified = params.kv_unified
        p.no_perf = False  # the default turns the counters off
        p.type_k, p.type_v = _KV_TYPES[params.type_k], _KV_TYPES[params.type_v]
        p.abort_callback = _ABORT_CALLBACK
        p.abort_callback_data = ctypes.cast(_ABORT_FLAG, ctypes.c_void_p)
        if params.flash_attn is not None:
            p.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_ENABLED if params.flash_attn
                                 else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        if trace is not None:
            p.cb_eval = trace.callback
        self.model, self.params, self.trace = model, params, trace
        mark = _log_mark()
        with _LOG_LOCK:
            _FA_LINES.clear()
        self.ptr = L.llama_init_from_model(model.ptr, p)
        if not self.ptr:
            raise MeasurementError(f"llama.cpp could not create a context "
                                   f"({first_error_since(mark)})",
                                   source=str(model.path))
        self.flash_attn_used = _flash_attn_used(params.flash_attn, type_v=params.type_v)
        # What llama.cpp made, which may differ from what was asked (it pads some sizes).
        self.n_ctx = int(L.llama_n_ctx(self.ptr))
        per_seq = getattr(L, "llama_n_ctx_seq", None)
        self.n_ctx_seq = int(per_seq(self.ptr)) if per_seq else None
        self.n_batch = int(L.llama_n_batch(self.ptr))
        self.n_ubatch = int(L.llama_n_ubatch(self.ptr))
        self.n_vocab = model.info().n_vocab
        self._one = (ctypes.c_int32 * 1)()
        self._one_batch = L.llama_batch_get_one(self._one, 1)

    def clear(self) -> None:
        """Empty the KV cache and reset the perf counters."""
        L.llama_memory_clear(L.llama_get_memory(self.ptr), True)
        L.llama_perf_context_reset(self.ptr)

    def reset_perf(self) -> None:
        L.llama_perf_context_reset(self.ptr)

    def trim(self, seq: int, n_keep: int) -> None:
        """Drop a sequence's cache cells from position n_keep on (all of them for 0)."""
        if not L.llama_memory_seq_rm(L.llama_get_memory(self.ptr), seq, n_keep, -1):
            raise MeasurementError(f"llama.cpp could not trim sequence {seq} to {n_keep}",
                                   source=str(self.model.path))

    def n_cached(self, seq: int) -> int:
        """Positions a sequence holds in the cache (0 when empty)."""
        return int(L.llama_memory_seq_pos_max(L.llama_get_memory(self.ptr), seq)) + 1

    def copy_seq(self, src: int, dst: int) -> None:
        """Make dst share src's cells (a unified cache copies no data, only cell tags)."""
        L.llama_memory_seq_cp(L.llama_get_memory(self.ptr), src, dst, -1, -1)

    def save_seq(self, seq: int) -> ctypes.Array:
        """A sequence's cache as bytes (llama_state_seq_get_data), for restore_seq."""
        size = L.llama_state_seq_get_size(self.ptr, seq)
        buf = (ctypes.c_uint8 * size)()
        if L.llama_state_seq_get_data(self.ptr, buf, size, seq) != size:
            raise MeasurementError("llama.cpp could not save a sequence's state",
                                   source=str(self.model.path))
        return buf

    def restore_seq(self, buf: ctypes.Array, seq: int) -> None:
        if not L.llama_state_seq_set_data(self.ptr, buf, len(buf), seq):
            raise MeasurementError("llama.cpp could not restore a sequence's state",
                                   source=str(self.model.path))

    def prefill_seqs(self, prompts: Sequence[Sequence[int]], first_seq: int = 0,
                     first_pos: int = 0) -> float:
        """Prefill several sequences' prompts packed into n_batch-token batches (prompt i on
        seq first_seq + i, from position first_pos); seconds until every last logit is ready."""
        items = [(tok, first_pos + j, first_seq + i, j == len(p) - 1)
                 for i, p in enumerate(prompts) for j, tok in enumerate(p)]
        step = self.params.n_batch
        with _Batch(min(step, len(items))) as batch:
            start = time.perf_counter_ns()
            for i in range(0, len(items), step):
                batch.fill(items[i:i + step])
                self._check(L.llama_decode(self.ptr, batch.raw), "prefill")
            L.llama_synchronize(self.ptr)
            return (time.perf_counter_ns() - start) / 1e9

    def decode_parallel(self, steps: Sequence[Sequence[int]], first_pos: int,
                        first_seq: int = 0) -> list[float]:
        """Each step decodes one token of every sequence (token i on seq first_seq + i, at
        first_pos + step) in one batch, synchronized; seconds of each step."""
        n_seq = len(steps[0]) if steps else 0
        out = []
        with _Batch(max(n_seq, 1)) as batch:
            for k, tokens in enumerate(steps):
                batch.fill([(tok, first_pos + k, first_seq + i, True)
                            for i, tok in enumerate(tokens)])
                start = time.perf_counter_ns()
                rc = L.llama_decode(self.ptr, batch.raw)
                L.llama_synchronize(self.ptr)
                out.append((time.perf_counter_ns() - start) / 1e9)
                if rc:
                    self._check(rc, "decode")
        return out

    def prefill(self, tokens: Sequence[int]) -> float:
        """Decode a prompt in n_batch chunks; seconds until the last token's logits are ready."""
        arr = (ctypes.c_int32 * len(tokens))(*tokens)
        step = self.params.n_batch
        start = time.perf_counter_ns()
        for i in range(0, len(tokens), step):
            n = min(step, len(tokens) - i)
            chunk = ctypes.cast(ctypes.byref(arr, i * 4), ctypes.POINTER(ctypes.c_int32))
            self._check(L.llama_decode(self.ptr, L.llama_batch_get_one(chunk, n)), "prefill")
        L.llama_synchronize(self.ptr)
        return (time.perf_counter_ns() - start) / 1e9

    def decode(self, tokens: Sequence[int]) -> list[float]:
        """One synchronized single-token step per token; seconds of each."""
        out = []
        one, batch, ctx, clock = self._one, self._one_batch, self.ptr, time.perf_counter_ns
        for token in tokens:
            one[0] = token
            start = clock()
            rc = L.llama_decode(ctx, batch)
            L.llama_synchronize(ctx)
            out.append((clock() - start) / 1e9)
            if rc:
                self._check(rc, "decode")
        return out

    def last_logits(self) -> list[float]:
        ptr = L.llama_get_logits_ith(self.ptr, -1)
        return ptr[: self.n_vocab]

    def perf(self) -> PerfCounters:
        d = L.llama_perf_context(self.ptr)
        return PerfCounters(float(d.t_p_eval_ms), int(d.n_p_eval), float(d.t_eval_ms),
                            int(d.n_eval))

    def _check(self, rc: int, step: str) -> None:
        if rc == DECODE_ABORTED and abort_requested():
            raise Interrupted()
        if rc != 0:
            error = MeasurementError(f"llama_decode returned {rc} during {step}",
                                     source=str(self.model.path))
            error.step = step
            raise error

    def close(self) -> None:
        if self.ptr:
            L.llama_free(self.ptr)
            self.ptr = None


def _flash_attn_used(requested: bool | None, type_v: str) -> bool | None:
    """Whether the context runs flash attention: as requested, or as llama.cpp resolved
    "auto" (it logs "Flash Attention enabled" or "... not supported, set to disabled")."""
    if requested is not None:
        return requested
    if type_v not in ("f16", "f32"):
        return True  # llama.cpp turns it on for a quantized V cache
    with _LOG_LOCK:
        lines = list(_FA_LINES)
    if any(line.endswith("Flash Attention enabled") for line in lines):
        return True
    if any("Flash Attention not supported" in line for line in lines):
        return False
    return None  # not logged: unknown, never guessed


class _Batch:
    """A llama_batch of explicit (token, position, seq id, wants logits) entries."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.raw = L.llama_batch_init(capacity, 0, 1)

    def fill(self, items: Sequence[tuple[int, int, int, bool]]) -> None:
        assert len(items) <= self.capacity
        b = self.raw
        for i, (token, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, logits
        b.n_tokens = len(items)

    def __enter__(self) -> _Batch:
        return self

    def __exit__(self, *exc) -> None:
        L.llama_batch_free(self.raw)


@contextlib.contextmanager
def open_context(model: Model, params: ContextParams) -> Iterator[Context]:
    ctx = Context(model, params)
    try:
        yield ctx
    finally:
        ctx.close()


# --- ggml's own kernels, for ceilings measured with the code decode and prefill run ----------

class _GgmlInitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


_P, _SZ, _I64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64
# name: (restype, argtypes), from ggml.h, ggml-alloc.h, ggml-backend.h and ggml-cpu.h.
_GGML_SIGNATURES = {
    "ggml_init": (_P, [_GgmlInitParams]),
    "ggml_free": (None, [_P]),
    "ggml_tensor_overhead": (_SZ, []),
    "ggml_graph_overhead": (_SZ, []),
    "ggml_new_tensor_2d": (_P, [_P, ctypes.c_int, _I64, _I64]),
    "ggml_new_tensor_3d": (_P, [_P, ctypes.c_int, _I64, _I64, _I64]),
    "ggml_mul_mat": (_P, [_P, _P, _P]),
    "ggml_flash_attn_ext": (_P, [_P, _P, _P, _P, _P, ctypes.c_float, ctypes.c_float,
                                 ctypes.c_float]),
    "ggml_new_graph": (_P, [_P]),
    "ggml_build_forward_expand": (None, [_P, _P]),
    "ggml_nbytes": (_SZ, [_P]),
    "ggml_row_size": (_SZ, [ctypes.c_int, _I64]),
    "ggml_quantize_chunk": (_SZ, [ctypes.c_int, _P, _P, _I64, _I64, _I64, _P]),
    "ggml_quantize_requires_imatrix": (ctypes.c_bool, [ctypes.c_int]),
    "ggml_backend_cpu_init": (_P, []),
    "ggml_backend_cpu_set_n_threads": (None, [_P, ctypes.c_int]),
    "ggml_backend_free": (None, [_P]),
    "ggml_backend_dev_by_type": (_P, [ctypes.c_int]),
    "ggml_backend_dev_backend_reg": (_P, [_P]),
    "ggml_backend_reg_get_proc_address": (_P, [_P, ctypes.c_char_p]),
    "ggml_backend_buft_name": (ctypes.c_char_p, [_P]),
    "ggml_backend_cpu_buffer_type": (_P, []),
    "ggml_backend_alloc_ctx_tensors_from_buft": (_P, [_P, _P]),
    "ggml_backend_buffer_free": (None, [_P]),
    "ggml_backend_tensor_set": (None, [_P, _P, _SZ, _SZ]),
    "ggml_backend_dev_supports_op": (ctypes.c_bool, [_P, _P]),
    "ggml_backend_graph_compute": (ctypes.c_int, [_P, _P]),
    "ggml_op_desc": (ctypes.c_char_p, [_P]),
}
# Types ggml_quantize_chunk cannot write (activation-only and integer types): never asked for.
NO_PROBE_TYPES = ("Q8_1", "Q8_K", "F64", "I8", "I16", "I32", "I64")
_GGML_DEVICE_CPU = 0  # GGML_BACKEND_DEVICE_TYPE_CPU
_GGML_F32 = 0
_GGML_F16 = 1
_GGML_I32 = 26
_REPACK_BUFT = "CPU_REPACK"  # llama.cpp puts Q4_0, Q4_K, IQ4_NL, ... weights here at load


def _ggml():
    """ggml's C functions from the libraries llama-cpp-python ships, loaded once."""
    if "ggml" in _state:
        return _state["ggml"]
    lib_dir = Path(L.__file__).parent / "lib"
    libs = []
    for stem in ("ggml-base", "ggml", "ggml-cpu"):
        found = sorted(p for p in lib_dir.glob(f"*{stem}.*")
                       if p.name.split(".")[0] in (f"lib{stem}", stem))
        if found:
            libs.append(ctypes.CDLL(str(found[0]), mode=ctypes.RTLD_GLOBAL))
    fns = SimpleNamespace()
    for name, (restype, argtypes) in _GGML_SIGNATURES.items():
        fn = next((getattr(lib, name) for lib in libs if hasattr(lib, name)), None)
        if fn is None:
            raise MeasurementError(f"ggml function {name} not found in {lib_dir}",
                                   source=str(lib_dir))
        fn.restype, fn.argtypes = restype, argtypes
        setattr(fns, name, fn)
    _state["ggml"] = fns
    return fns


@dataclass
class _MatMul:
    """A weight matrix (n_rows x n_cols of one type) times an F32 activation, ready to run."""

    graph: int
    n_bytes: int  # the weight matrix's bytes
    flops: float
    layout: str  # the buffer type the weights live in: CPU_REPACK or CPU
    handles: list  # (free function, pointer) pairs, freed in reverse order


class KernelProbe:
    """ggml's matrix kernels, as llama.cpp runs them, over matrices of any weight type.

    Streaming: one matrix-vector product over weights far larger than the last-level cache
    (what one decode step does per matrix), GB/s of weight bytes. Compute: the same weights
    times a 512-column activation (one prefill ubatch), GFLOP/s = 2 x weights x columns.
    Streaming runs at rows of N_COLS weights, and at NARROW_ROW for the short rows of small
    models (a row's fixed work weighs more there). Weights go where llama.cpp would put them
    at load: its CPU repack buffer when ggml supports the type there on this CPU, the plain
    CPU buffer otherwise.
    """

    N_COLS = 4096  # a multiple of every block size (32 and the K-quants' 256)
    COMPUTE_ROWS = 1024
    COMPUTE_COLUMNS = 512
    NARROW_COLUMNS = 128  # a short prompt's ubatch: GEMM is less efficient with fewer columns
    NARROW_ROW = 512  # a small model's hidden size: a row's fixed work weighs more on short rows
    # (queries, cached positions they attend to): a prefill ubatch, a decode step
    ATTENTION_SHAPES = {"prefill": (512, 2048), "decode": (1, 4096)}

    def __init__(self, stream_n_bytes: int) -> None:
        _init()
        self.g = _ggml()
        self.stream_n_bytes = stream_n_bytes
        self.backend = self.g.ggml_backend_cpu_init()
        self.device = self.g.ggml_backend_dev_by_type(_GGML_DEVICE_CPU)
        self.cpu_buft = self.g.ggml_backend_cpu_buffer_type()
        self.repack_buft = self._extra_buft(_REPACK_BUFT)
        self._cache: dict[tuple[str, str], _MatMul] = {}

    def _extra_buft(self, name: str) -> int | None:
        g = self.g
        reg = g.ggml_backend_dev_backend_reg(self.device)
        fn = g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
        if not fn:
            return None
        bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)(
            self.device)
        i = 0
        while bufts and bufts[i]:
            if g.ggml_backend_buft_name(bufts[i]).decode() == name:
                return bufts[i]
            i += 1
        return None

    def unsupported(self, type_name: str) -> str | None:
        """Why ggml cannot build a probe matrix of this type here (None when it can)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            qtype = GGMLQuantizationType[type_name.upper()]
        except KeyError:
            return f"ggml has no type {type_name}"
        if (qtype not in GGML_QUANT_SIZES or qtype.name in NO_PROBE_TYPES
                or self.N_COLS % GGML_QUANT_SIZES[qtype][0]):
            return f"no probe matrix for {type_name}"
        if self.g.ggml_quantize_requires_imatrix(qtype.value):
            return f"{type_name} needs an importance matrix to quantize"
        return None

    def stream(self, type_name: str, n_threads: int, passes: int,
               row_n_weights: int | None = None) -> dict:
        """GB/s of one matrix-vector product whose rows hold row_n_weights weights (N_COLS by
        default; a matrix's inner dimension, the hidden size for most of a model's)."""
        mm = self._matmul(type_name, "stream", 1, row_n_weights)
        seconds = self._run(mm, n_threads, passes)
        return {"samples_gb_s": [mm.n_bytes / s / 1e9 for s in seconds],
                "n_bytes": mm.n_bytes, "layout": mm.layout}

    def compute(self, type_name: str, n_threads: int, passes: int,
                n_columns: int | None = None) -> dict:
        """GFLOP/s of the type's weights times n_columns activations (a prefill ubatch of
        that many tokens; COMPUTE_COLUMNS by default)."""
        mm = self._matmul(type_name, "compute", n_columns or self.COMPUTE_COLUMNS)
        seconds = self._run(mm, n_threads, passes)
        return {"samples_gflop_s": [mm.flops / s / 1e9 for s in seconds],
                "n_bytes": mm.n_bytes, "layout": mm.layout}

    def attention(self, shape: tuple[int, int, int], n_threads: int, passes: int,
                  phase: str = "prefill") -> dict:
        """ggml's flash-attention kernel at one model's attention shape (head_dim, heads, KV
        heads) against an F16 K/V cache, unmasked: prefill, one ubatch of queries; decode,
        one query (a step of one layer) against a long cache. GFLOP/s = 4 x head_dim x heads
        x queries x keys (QK^T and the weighted sum of V)."""
        n_q, n_kv = self.ATTENTION_SHAPES[phase]
        mm = self._attention(shape, n_q, n_kv)
        seconds = self._run(mm, n_threads, passes)
        return {"samples_gflop_s": [mm.flops / s / 1e9 for s in seconds],
                "n_queries": n_q, "n_keys": n_kv}

    def layout(self, type_name: str) -> str:
        """The buffer type weights of this type live in: CPU_REPACK or CPU."""
        return self._matmul(type_name, "stream").layout

    def _run(self, mm: _MatMul, n_threads: int, passes: int) -> list[float]:
        """One untimed warm pass, then `passes` timed ones (seconds each)."""
        g = self.g
        g.ggml_backend_cpu_set_n_threads(self.backend, n_threads)
        out = []
        for i in range(passes + 1):
            start = time.perf_counter_ns()
            if g.ggml_backend_graph_compute(self.backend, mm.graph) != 0:
                raise MeasurementError("ggml could not compute the probe's matrix product",
                                       source="ggml")
            if i:
                out.append((time.perf_counter_ns() - start) / 1e9)
        return out

    def _matmul(self, type_name: str, kind: str, n_columns: int = 1,
                row_n_weights: int | None = None) -> _MatMul:
        row_n_weights = row_n_weights or self.N_COLS
        key = (type_name, kind, n_columns, row_n_weights)
        if key not in self._cache:
            reason = self.unsupported(type_name)
            if reason:
                raise MeasurementError(reason, source="ggml")
            from gguf import GGMLQuantizationType

            type_id = GGMLQuantizationType[type_name.upper()].value
            row = self.g.ggml_row_size(type_id, row_n_weights)
            stream_rows = max(self.stream_n_bytes // row // 64, 1) * 64
            rows = stream_rows if kind == "stream" else min(self.COMPUTE_ROWS, stream_rows)
            self._cache[key] = self._build(type_id, rows, n_columns, row_n_weights)
        return self._cache[key]

    def _attention(self, shape: tuple[int, int, int], n_q: int, n_kv: int) -> _MatMul:
        key = ("attention", "x".join(map(str, (*shape, n_q, n_kv))))
        if key not in self._cache:
            g, (head_dim, n_head, n_kv_head) = self.g, shape
            ctx = g.ggml_init(_GgmlInitParams(8 * g.ggml_tensor_overhead()
                                              + g.ggml_graph_overhead(), None, True))
            q = g.ggml_new_tensor_3d(ctx, _GGML_F32, head_dim, n_q, n_head)
            k = g.ggml_new_tensor_3d(ctx, _GGML_F16, head_dim, n_kv, n_kv_head)
            v = g.ggml_new_tensor_3d(ctx, _GGML_F16, head_dim, n_kv, n_kv_head)
            out = g.ggml_flash_attn_ext(ctx, q, k, v, None, head_dim ** -0.5, 0.0, 0.0)
            buf = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, self.cpu_buft)
            mm = _MatMul(out, 0, 4.0 * head_dim * n_head * n_q * n_kv, "CPU",
                         [(g.ggml_free, ctx), (g.ggml_backend_buffer_free, buf)])
            if not buf:
                self._free(mm)
                raise MemoryError("ggml could not allocate the attention probe")
            rng = np.random.default_rng(2)
            for t, n in ((q, head_dim * n_q * n_head), (k, head_dim * n_kv * n_kv_head),
                         (v, head_dim * n_kv * n_kv_head)):
                x = rng.standard_normal(n, dtype=np.float32)
                x = x if t == q else x.astype(np.float16)
                g.ggml_backend_tensor_set(t, x.ctypes.data, 0, x.nbytes)
            mm.graph = g.ggml_new_graph(ctx)
            g.ggml_build_forward_expand(mm.graph, out)
            self._cache[key] = mm
        return self._cache[key]

    def _build(self, type_id: int, n_rows: int, n_columns: int, row_n_weights: int) -> _MatMul:
        bufts = [b for b in (self.repack_buft, self.cpu_buft) if b]
        for buft in bufts:
            mm, w, x = self._allocate(type_id, n_rows, n_columns, buft, row_n_weights)
            if buft == self.cpu_buft or self.g.ggml_backend_dev_supports_op(self.device,
                                                                            mm.graph):
                break
            self._free(mm)  # ggml does not repack this type on this CPU: plain layout
        weights = _weight_bytes(self.g, type_id, n_rows, row_n_weights)
        self.g.ggml_backend_tensor_set(w, weights.ctypes.data, 0, weights.nbytes)
        del weights
        activation = np.random.default_rng(1).standard_normal(
            (n_columns, row_n_weights), dtype=np.float32)
        self.g.ggml_backend_tensor_set(x, activation.ctypes.data, 0, activation.nbytes)
        out = mm.graph
        graph_ctx = mm.handles[-1][1]  # the activation's context holds the graph
        mm.graph = self.g.ggml_new_graph(graph_ctx)
        self.g.ggml_build_forward_expand(mm.graph, out)
        return mm

    def _allocate(self, type_id: int, n_rows: int, n_columns: int, buft: int,
                  row_n_weights: int):
        """Weights in buft, the activation and output in the CPU buffer; graph = the product
        tensor until _build makes the graph."""
        g = self.g
        overhead = g.ggml_tensor_overhead()
        ctx_w = g.ggml_init(_GgmlInitParams(2 * overhead, None, True))
        w = g.ggml_new_tensor_2d(ctx_w, type_id, row_n_weights, n_rows)
        buf_w = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx_w, buft)
        ctx_a = g.ggml_init(_GgmlInitParams(8 * overhead + g.ggml_graph_overhead(), None, True))
        x = g.ggml_new_tensor_2d(ctx_a, _GGML_F32, row_n_weights, n_columns)
        out = g.ggml_mul_mat(ctx_a, w, x)
        buf_a = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx_a, self.cpu_buft)
        handles = [(g.ggml_free, ctx_w), (g.ggml_backend_buffer_free, buf_w),
                   (g.ggml_backend_buffer_free, buf_a), (g.ggml_free, ctx_a)]
        if not buf_w or not buf_a:
            self._free(_MatMul(0, 0, 0, "", handles))
            raise MemoryError(f"ggml could not allocate a {n_rows} x {row_n_weights} probe matrix")
        name = g.ggml_backend_buft_name(buft).decode()
        flops = 2.0 * n_rows * row_n_weights * n_columns
        return _MatMul(out, g.ggml_nbytes(w), flops, name, handles), w, x

    @staticmethod
    def _free(mm: _MatMul) -> None:
        for free, ptr in reversed(mm.handles):
            if ptr:
                free(ptr)
        mm.handles = []

    def close(self) -> None:
        for mm in self._cache.values():
            self._free(mm)
        self._cache.clear()
        if self.backend:
            self.g.ggml_backend_free(self.backend)
            self.backend = None


def _weight_bytes(g, type_id: int, n_rows: int, n_cols: int) -> np.ndarray:
    """Valid blocks of the type (a finite scale in each) for every row: 64 rows quantized from
    N(0, 1) numbers, repeated. Caches work on addresses, so repeats are read like fresh data."""
    chunk_rows = min(64, n_rows)
    src = np.random.default_rng(0).standard_normal((chunk_rows, n_cols), dtype=np.float32)
    row = g.ggml_row_size(type_id, n_cols)
    chunk = np.empty(chunk_rows * row, dtype=np.uint8)
    g.ggml_quantize_chunk(type_id, src.ctypes.data, chunk.ctypes.data, 0, chunk_rows, n_cols,
                          None)
    return np.tile(chunk, -(-n_rows // chunk_rows))[: n_rows * row]


def quantize_rows(type_id: int, rows: np.ndarray) -> bytes:
    """F32 rows (n_rows x n_cols) in a ggml type, by ggml's own quantizer; types that need an
    importance matrix get a flat one (every column weighs the same)."""
    _init()
    g = _ggml()
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    n_rows, n_cols = rows.shape
    imatrix = (np.ones(n_cols, dtype=np.float32)
               if g.ggml_quantize_requires_imatrix(type_id) else None)
    out = np.empty(n_rows * g.ggml_row_size(type_id, n_cols), dtype=np.uint8)
    n_bytes = g.ggml_quantize_chunk(type_id, rows.ctypes.data, out.ctypes.data, 0, n_rows,
                                    n_cols, None if imatrix is None else imatrix.ctypes.data)
    return out[:n_bytes].tobytes()


class _GgmlTensor(ctypes.Structure):
    """struct ggml_tensor as ggml.h lays it out (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64,
    GGML_MAX_SRC 10, GGML_MAX_NAME 64)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", _P), ("ne", _I64 * 4), ("nb", _SZ * 4),
                ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", _P * 10), ("view_src", _P),
                ("view_offs", _SZ), ("data", _P), ("name", ctypes.c_char * 64),
                ("extra", _P), ("padding", ctypes.c_char * 8)]


@dataclass
class NodeRecord:
    """One graph node as the eval callback saw it after computing it."""

    name: str
    op: str
    seconds: float  # since the previous node finished: this node's compute alone
    weight: str | None = None  # a matrix product's weight tensor (its first source)
    stats: dict | None = None  # of the node's F32 output (and its input, for activations)


class GraphTrace:
    """llama.cpp's eval callback, asking for every node: each node is then computed alone, and
    its time, op and name (and, with stats, its values' ranges) are recorded; the data of nodes
    whose name starts with a captured prefix (the experts each token picks) is copied out.
    Asking for every node synchronizes the graph: it attributes time, it does not measure it."""

    ACTIVATION_OPS = ("GELU", "SILU", "GEGLU", "SWIGLU", "GELU_QUICK", "GEGLU_ERF")

    def __init__(self, stats: bool = False, capture: tuple[str, ...] = ()) -> None:
        self.stats, self.capture = stats, capture
        self.nodes: list[NodeRecord] = []
        self.captured: list[tuple[str, np.ndarray]] = []
        self.callback = L.ggml_backend_sched_eval_callback(self._call)  # kept alive here
        self._g = _ggml()
        self._mark = time.perf_counter_ns()

    def start(self) -> None:
        """Start timing from now (call before each llama_decode)."""
        self._mark = time.perf_counter_ns()

    def _call(self, ptr: int, ask: bool, _user: int) -> bool:
        if ask:
            return True
        seconds = (time.perf_counter_ns() - self._mark) / 1e9
        t = _GgmlTensor.from_address(ptr)
        name = t.name.decode(errors="replace")
        record = NodeRecord(name, self._g.ggml_op_desc(ptr).decode(), seconds)
        if record.op in ("MUL_MAT", "MUL_MAT_ID") and t.src[0]:
            record.weight = _GgmlTensor.from_address(t.src[0]).name.decode(errors="replace")
        if self.stats:
            record.stats = {"out": _value_stats(t)}
            if record.op in self.ACTIVATION_OPS and t.src[0]:
                record.stats["in"] = _value_stats(_GgmlTensor.from_address(t.src[0]))
        if self.capture and name.startswith(self.capture):
            self.captured.append((name, _tensor_values(t).copy()))
        self.nodes.append(record)
        self._mark = time.perf_counter_ns()  # our own work is not the next node's
        return True


def _tensor_values(t: _GgmlTensor) -> np.ndarray:
    """An F32 or I32 tensor's values as an array over its memory, views with strides included
    (the chosen experts are a view of an argsort), outermost dimension first."""
    kinds = {_GGML_F32: np.float32, _GGML_I32: np.int32}
    if t.type not in kinds or not t.data:
        return np.empty(0, dtype=np.float32)
    shape = [int(n) for n in t.ne][::-1]
    strides = [int(b) for b in t.nb][::-1]
    span = sum((n - 1) * b for n, b in zip(shape, strides, strict=True)) + 4
    raw = (ctypes.c_char * span).from_address(t.data)
    values = np.ndarray(shape, dtype=kinds[t.type], buffer=raw, strides=strides)
    while values.ndim > 1 and values.shape[0] == 1:
        values = values[0]
    return values


def _value_stats(t: _GgmlTensor) -> dict | None:
    """Range, RMS, share beyond +-10 and non-finite count of an F32 tensor's values."""
    if t.type != _GGML_F32:
        return None
    x = _tensor_values(t)
    if not x.size:
        return None
    finite = np.isfinite(x)
    y = x[finite] if not finite.all() else x
    out = {"n": int(x.size), "non_finite": int(x.size - finite.sum())}
    if not y.size:
        return out | dict.fromkeys(("min", "max", "rms", "beyond_10", "subnormal"))
    return out | {"min": float(y.min()), "max": float(y.max()),
                  "rms": float(np.sqrt(np.mean(np.square(y, dtype=np.float64)))),
                  "beyond_10": float(np.mean(np.abs(y) > 10)),
                  "subnormal": float(np.mean((y != 0) & (np.abs(y) < np.finfo(np.float32).tiny)))}
