"""ggml's own kernels, for ceilings measured with the code decode and prefill run:
matrix-vector and matrix-matrix products over each tensor type, attention, a decode step's
fixed cost."""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import llama_cpp as L
import numpy as np

from ...core.errors import MeasurementError
from ._runtime import _init, _state

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
