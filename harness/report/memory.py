"""`harness memory`: check the request, load the model in fresh processes (mmap on and off),
and show the formula beside llama.cpp's buffers and the resident memory, as markdown or JSON."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from ..analysis.estimates import HARDWARE
from ..analysis.memory import (
    RAM_FROM_AVAILABLE,
    RAM_FROM_FLAG,
    Memory,
    catalogue_memory_n_bytes,
    fixed_n_bytes,
    load_of,
    memory,
    output_n_bytes_per_sequence,
)
from ..core.dtypes import KV_CACHE_TYPES, KV_NEEDS_FLASH_ATTN, kv_block_problem
from ..core.errors import HarnessError
from ..core.memory import MIB, fit, pad
from ..core.specs import ModelSpec
from ..engine.footprint import measure_in_fresh_process
from ..engine.llama import ContextParams
from .templating import render, template_path

SCHEMA = "harness.memory/1"
N_BATCH, N_UBATCH = 2048, 512  # llama.cpp's defaults (llama_context_default_params)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GiB|GB|G|MiB|MB|M|TiB|TB|T)\s*$", re.IGNORECASE)
_UNITS = {"gib": 1 << 30, "mib": 1 << 20, "tib": 1 << 40, "gb": 10**9, "g": 10**9,
          "mb": 10**6, "m": 10**6, "tb": 10**12, "t": 10**12}


@dataclass(frozen=True)
class Request:
    """What `harness memory` was asked: the model's file and the context to allocate."""

    spec: ModelSpec
    dtype: str
    path: Path
    n_ctx: int
    n_seq: int
    kv_type: str
    threads: int
    mmap: tuple[bool, ...]
    fill: bool


