"""Read a GGUF file's metadata and tensor table (for user-supplied .gguf models)."""

from __future__ import annotations

import functools
import hashlib
import struct
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, Keys

from ..core.costs import TensorEntry
from ..core.dtypes import DTYPES, DType
from ..core.errors import HarnessError
from ..core.specs import ARCHS, MULTIPLIERS, ModelSpec, spec_from_doc
from ..core.yamlio import Doc, safe_name


def open_gguf(path: Path) -> GGUFReader:
    """A GGUF file's reader, or one clear error naming the file."""
    if Path(path).exists() and not Path(path).is_file():  # a FIFO or a device would block
        raise HarnessError("not a regular file", source=str(path), fix="pass a .gguf file")
    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError, OverflowError, MemoryError,
            struct.error) as exc:  # gguf-py reads what the header says, however wrong
        raise HarnessError(f"cannot read the GGUF file ({str(exc)[:120]})", source=str(path),
                           fix="pass a complete GGUF file") from None


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


GGUF_MAGIC = b"GGUF"


def file_dtype(path: Path) -> DType:
    """The builder's dtype whose recipe a file's general.file_type names (the type a
    spec-built stand-in for it is made at)."""
    file_type = _scalar(_field(open_gguf(path), "general.file_type"))
    for dtype in DTYPES.values():
        if isinstance(file_type, int) and int(dtype.file_type) == file_type:
            return dtype
    raise HarnessError(f"general.file_type {file_type} names no type the builder makes",
                       source=str(path), key="general.file_type",
                       fix="time it against its twin (random: twin); the builder makes "
                           + ", ".join(DTYPES))


def is_gguf(path: Path) -> bool:
    """Whether a file starts with GGUF's magic bytes (told apart from a config.json)."""
    try:
        if not Path(path).is_file():  # a FIFO or a device would block
            return False
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _file_key(path: Path) -> tuple:
    """What identifies a file's contents for the caches below: path, inode, size, mtime."""
    try:
        info = Path(path).stat()
    except OSError:
        return (str(path), None)
    return (str(path), info.st_ino, info.st_size, info.st_mtime_ns)


def spec_from_gguf(path: Path, name: str | None = None) -> ModelSpec:
    """The architecture a GGUF file holds, as a ModelSpec, from its header alone: shapes,
    experts, sliding window, soft-capping and Granite's scales, each validated as a spec file's
    (a header can hold 0 heads or layers; nothing downstream may divide by them). Read once
    while the file is unchanged (a run asks for it dozens of times)."""
    return _spec_from_gguf(_file_key(path), name)


@functools.lru_cache(maxsize=64)
def _spec_from_gguf(file_key: tuple, name: str | None) -> ModelSpec:
    path = Path(file_key[0])
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str) or arch not in ARCHS:
        raise HarnessError(f"GGUF architecture {str(arch)[:40]!r} is not supported",
                           source=str(path), fix="supported: " + ", ".join(ARCHS))
    names = {t.name: t for t in reader.tensors}

    def key(k: str, default=None):
        return _field(reader, k.format(arch=arch), default)

    fields, keys = _header_fields(key, names, arch)
    fields |= {"name": name or safe_name(path.stem), "source": str(path)}
    try:
        return spec_from_doc(Doc(str(path), fields), safe_name(path.stem))
    except HarnessError as exc:  # name the header's key, not the spec's
        gguf_key = keys.get(exc.key or "", exc.key)
        raise HarnessError(f"{exc.message} (as {exc.key})" if gguf_key != exc.key
                           else exc.message, source=str(path), key=gguf_key,
                           fix="pass a GGUF converted by llama.cpp") from None


