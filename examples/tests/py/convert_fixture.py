"""Fixtures and checks for tests/convert.rs, without torch.

usage:
  convert_fixture.py pt FILE R N_EMBD N_FF   write a predictor state dict the way torch.save lays
                                             it out (fc2.weight first, f16; fc1.weight f32 stored
                                             transposed, i.e. non-contiguous) and print its values
                                             as JSON {name: [row-major values]}
  convert_fixture.py read FILE               read a GGUF / PowerInfer file with the PyPI gguf
                                             package's GGUFReader and print JSON: magic, tensors
                                             (name, shape, type, raw bytes as hex)

The .pt writer reuses the stub torch modules of crates/powerinfer-predictor/tests/py/pt_tool.py.
"""

import collections
import io
import json
import os
import pickle
import sys
import zipfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "crates", "powerinfer-predictor", "tests", "py"))


def write_pt(path, r, n_embd, n_ff):
    from pt_tool import Storage, Tensor, stub_torch

    torch, utils = stub_torch()
    storages = []

    def storage(arr, cls):
        s = Storage(str(len(storages)), getattr(torch, cls), arr)
        storages.append(s)
        return s

    # fc1 (torch shape [r, n_embd]) stored as the transpose of an [n_embd, r] buffer.
    base = (np.arange(n_embd * r, dtype=np.float32) % 97 - 48.0) / 7.0
    fc1 = Tensor(storage(base, "FloatStorage"), 0, (r, n_embd), (1, r), utils)
    fc1_vals = base.reshape(n_embd, r).T
    half = ((np.arange(n_ff * r + 3) % 89 - 44.0) / 9.0).astype(np.float16)
    fc2 = Tensor(storage(half, "HalfStorage"), 3, (n_ff, r), (r, 1), utils)
    fc2_vals = half[3:].reshape(n_ff, r)
    sd = collections.OrderedDict([("fc2.weight", fc2), ("fc1.weight", fc1)])
    sd._metadata = collections.OrderedDict([("", {"version": 1})])

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, Storage):
                return ("storage", obj.cls, obj.key, "cpu", obj.array.size)
            return None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(sd)
    stem = "archive"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{stem}/data.pkl", buf.getvalue())
        zf.writestr(f"{stem}/byteorder", "little")
        for s in storages:
            zf.writestr(f"{stem}/data/{s.key}", s.array.tobytes())
        zf.writestr(f"{stem}/version", "3\n")
    return {
        "fc2.weight": [float(v) for v in fc2_vals.reshape(-1)],
        "fc1.weight": [float(v) for v in fc1_vals.reshape(-1)],
    }


def read_gguf(path):
    from gguf import GGUFReader

    with open(path, "rb") as f:
        data = f.read()
    magic = data[:4].decode("ascii")
    if magic == "PWRI":
        # GGUFReader accepts only the GGUF magic; PowerInfer's own gguf-py reads PWRI files the
        # same way, so check everything after the magic.
        path = path + ".as-gguf"
        with open(path, "wb") as f:
            f.write(b"GGUF" + data[4:])
    r = GGUFReader(path)
    tensors = []
    for t in r.tensors:
        tensors.append(
            {
                "name": t.name,
                "shape": [int(d) for d in t.shape],
                "type": int(t.tensor_type),
                "hex": np.asarray(t.data).tobytes().hex(),
            }
        )
    keys = [k for k in r.fields.keys() if not k.startswith("GGUF.")]
    return {"magic": magic, "keys": keys, "tensors": tensors}


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "pt":
        path, r, n_embd, n_ff = sys.argv[2], *map(int, sys.argv[3:6])
        print(json.dumps(write_pt(path, r, n_embd, n_ff)))
    else:
        print(json.dumps(read_gguf(sys.argv[2])))
