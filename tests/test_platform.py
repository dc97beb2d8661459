"""Runs from any laptop: the environment record, the noise guard and the RAM check read the
machine through psutil and py-cpuinfo; where a platform lacks a figure it is recorded as
missing, never guessed and never a crash. Each platform branch is tested by faking psutil."""

from __future__ import annotations

import math
from collections import namedtuple

import psutil
import pytest

from harness import runner
from harness.engine import env, llama, noise
from harness.report.page import env_lines
from harness.report.tables import render_env

LinuxTimes = namedtuple("LinuxTimes", "user nice system idle iowait irq softirq steal guest "
                                      "guest_nice")
WindowsTimes = namedtuple("WindowsTimes", "user system idle interrupt dpc")
MacTimes = namedtuple("MacTimes", "user nice system idle")
Freq = namedtuple("Freq", "current min max")  # psutil.cpu_freq()'s fields


def test_busy_time_counts_every_platforms_busy_fields_and_nothing_idle():
    linux = LinuxTimes(10.0, 1.0, 5.0, 100.0, 7.0, 0.5, 0.25, 2.0, 3.0, 0.5)
    assert noise.busy_cpu_s(linux) == pytest.approx(10 + 1 + 5 + 0.5 + 0.25 + 2)  # guests in user
    assert noise.busy_cpu_s(WindowsTimes(10.0, 5.0, 100.0, 1.0, 0.5)) == pytest.approx(16.5)
    assert noise.busy_cpu_s(MacTimes(10.0, 1.0, 5.0, 100.0)) == pytest.approx(16.0)


def test_a_platform_without_cpu_times_makes_the_guard_say_it_cannot_tell(monkeypatch):
    def no_times():
        raise psutil.AccessDenied()

    monkeypatch.setattr(psutil, "cpu_times", no_times)
    assert math.isnan(noise.busy_cpu_s())
    start = noise.snapshot()
    later = noise.CpuSnapshot(start.busy_s, start.own_s, start.wall_s + 5)
    assert noise.other_cores(start, later) is None
    assert noise.idle_reading(0.0) is None
    warnings = []
    quiet = runner.Console(warn=warnings.append, info=lambda msg: None)
    assert runner._noise_gate("before round 0", strict=True, console=quiet) is None
    assert warnings and "cannot tell" in warnings[0]


def test_cores_fall_back_where_the_os_does_not_report_them(monkeypatch):
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 8 if logical else None)
    monkeypatch.setattr(env, "_usable_cpus", lambda: None)  # macOS: no affinity
    assert env.physical_cores() == 8 and env.logical_cores() == 8
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 8 if logical else 4)
    assert env.physical_cores() == 4
    monkeypatch.setattr(env, "_usable_cpus", lambda: 2)  # pinned to 2 CPUs by its affinity
    assert env.physical_cores() == 2


def test_affinity_missing_on_macos_is_not_an_error(monkeypatch):
    class NoAffinity:
        def cpu_affinity(self):
            raise AttributeError("cpu_affinity")  # psutil has no such method on macOS

    monkeypatch.setattr(psutil, "Process", NoAffinity)
    assert env._usable_cpus() is None


@pytest.mark.parametrize("freq", [None, "raise", Freq(0.0, 0.0, 0.0)])
def test_clock_is_missing_rather_than_zero(monkeypatch, freq):
    def cpu_freq():
        if freq == "raise":
            raise FileNotFoundError("/sys/devices/system/cpu/cpufreq")
        return freq

    monkeypatch.setattr(psutil, "cpu_freq", cpu_freq)
    assert env.cpu_freq_mhz() is None


def test_missing_figures_are_recorded_and_shown_never_guessed(monkeypatch):
    def no_memory():
        raise psutil.AccessDenied()

    monkeypatch.setattr(psutil, "virtual_memory", no_memory)
    monkeypatch.setattr(psutil, "cpu_freq", lambda: None)
    monkeypatch.setattr(env, "cpu_info", lambda: {})
    monkeypatch.setattr(env, "last_level_cache_bytes", lambda: None)
    monkeypatch.setattr(env.platform, "processor", lambda: "")
    monkeypatch.setattr(env.platform, "machine", lambda: "")
    info = env.collect_env()
    assert env.available_ram_bytes() is None
    assert info["missing"] == ["cpu_model", "cpu_flags", "cpu_freq_mhz", "ram_total_bytes",
                               "ram_available_bytes", "last_level_cache_bytes"]
    text = render_env(info)
    assert text.count("not reported") == 6
    assert "| not reported by this platform | cpu_model, cpu_flags" in "\n".join(env_lines(info))


def test_cpu_brand_and_flags_come_from_py_cpuinfo(monkeypatch):
    monkeypatch.setattr(env, "cpu_info", lambda: {"brand_raw": "Apple M2", "flags": ["neon",
                                                                                    "fp16"]})
    assert env.cpu_model() == "Apple M2" and env.cpu_flags() == ["fp16", "neon"]


def test_the_abort_callback_finds_strlen_on_windows_without_cdll_none(monkeypatch):
    class Msvcrt:
        strlen = object()

    class Loader:
        msvcrt = Msvcrt()

    monkeypatch.setattr(llama.sys, "platform", "win32")
    monkeypatch.setattr(llama.ctypes, "cdll", Loader())
    assert llama.libc_strlen() is Msvcrt.strlen
    monkeypatch.setattr(llama.sys, "platform", "linux")
    assert llama.libc_strlen() is not None