def parse_ram(text: str) -> int:
    """"24GB", "8 GiB", "512MB" as bytes (GB = 10⁹, GiB = 2³⁰)."""
    m = _SIZE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise HarnessError(f"cannot read {text!r} as a memory size", key="--ram",
                           fix="write a size such as 24GB, 16GiB or 512MB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def ram_budget(ram: str | None, hardware: str | None) -> tuple[int, str]:
    """The memory the users must fit in, and where the figure comes from."""
    if ram and hardware:
        raise HarnessError("--ram and --hardware both name a memory size", key="--hardware",
                           fix="give one of them")
    if ram:
        return parse_ram(ram), RAM_FROM_FLAG
    if hardware:
        if hardware not in HARDWARE:
            raise HarnessError(f"unknown hardware {hardware!r}", key="--hardware",
                               fix="one of " + ", ".join(HARDWARE))
        hw = HARDWARE[hardware]
        return catalogue_memory_n_bytes(hw), f"{hw['name']}, {hw['memory_gb']:.0f} GiB"
    return psutil.virtual_memory().available, RAM_FROM_AVAILABLE


def check_request(spec: ModelSpec, n_ctx: int, n_seq: int, kv_type: str) -> None:
    """Refuse, before anything is built or loaded, what llama.cpp cannot allocate."""
    if n_seq < 1:
        raise HarnessError(f"{n_seq} sequences", key="--parallel", fix="give 1 or more")
    if not 1 <= n_ctx <= spec.max_position_embeddings:
        raise HarnessError(f"a context of {n_ctx:,} tokens; {spec.name} was trained for "
                           f"{spec.max_position_embeddings:,}", key="--context",
                           fix=f"give 1 to {spec.max_position_embeddings:,}")
    if kv_type not in KV_CACHE_TYPES:
        raise HarnessError(f"unknown KV cache type {kv_type!r}", key="--kv-type",
                           fix="one of " + ", ".join(KV_CACHE_TYPES))
    problem = kv_block_problem(kv_type, spec.head_dim, spec.name)
    if problem:
        raise HarnessError(problem, key="--kv-type", fix="use --kv-type f16 for this model")


def context_params(req: Request, n_seq: int) -> ContextParams:
    return ContextParams(n_ctx=req.n_ctx * n_seq, n_batch=N_BATCH, n_ubatch=N_UBATCH,
                         n_threads=req.threads, type_k=req.kv_type, type_v=req.kv_type,
                         n_seq_max=n_seq,
                         flash_attn=True if req.kv_type in KV_NEEDS_FLASH_ATTN else None)


def check_fits(req: Request, ram: tuple[int, str]) -> None:
    """More than one sequence: load one first, and refuse a count whose cache would not fit
    beside what that load holds, before allocating it."""
    if req.n_seq == 1:
        return
    probe = measure_in_fresh_process(req.path, context_params(req, 1), min(req.mmap), False,
                                     prefill=False)
    load = load_of(probe)
    fixed = fixed_n_bytes((load,))
    room = fit(req.spec, ram[0], fixed, pad(req.n_ctx), req.kv_type, req.kv_type,
               output_n_bytes_per_sequence=output_n_bytes_per_sequence(load))
    if req.n_seq > room.n_sequences:
        kv, most = room.per_sequence_n_bytes * req.n_seq, room.n_sequences
        raise HarnessError(f"{req.n_seq} sequences need {kv / MIB:,.0f} MiB of KV cache and "
                           f"logits beside "
                           f"{fixed / MIB:,.0f} MiB of weights and buffers; {ram[1]} is "
                           f"{ram[0] / MIB:,.0f} MiB", key="--parallel",
                           fix=f"at most {most} fit; give --parallel {most} or less")


def run_memory(req: Request, ram: tuple[int, str], table: list) -> Memory:
    """Measure every requested load in a fresh process and put the report's data together."""
    start = time.perf_counter()
    check_fits(req, ram)
    params = context_params(req, req.n_seq)
    footprints = tuple(measure_in_fresh_process(req.path, params, on, req.fill)
                       for on in req.mmap)
    return memory(req.spec, req.dtype, str(req.path), table, req.n_ctx, req.n_seq, req.kv_type,
                  req.kv_type, footprints, ram, time.perf_counter() - start)


def render_memory(m: Memory) -> str:
    return render(template_path("memory"), m)


def memory_json(m: Memory) -> dict:
    """The report as JSON: every formula and measurement, bytes as integers."""
    return {
        "schema": SCHEMA, "model": m.spec.name, "dtype": m.dtype, "file": m.path,
        "context": {"asked": m.n_ctx_asked, "n_seq": m.n_seq, "n_ctx": m.kv.plan.n_ctx,
                    "n_ctx_seq": m.kv.plan.n_ctx_seq},
        "weights": {"types": [{"type": w.type_name, "n_params": w.n_params,
                               "bytes_per_weight": w.bytes_per_weight,
                               "formula_n_bytes": w.formula_n_bytes,
                               "file_n_bytes": w.file_n_bytes} for w in m.weights],
                    "n_params": m.n_params, "formula_n_bytes": m.weights_formula_n_bytes,
                    "file_n_bytes": m.file_n_bytes},
        "kv_cache": {"type_k": m.type_k, "type_v": m.type_v,
                     "n_bytes_per_token": m.kv_n_bytes_per_token,
                     "formula": [{"kind": c.kind, "n_layers": c.n_layers, "n_cells": c.n_cells,
                                  "n_streams": c.n_streams, "n_bytes": c.n_bytes}
                                 for c in m.kv.plan.caches],
                     "llama_cpp": [{"mib": c.mib, "n_layers": c.n_layers, "n_cells": c.n_cells,
                                    "n_streams": c.n_streams} for c in m.kv.logged],
                     "equal": m.kv.equal},
        "loads": [_load_json(ld) for ld in m.loads],
        "fit": {"ram_n_bytes": m.ram_n_bytes, "ram_from": m.ram_from,
                "modelled": m.ram_modelled,
                "fixed_n_bytes": m.fixed_n_bytes,
                "output_n_bytes_per_sequence": m.output_n_bytes_per_sequence,
                "rows": [{"kv_type": r.kv_type, "n_bytes_per_token": r.n_bytes_per_token}
                         | ({"n_sequences": r.fit.n_sequences,
                             "per_sequence_n_bytes": r.fit.per_sequence_n_bytes,
                             "longest_context": r.fit.longest_context,
                             "longest_capped_by_model": r.fit.longest_capped}
                            if r.fit else {"why": r.why}) for r in m.fits]},
        "seconds": m.seconds,
    }


def _load_json(ld) -> dict:
    f = ld.footprint
    return {"mmap": f.use_mmap, "model_n_bytes": f.model_n_bytes, "n_params": f.n_params,
            "buffers": [{"holds": b.holds, "where": b.where, "mib": b.mib} for b in f.buffers],
            "stages": [{"stage": s.stage, "rss_n_bytes": s.rss_n_bytes,
                        "anon_n_bytes": s.anon_n_bytes, "file_n_bytes": s.file_n_bytes,
                        "seconds": s.seconds} for s in f.stages],
            "n_filled_tokens": f.n_filled_tokens, "parts_mib": ld.parts_mib,
            "rss_mib": ld.rss_mib, "gap": ld.gap, "explained": ld.explained,
            "compute_touched_mib": ld.compute_touched_mib,
            "gap_without_untouched_compute": ld.gap_without_untouched,
            "kv_resident_at_creation": ld.kv_resident_at_creation}
