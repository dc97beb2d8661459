"""Read a GGUF file's metadata and tensor table (for user-supplied .gguf models)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from gguf import GGUFReader, Keys

from ..core.costs import TensorEntry
from ..core.dtypes import DTYPES, DType
from ..core.errors import HarnessError
from ..core.specs import ARCHS, ModelSpec


def open_gguf(path: Path) -> GGUFReader:
    """A GGUF file's reader, or one clear error naming the file."""
    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError) as exc:
        raise HarnessError(f"cannot read the GGUF file ({exc})", source=str(path),
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
    file_type = _field(open_gguf(path), "general.file_type")
    for dtype in DTYPES.values():
        if file_type is not None and int(dtype.file_type) == int(file_type):
            return dtype
    raise HarnessError(f"general.file_type {file_type} names no type the builder makes",
                       source=str(path), key="general.file_type",
                       fix="time it against its twin (random: twin); the builder makes "
                           + ", ".join(DTYPES))


def is_gguf(path: Path) -> bool:
    """Whether a file starts with GGUF's magic bytes (told apart from a config.json)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def spec_from_gguf(path: Path, name: str | None = None) -> ModelSpec:
    """The architecture a GGUF file holds, as a ModelSpec, from its header alone: shapes,
    experts, sliding window, soft-capping and Granite's scales (refusing unsupported ones)."""
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise HarnessError(f"GGUF architecture {arch!r} is not supported", source=str(path),
                           fix="supported: " + ", ".join(ARCHS))
    names = {t.name: t for t in reader.tensors}

    def key(k: str, default=None):
        return _field(reader, k.format(arch=arch), default)

    try:
        hidden = int(key(Keys.LLM.EMBEDDING_LENGTH))
        heads = int(key(Keys.Attention.HEAD_COUNT))
        fields = dict(
            name=name or path.stem, architecture=arch, hidden_size=hidden,
            num_hidden_layers=int(key(Keys.LLM.BLOCK_COUNT)), num_attention_heads=heads,
            num_key_value_heads=int(key(Keys.Attention.HEAD_COUNT_KV, heads)),
            intermediate_size=int(key(Keys.LLM.FEED_FORWARD_LENGTH)),
            vocab_size=int(names["token_embd.weight"].shape[-1]),
            tie_word_embeddings="output.weight" not in names,
            rope_theta=_f32(key(Keys.Rope.FREQ_BASE, 10000.0)),
            rms_norm_eps=_f32(key(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6)),
            max_position_embeddings=int(key(Keys.LLM.CONTEXT_LENGTH, 4096)),
            attention_bias="blk.0.attn_q.bias" in names,
            head_dim=int(key(Keys.Attention.KEY_LENGTH, hidden // heads)), source=str(path))
        fields |= _optional_hparams(key, ARCHS[arch], fields["intermediate_size"])
        return ModelSpec(**fields)
    except (TypeError, KeyError, ValueError) as exc:
        raise HarnessError(f"GGUF metadata incomplete ({exc})", source=str(path),
                           fix="pass a GGUF converted by llama.cpp") from None


def _f32(value) -> float:
    """A GGUF float32 as the decimal it was written from (0.22, not 0.2199999988)."""
    return float(str(np.float32(value)))


def _optional_hparams(key, arch, ffn: int) -> dict:
    """Experts (the expert width where the architecture has its own key), the window,
    soft-capping and Granite's four scales, as the builder writes them."""
    out: dict = {}
    for field, k, kind in (
            ("sliding_window", Keys.Attention.SLIDING_WINDOW, int),
            ("attn_logit_softcapping", Keys.LLM.ATTN_LOGIT_SOFTCAPPING, _f32),
            ("final_logit_softcapping", Keys.LLM.FINAL_LOGIT_SOFTCAPPING, _f32),
            ("num_experts", Keys.LLM.EXPERT_COUNT, int),
            ("num_experts_per_tok", Keys.LLM.EXPERT_USED_COUNT, int),
            ("shared_expert_intermediate_size", Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH,
             int)):
        if (value := key(k)) is not None:
            out[field] = kind(value)
    if out.get("num_experts") and arch.expert_ff_key:
        out["moe_intermediate_size"] = int(key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, ffn))
    if arch.multipliers:
        out |= {field: _f32(key(k, 1.0)) for field, k in (
            ("embedding_multiplier", Keys.LLM.EMBEDDING_SCALE),
            ("residual_multiplier", Keys.LLM.RESIDUAL_SCALE),
            ("attention_multiplier", Keys.Attention.SCALE),
            ("logits_scaling", Keys.LLM.LOGIT_SCALE))}
    return out


def tensor_table(path: Path) -> list[TensorEntry]:
    """Every tensor of a GGUF file: name, numpy shape, type and bytes."""
    reader = open_gguf(path)
    return [TensorEntry(t.name, tuple(int(x) for x in reversed(t.shape)), t.tensor_type.name,
                        int(t.n_bytes)) for t in reader.tensors]



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
    reader = open_gguf(path)
    start = min((int(t.data_offset) for t in reader.tensors), default=0)
    return start, path.stat().st_size - start
