"""Every file in tests/bad_inputs is refused with exit status 2 and one line that names the file,
the key path and line (where YAML has them) and the fix, leaving nothing behind.

Each file states what its error must say in its first lines:
    # expect-at: LINE [KEY.PATH]
    # expect: words that must appear, comma-separated
    # absent: words that must not appear (a file's content the error must not echo)
(s_*.yaml are scenarios, run with `harness run` and `harness check`; m_*.yaml are model specs,
given to `harness build`; c_*.yaml hold only comments and name their own command line,
    # command: ARGS
where {here} is this folder, {out} a fresh folder that must stay empty and {fifo} a named
pipe made for the case (a pipe cannot be committed); a directory holds its expectations in
EXPECT.) The GGUF files g_*.gguf are written by scripts/make_bad_ggufs.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml
from conftest import assert_user_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.core.errors import HarnessError
from harness.core.specs import spec_from_doc
from harness.core.yamlio import parse_yaml
from harness.engine.scenario import load_scenario

BAD = Path(__file__).resolve().parent / "bad_inputs"
CASES = sorted(p for p in BAD.iterdir() if p.name.startswith(("s_", "m_", "c_")))
ROOT = BAD.parent.parent


def _raw(path: Path) -> str:
    return (path / "EXPECT" if path.is_dir() else path).read_bytes().decode("latin-1")


def expectations(path: Path) -> tuple[int | None, str | None, list[str]]:
    """The line, key path and words a case's error must contain."""
    raw = _raw(path)
    at = re.search(r"^#? ?expect-at: (\d+)(?: (\S+))?$", raw, re.M)
    words = re.search(r"^#? ?expect: (.+)$", raw, re.M)
    assert words, f"{path.name} states no expectation"
    return (int(at.group(1)) if at else None, at.group(2) if at else None,
            [w.strip() for w in words.group(1).split(",")])


def _directive(path: Path, name: str) -> str | None:
    found = re.search(rf"^# {name}: (.+)$", _raw(path), re.M)
    return found.group(1).strip() if found else None


def _command(path: Path, tmp_path: Path) -> list[str]:
    """A c_ case's command line, its placeholders filled in."""
    out = tmp_path / "out"
    out.mkdir()
    fifo = tmp_path / "pipe"
    text = _directive(path, "command")
    assert text, f"{path.name} names no command"
    if "{fifo}" in text:
        suffix = re.search(r"\{fifo\}(\S*)", text).group(1)
        os.mkfifo(f"{fifo}{suffix}")
    return [w.format(here=BAD, out=out, fifo=fifo) for w in shlex.split(text)]


def _runs_folder() -> set[str]:
    runs = ROOT / "reports" / "runs"
    return {p.name for p in runs.iterdir()} if runs.is_dir() else set()


def test_the_corpus_is_big_enough():
    assert len([p for p in CASES if p.name.startswith("s_")]) >= 30
    assert len([p for p in CASES if p.name.startswith("m_")]) >= 10
    assert len([p for p in CASES if p.name.startswith("c_")]) >= 10


@pytest.mark.parametrize("path", CASES, ids=[p.name for p in CASES])
def test_bad_input_is_refused_clearly(path, run_cli, tmp_path):
    line, key, words = expectations(path)
    out, cache = tmp_path / "run", tmp_path / "cache"
    runs_before = _runs_folder()
    if path.name.startswith("s_"):
        result = run_cli("run", str(path), "--out", str(out), "--cache-dir", str(cache))
    elif path.name.startswith("c_"):
        result = run_cli(*_command(path, tmp_path))
        assert not any((tmp_path / "out").iterdir()), "a refused command wrote a file"
    else:
        result = run_cli("build", str(path), "--cache-dir", str(cache))
    assert_user_error(result, *([] if path.name.startswith("c_") else [path.name]), *words)
    assert _runs_folder() == runs_before, "a refused command wrote under reports/runs"
    message = result.stderr.strip()
    for word in (_directive(path, "absent") or "").split(","):
        assert not word.strip() or word.strip() not in message, message
    if line is not None:
        assert f"{path.name}:{line}: " in message, message
    if key is not None:
        assert f": {key}: " in message, message
    assert message.endswith(")"), f"no fix in brackets: {message}"
    assert not out.exists(), "a refused run must not leave a run directory"
    if path.name.startswith("s_"):  # `harness check` refuses it the same way
        checked = run_cli("check", str(path), "--cache-dir", str(cache))
        assert checked.exit_code == 2 and checked.stderr.strip() == message
    assert not list(cache.rglob("*.gguf")) if cache.exists() else True