def _header_fields(key, names: dict, arch: str) -> tuple[dict, dict]:
    """The spec's fields from a header, as read (validated by spec_from_doc), and the GGUF key
    each came from."""
    hidden = key(Keys.LLM.EMBEDDING_LENGTH)
    keys = {"hidden_size": Keys.LLM.EMBEDDING_LENGTH,
            "num_hidden_layers": Keys.LLM.BLOCK_COUNT,
            "num_attention_heads": Keys.Attention.HEAD_COUNT,
            "num_key_value_heads": Keys.Attention.HEAD_COUNT_KV,
            "intermediate_size": Keys.LLM.FEED_FORWARD_LENGTH,
            "rope_theta": Keys.Rope.FREQ_BASE,
            "rms_norm_eps": Keys.Attention.LAYERNORM_RMS_EPS,
            "max_position_embeddings": Keys.LLM.CONTEXT_LENGTH,
            "head_dim": Keys.Attention.KEY_LENGTH}
    # read once each; a default stands in only where the header has no value
    fields = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096}
    fields |= {f: v for f, k in keys.items() if (v := _scalar(key(k))) is not None}
    for f in ("rope_theta", "rms_norm_eps"):
        if isinstance(fields[f], float):
            fields[f] = _f32(fields[f])
    embd = names.get("token_embd.weight")
    keys |= {"vocab_size": "token_embd.weight", "architecture": "general.architecture"}
    fields |= {"architecture": arch, "vocab_size": int(embd.shape[-1]) if embd else None,
               "tie_word_embeddings": "output.weight" not in names,
               "attention_bias": "blk.0.attn_q.bias" in names}
    optional, optional_keys = _optional_hparams(key, ARCHS[arch], hidden)
    return fields | optional, {k: v.format(arch=arch) for k, v in (keys | optional_keys).items()}


def _scalar(value):
    """A header value as the YAML loader would give it (numpy scalars to Python's)."""
    return value.item() if isinstance(value, np.generic) else value


def _f32(value) -> float:
    """A GGUF float32 as the decimal it was written from (0.22, not 0.2199999988)."""
    return float(str(np.float32(value)))


ZERO_IS_UNSET = ("sliding_window", "num_experts", "num_experts_per_tok")


def _optional_hparams(key, arch, ffn) -> tuple[dict, dict]:
    """Experts (the expert width where the architecture has its own key), the window,
    soft-capping and Granite's four scales, as the builder writes them, and their keys; a 0
    (some converters write expert_count 0 for a dense model) means the key is not set."""
    out: dict = {}
    keys: dict = {}
    table = [("sliding_window", Keys.Attention.SLIDING_WINDOW),
             ("attn_logit_softcapping", Keys.LLM.ATTN_LOGIT_SOFTCAPPING),
             ("final_logit_softcapping", Keys.LLM.FINAL_LOGIT_SOFTCAPPING),
             ("num_experts", Keys.LLM.EXPERT_COUNT),
             ("num_experts_per_tok", Keys.LLM.EXPERT_USED_COUNT),
             ("shared_expert_intermediate_size", Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)]
    if arch.multipliers:
        table += [("embedding_multiplier", Keys.LLM.EMBEDDING_SCALE),
                  ("residual_multiplier", Keys.LLM.RESIDUAL_SCALE),
                  ("attention_multiplier", Keys.Attention.SCALE),
                  ("logits_scaling", Keys.LLM.LOGIT_SCALE)]
    for field, k in table:
        value = _scalar(key(k))
        if value is not None and not (value == 0 and field in ZERO_IS_UNSET):
            out[field], keys[field] = (_f32(value) if isinstance(value, float) else value), k
    if arch.multipliers:
        out = {f: out.get(f, 1.0) for f in MULTIPLIERS} | out
    if out.get("num_experts") and arch.expert_ff_key:
        out["moe_intermediate_size"] = _scalar(key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, ffn))
        keys["moe_intermediate_size"] = Keys.LLM.EXPERT_FEED_FORWARD_LENGTH
    return out, keys


def tensor_table(path: Path) -> list[TensorEntry]:
    """Every tensor of a GGUF file: name, numpy shape, type and bytes (read once while the
    file is unchanged)."""
    return list(_tensor_table(_file_key(path)))


@functools.lru_cache(maxsize=64)
def _tensor_table(file_key: tuple) -> tuple[TensorEntry, ...]:
    return _tensor_header(file_key)[0]


