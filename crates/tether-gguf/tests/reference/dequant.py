#!/usr/bin/env python3
"""Dequantize raw ggml blocks with the gguf Python package, as an independent reference.

Usage: dequant.py DIR NAME...

For each NAME (a ggml type name such as q4_k or iq4_xs) reads DIR/NAME.bin, the raw blocks
of that type, and writes DIR/NAME.f32, the values as little-endian f32, computed by
gguf.quants.dequantize. tests/python_reference.rs compares them with tether-gguf's output.
"""

import sys
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize


def main() -> None:
    out_dir = Path(sys.argv[1])
    for name in sys.argv[2:]:
        qtype = GGMLQuantizationType[name.upper()]
        _, type_size = GGML_QUANT_SIZES[qtype]
        raw = np.fromfile(out_dir / f"{name}.bin", dtype=np.uint8)
        assert raw.size % type_size == 0, f"{name}: {raw.size} bytes are not whole blocks"
        # One row of whole blocks; dequantize keeps the leading shape.
        values = dequantize(raw.reshape((1, -1)), qtype)
        values.astype("<f4").tofile(out_dir / f"{name}.f32")


if __name__ == "__main__":
    main()
