"""Measure the machine's ceilings: memory bandwidth (read, copy) and F32 matmul GFLOP/s.

STREAM conventions (McCalpin, https://www.cs.virginia.edu/stream/ref.html): arrays at least 4x
the last-level cache, one untimed warm pass, the best of several timed passes, and copy counted
as bytes read plus bytes written (write-allocate traffic not counted).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
from threadpoolctl import threadpool_limits

from .env import available_ram_bytes, last_level_cache_bytes

DEFAULT_ARRAY_N_BYTES = 1 << 30
MATMUL_N = 2048  # 2 * 2048**3 = 17.2 GFLOP per multiply, 16 MiB per F32 matrix
MIN_PASSES = 5


def plan_array_n_bytes(requested: int | None = None) -> tuple[int, list[str]]:
    """Array size: at least 4x the LLC (1 GiB by default), shrunk to fit free RAM."""
    notes = []
    llc = last_level_cache_bytes()
    env = os.environ.get("HARNESS_PROBE_MIB", "")
    if not requested and env.isdigit() and int(env) > 0:
        requested = int(env) << 20
    want = requested or max(DEFAULT_ARRAY_N_BYTES, 4 * (llc or 0))
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


def _bandwidth(n_threads: int, src: np.ndarray, dst: np.ndarray, passes: int) -> dict:
    edges = [src.size * i // n_threads for i in range(n_threads + 1)]
    bounds = list(zip(edges[:-1], edges[1:], strict=True))

    def read(i: int) -> None:
        lo, hi = bounds[i]
        src[lo:hi].max()

    def copy(i: int) -> None:
        lo, hi = bounds[i]
        np.copyto(dst[lo:hi], src[lo:hi])

    out = {}
    for name, work, factor in (("read", read, 1), ("copy", copy, 2)):
        _parallel(n_threads, work)  # warm pass
        seconds = [_parallel(n_threads, work) for _ in range(passes)]
        samples = [factor * src.nbytes / s / 1e9 for s in seconds]
        out[f"{name}_gb_s"] = max(samples)
        out[f"{name}_samples_gb_s"] = samples
    return out


def _matmul(n_threads: int, n: int, passes: int) -> dict:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    with threadpool_limits(limits=n_threads, user_api="blas"):
        a @ b  # warm pass
        seconds = []
        for _ in range(passes):
            start = time.perf_counter()
            a @ b
            seconds.append(time.perf_counter() - start)
    samples = [2 * n**3 / s / 1e9 for s in seconds]
    return {"matmul_gflop_s": max(samples), "matmul_samples_gflop_s": samples, "matmul_n": n}


def probe(thread_counts: list[int], array_n_bytes: int | None = None,
          passes: int = 7, matmul_n: int = MATMUL_N) -> dict:
    """Ceilings at each thread count; raw samples kept, best-of reported."""
    passes = max(passes, MIN_PASSES)
    n_bytes, notes = plan_array_n_bytes(array_n_bytes)
    start = time.perf_counter()
    src = np.ones(n_bytes // 4, dtype=np.float32)
    dst = np.zeros_like(src)
    results = {}
    for n in sorted(set(thread_counts)):
        results[str(n)] = _bandwidth(n, src, dst, passes) | _matmul(n, matmul_n, passes)
    del src, dst
    return {"array_n_bytes": n_bytes, "passes": passes, "notes": notes,
            "threads": results, "seconds": time.perf_counter() - start}
