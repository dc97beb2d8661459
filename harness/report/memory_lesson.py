"""The memory lesson: the typed result its page is rendered from (weights at each type, the KV
cache per token, memory against context, the users that fit, a quantized cache's decode cost),
and its plot. Pure (records -> MemoryLesson); the words are in templates/memory_lesson.md.j2."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec

from ..analysis.estimates import HARDWARE
from ..analysis.memory import (
    FIT_KV_TYPES,
    KvCheck,
    Load,
    catalogue_memory_n_bytes,
    fit_rows,
    fixed_n_bytes,
    footprint_of,
    load_of,
    output_n_bytes_per_sequence,
    weights_of,
)
from ..core.costs import decode_n_bytes_per_token, kv_n_bytes_per_token, mean_decode_context
from ..core.dtypes import DTYPES
from ..core.memory import MIB, kv_n_bytes_per_sequence, kv_plan
from ..core.records import Footprint as FootprintRecord
from ..core.specs import ModelSpec, resolve_spec
from ..engine.scenario import MemoryPlan
from ..levers.common import round_ratio, spec_of
from ..render.plotkit import doubling_y, plain_log2, plt, save
from .templating import GIB, Figure, Provenance, provenance

PLOT = "memory_vs_context"


@dataclass(frozen=True)
class WeightRow:
    """One model at one weight type: the formula, the file and what llama.cpp held."""

    model: str
    dtype: str
    bits_per_weight: float  # the formula's bytes × 8 ÷ parameters, block scales in
    formula_n_bytes: int
    file_n_bytes: int  # the file's tensors
    buffer_gib: float  # llama.cpp's model buffers (mmap off: the weights in its own memory)
    rss_gib: float  # what loading added to the process's resident memory
    mix: tuple[tuple[str, float], ...]  # the file's tensor types and their share of parameters
    slack_n_bytes: int  # llama.cpp logs each buffer to 0.01 MiB: half of that per buffer
    nominal_bits: float  # the bits per weight of the type the file is named after
    n_params: int
    hidden_size: int  # a K-quant's super-block of 256 must divide a tensor's rows

    @property
    def nominal_gib(self) -> float:
        """Parameters × the named type's bits: what the type's name alone predicts."""
        return self.n_params * self.nominal_bits / 8 / GIB

    @property
    def formula_gib(self) -> float:
        return self.formula_n_bytes / GIB

    @property
    def file_gib(self) -> float:
        return self.file_n_bytes / GIB

    @property
    def main_mix(self) -> tuple[tuple[str, float], ...]:
        """The types holding at least 0.5% of the parameters (norms and biases left out)."""
        return tuple(m for m in self.mix if m[1] >= 0.005)

    @property
    def mixed(self) -> bool:
        return len(self.main_mix) > 1

    @property
    def buffer_equal_file(self) -> bool:
        """llama.cpp's model buffers held the file's tensor bytes, to the MiB it logs."""
        return abs(self.buffer_gib * GIB - self.file_n_bytes) <= self.slack_n_bytes

    @property
    def buffer_gap(self) -> float:
        """llama.cpp's buffers against the file's tensors, as a share."""
        return self.buffer_gib / self.file_gib - 1

    @property
    def rss_gap(self) -> float:
        """What loading added to RSS against llama.cpp's buffers, as a share."""
        return self.rss_gib / self.buffer_gib - 1


@dataclass(frozen=True)
class KvRow:
    """One model's cache at one type: bytes per token, and one user's cache against
    llama.cpp's buffer."""

    model: str
    n_layers: int
    n_kv_heads: int
    n_heads: int  # query heads, which share the KV heads (grouped-query attention)
    head_dim: int
    kv_type: str
    n_bytes_per_token: int
    formula_mib: float  # one user at the run's context, as llama.cpp pads it
    logged_mib: float | None  # llama.cpp's KV buffer (None: not loaded or not logged)
    equal: bool


@dataclass(frozen=True)
class Point:
    """Several users loaded together: the formula, llama.cpp's buffers and RSS."""

    model: str
    n_users: int
    formula_gib: float
    buffers_gib: float
    rss_gib: float

    @property
    def gap(self) -> float:
        """RSS against the formula, as a share."""
        return self.rss_gib / self.formula_gib - 1


@dataclass(frozen=True)
class UsersRow:
    """How many users of the run's context fit in one machine's memory, per cache type."""

    model: str
    machine: str
    memory_gib: float
    modelled: bool  # another machine: the weights and buffers as llama.cpp allocated them here
    users: tuple[int | None, ...]  # per kv_types; None: that type cannot hold these heads


