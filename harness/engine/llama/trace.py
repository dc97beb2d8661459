"""A trace of the graph llama.cpp computes: every node's op, shape and (optionally) value
statistics."""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import llama_cpp as L
import numpy as np

from .kernels import _GGML_F32, _GGML_I32, _I64, _P, _SZ, _ggml


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
