"""A random-weight twin of a real GGUF file: its header and tensor table, fresh random values.

The twin keeps everything the loader and the kernels see apart from the values: every metadata
key (tokenizer included, so the header and every tensor's offset match), the tensors in the
file's order, each at its own type and shape, at the file's alignment. Its values are random
(one draw per tensor from its own seed, so no two tensors share bytes), but every block of 32
weights keeps the largest magnitude of the real block it replaces: the quantization scales
ggml reads have the real file's spread, while the weights within a block, and so everything a
model learned, are noise.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    Keys,
)
from gguf.quants import dequantize

from .. import __version__
from ..core.errors import HarnessError
from .gguf_build import BLOCK, write_tensor_data
from .gguf_inspect import open_gguf, tensor_table

# Bump when the bytes a twin gets change: it is part of every twin's cache key.
TWIN_VERSION = 1
ROWS_PER_CHUNK = 4096  # rows dequantized, drawn and quantized at a time (bounded memory)
DIRECT = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
# (type, F32 rows) -> the rows' bytes in that type; engine.llama.quantize_rows is ggml's.
Quantizer = Callable[[GGMLQuantizationType, np.ndarray], bytes]


def write_twin(real: Path, out: Path, seed: int, quantize: Quantizer,
               progress: Callable[[int], None] | None = None,
               factors: dict[str, float] | None = None) -> int:
    """Write the twin of real at out (the caller renames it into place); return its size.
    factors: per tensor name, a scale on its random values (the activation calibration)."""
    factors = factors or {}
    reader = open_gguf(real)
    _check_types(reader, real)
    writer = _writer_with_metadata(reader, real, seed)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, int(t.n_bytes),
                               raw_dtype=t.tensor_type)
    tensors = ((int(t.n_bytes), _twin_chunks(t, np.random.default_rng([seed, index]),
                                             quantize, factors.get(t.name, 1.0)))
               for index, t in enumerate(reader.tensors))
    return write_tensor_data(writer, out, tensors, progress)


def _check_types(reader: GGUFReader, path: Path) -> None:
    """Refuse, before writing anything, a type whose values cannot be read here (named by its
    first tensor)."""
    first: dict[GGMLQuantizationType, str] = {}
    for t in reader.tensors:
        first.setdefault(t.tensor_type, t.name)
    for kind, name in first.items():
        if kind in DIRECT or kind == GGMLQuantizationType.BF16:
            continue
        try:
            dequantize(np.zeros(GGML_QUANT_SIZES[kind][1], dtype=np.uint8), kind)
        except (NotImplementedError, KeyError):
            raise HarnessError(f"tensor {name} is {kind.name}, a type the twin cannot read "
                               "the statistics of", source=str(path),
                               fix="twin a file whose tensors are F32, F16, BF16 or quantized "
                                   "types gguf-py can dequantize") from None


def _writer_with_metadata(reader: GGUFReader, real: Path, seed: int) -> GGUFWriter:
    """Every key of the real file as it is, the name and description saying what this is."""
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    writer = GGUFWriter(None, arch)
    own = {Keys.General.NAME, Keys.General.DESCRIPTION, Keys.General.ARCHITECTURE}
    for field in reader.fields.values():
        if field.name in own or field.name.startswith(("GGUF.", "harness.")):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    if Keys.General.ALIGNMENT in reader.fields:
        writer.data_alignment = int(reader.fields[Keys.General.ALIGNMENT].contents())
    name = reader.fields.get(Keys.General.NAME)
    writer.add_name(f"{name.contents() if name else real.stem} (random-weight twin)")
    writer.add_description(f"Random-weight twin of {real.name}: its header and tensor table, "
                           f"values drawn per row with the real rows' mean and spread, seed "
                           f"{seed}. Made by harness.")
    writer.add_string("harness.version", __version__)
    writer.add_uint32("harness.twin_version", TWIN_VERSION)
    writer.add_uint64("harness.seed", seed)
    writer.add_string("harness.twin_of", real.name)
    return writer


def _twin_chunks(t, rng: np.random.Generator, quantize: Quantizer, factor: float):
    """The twin's bytes of one tensor, ROWS_PER_CHUNK rows at a time."""
    kind = t.tensor_type
    n_cols = int(t.shape[0])  # GGUF lists the row length first
    data = t.data.reshape(-1, t.data.shape[-1])  # rows of values, or of a row's bytes
    for start in range(0, data.shape[0], ROWS_PER_CHUNK):
        real_rows = _as_f32(data[start:start + ROWS_PER_CHUNK], kind).reshape(-1, n_cols)
        values = twin_values(real_rows, rng)
        yield _encode(values * np.float32(factor) if factor != 1.0 else values, kind, quantize)


