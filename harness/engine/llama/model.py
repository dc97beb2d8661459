"""A model file loaded through llama.cpp, and a context on it: prefill, decode steps, the KV
cache, perf counters."""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import llama_cpp as L

from ...core.dtypes import KV_CACHE_TYPES
from ...core.errors import Interrupted, MeasurementError
from ._runtime import (
    _ABORT_CALLBACK,
    _ABORT_FLAG,
    _FA_LINES,
    _LOG_LOCK,
    AMX_REBUILD,
    DECODE_ABORTED,
    _log_mark,
    abort_requested,
    build_problem,
    first_error_since,
)

if TYPE_CHECKING:
    from .trace import GraphTrace


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
    swa_full: bool = True  # sliding-window layers keep the full context (llama.cpp's default)


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
        p.swa_full = params.swa_full
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
