"""The memory of one model, formula beside measurement: weights per type, the KV cache llama.cpp
allocated, the resident memory of each stage explained by llama.cpp's buffers, and how many
users fit. Pure: the measurements come in as engine.footprint records."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from ..core.costs import TensorEntry, kv_n_bytes_per_token
from ..core.dtypes import KV_CACHE_TYPES, kv_block_problem
from ..core.memory import MIB, Fit, KvPlan, WeightType, fit, kv_plan, weight_types
from ..core.specs import ModelSpec
from ..engine.footprint import Footprint, LoggedCache

RSS_TOLERANCE = 0.10  # the parts must explain RSS within this share, or the gap is named
VISIBLE_KV_MIB = 16.0  # a cache smaller than this is lost in RSS's page-level noise
FIT_KV_TYPES = ("f16", "q8_0", "q4_0")
# where a fit's memory comes from: these two are this machine's, anything else a catalogue's
RAM_FROM_FLAG, RAM_FROM_AVAILABLE = "--ram", "this machine's available RAM"


@dataclass(frozen=True)
class KvCheck:
    """The formula's caches against llama.cpp's, cache by cache."""

    plan: KvPlan
    logged: tuple[LoggedCache, ...]

    @property
    def equal(self) -> bool:
        """Same caches, cells and layers, and the same MiB at the two decimals llama.cpp logs."""
        if len(self.plan.caches) != len(self.logged):
            return False
        return all(p.n_cells == q.n_cells and p.n_layers == q.n_layers
                   and p.n_streams == q.n_streams and round(p.n_bytes / MIB, 2) == q.mib
                   for p, q in zip(self.plan.caches, self.logged, strict=True))


@dataclass(frozen=True)
class Load:
    """One load (mmap on or off): its buffers and its resident memory, stage by stage."""

    footprint: Footprint
    model_mib: float
    mapped_mib: float  # the model file's pages llama.cpp uses in place (mmap)
    repacked_mib: float
    kv_mib: float
    output_mib: float
    compute_mib: float
    parts_mib: float  # process before loading + every buffer llama.cpp logged
    rss_mib: float  # after the last stage
    compute_touched_mib: float  # RSS added by the prefill stages
    kv_resident_at_creation: bool | None  # None: too small a cache to see in RSS

    @property
    def loaded_mib(self) -> float:
        """What loading the model added to RSS."""
        return (_stage_mib(self.footprint, "model loaded")
                - _stage_mib(self.footprint, "before loading"))

    @property
    def gap(self) -> float:
        """RSS against the parts, as a share of the parts."""
        return self.rss_mib / self.parts_mib - 1

    @property
    def gap_without_untouched(self) -> float:
        """The same with the compute buffer counted at what the prefill touched."""
        parts = self.parts_mib - self.compute_mib + self.compute_touched_mib
        return self.rss_mib / parts - 1

    @property
    def explained(self) -> bool:
        return abs(self.gap) <= RSS_TOLERANCE


@dataclass(frozen=True)
class FitRow:
    kv_type: str
    n_bytes_per_token: int
    fit: Fit | None  # None: this cache type cannot hold this model's heads
    why: str = ""


@dataclass(frozen=True)
class Memory:
    """Everything `harness memory` reports for one model and context."""

    spec: ModelSpec
    dtype: str
    path: str
    n_ctx_asked: int
    n_seq: int
    type_k: str
    type_v: str
    weights: tuple[WeightType, ...]
    n_params: int
    weights_formula_n_bytes: int
    file_n_bytes: int
    kv_n_bytes_per_token: int  # every layer's K and V, the cache's type
    kv: KvCheck
    loads: tuple[Load, ...]
    ram_n_bytes: int
    ram_from: str
    fixed_n_bytes: int
    output_n_bytes_per_sequence: int
    fits: tuple[FitRow, ...]
    seconds: float

    @property
    def ram_modelled(self) -> bool:
        """Another machine's memory, fitted beside the buffers llama.cpp allocated here."""
        return self.ram_from not in (RAM_FROM_FLAG, RAM_FROM_AVAILABLE)


def _mib(footprint: Footprint, holds: str, where: str | None = None) -> float:
    return sum(b.mib for b in footprint.buffers
               if b.holds == holds and (where is None or b.where == where))


def _stage_mib(footprint: Footprint, stage: str) -> float:
    return next(s.rss_n_bytes for s in footprint.stages if s.stage == stage) / MIB


