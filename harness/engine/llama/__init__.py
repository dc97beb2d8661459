"""The one package that talks to llama.cpp (through llama-cpp-python's C bindings, and ggml's
own libraries beside them): `_runtime` (loading, the log, the abort flag, versions,
quantizing), `model` (a model and its contexts), `kernels` (ggml's kernels, for the ceilings),
`trace` (the graph llama.cpp computes)."""

import ctypes
import sys

from ._runtime import (
    DECODE_ABORTED,
    L,
    abort_requested,
    build_problem,
    captured_log,
    check_abort,
    clear_abort,
    first_error_since,
    libc_strlen,
    quantize,
    request_abort,
    version_info,
)
from .kernels import NO_PROBE_TYPES, KernelProbe, quantize_rows
from .model import Context, ContextParams, Model, ModelInfo, PerfCounters, open_context
from .trace import GraphTrace, NodeRecord

__all__ = ["DECODE_ABORTED", "L", "NO_PROBE_TYPES", "Context", "ContextParams", "GraphTrace",
           "KernelProbe", "Model", "ModelInfo", "NodeRecord", "PerfCounters", "abort_requested",
           "build_problem", "captured_log", "check_abort", "clear_abort", "ctypes",
           "first_error_since", "libc_strlen", "open_context", "quantize", "quantize_rows",
           "request_abort", "sys", "version_info"]
