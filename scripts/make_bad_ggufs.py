"""Write the GGUF files of tests/bad_inputs whose headers hold impossible values (a few KB each:
a header and a 265 x 4 token embedding, enough for the harness to read a spec from)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

OUT = Path(__file__).resolve().parent.parent / "tests" / "bad_inputs"
SANE = {"embedding_length": 64, "block_count": 2, "attention.head_count": 4,
        "attention.head_count_kv": 2, "feed_forward_length": 128, "context_length": 2048}
CASES = {  # file: the header values that differ from SANE
    "g_zero_heads.gguf": {"attention.head_count": 0},
    "g_zero_layers.gguf": {"block_count": 0},
    "g_heads_do_not_divide.gguf": {"attention.head_count": 5, "attention.head_count_kv": 5},
}


def write(path: Path, values: dict) -> None:
    w = GGUFWriter(str(path), "llama")
    w.add_name("bad")
    for key, value in (SANE | values).items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_tensor("token_embd.weight", np.zeros((265, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    for name, values in CASES.items():
        write(OUT / name, values)
        print(OUT / name, file=sys.stderr)