# --- property tests: random structures either load or raise HarnessError -------------------

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                     st.sampled_from(["auto", "f16", "q8_0", "tiny-qwen2", "1..auto", "x.gguf"]))
_keys = st.sampled_from(["name", "models", "tests", "prompt", "generate", "threads", "dtypes",
                         "depth", "parallel", "shared_prefix", "kv_cache_type", "repetitions",
                         "warmup", "n_batch", "n_ubatch", "flash_attn", "seed", "hidden_size",
                         "architecture", "vocab_size", "num_hidden_layers", "head_dim",
                         "num_attention_heads", "intermediate_size", "title", "bogus"])
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(_keys, inner, max_size=6)), max_leaves=20)
_scenarios = st.fixed_dictionaries(
    {"name": _values, "models": st.one_of(_values, st.just(["tiny-qwen2"])),
     "tests": st.one_of(_values, st.lists(st.dictionaries(_keys, _values, max_size=5),
                                          max_size=3))},
    optional={k: _values for k in ("threads", "dtypes", "repetitions", "flash_attn", "seed")})
_specs = st.fixed_dictionaries(
    {"architecture": st.one_of(_values, st.sampled_from(["llama", "qwen2"])),
     "hidden_size": st.one_of(_values, st.integers(1, 512)),
     "num_hidden_layers": st.one_of(_values, st.integers(1, 4)),
     "num_attention_heads": st.one_of(_values, st.integers(1, 8)),
     "intermediate_size": st.one_of(_values, st.integers(1, 512)),
     "vocab_size": st.one_of(_values, st.integers(200, 1000))},
    optional={k: _values for k in ("num_key_value_heads", "head_dim", "attention_bias",
                                   "rope_theta", "rms_norm_eps", "max_position_embeddings")})
_FAST = settings(max_examples=150, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


def _dump(data) -> str:
    return yaml.safe_dump(data, allow_unicode=True)


@_FAST
@given(data=_scenarios)
def test_scenario_loader_loads_or_refuses(tmp_path, data):
    path = tmp_path / "fuzz.yaml"
    path.write_text(_dump(data), encoding="utf-8")
    try:
        load_scenario(path, physical_cores=2)
    except HarnessError as exc:
        assert exc.render() and "\n" not in exc.render()


@_FAST
@given(data=_specs)
def test_spec_loader_loads_or_refuses(data):
    try:
        spec_from_doc(parse_yaml(_dump(data), "fuzz.yaml"), "fuzz")
    except HarnessError as exc:
        assert exc.render() and "\n" not in exc.render()


@_FAST
@given(text=st.text(max_size=200))
def test_yaml_parser_loads_or_refuses_any_text(text):
    try:
        parse_yaml(text, "fuzz.yaml")
    except HarnessError as exc:
        assert "\n" not in exc.render()


_json_lines = st.lists(st.one_of(
    st.binary(max_size=40),
    st.recursive(_scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(
            st.sampled_from(["type", "key", "id", "scenario", "seq"]), inner, max_size=4)),
        max_leaves=8).map(lambda v: json.dumps(v, allow_nan=True).encode())), max_size=6)


@_FAST
@given(lines=_json_lines)
def test_results_reader_reads_or_refuses(tmp_path, lines):
    from harness.engine.results import read_records

    path = tmp_path / "results.jsonl"
    path.write_bytes(b"\n".join(lines))
    try:
        read_records(path)
    except HarnessError as exc:
        assert "\n" not in exc.render()
