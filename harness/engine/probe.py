"""Measure the machine's ceilings: plain memory bandwidth (numpy read and copy) and, per weight
type, the streaming bandwidth and compute peak of ggml's own matrix kernels.

Plain memory follows STREAM conventions (McCalpin, https://www.cs.virginia.edu/stream/ref.html):
arrays at least 4x the last-level cache, one untimed warm pass, the best of several timed
passes, and copy counted as bytes read plus bytes written (write-allocate traffic not counted).
The ggml figures come from the kernels decode and prefill run (harness.engine.llama.KernelProbe):
a matrix-vector product over weights far larger than the cache, and the same kind of weights
times a 512-column activation.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..core.errors import MeasurementError
from .env import available_ram_bytes, last_level_cache_bytes

DEFAULT_ARRAY_N_BYTES = 1 << 30
DEFAULT_STREAM_N_BYTES = 256 << 20  # 8x this machine's 32 MiB L3; at least 4x the LLC anywhere
MIN_PASSES = 5
FULL = {"read": 7, "stream": 7, "compute": 5}
# Beside a measurement: a few hundred ms, only what the next cell needs.
BESIDE = {"read": 3, "stream": 3, "compute": 2}
# Probed in every full probe besides the run's own types, so that an estimate for a type the
# run did not measure still has a yardstick (harness estimate).
COMMON_DTYPES = ("f16", "q8_0", "q4_0", "q4_k", "q6_k")
# Layer counts of the skeletons that time a decode step's fixed cost (two points of a line).
SKELETON_LAYERS = (1, 32)
SKELETON_PROMPT, SKELETON_STEPS = 16, 32


def _env_mib() -> int | None:
    env = os.environ.get("HARNESS_PROBE_MIB", "")
    return int(env) << 20 if env.isdigit() and int(env) > 0 else None


def plan_array_n_bytes(requested: int | None = None) -> tuple[int, list[str]]:
    """Array size: at least 4x the LLC (1 GiB by default), shrunk to fit free RAM."""
    notes = []
    llc = last_level_cache_bytes()
    want = requested or _env_mib() or max(DEFAULT_ARRAY_N_BYTES, 4 * (llc or 0))
    available = available_ram_bytes()
    # copy needs a source and a destination; leave half of what is free to everything else
    if available is not None and 2 * want > available // 2:
        shrunk = max((available // 4) // (1 << 20) << 20, 1 << 20)
        notes.append(f"arrays shrunk from {want / 2**20:.0f} MiB to {shrunk / 2**20:.0f} MiB: "
                     f"only {available / 2**30:.1f} GiB of RAM is available")
        want = shrunk
    if llc and want < 4 * llc:
        notes.append(f"arrays of {want / 2**20:.0f} MiB are under 4x the {llc / 2**20:.0f} MiB "
                     "last-level cache: bandwidth may include cache hits")
    return want, notes


def plan_stream_n_bytes(n_types: int) -> tuple[int, list[str]]:
    """Bytes of each type's streaming matrix: 256 MiB (or HARNESS_PROBE_MIB, or 4x the LLC),
    shrunk so every type's matrix fits in a quarter of free RAM."""
    llc = last_level_cache_bytes() or 0
    want = _env_mib() or max(DEFAULT_STREAM_N_BYTES, 4 * llc)
    notes = []
    available = available_ram_bytes()
    if available is not None and want * max(n_types, 1) > available // 4:
        shrunk = max(available // 4 // max(n_types, 1) >> 20 << 20, 1 << 20)
        notes.append(f"ggml probe matrices shrunk from {want >> 20} MiB to {shrunk >> 20} MiB: "
                     f"only {available / 2**30:.1f} GiB of RAM is available")
        want = shrunk
    if llc and want < 4 * llc:
        notes.append(f"ggml probe matrices of {want >> 20} MiB are under 4x the "
                     f"{llc >> 20} MiB last-level cache: bandwidth may include cache hits")
    return want, notes


def _parallel(n_threads: int, work) -> float:
    """Seconds for n_threads threads to each run work(i) (numpy releases the GIL in them)."""
    barrier = threading.Barrier(n_threads + 1)
    threads = [threading.Thread(target=lambda i=i: (barrier.wait(), work(i)))
               for i in range(n_threads)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def _bandwidth(n_threads: int, src: np.ndarray, dst: np.ndarray | None, passes: int) -> dict:
    edges = [src.size * i // n_threads for i in range(n_threads + 1)]
    bounds = list(zip(edges[:-1], edges[1:], strict=True))

    def read(i: int) -> None:
        lo, hi = bounds[i]
        src[lo:hi].max()

    def copy(i: int) -> None:
        lo, hi = bounds[i]
        np.copyto(dst[lo:hi], src[lo:hi])

    out = {}
    kernels = (("read", read, 1), ("copy", copy, 2)) if dst is not None else (("read", read, 1),)
    for name, work, factor in kernels:
        _parallel(n_threads, work)  # warm pass
        seconds = [_parallel(n_threads, work) for _ in range(passes)]
        samples = [factor * src.nbytes / s / 1e9 for s in seconds]
        out[f"{name}_gb_s"] = max(samples)
        out[f"{name}_samples_gb_s"] = samples
    return out


def _kernels(kp, n_threads: int, dtypes: list[str], passes: dict, phases: tuple[str, ...]
             ) -> dict:
    """Each weight type's ggml streaming GB/s and compute GFLOP/s; a type ggml cannot probe
    is recorded with the reason, never guessed."""
    out = {}
    for dtype in dtypes:
        entry: dict = {}
        try:
            if "stream" in phases:
                s = kp.stream(dtype, n_threads, passes["stream"])
                entry |= {"stream_gb_s": max(s["samples_gb_s"]),
                          "stream_samples_gb_s": s["samples_gb_s"], "layout": s["layout"],
                          "stream_n_bytes": s["n_bytes"]}
            if "compute" in phases:
                c = kp.compute(dtype, n_threads, passes["compute"])
                entry |= {"compute_gflop_s": max(c["samples_gflop_s"]),
                          "compute_samples_gflop_s": c["samples_gflop_s"],
                          "layout": c["layout"]}
            if "narrow" in phases:
                c = kp.compute(dtype, n_threads, passes["compute"], kp.NARROW_COLUMNS)
                s = kp.stream(dtype, n_threads, passes["stream"], kp.NARROW_ROW)
                entry |= {"narrow_gflop_s": max(c["samples_gflop_s"]),
                          "narrow_samples_gflop_s": c["samples_gflop_s"],
                          "narrow_columns": kp.NARROW_COLUMNS,
                          "shortrows_gb_s": max(s["samples_gb_s"]),
                          "shortrows_samples_gb_s": s["samples_gb_s"],
                          "shortrows_n_weights": kp.NARROW_ROW,
                          "row_n_weights": kp.N_COLS}
        except (MeasurementError, MemoryError) as exc:
            entry["error"] = str(exc)
        out[dtype] = entry
    return out


class PageReader:
    """A read of the pages a decode step reads: the model file's own tensor data as llama.cpp
    maps it (the same page-cache pages), or an anonymous buffer of the same size when llama.cpp
    copies most of the weights into its own repacked buffers at load."""

    CAP_N_BYTES = 1 << 30  # a few hundred ms at most, even at 5 GB/s

    def __init__(self, path=None, offset: int = 0, n_bytes: int = 0) -> None:
        n = min(n_bytes, self.CAP_N_BYTES) // 4
        if path is not None:
            self.array = np.memmap(path, dtype=np.int32, mode="r", offset=offset, shape=(n,))
            self.source = "the model's mapped weight pages"
        else:
            self.array = np.ones(n, dtype=np.int32)  # written: no zero page
            self.source = "an anonymous buffer (llama.cpp repacks these weights at load)"
        self.read(1)  # map every page once, untimed

    def read(self, n_threads: int) -> float:
        """GB/s of one pass over the pages with n_threads threads."""
        a = self.array
        edges = [a.size * i // n_threads for i in range(n_threads + 1)]
        seconds = _parallel(n_threads, lambda i: a[edges[i]:edges[i + 1]].max())
        return a.nbytes / seconds / 1e9


def skeleton_spec(spec, n_layers: int):
    """A spec's graph at negligible bytes: its architecture, its kind of attention and experts
    and n_layers layers, every width tiny, so a decode step's time is the time that does not
    scale with bytes (graph build, one synchronization per node, sampling's logits)."""
    experts = {}
    if spec.is_moe:
        experts = {"moe_intermediate_size": 32 if spec.moe_intermediate_size else None,
                   "shared_expert_intermediate_size":
                       32 if spec.shared_expert_intermediate_size else None}
    grouped = spec.num_key_value_heads < spec.num_attention_heads
    return replace(spec, name=f"skeleton-{spec.architecture}-{n_layers}", source=None,
                   hidden_size=64, num_hidden_layers=n_layers, num_attention_heads=2,
                   num_key_value_heads=1 if grouped else 2, head_dim=32,
                   intermediate_size=32 if spec.is_moe else 128, vocab_size=512, **experts)


def skeleton_seconds(path: Path, n_threads: int, passes: int) -> list[float]:
    """Seconds per decode step of a skeleton: the median step of each pass (16 prompt tokens,
    32 steps), after one untimed pass."""
    from .llama import Context, ContextParams, Model

    rng = np.random.default_rng(3)
    out = []
    with Model(path) as model:
        ctx = Context(model, ContextParams(n_ctx=256, n_batch=512, n_ubatch=512,
                                           n_threads=n_threads))
        try:
            high = ctx.n_vocab
            for i in range(passes + 1):
                ctx.clear()
                ctx.prefill(rng.integers(1, high, SKELETON_PROMPT).tolist())
                steps = ctx.decode(rng.integers(1, high, SKELETON_STEPS).tolist())
                if i:
                    out.append(statistics.median(steps))
        finally:
            ctx.close()
    return out


class Prober:
    """The ceilings of one run: the full set at its ends, a short probe beside every
    measurement. Holds the probe matrices so a probe beside a measurement costs no set-up.
    extras: "attention", the (head_dim, heads, KV heads) shapes to probe flash attention at;
    "skeletons", {architecture: {layers: GGUF path}} whose decode steps time the fixed cost."""

    def __init__(self, dtypes: list[str], extras: dict | None = None,
                 array_n_bytes: int | None = None) -> None:
        from .llama import KernelProbe

        self.extras = extras or {}
        self.dtypes = sorted(set(dtypes) | set(COMMON_DTYPES))
        self.array_n_bytes, self.notes = plan_array_n_bytes(array_n_bytes)
        stream_n_bytes, notes = plan_stream_n_bytes(len(self.dtypes))
        self.notes += notes
        self.kernels = KernelProbe(stream_n_bytes)
        self._read_array: np.ndarray | None = None

    def full(self, thread_counts: list[int], passes: dict | None = None) -> dict:
        """Every weight type at every thread count, and numpy read and copy."""
        passes = {k: max(v, MIN_PASSES) for k, v in (passes or FULL).items()}
        start = time.perf_counter()
        src = np.ones(self.array_n_bytes // 4, dtype=np.float32)  # written: no zero page
        dst = np.zeros_like(src)
        dst.fill(1.0)
        results = {}
        for n in sorted(set(thread_counts)):
            results[str(n)] = _bandwidth(n, src, dst, passes["read"]) | {
                "ggml": _kernels(self.kernels, n, self.dtypes, passes,
                                 ("stream", "compute", "narrow")),
                "attention": self._attention(n, passes["compute"], "prefill"),
                "decode_attention": self._attention(n, passes["compute"], "decode"),
                "fixed_cost": self._fixed_cost(n, passes["compute"])}
        del src, dst
        return {"array_n_bytes": self.array_n_bytes, "passes": passes, "notes": self.notes,
                "stream_n_bytes": self.kernels.stream_n_bytes, "dtypes": self.dtypes,
                "threads": results, "seconds": time.perf_counter() - start}

    def beside(self, n_threads: int, dtypes: list[str], phases: tuple[str, ...]) -> dict:
        """What the next measurement needs: a short numpy read and its types' kernels."""
        start = time.perf_counter()
        if self._read_array is None:
            self._read_array = np.ones(self.kernels.stream_n_bytes // 4, dtype=np.float32)
        result = _bandwidth(n_threads, self._read_array, None, BESIDE["read"]) | {
            "ggml": _kernels(self.kernels, n_threads, sorted(set(dtypes)), BESIDE, phases)}
        return {"array_n_bytes": self._read_array.nbytes, "passes": BESIDE,
                "stream_n_bytes": self.kernels.stream_n_bytes, "dtypes": sorted(set(dtypes)),
                "threads": {str(n_threads): result}, "seconds": time.perf_counter() - start}

    def tick(self, n_threads: int, dtypes: list[str]) -> dict[str, float | None]:
        """One timed streaming pass of each type, a "cell" in a round's rotation of decode
        steps: the ceiling beside the steps around it (None where ggml cannot probe it)."""
        out: dict[str, float | None] = {}
        for dtype in dtypes:
            try:
                out[dtype] = self.kernels.stream(dtype, n_threads, 1)["samples_gb_s"][0]
            except (MeasurementError, MemoryError):
                out[dtype] = None
        return out

    def _attention(self, n_threads: int, passes: int, phase: str) -> dict:
        """Flash attention's GFLOP/s at each shape, a prefill ubatch or a decode step; a shape
        ggml cannot run keeps its reason."""
        out = {}
        for shape in sorted(set(map(tuple, self.extras.get("attention", [])))):
            name = "x".join(map(str, shape))
            try:
                # a decode step's op takes milliseconds: more passes for the same confidence
                a = self.kernels.attention(shape, n_threads,
                                           3 * passes if phase == "decode" else passes, phase)
                out[name] = {"attention_gflop_s": max(a["samples_gflop_s"]),
                             "attention_samples_gflop_s": a["samples_gflop_s"],
                             "n_queries": a["n_queries"], "n_keys": a["n_keys"]}
            except (MeasurementError, MemoryError) as exc:
                out[name] = {"error": str(exc)}
        return out

    def _fixed_cost(self, n_threads: int, passes: int) -> dict:
        """Seconds per decode step of each architecture's skeletons, by layer count."""
        out: dict = {}
        for arch, paths in sorted(self.extras.get("skeletons", {}).items()):
            entry = out.setdefault(arch, {})
            for layers, path in sorted(paths.items()):
                try:
                    samples = skeleton_seconds(Path(path), n_threads, passes)
                    entry[str(layers)] = {"seconds": statistics.median(samples),
                                          "samples_seconds": samples}
                except (MeasurementError, MemoryError, OSError) as exc:
                    entry[str(layers)] = {"error": str(exc)}
        return out

    def layout(self, dtype: str) -> str | None:
        """Where llama.cpp keeps weights of this type at load (CPU_REPACK or CPU)."""
        try:
            return self.kernels.layout(dtype)
        except (MeasurementError, MemoryError):
            return None

    def close(self) -> None:
        self.kernels.close()
        self._read_array = None

    def __enter__(self) -> Prober:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def probe_dtypes() -> list[str]:
    """The weight types a probe can be asked for: ggml's types that quantize without an
    importance matrix (harness.engine.llama.KernelProbe.unsupported says which, on this build)."""
    from gguf import GGML_QUANT_SIZES

    from .llama import NO_PROBE_TYPES

    return [t.name.lower() for t in GGML_QUANT_SIZES if t.name not in NO_PROBE_TYPES
            and not t.name.startswith(("IQ1", "IQ2", "IQ3", "TQ"))]


def probe(thread_counts: list[int], dtypes: list[str] | None = None,
          array_n_bytes: int | None = None, passes: int = 7) -> dict:
    """The full set of ceilings at each thread count; raw samples kept, best-of reported."""
    n = max(passes, MIN_PASSES)
    with Prober(dtypes or ["f32"], array_n_bytes=array_n_bytes) as prober:
        return prober.full(thread_counts, {"read": n, "stream": n, "compute": n})