# The sizes of GGUF's scalar value types (gguf-py's GGUFValueType): 8 is a string, 9 an array.
_SCALAR_N_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@functools.lru_cache(maxsize=64)
def _tensor_header(file_key: tuple) -> tuple[tuple[TensorEntry, ...], int]:
    """The tensor infos of a GGUF file and where its tensor data starts, read past the
    key-value pairs without decoding them (gguf-py decodes a 150k-token vocabulary into numpy
    views: 10-20 s a file); a header that ends early is refused as gguf-py's would be."""
    path = Path(file_key[0])
    if path.exists() and not path.is_file():  # a FIFO or a device would block
        raise HarnessError("not a regular file", source=str(path), fix="pass a .gguf file")
    try:
        return _read_tensor_header(path)
    except (ValueError, OSError, KeyError, OverflowError, MemoryError, struct.error) as exc:
        raise HarnessError(f"cannot read the GGUF file ({str(exc)[:120]})", source=str(path),
                           fix="pass a complete GGUF file") from None


def _read_tensor_header(path: Path) -> tuple[tuple[TensorEntry, ...], int]:
    with open(path, "rb") as f:
        head = _Cursor(f)
        if head.take(4) != GGUF_MAGIC:
            raise HarnessError("not a GGUF file", source=str(path), fix="pass a .gguf file")
        _, n_tensors, n_kv = head.unpack("<IQQ")
        alignment = 32  # GGUF's default (general.alignment overrides it)
        for _ in range(n_kv):
            key = head.string()
            kind = head.unpack("<I")[0]
            value = head.skip_value(kind)
            if key == "general.alignment" and isinstance(value, int):
                alignment = value
        tensors, offsets = [], []
        for _ in range(n_tensors):
            name = head.string()
            dims = head.unpack(f"<{head.unpack('<I')[0]}Q")
            ggml_type, offset = head.unpack("<IQ")
            block, type_n_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            n = int(np.prod(dims, dtype=np.int64)) if dims else 1
            tensors.append(TensorEntry(name, tuple(int(d) for d in reversed(dims)),
                                       GGMLQuantizationType(ggml_type).name,
                                       n // block * type_n_bytes))
            offsets.append(offset)
        data_start = -(-head.position // alignment) * alignment
    return tuple(tensors), data_start + min(offsets, default=0)


class _Cursor:
    """Sequential reads of a file's header, strings and arrays skipped by their lengths."""

    def __init__(self, f) -> None:
        self.f, self.position = f, 0

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise struct.error("the header ends early")
        self.position += n
        return data

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def string(self) -> str:
        return self.take(self.unpack("<Q")[0]).decode("utf-8", "replace")

    def skip_value(self, kind: int):
        """The value when a scalar or a string, else None (an array, skipped)."""
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<IQ")
            if item in _SCALAR_N_BYTES:
                self.f.seek(count * _SCALAR_N_BYTES[item], 1)
                self.position += count * _SCALAR_N_BYTES[item]
            else:
                for _ in range(count):
                    self.skip_value(item)
            return None
        data = self.take(_SCALAR_N_BYTES[kind])
        return int.from_bytes(data, "little") if kind in (0, 2, 4, 10) else None



def identical_weights(path: Path) -> list[tuple[str, str]]:
    """Pairs of weight matrices, or experts of one 3-D expert tensor, holding the same bytes
    (vectors such as norms are left out: unit norms are meant to be equal)."""
    seen: dict[bytes, str] = {}
    pairs = []
    for t in open_gguf(path).tensors:
        if len(t.shape) < 2:
            continue
        data = np.asarray(t.data)
        slices = ([(f"{t.name}[{i}]", data[i]) for i in range(data.shape[0])] if len(t.shape) == 3
                  else [(t.name, data)])
        for name, values in slices:
            digest = hashlib.sha256(np.ascontiguousarray(values).tobytes()).digest()
            if digest in seen:
                pairs.append((seen[digest], name))
            seen.setdefault(digest, name)
    return pairs


def tensor_data_span(path: Path) -> tuple[int, int]:
    """Where a GGUF file's tensor data starts, and its bytes to the end of the file."""
    start = _tensor_header(_file_key(path))[1]
    return start, path.stat().st_size - start
