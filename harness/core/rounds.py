"""Interleaved rounds: which cells run in which order, and when each has enough samples.

A run is a sequence of rounds; each round does one repetition of every cell still running, in
an order shuffled per round from the run's seed, so a slow or fast spell of the machine hits
every cell alike instead of one cell's whole series. Pure functions: the runner does the work.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from .stats import CONFIDENCE, median_ci

MIN_SAMPLES_FOR_TARGET = 6  # the fewest samples whose order-statistic CI reaches 95%


@dataclass(frozen=True)
class Policy:
    """How many repetitions a cell gets: a fixed count, or `auto` until its CI is narrow."""

    repetitions: int | None  # None: auto
    target_ci: float = 0.03  # auto: stop when the 95% CI of the median is within ±3% of it
    min_repetitions: int = 6
    max_repetitions: int = 200

    @property
    def auto(self) -> bool:
        return self.repetitions is None


def round_order(cell_ids: list[str], seed: int, round_index: int) -> list[str]:
    """The cells' order in one round: a shuffle seeded by the run's seed and the round, so a
    run (and its resume) replays the same sequence."""
    order = sorted(cell_ids)
    random.Random(f"{seed}:{round_index}").shuffle(order)
    return order


def relative_ci(samples: list[float]) -> float | None:
    """Half-width of the median's 95% CI relative to the median (the wider side), or None
    while there are too few samples for 95% coverage."""
    if len(samples) < MIN_SAMPLES_FOR_TARGET:
        return None
    (lo, hi), coverage = median_ci(samples)
    mid = statistics.median(samples)
    if coverage < CONFIDENCE or not mid:
        return None
    return max(mid - lo, hi - mid) / mid


def stop_reason(samples: list[float], policy: Policy, over_budget: bool = False) -> str | None:
    """Why a cell leaves the rounds now ("fixed", "target", "max", "budget"), or None to go
    on. The run's time budget stops only `auto` cells, and never before min_repetitions."""
    n = len(samples)
    if not policy.auto:
        return "fixed" if n >= policy.repetitions else None
    if n >= policy.max_repetitions:
        return "max"
    ci = relative_ci(samples)
    if n >= policy.min_repetitions and ci is not None and ci <= policy.target_ci:
        return "target"
    if over_budget and n >= policy.min_repetitions:
        return "budget"
    return None


def group_by_memory(needs: dict[str, int], available: int | None) -> list[list[str]]:
    """Models (key -> bytes they need loaded, with their cells' contexts) packed into groups
    that fit in the available RAM together, largest first; one group when all fit."""
    keys = list(needs)
    if available is None or sum(needs.values()) <= available:
        return [keys] if keys else []
    groups: list[tuple[int, list[str]]] = []
    for key in sorted(keys, key=lambda k: -needs[k]):
        for i, (used, members) in enumerate(groups):
            if used + needs[key] <= available:
                groups[i] = (used + needs[key], members + [key])
                break
        else:
            groups.append((needs[key], [key]))
    return [members for _, members in groups]
