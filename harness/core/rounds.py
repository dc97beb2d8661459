"""Interleaved rounds: which cells run in which order, and when each has enough samples.

A run is a sequence of rounds; each round does one repetition of every cell still running, in
an order shuffled per round from the run's seed, so a slow or fast spell of the machine hits
every cell alike instead of one cell's whole series. Pure functions: the runner does the work.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .stats import contrast, finest, relative_half_width, summarize


@dataclass(frozen=True)
class Policy:
    """How many repetitions a cell gets: a fixed count, or `auto` until the intervals it is
    judged on (its contrasts, or its absolute figure) are narrow."""

    repetitions: int | None  # None: auto
    target_ci: float = 0.03  # auto: stop when the 95% intervals are within ±3%
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
    """The wider side of the 95% interval of a cell's long-run median relative to it (None
    under 3 samples)."""
    return relative_half_width(summarize(samples)) if samples else None


def contrast_ci(ours: dict, theirs: dict) -> float | None:
    """The wider side of a contrast's 95% interval relative to its ratio (per-round rates of
    two cells, {round: rate}); None under 3 shared rounds."""
    return relative_half_width(contrast(ours, theirs))


# The settings that tell two cells apart (the context follows them and is left out), and the
# phases on which the report compares two cells that differ in one of them: model sizes and
# experts on decode, prompt lengths and cached prefixes on prefill, weight types, threads and
# kernel settings on every phase both cells have; generation lengths it does not compare.
BOTH = ("decode", "prefill")
COMPARED_ON = {"model": ("decode",), "dtype": BOTH, "threads": BOTH, "n_batch": BOTH,
               "n_ubatch": BOTH, "flash_attn": BOTH, "n_prompt": ("prefill",), "n_gen": (),
               "depth": ("decode",), "kv_type": ("decode",), "parallel": ("decode",),
               "shared_prefix": ("prefill",)}
PAIRING_FIELDS = tuple(COMPARED_ON)


def contrast_pairs(cells: dict[str, tuple], phases: dict[str, set]) -> list[tuple]:
    """The contrasts a report draws between cells, as (a, b, phase): cells whose settings
    (tuples in PAIRING_FIELDS order) differ in exactly one place, on each phase the report
    compares that setting on and both cells measure (phases: cell -> its phases)."""
    ids, out = sorted(cells), []
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            differ = [f for f, x, y in zip(PAIRING_FIELDS, cells[a], cells[b], strict=True)
                      if x != y]
            if len(differ) == 1:
                out += [(a, b, ph) for ph in COMPARED_ON[differ[0]]
                        if ph in phases[a] and ph in phases[b]]
    return out


def widest_ci(cell: str, partners: list[tuple[str, str]], series, target: str = "contrasts"
              ) -> float | None:
    """The widest relative interval a cell is judged on: its contrasts with its partners
    ((partner, phase) pairs; series(cell, phase) gives its ({(round, window): rate},
    {round: rate}), paired on the finest blocks both have), or its own long-run median under
    target `absolute`; None while one is missing or, with target `contrasts`, when the cell
    is in no contrast."""
    if target == "absolute":
        own = series(cell, None)[1]
        return relative_ci([own[k] for k in sorted(own)])
    widths = [contrast_ci(*finest(series(cell, phase), series(other, phase)))
              for other, phase in partners]
    return None if not widths or any(w is None for w in widths) else max(widths)


def stop_reason(n: int, ci: float | None, policy: Policy, over_budget: bool = False,
                alone: bool = False) -> str | None:
    """Why a cell leaves the rounds now ("fixed", "target", "alone", "max", "budget"), or None
    to go on, from its repetitions so far and the widest interval it is judged on; `alone`: a
    cell in no contrast when the target is the contrasts, done at min_repetitions. The run's
    time budget stops only `auto` cells, and never before min_repetitions."""
    if not policy.auto:
        return "fixed" if n >= policy.repetitions else None
    if n >= policy.max_repetitions:
        return "max"
    if alone and n >= policy.min_repetitions:
        return "alone"
    if n >= policy.min_repetitions and ci is not None and ci <= policy.target_ci:
        return "target"
    if over_budget and n >= policy.min_repetitions:
        return "budget"
    return None


def group_by_memory(needs: dict[str, int], available: int | None,
                    links: set[frozenset[str]] = frozenset()) -> list[list[str]]:
    """Models (key -> bytes they need loaded, with their cells' contexts) packed into groups
    that fit in the available RAM together; one group when all fit. Models a report compares
    (links: pairs of keys) are put together first, the pairs with the most links between
    them first, so a contrast is split across groups only where the two cannot fit at once;
    then the clusters are packed largest first."""
    keys = list(needs)
    if available is None or sum(needs.values()) <= available:
        return [keys] if keys else []
    clusters = [[k] for k in keys]
    while merge := _best_merge(clusters, needs, available, links):
        i, j = merge
        clusters[i] += clusters.pop(j)
    groups: list[tuple[int, list[str]]] = []
    for cluster in sorted(clusters, key=lambda c: -sum(needs[k] for k in c)):
        size = sum(needs[k] for k in cluster)
        for i, (used, members) in enumerate(groups):
            if used + size <= available:
                groups[i] = (used + size, members + cluster)
                break
        else:
            groups.append((size, cluster))
    return [members for _, members in groups]


def _best_merge(clusters: list[list[str]], needs: dict[str, int], available: int,
                links: set[frozenset[str]]) -> tuple[int, int] | None:
    """The two clusters with the most links between them that fit together (the larger
    pair on a tie), or None."""
    best = None
    for i, a in enumerate(clusters):
        for j in range(i + 1, len(clusters)):
            b = clusters[j]
            size = sum(needs[k] for k in a + b)
            n_links = sum(frozenset((x, y)) in links for x in a for y in b)
            if n_links and size <= available and (best is None or (n_links, size) > best[0]):
                best = ((n_links, size), (i, j))
    return best[1] if best else None


def split_pairs(groups: list[list[str]], links: set[frozenset[str]]) -> list[list[str]]:
    """The compared model pairs that ended in different groups (never paired), sorted."""
    group_of = {k: i for i, g in enumerate(groups) for k in g}
    return sorted(sorted(pair) for pair in links
                  if len({group_of.get(k) for k in pair}) > 1)


def model_links(cells: dict[str, tuple], model_of: dict[str, str], phases: dict[str, set]
                ) -> set[frozenset[str]]:
    """The model pairs the report compares: the models of every contrast's two cells, where
    they differ (cells: pairing keys; model_of: cell -> model key)."""
    return {frozenset((model_of[a], model_of[b])) for a, b, _ in contrast_pairs(cells, phases)
            if model_of[a] != model_of[b]}
