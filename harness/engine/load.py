"""Load as the serving benchmarks define it: closed loop (N requests in flight, a new one sent
as each ends) and open loop (Poisson arrivals at a rate, whatever the server's state), each
bounded by a request count and a duration, after warm-up requests that are not kept."""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np

from ..core.errors import MeasurementError
from ..core.options import REQUEST_TIMEOUT_S
from .http import client_timeout, completion_body, prometheus_counters, stream_completion

FIRST_TOKEN = 3  # after the synthetic vocabulary's <unk>, <s>, </s>
# Warm-up requests that may fail before a level gives up: a server that fails its warm-up
# fails the level's requests too, and each failure may have waited a whole timeout_s.
MAX_WARMUP_FAILURES = 1


@dataclass(frozen=True)
class Level:
    """One load level: `concurrency` in flight (closed loop) or `rate` requests/s (open)."""

    concurrency: int | None = None
    rate: float | None = None

    @property
    def label(self) -> str:
        return f"{self.concurrency} in flight" if self.concurrency else f"{self.rate:g} req/s"

    @property
    def key(self) -> str:
        return f"c{self.concurrency}" if self.concurrency else f"r{self.rate:g}"


@dataclass(frozen=True)
class Workload:
    """What every request asks for, and the bounds of a level."""

    n_prompt: int
    n_generate: int
    n_vocab: int
    n_requests: int
    duration_s: float
    warmup: int = 1
    cache_prompt: bool = False  # unique prompts either way: the cache cannot hide prefill
    timeout_s: float = REQUEST_TIMEOUT_S
    seed: int = 0
    pin_slots: bool = False  # closed loop: worker k's requests ask for llama-server's slot k


def prompts(w: Workload, level: Level) -> Callable[[int], list[int]]:
    """Request i's prompt: random token ids, unique per request, level and run seed."""
    def make(i: int) -> list[int]:
        rng = np.random.default_rng([w.seed, zlib.crc32(level.key.encode()), i])
        return rng.integers(FIRST_TOKEN, w.n_vocab, w.n_prompt).tolist()
    return make


WARMUP_INDEX = 1 << 32  # warm-up prompts' indices: apart from every kept request's


async def run_level(base_url: str, level: Level, w: Workload, first: int = 0) -> dict:
    """Warm up, then load the server at this level with requests first, first + 1, …; the
    requests' records and the server's counters before and after (None where it has no
    /metrics)."""
    make = prompts(w, level)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=client_timeout(w.timeout_s), limits=limits) as client:
        async def send(i: int, slot: int | None = None) -> dict:
            body = completion_body(make(i), w.n_generate, w.cache_prompt)
            if slot is not None:
                body["id_slot"] = slot
            return await stream_completion(client, base_url, body, w.timeout_s) | {"index": i}

        await _warm_up(send, w, level)
        before = await asyncio.to_thread(prometheus_counters, base_url)
        started = time.perf_counter()
        records = await (_closed(send, level.concurrency, w, first) if level.concurrency
                         else _open(send, level.rate, w, first))
        wall_s = time.perf_counter() - started
        after = await asyncio.to_thread(prometheus_counters, base_url)
    return {"records": records, "wall_s": wall_s, "started_s": started,
            "metrics_before": before, "metrics_after": after}


async def _warm_up(send, w: Workload, level: Level) -> None:
    """The warm-up requests (prompts of their own, records not kept); MAX_WARMUP_FAILURES
    failed ones end the level with the last one's reason."""
    failures = 0
    for i in range(w.warmup):
        error = (await send(WARMUP_INDEX + i))["error"]
        failures += error is not None
        if failures >= MAX_WARMUP_FAILURES:
            raise MeasurementError(f"the warm-up request at {level.label} failed: {error}",
                                   key="server", fix="check that the server answers "
                                   "completions; what earlier levels measured is kept")


async def _closed(send, concurrency: int, w: Workload, first: int = 0) -> list[dict]:
    """`concurrency` workers, each sending its next request when the last one ended, until
    n_requests were sent or duration_s passed."""
    deadline = time.perf_counter() + w.duration_s
    counter = iter(range(first, first + w.n_requests))
    records: list[dict] = []

    async def worker(k: int) -> None:
        for i in counter:
            if time.perf_counter() >= deadline:
                return
            records.append(await send(i, k if w.pin_slots else None) | (
                {"slot": k} if w.pin_slots else {}))

    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return sorted(records, key=lambda r: r["index"])


async def _open(send, rate: float, w: Workload, first: int = 0) -> list[dict]:
    """Requests sent at Poisson arrival times (exponential gaps of mean 1/rate), whatever is
    in flight, until n_requests were sent or duration_s passed."""
    gaps = np.random.default_rng([w.seed, 7]).exponential(1.0 / rate, w.n_requests)
    start = time.perf_counter()
    tasks, at = [], 0.0
    for i, gap in enumerate(gaps):
        at += float(gap)
        if at >= w.duration_s:
            break
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tasks.append(asyncio.create_task(send(first + i)))
    return list(await asyncio.gather(*tasks))
