"""Noise guard: how much CPU other processes used, from the machine's CPU times (psutil, on any
OS) and our own CPU time."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import psutil

# Other processes using more than this many cores' worth of CPU make a reading noisy: on 2
# cores one busy process made a 2-thread decode 100x slower (thread barriers wait on it).
NOISY_CORES = 0.10
# Fields of psutil.cpu_times() that are not busy time: idle and waiting on I/O; guest time is
# already inside user time on Linux (psutil documents the fields per platform).
_NOT_BUSY = ("idle", "iowait", "guest", "guest_nice")


@dataclass(frozen=True)
class CpuSnapshot:
    """Machine-wide busy CPU seconds, our process's CPU seconds, and the wall clock."""

    busy_s: float
    own_s: float
    wall_s: float


def snapshot() -> CpuSnapshot:
    busy = busy_cpu_s()
    t = os.times()
    return CpuSnapshot(busy, t.user + t.system, time.monotonic())


def busy_cpu_s(times=None) -> float:
    """Machine-wide busy CPU seconds since boot, from whichever fields this OS reports (NaN
    where it reports none: the guard then says it cannot tell, never crashes)."""
    try:
        times = times if times is not None else psutil.cpu_times()
    except (psutil.Error, OSError, RuntimeError):
        return math.nan
    fields = times._asdict()
    return sum(v for k, v in fields.items() if k not in _NOT_BUSY)


# The OS counts CPU time in clock ticks (10 ms on Linux): a shorter window cannot be read honestly.
MIN_WINDOW_S = 1.0


def other_cores(start: CpuSnapshot, end: CpuSnapshot, min_window_s: float = MIN_WINDOW_S
                ) -> float | None:
    """Average cores other processes kept busy between two snapshots (None: too short to tell)."""
    wall = end.wall_s - start.wall_s
    if wall < min_window_s:
        return None
    other = (end.busy_s - start.busy_s) - (end.own_s - start.own_s)
    if math.isnan(other):
        return None
    return max(other, 0.0) / wall


def idle_reading(seconds: float = 0.3) -> float | None:
    """Cores others use while we sit idle: the cleanest look at background load (None where
    the OS reports no machine-wide CPU time)."""
    start = snapshot()
    time.sleep(seconds)
    return other_cores(start, snapshot(), min_window_s=0.0)
