#!/usr/bin/env python3
"""Benchmark: does running decode steps in turn change a step's cost? (issue 43, item 2)

For each target model, its steps come in pairs: one right after a step of a partner model and
a streaming pass of the rotation's probe (interleaved, as a `step` round runs it), the next
right after its own (alone, as a whole decode runs it). The ratio interleaved ÷ alone of the
target's time per step is taken over blocks of adjacent pairs (each pair within a few hundred
ms, so the machine's speed switches cancel), with the 95% interval of
harness.core.stats.contrast. Targets:

- the given models (larger than the last-level cache): should agree within ±2%;
- a model whose bytes per step fit in the last-level cache (4 layers, Q8_0): it loses that cache
  to the partner's steps, so it is expected slower interleaved (the report flags it);
- a skeleton (32 layers, every width tiny): a step's fixed cost (graph, thread wake-ups), which
  must not grow from switching between contexts.

    python scripts/bench_interleave.py [--seconds 60] [--models qwen2.5-0.5b llama-3.2-1b]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.core.dtypes import DTYPES  # noqa: E402
from harness.core.specs import resolve_spec  # noqa: E402
from harness.core.stats import WINDOW_TICKS, contrast  # noqa: E402
from harness.engine.build import build  # noqa: E402
from harness.engine.env import last_level_cache_bytes, physical_cores  # noqa: E402
from harness.engine.llama import Context, ContextParams, Model  # noqa: E402
from harness.engine.probe import Prober, skeleton_spec  # noqa: E402

N_CTX, PROMPT = 256, 16


class Stepper:
    """A model and a context decoding one token per call; refilled (untimed) before it fills."""

    def __init__(self, path: Path, threads: int) -> None:
        self.model = Model(path)
        self.ctx = Context(self.model, ContextParams(n_ctx=N_CTX, n_batch=512, n_ubatch=512,
                                                     n_threads=threads))
        self.n_bytes, self.pos = self.model.info().n_bytes, N_CTX

    def step(self) -> float:
        if self.pos >= N_CTX - 1:
            self.ctx.clear()
            self.ctx.prefill([300 + i for i in range(PROMPT)])
            self.pos = PROMPT
        self.pos += 1
        return self.ctx.decode([300 + self.pos % 200])[0]

    def close(self) -> None:
        self.ctx.close()
        self.model.close()


def compare(target: Stepper, partner: Stepper, tick, seconds: float, width: int) -> dict:
    """The target's steps in pairs: one right after a step of the partner and a probe pass
    (interleaved, as a `step` round runs it), the next right after its own (alone, as a whole
    decode runs it), a few hundred ms apart, for `seconds`; the ratio of its time per step,
    interleaved ÷ alone, over windows of `width` pairs."""
    turned, alone = [], []
    for _ in range(WINDOW_TICKS):  # warm: every context has stepped before timing
        target.step(), partner.step()
    start = time.monotonic()
    while time.monotonic() - start < seconds or len(turned) < 6 * width:
        partner.step()
        tick()
        turned.append(target.step())
        alone.append(target.step())
    blocks = range(len(turned) // width)
    rate = {"alone": {}, "turned": {}}
    for b in blocks:
        rate["alone"][b] = width / sum(alone[b * width:(b + 1) * width])
        rate["turned"][b] = width / sum(turned[b * width:(b + 1) * width])
    c = contrast(rate["alone"], rate["turned"])  # steps/s alone ÷ interleaved: time ratio
    return c | {"ms_alone": 1000 * statistics.median(alone),
                "ms_turned": 1000 * statistics.median(turned), "n_pairs": len(turned)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "llama-3.2-1b"])
    parser.add_argument("--seconds", type=float, default=60.0, help="per target")
    parser.add_argument("--threads", type=int, default=physical_cores())
    parser.add_argument("--width", type=int, default=8, help="step pairs per block")
    args = parser.parse_args()
    base = resolve_spec(args.models[0])
    small = replace(base, name="in-cache", source=None, hidden_size=512, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                    intermediate_size=1408, vocab_size=4096, tie_word_embeddings=True)
    paths = {m: build(resolve_spec(m), DTYPES["f32"]).path for m in args.models}
    paths["in-cache (4 layers, Q8_0)"] = build(small, DTYPES["q8_0"]).path
    paths["skeleton (32 layers, tiny widths)"] = build(skeleton_spec(base, 32),
                                                       DTYPES["f32"]).path
    prober = Prober(["f32"])
    llc = last_level_cache_bytes()
    print(f"last-level cache {llc / 2**20:.0f} MiB; {args.threads} threads; blocks of "
          f"{args.width} step pairs; {args.seconds:.0f} s per target\n")
    print("| target | bytes per step | alone ms/step | interleaved ms/step "
          "| interleaved ÷ alone [95%] | step pairs |")
    print("|---|---:|---:|---:|---:|---:|")
    partner_of = {m: args.models[(i + 1) % len(args.models)] for i, m in enumerate(args.models)}
    for name, path in paths.items():
        target = Stepper(path, args.threads)
        partner = Stepper(paths[partner_of.get(name, args.models[0])], args.threads)
        try:
            c = compare(target, partner, lambda: prober.tick(args.threads, ["f32"]),
                        args.seconds, args.width)
        finally:
            target.close()
            partner.close()
        lo, hi = c["median_ci95"]
        print(f"| {name} | {target.n_bytes / 2**20:,.1f} MiB | {c['ms_alone']:.3f} "
              f"| {c['ms_turned']:.3f} | {c['ratio']:.3f} [{lo:.3f}–{hi:.3f}] | {c['n_pairs']} |")
    prober.close()


if __name__ == "__main__":
    main()