@dataclass(frozen=True)
class CacheCost:
    """Decode at depth with one cache type: its speed, against F16 beside it, against empty."""

    model: str
    dtype: str
    kv_type: str
    depth: int
    n_bytes_per_token: int
    tok_s: Figure | None
    against_f16: Figure | None  # this type's decode ÷ F16's, paired step by step
    paired: bool
    stepped: bool  # its decode steps ran in turn with the other cells' (else round by round)
    at_budget: bool  # the run's time budget stopped it before its target interval
    ci_reached: float | None  # the widest relative half-width of its contrasts when it stopped
    target_ci: float | None
    slowdown: Figure | None  # at depth ÷ with an empty cache, in the same repetitions
    predicted_slowdown: float  # what the extra bytes read per step alone predict
    flash_attn: bool | None


@dataclass(frozen=True)
class Overheads:
    """Where llama.cpp's allocation differs from the two formulas (one model's load)."""

    model: str
    context: int
    n_ctx_seq: int  # the cells llama.cpp gave one user
    compute_mib: float  # reserved for the worst ubatch
    n_ubatch: int
    compute_touched_mib: float  # what one decoded token made resident of it
    output_mib_per_user: float  # one row of logits
    n_vocab: int
    repacked: tuple[tuple[str, float], ...]  # files whose weights llama.cpp repacked, MiB
    kv_resident_at_creation: bool | None
    rss_gap: float  # RSS against every buffer, as a share
    rss_gap_touched: float  # the same, the compute buffer counted as touched


@dataclass(frozen=True)
class LoadRow:
    """One load, for the full report: llama.cpp's buffers and the resident memory."""

    model: str
    dtype: str
    kv_type: str
    n_users: int
    model_mib: float
    repacked_mib: float
    kv_mib: float
    output_mib: float
    compute_mib: float
    parts_mib: float  # the process before loading and every buffer
    loaded_mib: float  # what loading the model added to RSS
    rss_mib: float  # after one decoded token
    seconds: float  # the load and its stages, in its fresh process


@dataclass(frozen=True)
class LoadTable:
    """Every load of a run's `memory:` block (templates/memory_loads.md.j2)."""

    context: int
    rows: tuple[LoadRow, ...]


def load_table(records, loads: dict) -> LoadTable:
    """Every load (memory_loads) as the full report's table."""
    plan = memory_plan(records)
    rows = tuple(LoadRow(r.model, r.dtype, r.kv_type, r.n_users, ld.model_mib,
                         ld.repacked_mib, ld.kv_mib, ld.output_mib, ld.compute_mib,
                         ld.parts_mib, ld.loaded_mib,
                         ld.rss_mib,
                         sum(st.seconds for st in ld.footprint.stages))
                 for r, ld in loads.values())
    return LoadTable(plan.context, rows)


@dataclass(frozen=True)
class MemoryLesson:
    """Everything the memory lesson's template can print."""

    title: str
    intro: str
    provenance: Provenance
    context: int
    weights_dtype: str  # the type users are served at
    kv_types: tuple[str, ...]
    weights: tuple[WeightRow, ...]
    kv: tuple[KvRow, ...]
    points: tuple[Point, ...]
    users: tuple[UsersRow, ...]
    costs: tuple[CacheCost, ...]
    overheads: Overheads | None
    ram_available_gib: float | None  # when the first load began: the users table's figure
    ram_available_range_gib: tuple[float, float] | None  # over every load of the run
    failures: tuple[str, ...]
    plot: str | None
    full_report: str | None

    @property
    def weights_exact(self) -> bool:
        """The formula gave every file's tensor bytes exactly."""
        return all(w.formula_n_bytes == w.file_n_bytes for w in self.weights)

    @property
    def buffers_equal_file(self) -> bool:
        return all(w.buffer_equal_file for w in self.weights)

    @property
    def buffer_gap_max(self) -> float | None:
        return max((abs(w.buffer_gap) for w in self.weights), default=None)

    @property
    def rss_extra_mib(self) -> tuple[float, float] | None:
        """The least and most RSS that loading added beyond llama.cpp's buffers."""
        extra = [(w.rss_gib - w.buffer_gib) * GIB / MIB for w in self.weights]
        return (min(extra), max(extra)) if extra else None

    @property
    def kv_extremes(self) -> tuple[KvRow, KvRow] | None:
        """The models with the smallest and the largest F16 cache per token."""
        f16 = sorted((r for r in self.kv if r.kv_type == "f16"),
                     key=lambda r: r.n_bytes_per_token)
        return (f16[0], f16[-1]) if len(f16) > 1 else None

    @property
    def kv_inversion(self) -> tuple[KvRow, KvRow] | None:
        """A model with larger weights but a smaller cache per token than another (F16)."""
        size = {w.model: w.file_n_bytes for w in self.weights if w.dtype == self.weights_dtype}
        f16 = [r for r in self.kv if r.kv_type == "f16" and r.model in size]
        return next(((a, b) for a in f16 for b in f16 if size[a.model] > size[b.model]
                     and a.n_bytes_per_token < b.n_bytes_per_token), None)

    @property
    def point_shares(self) -> tuple[float, float] | None:
        """The smallest and largest RSS of the loaded users, as a share of the formula."""
        shares = [1 + p.gap for p in self.points]
        return (min(shares), max(shares)) if shares else None

    @property
    def point_users(self) -> tuple[int, ...]:
        return tuple(sorted({p.n_users for p in self.points}))

    @property
    def n_kv_equal(self) -> int:
        return sum(r.equal for r in self.kv if r.logged_mib is not None)

    @property
    def n_kv_loaded(self) -> int:
        return sum(r.logged_mib is not None for r in self.kv)


