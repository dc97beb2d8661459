"""Table of the weight types the builder can write, driven by gguf's constants."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from .errors import HarnessError


@dataclass(frozen=True)
class DType:
    """One buildable weight type: how llama.cpp names it and how it is made."""

    name: str
    ggml_type: GGMLQuantizationType  # the type of 2-D weight tensors
    file_type: LlamaFileType  # general.file_type and the quantizer's ftype
    direct: bool  # written by the gguf package (True) or by llama.cpp's quantizer

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.ggml_type][0]

    @property
    def block_bytes(self) -> int:
        return GGML_QUANT_SIZES[self.ggml_type][1]

    @property
    def bits_per_weight(self) -> float:
        """Nominal bits per weight of the base type (recipes may mix in others)."""
        return 8.0 * self.block_bytes / self.block_size


_T, _F = GGMLQuantizationType, LlamaFileType
DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("f32", _T.F32, _F.ALL_F32, True),
        DType("f16", _T.F16, _F.MOSTLY_F16, True),
        DType("bf16", _T.BF16, _F.MOSTLY_BF16, True),
        DType("q8_0", _T.Q8_0, _F.MOSTLY_Q8_0, False),
        DType("q5_0", _T.Q5_0, _F.MOSTLY_Q5_0, False),
        DType("q5_1", _T.Q5_1, _F.MOSTLY_Q5_1, False),
        DType("q4_0", _T.Q4_0, _F.MOSTLY_Q4_0, False),
        DType("q4_1", _T.Q4_1, _F.MOSTLY_Q4_1, False),
        DType("q6_k", _T.Q6_K, _F.MOSTLY_Q6_K, False),
        DType("q5_k_m", _T.Q5_K, _F.MOSTLY_Q5_K_M, False),
        DType("q5_k_s", _T.Q5_K, _F.MOSTLY_Q5_K_S, False),
        DType("q4_k_m", _T.Q4_K, _F.MOSTLY_Q4_K_M, False),
        DType("q4_k_s", _T.Q4_K, _F.MOSTLY_Q4_K_S, False),
        DType("q3_k_m", _T.Q3_K, _F.MOSTLY_Q3_K_M, False),
        DType("q2_k", _T.Q2_K, _F.MOSTLY_Q2_K, False),
        DType("iq4_nl", _T.IQ4_NL, _F.MOSTLY_IQ4_NL, False),
        DType("iq4_xs", _T.IQ4_XS, _F.MOSTLY_IQ4_XS, False),
    )
}

# Quantized files are made from this build, as llama.cpp's own convert + quantize pipeline does.
QUANT_SOURCE = "f16"


def get_dtype(name: object, *, source: str | None = None, key: str | None = "dtype") -> DType:
    """Look up a dtype by name or raise a HarnessError listing the valid ones."""
    if isinstance(name, str) and name.lower() in DTYPES:
        return DTYPES[name.lower()]
    raise HarnessError(f"unknown dtype {name!r}", source=source, key=key,
                       fix="valid dtypes: " + ", ".join(DTYPES))

# Types llama.cpp's CPU backend can keep the KV cache in (llama-bench -ctk/-ctv); a quantized
# V cache needs flash attention, whose kernel dequantizes V on the fly.
KV_CACHE_TYPES = ("f32", "f16", "q8_0", "q4_0")
KV_NEEDS_FLASH_ATTN = ("q8_0", "q4_0")


def kv_block_size(name: str) -> int:
    """Elements per block of a KV cache type: a head's K and V rows must be a multiple."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]][0]


def kv_block_problem(kv_type: str, head_dim: int, model_name: str) -> str | None:
    """Why a cache of this type cannot hold this model's heads (its blocks must divide a head's
    K and V rows), or None."""
    block = kv_block_size(kv_type)
    if head_dim % block:
        return (f"a {kv_type} KV cache stores blocks of {block}, which do not divide "
                f"{model_name}'s head size {head_dim}")
    return None
