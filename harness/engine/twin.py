"""Build the random-weight twin of a real GGUF file, calibrated so its activations keep the
real model's ranges, into the content-keyed cache."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
from filelock import FileLock

from ..core.errors import HarnessError
from ..weights.twin import TWIN_VERSION, twin_mismatch, write_twin
from .build import (
    Progress,
    _atomically,
    _ensure_free_space,
    _ensure_writable_dir,
    _stepper,
    cache_dir,
    check_gguf_file,
    file_sha256,
    manifest_path,
    read_manifest,
    valid_cache_entry,
    write_json_atomically,
)

CALIBRATION_TOKENS = 64  # one prompt, as a prefill sees it
CALIBRATION_PASSES = 4  # at most; each rewrites the twin
CALIBRATION_TOLERANCE = 1.10  # every matrix product's output RMS within 10% of the real one's


def twin_target(real: Path, seed: int, directory: Path) -> Path:
    """Where the cache keeps the twin of a real file: keyed by the file's bytes, the seed, the
    twin's version and llama.cpp's commit (its quantizer and its activations calibrate it)."""
    from .llama import version_info

    parts = [file_sha256(real), str(seed), str(TWIN_VERSION), version_info()["ggml_commit"]]
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    return directory / f"{real.stem}-twin-s{seed}-{key}.gguf"


def build_twin(real: Path, seed: int = 0, *, directory: Path | None = None,
               threads: int = 1, progress: Progress | None = None) -> Path:
    """The cached random-weight twin of a real GGUF file: built when missing, checked tensor by
    tensor against the real file's table, and rescaled matrix by matrix until every matrix
    product's output has the real model's RMS on the same prompt."""
    check_gguf_file(real)
    directory = cache_dir(directory)
    _ensure_writable_dir(directory, "cache directory", "--cache-dir or HARNESS_CACHE_DIR")
    target = twin_target(real, seed, directory)
    with FileLock(str(directory / (target.name + ".lock"))):
        if valid_cache_entry(target):
            return target
        _ensure_free_space(directory, real.stat().st_size)
        tokens = calibration_tokens(real, seed)
        real_rms = output_rms(real, tokens, threads)
        factors: dict[str, float] = {}
        for n_pass in range(1, CALIBRATION_PASSES + 1):
            n_bytes = _write(real, target, seed, factors, progress)
            ratios = rms_ratios(real_rms, output_rms(target, tokens, threads))
            worst = max((abs(math.log(r)) for r in ratios.values()), default=0.0)
            if worst <= math.log(CALIBRATION_TOLERANCE) or n_pass == CALIBRATION_PASSES:
                break
            factors = {w: factors.get(w, 1.0) * r for w, r in ratios.items()}
        record = {"twin_version": TWIN_VERSION, "twin_of": str(real), "seed": seed,
                  "twin_of_sha256": file_sha256(real), "n_bytes": n_bytes, "sha256": None,
                  "calibration": {"passes": n_pass, "tokens": len(tokens),
                                  "worst_rms_ratio": math.exp(worst), "factors": factors}}
        write_json_atomically(manifest_path(target), record)
    return target


def twin_calibration(twin: Path) -> dict | None:
    """How a cached twin was calibrated (passes, worst remaining RMS ratio, factors)."""
    manifest = read_manifest(twin)
    return manifest.get("calibration") if manifest else None


def _write(real: Path, target: Path, seed: int, factors: dict[str, float],
           progress: Progress | None) -> int:
    from .llama import quantize_rows

    step = _stepper(real.stat().st_size, progress)
    n_bytes = _atomically(target, lambda tmp: write_twin(
        real, tmp, seed, lambda kind, rows: quantize_rows(int(kind), rows), step, factors))
    if problem := twin_mismatch(real, target):
        target.unlink()
        raise HarnessError(f"the twin does not match the real file: {problem}",
                           source=str(real), fix="report this file's tensor table as a bug")
    return n_bytes


def calibration_tokens(real: Path, seed: int) -> list[int]:
    """A fixed prompt of token ids from the upper three quarters of the vocabulary (clear of
    the control tokens most vocabularies start with)."""
    from ..weights.gguf_inspect import tensor_table

    n_vocab = next(t.shape[0] for t in tensor_table(real) if t.name == "token_embd.weight")
    rng = np.random.default_rng([seed, 23])
    return [int(x) for x in rng.integers(n_vocab // 4, n_vocab, CALIBRATION_TOKENS)]


def output_rms(path: Path, tokens: list[int], threads: int) -> dict[str, float]:
    """RMS of every matrix product's output over one prefill of tokens, by weight tensor."""
    from .llama import Context, ContextParams, GraphTrace, Model

    trace = GraphTrace(stats=True)
    params = ContextParams(n_ctx=256 * -(-len(tokens) // 256), n_batch=len(tokens),
                           n_ubatch=len(tokens), n_threads=threads)
    with Model(path) as model:
        context = Context(model, params, trace)
        try:
            context.prefill(tokens)
        finally:
            context.close()
    squares: dict[str, list[float]] = {}
    for node in trace.nodes:
        out = node.stats and node.stats.get("out")
        if node.weight and out and out["rms"] is not None:
            acc = squares.setdefault(node.weight, [0.0, 0])
            acc[0] += out["rms"] ** 2 * out["n"]
            acc[1] += out["n"]
    return {w: math.sqrt(s / n) for w, (s, n) in squares.items() if n}


def rms_ratios(real: dict[str, float], twin: dict[str, float]) -> dict[str, float]:
    """real ÷ twin output RMS for every weight both measured with a nonzero output."""
    return {w: real[w] / twin[w] for w in real if twin.get(w) and real[w] > 0}
