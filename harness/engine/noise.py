"""Noise guard: how much CPU other processes used, from /proc/stat and our own CPU time."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

# Other processes using more than this many cores' worth of CPU make a reading noisy: on 2
# cores one busy process made a 2-thread decode 100x slower (thread barriers wait on it).
NOISY_CORES = 0.10
_HZ = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuSnapshot:
    """Machine-wide busy CPU seconds, our process's CPU seconds, and the wall clock."""

    busy_s: float
    own_s: float
    wall_s: float


def snapshot() -> CpuSnapshot:
    busy = _proc_stat_busy_s()
    t = os.times()
    return CpuSnapshot(busy, t.user + t.system, time.monotonic())


def _proc_stat_busy_s() -> float:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return float("nan")
    # user nice system idle iowait irq softirq steal guest guest_nice; guests are inside user
    values = [int(x) for x in fields[:8]]
    idle = values[3] + values[4]
    return (sum(values) - idle) / _HZ


# /proc/stat counts in clock ticks (10 ms): a window shorter than this cannot be read honestly.
MIN_WINDOW_S = 1.0


def other_cores(start: CpuSnapshot, end: CpuSnapshot, min_window_s: float = MIN_WINDOW_S
                ) -> float | None:
    """Average cores other processes kept busy between two snapshots (None: too short to tell)."""
    wall = end.wall_s - start.wall_s
    if wall < min_window_s:
        return None
    other = (end.busy_s - start.busy_s) - (end.own_s - start.own_s)
    return max(other, 0.0) / wall


def idle_reading(seconds: float = 0.3) -> float:
    """Cores others use while we sit idle: the cleanest look at background load."""
    start = snapshot()
    time.sleep(seconds)
    return other_cores(start, snapshot(), min_window_s=0.0) or 0.0
