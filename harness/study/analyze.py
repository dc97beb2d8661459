"""The analysis of a run: the two phases, the machine, the estimates, and every lever in the
registry. A pure function of the typed records, recomputed on every read (never stored)."""

from __future__ import annotations

import msgspec

from ..analysis.ceilings import round_rates
from ..analysis.estimates import predictions, workload_balance
from ..analysis.machine import ceilings_summary, probe_errors, stability
from ..analysis.model import machine_model
from ..analysis.phases import (
    decode_rows,
    fit_verdicts,
    phase_use,
    prefill_rows,
    prompt_contrasts,
)
from ..core.errors import HarnessError
from ..core.records import Grouping, Measurement, Model, Probe, Round
from ..core.specs import ModelSpec, all_specs
from ..core.stats import machine_drift
from ..engine.noise import NOISY_CORES
from ..levers import analyze_levers


def analyze(measurements: list[Measurement], models: dict[str, Model], probes: list[Probe],
            specs: dict | None = None, rounds: list[Round] | None = None,
            noisy_cores: float = 0.10, ram_bytes: int | None = None,
            llc_n_bytes: int | None = None) -> dict:
    """Everything the rule-of-thumb section of a report shows."""
    decode = flag_cache_evicted(decode_rows(measurements, models, probes), llc_n_bytes)
    prefill = prefill_rows(measurements, models, probes)
    fits = fit_verdicts(decode)
    levers = analyze_levers(measurements, models, probes, {"decode": decode, "prefill": prefill})
    mm = machine_model(decode, prefill, models, probes, ram_bytes)
    run_models = list(dict.fromkeys(m.model for m in measurements))
    run_dtypes = list(dict.fromkeys(m.dtype for m in measurements))
    out = levers | {
        "ceilings": ceilings_summary(probes),
        "probe_errors": probe_errors(probes),
        "decode": decode, "fits": fits, "prefill": prefill,
        "prompt_lengths": prompt_contrasts(prefill),
        "machine_model": mm,
        "predictions": predictions(mm, specs or {}, run_models, run_dtypes),
        "workloads": workload_balance(prefill, decode, levers.get("kv_depth", []), mm),
        "stability": stability(measurements, rounds or [], noisy_cores),
        "phase_use": phase_use(decode, prefill, models),
        "machine_drift": machine_drift([round_rates(m, "decode" if m.decode_tok_s
                                                    else "prefill") for m in measurements]),
    }
    return out | {"contrasts": collect_contrasts(out)}


def flag_cache_evicted(rows: list[dict], llc_n_bytes: int | None) -> list[dict]:
    """A decode that ran in turn with other cells while its bytes per step fit in the
    machine's last-level cache lost that cache to them: flagged, as it would run faster alone."""
    for r in rows:
        if llc_n_bytes and r.get("interleave") == "step" and r["bytes_per_token"] <= llc_n_bytes:
            r["flags"] = [*r["flags"], "cache-evicted"]
    return rows


CONTRAST_KEYS = ("name", "numerator", "denominator", "metric", "ratio", "ci95", "n", "paired")


def collect_contrasts(node, found: dict | None = None) -> list[dict]:
    """Every comparison the analysis holds (a dict naming a numerator and a denominator), once
    each, in the JSON report's shape."""
    found = {} if found is None else found
    if isinstance(node, dict):
        if ("numerator" in node and "denominator" in node and node.get("ratio") is not None
                and node["numerator"] != node["denominator"]):
            key = (node["numerator"], node["denominator"], node["metric"])
            found.setdefault(key, {k: v for k, v in (node | {"ci95": node.get("median_ci95")})
                                   .items() if k in CONTRAST_KEYS})
        for value in node.values():
            collect_contrasts(value, found)
    elif isinstance(node, list):
        for value in node:
            collect_contrasts(value, found)
    return list(found.values())


def analyze_records(records) -> dict:
    """The analysis of whatever a results file holds (complete or not)."""
    try:
        specs = {name: spec for name, spec in all_specs().items() if spec.source}
    except HarnessError:
        specs = {}
    for model in records.models.values():  # the run's own specs (a given file's included)
        if model.spec:
            specs.setdefault(model.model, ModelSpec(**model.spec))
    env = (records.header.env if records.header else None) or {}
    return analyze(with_ram_groups(records.measurements, records.of_type(Grouping)),
                   records.models, records.probes, specs, records.rounds, NOISY_CORES,
                   env.get("ram_total_bytes"), env.get("last_level_cache_bytes"))


def with_ram_groups(measurements: list[Measurement], grouping: list[Grouping]
                    ) -> list[Measurement]:
    """Each measurement with the index of the RAM group it was measured in (0 when the run
    had one): only cells of one group ran side by side, and runs before rounds ran on across
    groups numbered each group's rounds from 0, so pairing by round needs the group too."""
    if not grouping:
        return measurements
    group_of = {key: i for i, keys in enumerate(grouping[-1].groups) for key in keys}
    return [msgspec.structs.replace(m, ram_group=group_of.get(m.model_key, 0))
            for m in measurements]
