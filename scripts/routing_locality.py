"""How often a built mixture of experts sends neighbouring tokens to a shared expert, beside
distant ones and uniform routing: the figures docs/twins.md ("Routing locality") quotes.

    python scripts/routing_locality.py granite-3.0-1b-a400m [--dtype f16] [--cache-dir DIR]

One 512-token prefill in one ubatch and 256 decode steps of random tokens (as `harness routing
MODEL --generate 256`, which prints the decode columns per layer). Per layer: the share of
consecutive prefill tokens sharing any expert ("near"), the same at distances 64, 128 and 256
("far"), and the share and mean overlap of consecutive decode steps.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from harness.core.costs import (
    consecutive_overlap,
    experts_touched,
    repeat_share,
    uniform_overlap,
    uniform_repeat_share,
)
from harness.core.dtypes import get_dtype
from harness.core.specs import resolve_spec
from harness.engine.build import build
from harness.engine.env import physical_cores
from harness.engine.llama import Model
from harness.engine.routing import expert_selections

FAR = (64, 128, 256)


def _row(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="f16")
    parser.add_argument("--cache-dir", type=Path)
    args = parser.parse_args()
    spec = resolve_spec(args.model)
    path = build(spec, get_dtype(args.dtype, key="--dtype"), 0, directory=args.cache_dir).path
    with Model(path) as model:
        chosen = expert_selections(model, 512, 256, physical_cores(), 0)
    prefill, decode = chosen["prefill"], chosen["decode"]
    e, k = spec.num_experts, spec.num_experts_per_tok
    whole = [layer for layer in sorted(prefill) if len(prefill[layer]) > 1]
    near = [repeat_share(prefill[layer]) for layer in whole]
    far = [float(np.mean([repeat_share(prefill[layer], d) for d in FAR])) for layer in whole]
    sharing = [repeat_share(decode[layer]) for layer in sorted(decode)]
    overlap = [consecutive_overlap(decode[layer]) for layer in sorted(decode)]
    print(f"{spec.name}: {k} of {e} experts, {spec.num_hidden_layers} layers; uniform: "
          f"sharing any {uniform_repeat_share(e, k):.3f}, overlap {uniform_overlap(e, k):.2f}")
    print("prefill touched, fewest over layers:",
          min(experts_touched(prefill[layer]) for layer in whole), f"of {e}")
    print("prefill near, per layer:", _row(near))
    print("prefill far, per layer: ", _row(far))
    print("decode sharing any, per layer:", _row(sharing))
    print("decode overlap, per layer:    ", _row(overlap))


if __name__ == "__main__":
    main()
