"""Crashes and concurrency with real subprocesses: SIGKILL mid-run and mid-build, two builds of
one model at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT

from harness.core.dtypes import DTYPES
from harness.core.specs import load_spec_file
from harness.engine.build import cache_target, read_manifest, valid_cache_entry

SCENARIO = Path(__file__).resolve().parent / "scenarios" / "long_tiny.yaml"
# Big enough (~190 MiB) that a build takes a few tenths of a second to write.
MEDIUM_SPEC = """\
name: medium-llama
architecture: llama
hidden_size: 512
num_hidden_layers: 4
num_attention_heads: 8
intermediate_size: 1536
vocab_size: 80000
max_position_embeddings: 2048
"""


def _ids(path: Path) -> list[str]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.endswith("}"):
            record = json.loads(line)
            if record["type"] == "measurement":
                out.append(record["id"])
    return out


def _harness(*args: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(condition, timeout: float = 60, step: float = 0.002) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return False


def _repetitions(path: Path) -> list[tuple[str, int]]:
    if not path.exists():
        return []
    return [(r["id"], r["round"]) for line in path.read_text().splitlines()
            if line.endswith("}") and (r := json.loads(line))["type"] == "repetition"]


def test_sigkill_during_a_run_loses_only_the_repetition_in_flight(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ)  # HARNESS_PROBE_MIB=1 (conftest)
    proc = _harness("run", str(SCENARIO), "--out", str(out), env=env)
    results = out / "results.jsonl"
    assert _wait_for(lambda: len(_repetitions(results)) >= 3, step=0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=10)
    kept = _repetitions(results)
    assert len(kept) >= 3
    for line in results.read_text().splitlines():
        json.loads(line)  # every line that was written is whole
    resumed = subprocess.run([sys.executable, "-m", "harness", "run", str(SCENARIO), "--out",
                              str(out), "--resume"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    reps = _repetitions(results)
    assert reps[:len(kept)] == kept  # what was kept stays, in place
    assert len(reps) == len(set(reps)) == 2 * 8  # nothing measured twice, nothing missing
    assert len(_ids(results)) == 2


def _medium(tmp_path: Path):
    spec_file = tmp_path / "medium-llama.yaml"
    spec_file.write_text(MEDIUM_SPEC)
    return spec_file, load_spec_file(spec_file)


def test_sigkill_during_a_build_leaves_no_valid_cache_entry(tmp_path):
    spec_file, spec = _medium(tmp_path)
    cache = tmp_path / "cache"
    target = cache_target(spec, DTYPES["f32"], 0, cache)
    proc = _harness("build", str(spec_file), "--cache-dir", str(cache), env=dict(os.environ))
    partial = lambda: any(cache.glob(target.name + ".tmp-*"))  # noqa: E731
    assert _wait_for(partial), "the build never started writing"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=10)
    assert not target.exists() or not valid_cache_entry(target)
    assert read_manifest(target) is None
    # The next build clears the fragment and makes a whole file.
    again = subprocess.run([sys.executable, "-m", "harness", "build", str(spec_file),
                            "--cache-dir", str(cache)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert valid_cache_entry(target) and not partial()


def test_two_builds_at_once_make_one_file(tmp_path):
    spec_file, spec = _medium(tmp_path)
    cache = tmp_path / "cache"
    procs = [_harness("build", str(spec_file), "--cache-dir", str(cache), env=dict(os.environ))
             for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    paths = {out.strip() for out, _ in results}
    target = cache_target(spec, DTYPES["f32"], 0, cache)
    assert paths == {str(target)} and valid_cache_entry(target)
    notes = sorted(err.strip().splitlines()[-1].rsplit(", ", 1)[-1] for _, err in results)
    assert notes[0].startswith("built in") and notes[1] == "cached", notes
    assert [p.name for p in cache.iterdir() if p.suffix == ".gguf"] == [target.name]


def test_truncated_gguf_is_refused_before_the_run(tmp_path, run_cli):
    from conftest import assert_user_error

    from harness.core.specs import resolve_spec
    from harness.engine.build import build

    built = build(resolve_spec("tiny-llama"), DTYPES["f32"])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(built.path.read_bytes()[: built.n_bytes // 2])
    out = tmp_path / "run"
    r = run_cli("run", str(_tiny_scenario(tmp_path, f'["{cut}"]')), "--out", str(out))
    assert_user_error(r, "models[0]", "cut.gguf", "cannot read the GGUF file",
                      "pass a complete GGUF file")
    assert not out.exists()


def test_a_model_llama_cpp_cannot_load_is_recorded_and_the_run_goes_on(tmp_path, run_cli):
    """Its metadata claims 3 layers but it holds tensors for 2: the GGUF reads fine, llama.cpp
    refuses it. The run records the failure with the model and step, measures the other model,
    and exits 1."""
    import shutil

    from gguf import GGUFReader

    from harness.core.specs import resolve_spec
    from harness.engine.build import build

    built = build(resolve_spec("tiny-llama"), DTYPES["f32"])
    bad = tmp_path / "bad.gguf"
    shutil.copy(built.path, bad)
    reader = GGUFReader(bad, "r+")
    field = reader.fields["llama.block_count"]
    field.parts[field.data[0]][0] = 3
    del reader
    out = tmp_path / "run"
    r = run_cli("run", str(_tiny_scenario(tmp_path, f'["{bad}", tiny-qwen2]')), "--out",
                str(out))
    assert r.exit_code == 1, r.stderr
    assert "bad|file" in r.stderr and "could not load" in r.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    (failure,) = [x for x in records if x["type"] == "failure"]
    assert failure["model_key"] == "bad|file" and failure["step"] == "load"
    assert "bad.gguf" in failure["error"] and "blk.2" in failure["error"]
    measured = [x for x in records if x["type"] == "measurement"]
    assert [m["model"] for m in measured] == ["tiny-qwen2"]
    assert "**Failed:** bad|file at load" in (out / "report.md").read_text()


def _tiny_scenario(tmp_path: Path, models: str = "[tiny-llama, tiny-qwen2]") -> Path:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"name: t\nmodels: {models}\nthreads: [1]\nrepetitions: 1\n"
                        "warmup: 0\ntests:\n  - {prompt: 4, generate: 2}\n")
    return scenario


def test_a_decode_error_names_model_and_step_and_the_run_goes_on(tmp_path, run_cli,
                                                                  monkeypatch):
    import harness.engine.llama
    import harness.engine.probe

    real = harness.engine.llama.L.llama_decode
    seen = {"failed": 0}
    monkeypatch.setattr(harness.engine.probe, "SKELETON_LAYERS", ())  # no skeleton decodes

    def failing(ctx, batch):
        # the first single-token decode of the run fails, whichever cell the shuffle put first
        if batch.n_tokens == 1 and not seen["failed"]:
            seen["failed"] = 1
            return -3
        return real(ctx, batch)

    monkeypatch.setattr(harness.engine.llama.L, "llama_decode", failing)
    out = tmp_path / "run"
    r = run_cli("run", str(_tiny_scenario(tmp_path)), "--out", str(out))
    assert r.exit_code == 1, r.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    (failure,) = [x for x in records if x["type"] == "failure"]
    measured = [x["model_key"] for x in records if x["type"] == "measurement"]
    assert len(measured) == 1 and failure["model_key"] != measured[0]  # the other went on
    assert failure["model_key"] in ("tiny-llama|f32", "tiny-qwen2|f32")
    assert failure["step"].startswith(f"decode in {failure['model_key']}|")
    assert "llama_decode returned -3 during decode" in failure["error"]


def test_short_disk_is_refused_before_the_run_directory_exists(tmp_path, run_cli,
                                                                monkeypatch):
    import harness.engine.build

    class Usage:
        free = 1000

    monkeypatch.setattr(harness.engine.build.shutil, "disk_usage", lambda path: Usage())
    out = tmp_path / "run"
    r = run_cli("run", str(_tiny_scenario(tmp_path)), "--out", str(out), "--cache-dir",
                str(tmp_path / "empty-cache"))
    from conftest import assert_user_error

    assert_user_error(r, "not enough free disk: the build needs", "GiB is free")
    assert not out.exists()


def test_short_ram_is_refused_before_the_run_directory_exists(tmp_path, run_cli,
                                                               monkeypatch):
    from conftest import assert_user_error

    from harness import runner

    monkeypatch.setattr(runner, "available_ram_bytes", lambda: 1000)
    out = tmp_path / "run"
    r = run_cli("run", str(_tiny_scenario(tmp_path)), "--out", str(out))
    assert_user_error(r, "tiny-llama|f32 needs about", "GiB is available")
    assert not out.exists()


def test_unwritable_run_and_report_directories_are_refused(tmp_path, run_cli):
    from conftest import assert_user_error

    # chmod does not stop root; /proc refuses new entries to everyone.
    r = run_cli("run", str(_tiny_scenario(tmp_path)), "--out", "/proc/self/harness-run")
    assert_user_error(r, "run directory is not writable")
    fixture = Path(__file__).resolve().parent / "fixtures" / "runs" / "tiny"
    r = run_cli("report", str(fixture), "-o", "/proc/self/harness-report.md")
    assert_user_error(r, "/proc/self")
