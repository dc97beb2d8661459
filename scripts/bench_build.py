#!/usr/bin/env python3
"""Benchmark: building a synthetic GGUF against writing the same bytes sequentially.

Both run in child processes on the same disk, alternating, each ending with fsync, so the
ratio compares like with like; the build's peak RSS comes from the child's rusage.

    python scripts/bench_build.py --model qwen2.5-1.5b --dtype f32 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHUNK = 64 << 20

WRITER = r"""
import os, sys
n, path, chunk = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
buf = memoryview(os.urandom(chunk))
with open(path, "wb") as f:
    left = n
    while left:
        k = min(left, chunk)
        f.write(buf[:k])
        left -= k
    f.flush()
    os.fsync(f.fileno())
"""


def timed_child(argv: list[str]) -> tuple[float, int]:
    """Seconds and peak RSS (bytes) of one child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return seconds, max(peak_kib, before) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--dtype", default="f32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="Where to write (default: cache).")
    args = parser.parse_args()

    from harness.core.dtypes import get_dtype
    from harness.core.specs import resolve_spec
    from harness.engine.build import cache_dir
    from harness.weights.gguf_build import file_n_bytes

    spec, dtype = resolve_spec(args.model), get_dtype(args.dtype)
    n_bytes = file_n_bytes(spec, dtype)
    base = args.dir or cache_dir().parent
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-build-", dir=base))
    print(f"{spec.name} {dtype.name}: {n_bytes / 2**30:.2f} GiB into {work}")
    seq, built, rss = [], [], []
    try:
        for r in range(args.rounds):
            # Alternate which goes first: the disk is slower right after a big delete.
            for kind in (("seq", "build") if r % 2 == 0 else ("build", "seq")):
                if kind == "seq":
                    target = work / "seq.bin"
                    s, _ = timed_child([sys.executable, "-c", WRITER, str(n_bytes), str(target),
                                        str(CHUNK)])
                    target.unlink()
                    seq.append(s)
                else:
                    cache = work / f"cache{r}"
                    b, peak = timed_child([sys.executable, "-m", "harness", "build", spec.name,
                                           "--dtype", dtype.name, "--cache-dir", str(cache)])
                    shutil.rmtree(cache)
                    built.append(b)
                    rss.append(peak)
            print(f"round {r + 1}: sequential write {s:.2f} s ({n_bytes / s / 1e9:.2f} GB/s), "
                  f"harness build {b:.2f} s ({n_bytes / b / 1e9:.2f} GB/s), ratio {b / s:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # Disk speed drifts between rounds, so compare within each round.
    ratios = [b / s for b, s in zip(built, seq, strict=True)]
    print(f"median: sequential {statistics.median(seq):.2f} s, build {statistics.median(built):.2f}"
          f" s; build/sequential per round {', '.join(f'{x:.2f}' for x in ratios)}, median "
          f"{statistics.median(ratios):.2f} (goal <= 1.5)")
    print(f"peak RSS of the build process: {max(rss) / 2**20:.0f} MiB (goal < 600 MiB)")
    print(f"cpu count {os.cpu_count()}; load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
