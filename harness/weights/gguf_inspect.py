"""Read a GGUF file's metadata and tensor table (for user-supplied .gguf models)."""

from __future__ import annotations

from pathlib import Path

from gguf import GGUFReader

from ..core.costs import TensorEntry
from ..core.errors import HarnessError
from ..core.specs import ARCHS, ModelSpec


def _reader(path: Path) -> GGUFReader:
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


def spec_from_gguf(path: Path) -> ModelSpec:
    """The architecture a GGUF file holds, as a ModelSpec (refusing unsupported ones)."""
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise HarnessError(f"GGUF architecture {arch!r} is not supported", source=str(path),
                           fix="supported: " + ", ".join(ARCHS))
    names = {t.name: t for t in reader.tensors}
    try:
        hidden = int(_field(reader, f"{arch}.embedding_length"))
        heads = int(_field(reader, f"{arch}.attention.head_count"))
        embd = names["token_embd.weight"]
        return ModelSpec(
            name=path.stem, architecture=arch, hidden_size=hidden,
            num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
            intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
            vocab_size=int(embd.shape[-1]),
            tie_word_embeddings="output.weight" not in names,
            rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
            attention_bias="blk.0.attn_q.bias" in names,
            head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
            source=str(path),
        )
    except (TypeError, KeyError, ValueError) as exc:
        raise HarnessError(f"GGUF metadata incomplete ({exc})", source=str(path),
                           fix="pass a GGUF converted by llama.cpp") from None


def tensor_table(path: Path) -> list[TensorEntry]:
    """Every tensor of a GGUF file: name, numpy shape, type and bytes."""
    reader = _reader(path)
    return [TensorEntry(t.name, tuple(int(x) for x in reversed(t.shape)), t.tensor_type.name,
                        int(t.n_bytes)) for t in reader.tensors]



def tensor_data_span(path: Path) -> tuple[int, int]:
    """Where a GGUF file's tensor data starts, and its bytes to the end of the file."""
    reader = _reader(path)
    start = min((int(t.data_offset) for t in reader.tensors), default=0)
    return start, path.stat().st_size - start
