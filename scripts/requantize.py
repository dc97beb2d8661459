"""Convert a GGUF file to another weight type with llama.cpp's quantizer, already quantized
files included (--allow-requantize): the F16 and Q8_0 files `harness twin` is checked on.

    python scripts/requantize.py gemma-3-270m-q4_k_m.gguf gemma-3-270m-f16.gguf f16
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness.core.dtypes import get_dtype
from harness.engine.llama import quantize


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        sys.exit("usage: python scripts/requantize.py IN.gguf OUT.gguf DTYPE")
    src, dst, dtype = Path(argv[0]), Path(argv[1]), get_dtype(argv[2], key="DTYPE")
    quantize(src, dst, int(dtype.file_type), allow_requantize=True)
    print(dst)


if __name__ == "__main__":
    main(sys.argv[1:])
