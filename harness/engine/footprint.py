"""What a model and its KV cache take once llama.cpp has loaded them: the buffers llama.cpp
logs and the process's resident memory (RSS) at each stage, measured in a fresh process."""

from __future__ import annotations

import multiprocessing
import re
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from .llama import Context, ContextParams, Model, captured_log

# llama.cpp logs its buffers, it does not return them: "load_tensors: CPU_Mapped model buffer
# size = 327.83 MiB", "llama_kv_cache: size = 48.00 MiB (4096 cells, 24 layers, 1/1 seqs),
# K (f16): 24.00 MiB, V (f16): 24.00 MiB" (two decimals of MiB).
_BUFFER = re.compile(r"(\S+)\s+(model|KV|output|compute) buffer size =\s*([\d.]+) MiB")
_CACHE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,"
                    r"\s*(\d+)/(\d+) seqs\), K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):"
                    r"\s*([\d.]+) MiB")
_STATUS_FIELDS = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file"}


@dataclass(frozen=True)
class LoggedBuffer:
    """One buffer llama.cpp allocated: what it holds (model, KV, output, compute) and where."""

    holds: str
    where: str  # CPU, CPU_Mapped (the file's pages), CPU_REPACK (weights rearranged for SIMD)
    mib: float


@dataclass(frozen=True)
class LoggedCache:
    """One KV cache as llama.cpp logs it (a sliding-window model logs two)."""

    mib: float
    n_cells: int
    n_layers: int
    n_streams: int
    type_k: str
    type_v: str


@dataclass(frozen=True)
class RssStage:
    """Resident memory at one point: all of it, anonymous pages, and file pages (mmap)."""

    stage: str
    rss_n_bytes: int
    anon_n_bytes: int | None
    file_n_bytes: int | None
    seconds: float  # since the stage before


@dataclass(frozen=True)
class Footprint:
    """One load of a model with one context, measured."""

    use_mmap: bool
    params: ContextParams
    n_ctx: int
    n_ctx_seq: int
    model_n_bytes: int  # llama_model_size: every tensor's bytes
    n_params: int
    n_vocab: int
    buffers: tuple[LoggedBuffer, ...]
    caches: tuple[LoggedCache, ...]
    stages: tuple[RssStage, ...]
    n_filled_tokens: int  # tokens written to the cache by the last stage, all sequences


def parse_buffers(lines: list[str]) -> tuple[LoggedBuffer, ...]:
    out = []
    for line in lines:
        m = _BUFFER.search(line)
        if m:
            out.append(LoggedBuffer(m.group(2), m.group(1), float(m.group(3))))
    return tuple(out)


def parse_caches(lines: list[str]) -> tuple[LoggedCache, ...]:
    out = []
    for line in lines:
        m = _CACHE.search(line)
        if m:
            out.append(LoggedCache(float(m.group(1)), int(m.group(2)), int(m.group(3)),
                                   int(m.group(5)), m.group(6), m.group(8)))
    return tuple(out)


def resident() -> tuple[int, int | None, int | None]:
    """RSS, and its anonymous and file-backed parts where /proc says (Linux)."""
    found: dict[str, int] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in _STATUS_FIELDS:
                found[_STATUS_FIELDS[key]] = int(value.split()[0]) * 1024
    except OSError:
        pass
    rss = found.get("rss") or psutil.Process().memory_info().rss
    return rss, found.get("anon"), found.get("file")


class _Stages:
    def __init__(self) -> None:
        self.items: list[RssStage] = []
        self.clock = time.perf_counter()

    def mark(self, stage: str) -> None:
        now = time.perf_counter()
        self.items.append(RssStage(stage, *resident(), now - self.clock))
        self.clock = now


def _tokens(n: int, n_vocab: int, seed: int) -> list[int]:
    """Token ids spread over the vocabulary (what is cached does not change its size)."""
    return [(seed * 7919 + i * 104729) % (n_vocab - 1) + 1 for i in range(n)]


def measure(path: Path, params: ContextParams, use_mmap: bool, fill: bool,
            prefill: bool = True) -> Footprint:
    """Load, create the context, decode one token (prefill), and (fill) every sequence to its
    context, reading RSS after each stage."""
    stages = _Stages()
    stages.mark("before loading")
    with captured_log() as log:
        model = Model(path, use_mmap=use_mmap)
    try:
        stages.mark("model loaded")
        info = model.info()
        with captured_log() as ctx_log:
            ctx = Context(model, params)
        try:
            stages.mark("context created")
            n_filled = _prefill(ctx, info.n_vocab, fill, stages) if prefill else 0
            n_ctx, n_ctx_seq = ctx.n_ctx, ctx.n_ctx_seq or ctx.n_ctx
        finally:
            ctx.close()
    finally:
        model.close()
    lines = log + ctx_log
    return Footprint(use_mmap, params, n_ctx, n_ctx_seq, info.n_bytes, info.n_params,
                     info.n_vocab, parse_buffers(lines), parse_caches(lines),
                     tuple(stages.items), n_filled)


def _prefill(ctx: Context, n_vocab: int, fill: bool, stages: _Stages) -> int:
    """One token into sequence 0 (the compute buffer as a decode step uses it), then, to
    fill, every sequence's remaining cells in ubatches; the tokens written."""
    n_ctx_seq = ctx.n_ctx_seq or ctx.n_ctx
    ctx.prefill_seqs([_tokens(1, n_vocab, 0)])
    stages.mark("first token decoded")
    if not fill:
        return 1
    if n_ctx_seq > 1:
        ctx.prefill_seqs([_tokens(n_ctx_seq - 1, n_vocab, 1)], first_seq=0, first_pos=1)
    for seq in range(1, ctx.params.n_seq_max):
        ctx.prefill_seqs([_tokens(n_ctx_seq, n_vocab, seq + 1)], first_seq=seq)
    stages.mark("cache filled")
    return n_ctx_seq * ctx.params.n_seq_max


def _measure_one(args: tuple) -> Footprint:
    return measure(*args)


def measure_in_fresh_process(path: Path, params: ContextParams, use_mmap: bool,
                             fill: bool, prefill: bool = True) -> Footprint:
    """measure() in a new process, so that RSS starts from an interpreter that never loaded
    a model (a freed model leaves pages in the allocator's arenas)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_measure_one, ((path, params, use_mmap, fill, prefill),))