def footprints(records) -> list[FootprintRecord]:
    return records.of_type(FootprintRecord)


def memory_plan(records) -> MemoryPlan | None:
    """The scenario's `memory:` block, as the header keeps it, typed."""
    stored = ((records.header.scenario if records.header else None) or {}).get("memory")
    return msgspec.convert(stored, MemoryPlan) if stored else None


def memory_loads(records) -> dict[tuple, tuple[FootprintRecord, Load]]:
    """Each measured load by (model, dtype, cache type, users), with its buffers and RSS."""
    return {(f.model, f.dtype, f.kv_type, f.n_users): (f, load_of(footprint_of(f.footprint)))
            for f in footprints(records) if f.footprint}


def memory_lesson(records, loads: dict, plot: str | None, full_report: str | None
                  ) -> MemoryLesson:
    """The page's data from a run's footprint records (loads: memory_loads) and its
    decode-at-depth cells."""
    plan, header, found = memory_plan(records), records.header, footprints(records)
    scenario = header.scenario or {}
    specs = {m: resolve_spec(m) for m in plan.models}
    ram = found[0].ram_available_n_bytes if found else None
    return MemoryLesson(
        title=scenario.get("title", ""), intro=scenario.get("description", ""),
        provenance=provenance(header, header.env or {}, scenario), context=plan.context,
        weights_dtype=plan.weights, kv_types=tuple(plan.kv_types),
        weights=tuple(_weight_rows(plan, specs, loads)), kv=tuple(_kv_rows(plan, specs, loads)),
        points=tuple(_points(plan, specs, loads)),
        users=tuple(_users_rows(plan, specs, loads, ram)),
        costs=tuple(_costs(records)), overheads=_overheads(plan, specs, loads),
        ram_available_gib=ram / GIB if ram else None,
        ram_available_range_gib=_ram_range(found),
        failures=tuple(f"{f.model} {f.dtype}, {f.n_users} × {f.context:,} tokens of {f.kv_type} "
                       f"cache: {f.error}" for f in found if f.error),
        plot=plot, full_report=full_report)


def _ram_range(found: list[FootprintRecord]) -> tuple[float, float] | None:
    free = [f.ram_available_n_bytes / GIB for f in found if f.ram_available_n_bytes]
    return (min(free), max(free)) if free else None


def _weight_rows(plan: MemoryPlan, specs: dict[str, ModelSpec], loads: dict) -> list[WeightRow]:
    rows = []
    for model in plan.models:
        for dtype in plan.dtypes:
            if (model, dtype, "f16", 1) not in loads:
                continue
            record, load = loads[model, dtype, "f16", 1]
            types = weights_of(record.weights)
            formula = sum(w.formula_n_bytes for w in types)
            n_params = sum(w.n_params for w in types)
            rows.append(WeightRow(
                model, dtype, formula * 8 / n_params, formula,
                sum(w.file_n_bytes for w in types), load.model_mib * MIB / GIB,
                load.loaded_mib * MIB / GIB,
                tuple((w.type_name, w.n_params / n_params)
                      for w in sorted(types, key=lambda w: -w.n_params)),
                sum(b.holds == "model" for b in load.footprint.buffers) * MIB // 200,
                DTYPES[dtype].bits_per_weight, n_params, specs[model].hidden_size))
    return rows