def load_of(footprint: Footprint) -> Load:
    """A load's buffers, its RSS and the parts that should explain it."""
    model, kv = _mib(footprint, "model"), _mib(footprint, "KV")
    output, compute = _mib(footprint, "output"), _mib(footprint, "compute")
    before = _stage_mib(footprint, "before loading")
    created = _stage_mib(footprint, "context created")
    loaded = _stage_mib(footprint, "model loaded")
    rss = footprint.stages[-1].rss_n_bytes / MIB
    at_creation = None if kv < VISIBLE_KV_MIB else created - loaded >= kv * (1 - RSS_TOLERANCE)
    return Load(footprint, model, _mib(footprint, "model", "CPU_Mapped"),
                _mib(footprint, "model", "CPU_REPACK"), kv, output, compute,
                before + model + kv + output + compute, rss, max(rss - created, 0.0),
                at_creation)


def catalogue_memory_n_bytes(hardware: dict) -> int:
    """A catalogue machine's memory: its marketed GB are GiB (a "24 GB" card holds 24 GiB)."""
    return int(hardware["memory_gb"] * 2**30)


def fit_rows(spec: ModelSpec, ram_n_bytes: int, fixed_n_bytes: int, n_ctx_seq: int,
             output_per_seq: int, kv_types: tuple[str, ...] = FIT_KV_TYPES
             ) -> tuple[FitRow, ...]:
    """Users of n_ctx_seq tokens that fit, and one user's longest context, per cache type."""
    rows = []
    for kv_type in kv_types:
        per_token = round(kv_n_bytes_per_token(spec, kv_type, kv_type))
        problem = kv_block_problem(kv_type, spec.head_dim, spec.name)
        if problem:
            rows.append(FitRow(kv_type, per_token, None, problem))
            continue
        rows.append(FitRow(kv_type, per_token, fit(
            spec, ram_n_bytes, fixed_n_bytes, n_ctx_seq, kv_type, kv_type,
            output_n_bytes_per_sequence=output_per_seq)))
    return tuple(rows)


def fixed_n_bytes(loads: tuple[Load, ...]) -> int:
    """What stays whatever the cache: the process before loading, the smallest model buffers
    (without mmap: the weights held once) and the compute buffer as reserved."""
    best = min(loads, key=lambda ld: ld.model_mib)
    before = _stage_mib(best.footprint, "before loading")
    return round((before + best.model_mib + best.compute_mib) * MIB)


def output_n_bytes_per_sequence(load: Load) -> int:
    """llama.cpp's output buffer holds a decode step's logits: one f32 row of the vocabulary
    per sequence (0.58 MiB per sequence for Qwen2.5's 151,936 tokens, as it logs)."""
    return load.footprint.n_vocab * 4


def memory(spec: ModelSpec, dtype: str, path: str, table: list[TensorEntry], n_ctx: int,
           n_seq: int, type_k: str, type_v: str, footprints: tuple[Footprint, ...],
           ram: tuple[int, str], seconds: float) -> Memory:
    """The report's data from the file's table and the loads (n_ctx tokens per sequence)."""
    first = footprints[0]
    plan = kv_plan(spec, n_ctx * n_seq, n_seq, type_k, type_v, unified=first.params.kv_unified,
                   swa_full=first.params.swa_full, n_ubatch=first.params.n_ubatch)
    loads = tuple(load_of(f) for f in footprints)
    fixed, output = fixed_n_bytes(loads), output_n_bytes_per_sequence(loads[0])
    weights = tuple(weight_types(table))
    return Memory(spec, dtype, path, n_ctx, n_seq, type_k, type_v, weights,
                  sum(w.n_params for w in weights), sum(w.formula_n_bytes for w in weights),
                  sum(t.n_bytes for t in table),
                  round(kv_n_bytes_per_token(spec, type_k, type_v)), KvCheck(plan, first.caches),
                  loads, ram[0], ram[1], fixed, output,
                  fit_rows(spec, ram[0], fixed, plan.n_ctx_seq, output), seconds)


assert set(FIT_KV_TYPES) <= set(KV_CACHE_TYPES)


def footprint_of(stored: dict) -> Footprint:
    """A footprint record's measurements as engine.footprint's type."""
    return msgspec.convert(stored, Footprint)


def weights_of(stored: list[dict]) -> tuple[WeightType, ...]:
    """A footprint record's weight types as core.memory's type."""
    return tuple(msgspec.convert(w, WeightType) for w in stored)
