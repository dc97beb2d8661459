"""Random-weight twins of real GGUF files: the table, the values, the calibration, the
scenario entry, the page section and the command; on tiny stand-ins made here (never a
download)."""

import math
from pathlib import Path

import numpy as np
import pytest
from conftest import measure_scenario
from gguf import GGUFReader, GGUFValueType, GGUFWriter, Keys

from harness.core.dtypes import DTYPES
from harness.core.rounds import contrast_pairs
from harness.core.specs import resolve_spec
from harness.engine.build import build
from harness.engine.llama import Context, ContextParams, GraphTrace, Model, quantize
from harness.engine.pagecache import huge_mapped_n_bytes, recache
from harness.engine.scenario import load_scenario
from harness.engine.twin import (
    CALIBRATION_PASSES,
    CALIBRATION_TOLERANCE,
    build_twin,
    calibration_tokens,
    output_rms,
    rms_ratios,
    twin_calibration,
)
from harness.weights.twin import BLOCK, twin_mismatch, twin_values


def structured_copy(src: Path, dst: Path) -> Path:
    """src's header and tensor table with structured, non-random values: smooth waves whose
    rows differ in scale and a few columns ten times larger (the outlier features trained
    models have); norm vectors near 1."""
    reader = GGUFReader(src)
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    writer = GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    for index, t in enumerate(reader.tensors):
        shape = t.data.shape
        if len(shape) == 1:
            values = 1 + 0.1 * np.cos(np.arange(shape[0]) * 0.7 + index)
        else:
            rows, cols = np.prod(shape[:-1]), shape[-1]
            i, j = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
            values = 0.02 * (1 + (i % 7)) * np.sin(0.37 * i + 1.3 * j + index)
            values *= np.where(j % 17 == 0, 10.0, 1.0)
        writer.add_tensor(t.name, values.reshape(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> Path:
    """A "real" Q8_0 file of tiny-gemma3's shapes with structured weights."""
    tmp = tmp_path_factory.mktemp("standin")
    f32 = build(resolve_spec("tiny-gemma3"), DTYPES["f32"], directory=tmp / "cache").path
    real_f32 = structured_copy(f32, tmp / "real-f32.gguf")
    out = tmp / "tiny-real-q8_0.gguf"
    quantize(real_f32, out, int(DTYPES["q8_0"].file_type))
    return out


@pytest.fixture(scope="module")
def twin_of_standin(standin, tmp_path_factory) -> Path:
    return build_twin(standin, 0, directory=tmp_path_factory.mktemp("twins"))


def test_twin_has_the_real_table_and_none_of_its_bytes(standin, twin_of_standin):
    assert twin_mismatch(standin, twin_of_standin) is None
    real, twin = GGUFReader(standin), GGUFReader(twin_of_standin)
    assert {t.tensor_type.name for t in twin.tensors} == {"Q8_0", "F32"}
    seen = set()
    for a, b in zip(real.tensors, twin.tensors, strict=True):
        assert a.name == b.name and a.tensor_type == b.tensor_type
        assert bytes(a.data) != bytes(b.data), a.name  # random values, not the real ones
        assert bytes(b.data) not in seen, f"{b.name} repeats another tensor's bytes"
        seen.add(bytes(b.data))
    names = {f.name for f in twin.fields.values()}
    assert "tokenizer.ggml.tokens" in names and "harness.twin_of" in names


def test_a_file_with_another_table_is_told_apart_at_its_first_difference(standin, tmp_path):
    other = build(resolve_spec("tiny-llama"), DTYPES["f32"], directory=tmp_path).path
    problem = twin_mismatch(standin, other)
    assert problem and problem.startswith(("tensor 0", "tensor 1", "tensor 2")) or \
        "tensors" in problem


def test_every_block_keeps_the_real_blocks_largest_magnitude():
    rng = np.random.default_rng(1)
    real = (rng.standard_t(3, size=(5, 4 * BLOCK)) * 0.02).astype(np.float32)
    twin = twin_values(real, np.random.default_rng(2))
    blocks = lambda x: np.abs(x.reshape(5, -1, BLOCK)).max(axis=2)  # noqa: E731
    assert np.allclose(blocks(twin), blocks(real), rtol=1e-6)
    assert not np.allclose(twin, real)
    norm = np.full((1, 48), 1.5, dtype=np.float32) + rng.normal(0, 0.1, (1, 48)).astype(
        np.float32)
    drawn = twin_values(norm, np.random.default_rng(3))  # a vector: its mean and spread
    assert abs(drawn.mean() - norm.mean()) < 0.1 and drawn.std() < 0.3


def test_calibration_records_what_it_reached(standin, twin_of_standin):
    cal = twin_calibration(twin_of_standin)
    assert 1 <= cal["passes"] <= CALIBRATION_PASSES
    tokens = calibration_tokens(standin, 0)
    ratios = rms_ratios(output_rms(standin, tokens, 1), output_rms(twin_of_standin, tokens, 1))
    assert ratios and all(r > 0 for r in ratios.values())
    worst = max(max(r, 1 / r) for r in ratios.values())
    assert math.isclose(worst, cal["worst_rms_ratio"], rel_tol=1e-3)
    assert worst <= CALIBRATION_TOLERANCE or cal["passes"] == CALIBRATION_PASSES


def test_graph_trace_names_each_products_weight_and_times_every_node(standin):
    names = {t.name for t in GGUFReader(standin).tensors}
    trace = GraphTrace(stats=True)
    with Model(standin) as model:
        ctx = Context(model, ContextParams(n_ctx=256, n_batch=16, n_ubatch=16, n_threads=1),
                      trace)
        try:
            ctx.prefill(list(range(10, 26)))
        finally:
            ctx.close()
    products = [n for n in trace.nodes if n.weight]
    assert products and {n.weight for n in products} <= names
    assert all(n.seconds >= 0 for n in trace.nodes)
    outs = [n.stats["out"] for n in products if n.stats.get("out")]
    assert outs and all(s["non_finite"] == 0 and s["rms"] > 0 for s in outs)


def test_no_mmap_is_honoured(standin):
    """llama.cpp replaced use_mmap by load_mode: mapping the file or not must show."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc here")
    with Model(standin, use_mmap=True):
        assert str(standin.resolve()) in maps.read_text()
    with Model(standin, use_mmap=False):
        assert str(standin.resolve()) not in maps.read_text()


def test_huge_page_reading_sums_the_files_mappings(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "7f00-7f10 r--s 00000000 08:01 42    /models/a.gguf\nSize: 8 kB\n"
        "FilePmdMapped:      2048 kB\n"
        "7f10-7f20 r--s 00001000 08:01 42    /models/a.gguf\nFilePmdMapped:      4096 kB\n"
        "7f20-7f30 r--s 00000000 08:01 43    /models/b.gguf\nFilePmdMapped:      9999 kB\n"
        "7f30-7f40 rw-p 00000000 00:00 0 \nFilePmdMapped:      0 kB\n")
    assert huge_mapped_n_bytes(Path("/models/a.gguf"), smaps) == 6144 * 1024
    assert huge_mapped_n_bytes(Path("/models/c.gguf"), smaps) == 0
    (tmp_path / "old").write_text("7f00-7f10 r--s 00000000 08:01 42    /models/a.gguf\n")
    assert huge_mapped_n_bytes(Path("/models/a.gguf"), tmp_path / "old") is None


def test_recache_reads_the_whole_file(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"\1" * 5_000_000)
    assert recache(path) is hasattr(__import__("os"), "posix_fadvise")
    assert path.read_bytes() == b"\1" * 5_000_000


def _twin_scenario(tmp: Path, real: Path, reps: int = 3, random: str = "") -> Path:
    path = tmp / "twin.yaml"
    entry = f"{{twin_of: {real}" + (f", random: {random}}}" if random else "}")
    path.write_text(f"name: twin-test\nmodels:\n  - {entry}\nthreads: 1\n"
                    f"repetitions: {reps}\nwarmup: 0\ntests:\n  - prompt: 16\n    generate: 4\n")
    return path


def test_random_lists_the_stand_ins_a_real_file_is_timed_against(standin, tmp_path):
    plan = load_scenario(_twin_scenario(tmp_path, standin, random="[twin, built]"),
                         physical_cores=2)
    models = list(dict.fromkeys(m.model for m in plan.measurements))
    assert [m.dtype for m in models] == ["real", "twin", "built"]
    assert all(m.twin_of == standin for m in models[1:])
    plan = load_scenario(_twin_scenario(tmp_path, standin, random="built"), physical_cores=2)
    assert [m.model.dtype for m in plan.measurements][:2] == ["real", "built"]


def test_the_spec_built_file_is_checked_on_names_shapes_and_types(standin, tmp_path):
    from harness.weights.gguf_inspect import file_dtype, spec_from_gguf
    from harness.weights.twin import built_mismatch

    assert file_dtype(standin).name == "q8_0"
    built = build(spec_from_gguf(standin), DTYPES["q8_0"], directory=tmp_path).path
    assert built_mismatch(standin, built) is None
    other = build(spec_from_gguf(standin), DTYPES["f16"], directory=tmp_path).path
    assert built_mismatch(standin, other) == (
        "tensor token_embd.weight: type F16, the real file's is Q8_0")
    wider = build(resolve_spec("tiny-llama"), DTYPES["q8_0"], directory=tmp_path).path
    assert built_mismatch(standin, wider).startswith("the built file")


def test_a_twin_of_entry_is_the_file_and_its_twin_compared_on_both_phases(standin, tmp_path):
    plan = load_scenario(_twin_scenario(tmp_path, standin), physical_cores=2)
    models = [m.model for m in plan.measurements]
    assert [(m.label, m.dtype) for m in models] == [(standin.stem, "real"),
                                                    (standin.stem, "twin")]
    assert models[0].gguf_path == standin and models[1].twin_of == standin
    pairs = contrast_pairs({m.id: m.pairing_key for m in plan.measurements},
                           {m.id: {"decode", "prefill"} for m in plan.measurements})
    assert sorted(p[2] for p in pairs) == ["decode", "prefill"]


@pytest.mark.parametrize("entry, message", [
    ("{twin_of: nowhere.gguf}", "model file not found"),
    ("{twin_of: spec.yaml}", "twin_of names a GGUF file"),
    ("{twin_off: a.gguf}", "unknown key"),
    ("{twin_of: REAL, random: clone}", "unknown random-weight file 'clone'"),
    ("{twin_of: REAL, random: [twin, twin]}", "a kind is listed twice"),
])
def test_a_bad_twin_of_entry_is_one_line(run_cli, standin, tmp_path, entry, message):
    path = tmp_path / "bad.yaml"
    entry = entry.replace("REAL", str(standin))
    path.write_text(f"name: bad\nmodels:\n  - {entry}\ntests:\n  - prompt: 8\n")
    result = run_cli("check", str(path))
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_a_twin_run_reloads_in_alternating_order_and_reports_both_phases(standin, tmp_path):
    from harness.core.records import Load
    from harness.report.lesson import twin_section
    from harness.study.analyze import analyze_records

    plan, records = measure_scenario(_twin_scenario(tmp_path, standin, reps=4), tmp_path)
    loads = records.of_type(Load)
    assert len(loads) == 4
    assert loads[0].order == loads[2].order == loads[1].order[::-1]
    twin_model = next(m for k, m in records.models.items() if k.endswith("|twin"))
    assert twin_model.calibration["passes"] >= 1 and twin_model.twin_of == str(standin)
    rows = analyze_records(records)["twins"]
    assert sorted(r["phase"] for r in rows) == ["decode", "prefill"]
    assert all(r["n_pairs"] == 4 and len(r["per_round"]) == 4 for r in rows)
    text = "\n".join(twin_section({"twins": rows}))
    assert "## Random weights against real weights" in text and "twin ÷ real" in text


def test_a_page_without_a_twin_says_the_premise_was_not_checked():
    from harness.report.lesson import twin_section

    assert "Not checked in this run" in "\n".join(twin_section({"twins": []}))


def test_harness_twin_measures_a_file_against_its_twin(run_cli, standin, tmp_path,
                                                       monkeypatch):
    from harness import runner

    monkeypatch.setattr(runner.noise, "idle_reading", lambda seconds=0.3: 0.0)
    out = tmp_path / "run"
    result = run_cli("twin", str(standin), "--out", str(out), "--threads", "1", "--prompt",
                     "16", "--generate", "4", "--repetitions", "3", "--min-repetitions", "3")
    assert result.exit_code == 0, result.stderr
    assert "Prefill of" in result.stdout and "Decode of" in result.stdout
    assert "random-weight twin ran" in result.stdout
    assert (out / "twin.yaml").exists() and (out / "report.md").exists()
    assert "Random weights against real weights" in (out / "report.md").read_text()


def test_harness_twin_against_both_reports_the_twin_and_the_spec_built_file(
        run_cli, standin, tmp_path, monkeypatch):
    from harness import runner

    monkeypatch.setattr(runner.noise, "idle_reading", lambda seconds=0.3: 0.0)
    out = tmp_path / "run"
    result = run_cli("twin", str(standin), "--out", str(out), "--threads", "1", "--prompt",
                     "16", "--generate", "4", "--repetitions", "3", "--min-repetitions", "3",
                     "--against", "both")
    assert result.exit_code == 0, result.stderr
    assert "random-weight twin ran" in result.stdout and "spec-built file ran" in result.stdout
    page = (out / "report.md").read_text()
    assert "random ÷ real" in page and "| spec-built |" in page and "| twin |" in page


def test_harness_twin_refuses_a_type_the_builder_cannot_make(run_cli, standin, tmp_path):
    from harness.weights.gguf_inspect import open_gguf

    odd = tmp_path / "odd.gguf"
    reader = open_gguf(standin)
    data = bytearray(standin.read_bytes())
    field = reader.fields["general.file_type"]
    offset = int(field.parts[field.data[0]].ctypes.data - reader.data.ctypes.data)
    data[offset:offset + 4] = (99).to_bytes(4, "little")
    odd.write_bytes(bytes(data))
    result = run_cli("twin", str(odd), "--against", "built")
    assert result.exit_code == 2
    assert "general.file_type 99 names no type the builder makes" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_harness_twin_refuses_a_file_that_is_not_gguf(run_cli, tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_text("not a model")
    result = run_cli("twin", str(bad))
    assert result.exit_code == 2 and "not a GGUF file" in result.stderr


def test_a_real_files_hash_is_remembered_until_the_file_changes(tmp_path):
    import hashlib
    import os

    from harness.engine.build import file_sha256

    path = tmp_path / "real.gguf"
    path.write_bytes(b"GGUF one")
    assert file_sha256(path) == hashlib.sha256(b"GGUF one").hexdigest()
    assert file_sha256(path) == hashlib.sha256(b"GGUF one").hexdigest()  # remembered
    path.write_bytes(b"GGUF two!")
    os.utime(path, ns=(1, 1))
    assert file_sha256(path) == hashlib.sha256(b"GGUF two!").hexdigest()