def _kv_rows(plan: MemoryPlan, specs: dict[str, ModelSpec], loads: dict) -> list[KvRow]:
    rows = []
    for model, spec in specs.items():
        for kv in plan.kv_types:
            plan_kv = kv_plan(spec, plan.context, 1, kv, kv)
            found = loads.get((model, plan.weights, kv, 1))
            logged = found[1].footprint.caches if found else ()
            rows.append(KvRow(model, spec.num_hidden_layers, spec.num_key_value_heads,
                              spec.num_attention_heads, spec.head_dim, kv,
                              round(kv_n_bytes_per_token(spec, kv, kv)), plan_kv.n_bytes / MIB,
                              sum(c.mib for c in logged) if found else None,
                              bool(found) and KvCheck(plan_kv, logged).equal))
    return rows


def _per_user_n_bytes(spec: ModelSpec, load: Load, n_ctx: int, kv: str = "f16") -> int:
    return kv_n_bytes_per_sequence(spec, n_ctx, kv, kv) + output_n_bytes_per_sequence(load)


def _points(plan: MemoryPlan, specs: dict[str, ModelSpec], loads: dict) -> list[Point]:
    out = []
    for model, spec in specs.items():
        base = loads.get((model, plan.weights, "f16", 1))
        for users in plan.users:
            found = loads.get((model, plan.weights, "f16", users))
            if not base or not found:
                continue
            load = found[1]
            formula = (fixed_n_bytes((base[1],))
                       + users * _per_user_n_bytes(spec, base[1], plan.context))
            out.append(Point(model, users, formula / GIB, load.parts_mib * MIB / GIB,
                             load.rss_mib * MIB / GIB))
    return out


def _machines(ram: int | None) -> list[tuple[str, int, bool]]:
    here = [("this machine (free)", ram, False)] if ram else []
    return here + [(hw["name"].split(" (")[0], catalogue_memory_n_bytes(hw), True)
                   for hw in HARDWARE.values()]


def _users_rows(plan: MemoryPlan, specs: dict[str, ModelSpec], loads: dict, ram: int | None
                ) -> list[UsersRow]:
    rows = []
    for machine, n_bytes, modelled in _machines(ram):
        for model, spec in specs.items():
            found = loads.get((model, plan.weights, "f16", 1))
            if not found:
                continue
            rows.append(UsersRow(model, machine, n_bytes / GIB, modelled, tuple(
                _users(spec, n_bytes, plan, k, loads.get((model, plan.weights, k, 1), found))
                for k in plan.kv_types)))
    return rows


def _users(spec: ModelSpec, n_bytes: int, plan: MemoryPlan, kv: str, found: tuple) -> int | None:
    """Users of the plan's context that fit in n_bytes with a cache of type kv, beside that
    cache type's own load (its compute buffer differs with flash attention); None where the
    type cannot hold the model's heads."""
    load = found[1]
    row, = fit_rows(spec, n_bytes, fixed_n_bytes((load,)),
                    kv_plan(spec, plan.context).n_ctx_seq,
                    output_n_bytes_per_sequence(load), kv_types=(kv,))
    return row.fit.n_sequences if row.fit else None


def _costs(records) -> list[CacheCost]:
    """Every decode-at-depth cell, against the F16 cell of the same model, type and depth."""
    deep = [m for m in records.measurements if m.depth and m.n_gen and m.decode_tok_s
            and m.model_key in records.models]
    out = []
    for m in sorted(deep, key=lambda m: (m.model, m.dtype, m.depth,
                                         FIT_KV_TYPES.index(m.kv_type)
                                         if m.kv_type in FIT_KV_TYPES else 9)):
        base = next((b for b in deep if (b.model, b.dtype, b.depth, b.n_gen, b.kv_type)
                     == (m.model, m.dtype, m.depth, m.n_gen, "f16")), None)
        ratio = round_ratio(m, base, "decode") if base else None
        spec = spec_of(records.models, m.model_key)
        out.append(CacheCost(m.model, m.dtype, m.kv_type, m.depth,
                             round(kv_n_bytes_per_token(spec, m.kv_type, m.kv_type)),
                             Figure.of(m.decode_tok_s), Figure.of(ratio),
                             bool(ratio and ratio.get("paired")), m.interleave == "step",
                             m.stopped_by == "budget", m.ci_reached,
                             (m.policy or {}).get("target_ci"),
                             Figure.of(m.paired_slowdown), _bytes_slowdown(m, records, spec),
                             m.flash_attn_used if m.flash_attn_used is not None
                             else m.flash_attn))
    return out


