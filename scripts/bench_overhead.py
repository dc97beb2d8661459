#!/usr/bin/env python3
"""Benchmark: the harness' own per-token cost in the decode loop (Python + ctypes + clocks).

On a tiny model llama.cpp's work per token is ~0.1 ms, so the harness' share shows. The cost is
the timed wall clock per step minus llama.cpp's own t_eval_ms per step (its counters run from
inside llama_decode to the end of llama_synchronize), counted over the whole loop, so the
untimed bookkeeping between steps is included. The goal is under 50 us per step.

    python scripts/bench_overhead.py --tokens 1000 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from harness.core.dtypes import DTYPES
    from harness.core.specs import resolve_spec
    from harness.engine.build import build
    from harness.engine.llama import ContextParams, Model, open_context

    built = build(resolve_spec(args.model), DTYPES["f32"])
    params = ContextParams(n_ctx=args.tokens + 16, n_batch=512, n_ubatch=512,
                           n_threads=args.threads)
    overheads, walls, loops = [], [], []
    with Model(built.path) as model, open_context(model, params) as ctx:
        tokens = [300 + i % 200 for i in range(args.tokens)]
        ctx.clear()
        ctx.decode(tokens[:50])  # warm-up
        for _ in range(args.rounds):
            ctx.clear()
            start = time.perf_counter()
            steps = ctx.decode(tokens)
            loop_us = 1e6 * (time.perf_counter() - start) / len(steps)
            perf = ctx.perf()
            wall_us = 1e6 * sum(steps) / len(steps)
            counter_us = 1e3 * perf.t_eval_ms / perf.n_eval
            walls.append(wall_us)
            overheads.append(loop_us - counter_us)
            loops.append(loop_us - wall_us)
            print(f"loop {loop_us:7.1f} us/step, timed {wall_us:7.1f}, llama.cpp {counter_us:7.1f}"
                  f": harness {loop_us - counter_us:5.1f} us/step, of it {loop_us - wall_us:4.1f}"
                  f" outside the timed window ({perf.n_eval} steps)")
    print(f"{args.model}, {args.threads} thread(s): median harness overhead "
          f"{statistics.median(overheads):.1f} us per decode step (goal < 50 us; "
          f"{statistics.median(loops):.1f} us of it between timed windows), median timed step "
          f"{statistics.median(walls):.1f} us")


if __name__ == "__main__":
    main()
