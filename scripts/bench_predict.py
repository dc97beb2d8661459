#!/usr/bin/env python3
"""Benchmark (issue 22): do the model's estimates hold on configurations the run never used?

One run measures every configuration side by side, in interleaved rounds: the training ones
(decode and a short prefill), the reference, and the held-out ones. The run's model of its
machine is then fitted on the training cells alone (the held-out measurements removed from
the records), and for each held-out configuration

    predicted ratio = the model's estimate of it ÷ the reference's measured rate
    measured ratio  = its measured rate ÷ the reference's, round by round (95% interval)

Goal: predicted ÷ measured within ±10%. A configuration is MODEL:DTYPE, with :depth=N (decode
after N cached tokens) or :prompt=N (a prefill of N tokens, no decode); decode cells generate
64 tokens after a 16-token prompt.

    python scripts/bench_predict.py --out /tmp/predict
    python scripts/bench_predict.py --held-out qwen2.5-3b:f32 --held-out qwen2.5-0.5b:q6_k
    python scripts/bench_predict.py --runs /tmp/predict/run          # re-analyze, no rerun
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TRAIN = ["qwen2.5-0.5b:f32", "llama-3.2-1b:f32", "qwen2.5-0.5b:f32:prompt=128"]
REFERENCE = "qwen2.5-0.5b:f32"
HELD_OUT = ["qwen2.5-1.5b:f32", "qwen2.5-0.5b:q8_0", "qwen2.5-0.5b:f32:depth=4096",
            "qwen2.5-0.5b:f32:prompt=1024"]
PROMPT, GENERATE = 16, 64


@dataclass(frozen=True)
class Config:
    model: str
    dtype: str
    depth: int = 0
    prompt: int | None = None  # a prefill-only cell of this many tokens

    @classmethod
    def parse(cls, text: str) -> Config:
        model, dtype, *rest = text.split(":")
        extra = dict(part.split("=", 1) for part in rest)
        return cls(model, dtype.lower(), int(extra.get("depth", 0)),
                   int(extra["prompt"]) if "prompt" in extra else None)

    @property
    def phase(self) -> str:
        return "prefill" if self.prompt else "decode"

    def matches(self, m) -> bool:
        if (m.model, m.dtype) != (self.model, self.dtype) or m.parallel != 1:
            return False
        if self.prompt:
            return m.n_gen == 0 and m.n_prompt == self.prompt
        return (m.n_gen == GENERATE and m.n_prompt == PROMPT
                and m.depth == self.depth and m.kv_type == "f16")

    def __str__(self) -> str:
        tail = f" depth {self.depth:,}" if self.depth else ""
        return f"{self.model} {self.dtype}" + (f" pp{self.prompt}" if self.prompt else
                                               f" decode{tail}")


def scenario_text(configs: list[Config], max_seconds: int) -> str:
    lines = ["name: bench_predict", "title: Held-out configurations against the model",
             f"models: [{', '.join(sorted({c.model for c in configs}))}]",
             f"dtypes: [{', '.join(sorted({c.dtype for c in configs}))}]",
             "threads: [auto]", "repetitions: auto", "target_ci: 0.03",
             f"max_seconds: {max_seconds}", "warmup: 1", "tests:"]
    for i, c in enumerate(configs):
        work = (f"prompt: {c.prompt}, generate: 0" if c.prompt else
                f"prompt: {PROMPT}, generate: {GENERATE}"
                + (f", depth: {c.depth}" if c.depth else ""))
        lines.append(f"  - {{name: c{i}, {work}, models: [{c.model}], dtypes: [{c.dtype}]}}")
    return "\n".join(lines) + "\n"


def measure(configs: list[Config], out: Path, max_seconds: int) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    scenario = out / "bench_predict.yaml"
    scenario.write_text(scenario_text(configs, max_seconds))
    run = out / "run"
    subprocess.run([sys.executable, "-m", "harness", "run", str(scenario), "--out", str(run)],
                   check=True)
    return run


def compare(run: Path, train: list[Config], reference: Config, held: list[Config]) -> int:
    from harness.analysis.ceilings import round_rates
    from harness.analysis.estimates import estimate
    from harness.core.costs import mean_decode_context
    from harness.core.records import Grouping
    from harness.core.specs import ModelSpec
    from harness.core.stats import center, contrast
    from harness.report.files import load_run
    from harness.study.analyze import analyze, with_ram_groups

    _, records = load_run(run)
    measurements = with_ram_groups(records.measurements, records.of_type(Grouping))
    held_ids = {m.id for m in measurements if any(c.matches(m) for c in held)}
    train_ms = [m for m in measurements if m.id not in held_ids]
    env = records.header.env or {}
    mm = analyze(train_ms, records.models, records.probes, {}, records.rounds,
                 ram_bytes=env.get("ram_total_bytes"))["machine_model"]
    cells = {c: next((m for m in measurements if c.matches(m)), None)
             for c in [reference, *held, *(t for t in train if t.prompt)]}
    misses = []
    print(f"model fitted on: {', '.join(map(str, train))}; reference: {reference}")
    print(f"{'held-out configuration':<36} {'predicted':>10} {'measured (95% CI)':>24} "
          f"{'pred ÷ meas':>11}")
    for c in held:
        m, ref = cells[c], cells[reference if c.phase == "decode" else _prefill_ref(train)]
        if m is None or ref is None:
            print(f"{c!s:<36} not measured")
            continue
        spec = ModelSpec(**records.models[f"{c.model}|{c.dtype}"].spec)
        if c.phase == "decode":
            context = c.depth + mean_decode_context(PROMPT, GENERATE)
            e = estimate(mm, spec, c.dtype, threads=m.threads, context=int(context))
            predicted = e["decode_tok_s"]
        else:
            e = estimate(mm, spec, c.dtype, threads=m.threads, n_prompt=c.prompt)
            predicted = e["prefill_tok_s"]
        phase = c.phase
        measured = contrast(round_rates(m, phase), round_rates(ref, phase))
        if predicted is None or measured is None:
            print(f"{c!s:<36} no estimate ({e.get('why') or e.get('decode_why')})")
            continue
        ratio = predicted / center(ref[f"{phase}_tok_s"])
        ci = measured.get("median_ci95") or [measured["ratio"]] * 2
        miss = ratio / measured["ratio"]
        misses.append(abs(miss - 1))
        print(f"{c!s:<36} {ratio:>9.3f}× {measured['ratio']:>9.3f}× "
              f"[{ci[0]:.3f}–{ci[1]:.3f}]  {miss:>10.3f}")
        source = e.get("decode_gb_s_from") if c.phase == "decode" else e.get("prefill_matmul_from")
        print(f"{'':<38}from {source}")
    if misses:
        print(f"largest miss {max(misses):.1%} (goal ±10%)")
    return 0 if misses and max(misses) <= 0.10 else 1


def _prefill_ref(train: list[Config]) -> Config:
    return min((c for c in train if c.prompt), key=lambda c: c.prompt)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", action="append", help=f"default: {' '.join(TRAIN)}")
    ap.add_argument("--reference", default=REFERENCE)
    ap.add_argument("--held-out", action="append", help=f"default: {' '.join(HELD_OUT)}")
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench_predict"))
    ap.add_argument("--max-seconds", type=int, default=420)
    ap.add_argument("--runs", type=Path, help="analyze this run instead of measuring")
    args = ap.parse_args()
    train = [Config.parse(t) for t in args.train or TRAIN]
    reference = Config.parse(args.reference)
    held = [Config.parse(t) for t in args.held_out or HELD_OUT]
    configs = list(dict.fromkeys([*train, reference, *held]))
    run = args.runs or measure(configs, args.out, args.max_seconds)
    return compare(run, train, reference, held)


if __name__ == "__main__":
    sys.exit(main())