def _bytes_slowdown(m, records, spec: ModelSpec) -> float:
    """A step's bytes at the depth ÷ with an empty cache: the slowdown bytes alone predict."""
    weights = records.models[m.model_key].decode_weight_n_bytes or 0
    per_token = kv_n_bytes_per_token(spec, m.kv_type, m.kv_type)
    context = mean_decode_context(m.n_prompt, m.n_gen)
    return (decode_n_bytes_per_token(weights, per_token, m.depth + context)
            / decode_n_bytes_per_token(weights, per_token, context))


def _overheads(plan: MemoryPlan, specs: dict[str, ModelSpec], loads: dict) -> Overheads | None:
    """The first model's load at the served type: the buffers no formula above counts."""
    model = plan.models[0]
    found = loads.get((model, plan.weights, "f16", 1))
    if not found:
        return None
    load = found[1]
    repacked = [(r.dtype, ld.repacked_mib) for (m, _, k, u), (r, ld) in loads.items()
                if m == model and k == "f16" and u == 1 and ld.repacked_mib]
    return Overheads(model, plan.context, load.footprint.n_ctx_seq, load.compute_mib,
                     load.footprint.params.n_ubatch, load.compute_touched_mib,
                     output_n_bytes_per_sequence(load) / MIB, load.footprint.n_vocab,
                     tuple(repacked),
                     load.kv_resident_at_creation, load.gap, load.gap_without_untouched)


# --- plot

def plot_memory(lesson: MemoryLesson, specs: dict[str, ModelSpec], fixed: dict[str, int],
                output: dict[str, int], users: tuple[int, ...], out_dir: Path) -> str | None:
    """Memory against each user's context for 1, 4, 16 … users (F16 cache), one panel per
    model, the machine's available RAM across, the loads measured as points."""
    if not fixed or not lesson.ram_available_gib:
        return None
    fig, axes = plt.subplots(1, len(fixed), figsize=(4 * len(fixed), 4), sharey=True,
                             squeeze=False)
    for ax, (model, base) in zip(axes[0], fixed.items(), strict=True):
        spec = specs[model]
        contexts = [c for c in (2 ** k for k in range(8, 18)) if c <= spec.max_position_embeddings]
        for n in users:
            ax.plot(contexts, [(base + n * (kv_n_bytes_per_sequence(spec, c) + output[model]))
                               / GIB for c in contexts], "-", label=f"{n} user{'s' * (n > 1)}")
        points = [p for p in lesson.points if p.model == model]
        ax.plot([lesson.context] * len(points), [p.buffers_gib for p in points], "o",
                mfc="none", color="0.2", label="llama.cpp's buffers, measured")
        ax.plot([lesson.context] * len(points), [p.rss_gib for p in points], "kx",
                label="RSS, measured")
        ax.axhline(lesson.ram_available_gib, color="0.3", ls="--", lw=1,
                   label="available RAM")
        plain_log2(ax)
        doubling_y(ax)
        ax.set_title(model, fontsize=10)
        ax.set_xlabel("tokens per user (F16 cache)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("memory (GiB)")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=6,
               fontsize=8, bbox_to_anchor=(0.5, -0.08))
    fig.suptitle(plot_title(lesson, users), fontsize=10, y=1.06)
    return save(fig, out_dir, PLOT)


def plot_title(lesson: MemoryLesson, users: tuple[int, ...]) -> str:
    """The plot's finding: the most users the run's context fits here, per model."""
    here = [r for r in lesson.users if not r.modelled]
    fits = ", ".join(f"{r.model} {r.users[0]:,}" for r in here if r.users[0] is not None)
    return (f"Users of {lesson.context:,} tokens that fit in this machine's available RAM "
            f"({lesson.weights_dtype.upper()} weights, F16 cache):\n{fits}")


def write_memory_plot(records, loads: dict, lesson: MemoryLesson, out_dir: Path
                      ) -> str | None:
    """The plot for a run's memory page (the fixed parts measured at the served type)."""
    plan = memory_plan(records)
    specs = {m: resolve_spec(m) for m in plan.models}
    found = {m: loads[m, plan.weights, "f16", 1][1] for m in specs
             if (m, plan.weights, "f16", 1) in loads}
    return plot_memory(lesson, specs, {m: fixed_n_bytes((ld,)) for m, ld in found.items()},
                       {m: output_n_bytes_per_sequence(ld) for m, ld in found.items()},
                       tuple(plan.users), out_dir)
