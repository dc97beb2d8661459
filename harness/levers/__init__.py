"""The levers beyond the two phases, one module each (analysis, table and plot together), in
the order the report walks them."""

from __future__ import annotations

from pathlib import Path

from ..core.records import Measurement, Model, Probe
from . import batching, experts, kv_depth, prefix, quant, threads, twins
from .common import Lever

LEVERS: tuple[Lever, ...] = (experts.LEVER, quant.LEVER, kv_depth.LEVER, batching.LEVER,
                             threads.LEVER, prefix.LEVER, twins.LEVER)


def analyze_levers(measurements: list[Measurement], models: dict[str, Model],
                   probes: list[Probe], phases: dict) -> dict:
    """Every lever's rows (empty lists where the run did not measure that lever)."""
    out: dict = {}
    for lever in LEVERS:
        out |= lever.analyze(measurements, models, probes, phases)
    return out


def lever_tables(analysis: dict) -> list:
    """Every lever's tables, in the registry's order."""
    return [t for lever in LEVERS for t in lever.tables(analysis)]


def write_lever_plots(analysis: dict, out_dir: Path) -> list[str | None]:
    return [lever.plot(analysis, out_dir) for lever in LEVERS]


TABLE_NAMES = tuple(name for lever in LEVERS for name in lever.table_names)
PLOT_CAPTIONS = {lever.plot_name: lever.caption for lever in LEVERS}
# A lever's plot goes right after its last table.
PLOT_AFTER = {lever.plot_name: lever.table_names[-1] for lever in LEVERS}
