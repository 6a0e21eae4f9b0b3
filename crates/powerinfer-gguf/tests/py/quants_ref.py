"""Reference side of tests/quants_conformance.rs: runs the PyPI `gguf` package's codecs.

Usage: quants_ref.py MANIFEST

Each line of MANIFEST is `KIND TYPE INPUT OUTPUT_PREFIX`, TYPE a ggml type name (Q4_0, BF16, ...):
- KIND `quant`: INPUT holds little-endian f32 values. Writes OUTPUT_PREFIX.q, the bytes of
  gguf.quants.quantize(values, TYPE), and OUTPUT_PREFIX.dq, gguf.quants.dequantize of those bytes
  as little-endian f32.
- KIND `dequant`: INPUT holds raw TYPE blocks. Writes OUTPUT_PREFIX.dq as above.
"""

import sys
import warnings

import numpy as np
from gguf import GGMLQuantizationType, quants


def main() -> None:
    # The test feeds overflowing and NaN blocks on purpose; numpy's warnings are noise here.
    warnings.simplefilter("ignore")
    np.seterr(all="ignore")
    with open(sys.argv[1], encoding="utf-8") as manifest:
        for line in manifest:
            kind, name, inp, out = line.split()
            qtype = GGMLQuantizationType[name]
            if kind == "quant":
                values = np.fromfile(inp, dtype="<f4")
                data = np.ascontiguousarray(quants.quantize(values, qtype)).view(np.uint8)
                data.tofile(out + ".q")
            elif kind == "dequant":
                data = np.fromfile(inp, dtype=np.uint8)
            else:
                raise ValueError(f"unknown kind {kind!r}")
            np.asarray(quants.dequantize(data, qtype), dtype="<f4").tofile(out + ".dq")


if __name__ == "__main__":
    main()