def twin_values(real_rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Random values shaped like real_rows: in every block of BLOCK weights, normal numbers
    scaled so that the block's largest magnitude is the real block's (ggml converts each
    block's F16 scale through a 256 KiB table, so the spread of the scales sets how much of
    the table a product touches: docs/twins.md); vectors and rows that are not whole blocks
    get the real row's mean and spread instead (norm weights stay near their stored level)."""
    n_rows, n_cols = real_rows.shape
    if n_rows == 1 or n_cols % BLOCK:
        mean = real_rows.mean(axis=1, keepdims=True, dtype=np.float64)
        std = real_rows.std(axis=1, keepdims=True, dtype=np.float64)
        z = rng.standard_normal(real_rows.shape, dtype=np.float32)
        return (z * std + mean).astype(np.float32)
    real_blocks = real_rows.reshape(n_rows, -1, BLOCK)
    z = rng.standard_normal(real_blocks.shape, dtype=np.float32)
    peak = np.abs(z).max(axis=2, keepdims=True)
    return (z / peak * np.abs(real_blocks).max(axis=2, keepdims=True)).reshape(n_rows, n_cols)


def _as_f32(rows: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    if kind in DIRECT:
        return rows.astype(np.float32)
    if kind == GGMLQuantizationType.BF16:
        return (rows.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return dequantize(rows, kind)


def _encode(rows: np.ndarray, kind: GGMLQuantizationType, quantize: Quantizer) -> bytes:
    if kind in DIRECT:
        return rows.astype(DIRECT[kind]).tobytes()
    return quantize(kind, rows)


def twin_mismatch(real: Path, twin: Path) -> str | None:
    """The first way the twin's tensor table differs from the real file's (count, name,
    shape, type, bytes, offset from the data start, alignment), or None when it matches."""
    a, b = open_gguf(real), open_gguf(twin)
    if len(a.tensors) != len(b.tensors):
        return f"{len(b.tensors)} tensors, the real file has {len(a.tensors)}"
    if a.alignment != b.alignment:
        return f"alignment {b.alignment}, the real file's is {a.alignment}"
    start_a, start_b = a.data_offset, b.data_offset
    for index, (x, y) in enumerate(zip(a.tensors, b.tensors, strict=True)):
        for what, mine, theirs in (
                ("name", y.name, x.name), ("shape", list(y.shape), list(x.shape)),
                ("type", y.tensor_type.name, x.tensor_type.name),
                ("bytes", int(y.n_bytes), int(x.n_bytes)),
                ("offset", int(y.data_offset) - start_b, int(x.data_offset) - start_a)):
            if mine != theirs:
                return f"tensor {index} ({x.name}): {what} {mine}, the real file's is {theirs}"
    return None


def built_mismatch(real: Path, built: Path) -> str | None:
    """The first way a spec-built file's tensors differ from the real file's (names, then
    each tensor's shape and type; the order and offsets may differ), or None."""
    a = {t.name: t for t in tensor_table(real)}
    b = {t.name: t for t in tensor_table(built)}
    if missing := sorted(a.keys() - b.keys()) or sorted(b.keys() - a.keys()):
        where = "lacks" if missing[0] in a else "adds"
        return f"the built file {where} tensor {missing[0]}"
    for name, x in a.items():
        for what, mine, theirs in (("shape", list(b[name].shape), list(x.shape)),
                                   ("type", b[name].type_name, x.type_name)):
            if mine != theirs:
                return f"tensor {name}: {what} {mine}, the real file's is {theirs}"
    return None
