"""PyTorch .pt files without torch (stub modules), for the conformance test of src/pt.rs.

usage:
  pt_tool.py read FILE           print the tensor or state dict in FILE as JSON
  pt_tool.py write FILE          write a fixture the way torch.save lays it out and print the
                                 JSON of what it holds

Reading follows torch.load: the pickle in <prefix>/data.pkl, persistent ids
('storage', torch.<Type>Storage, key, location, numel) loaded from <prefix>/data/<key>, tensors
rebuilt by torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...). Writing uses
the same constructs through stub `torch` / `torch._utils` modules placed in sys.modules.
"""

import collections
import io
import json
import pickle
import sys
import types
import zipfile

import numpy as np

DTYPES = {
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "DoubleStorage": np.float64,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


def as_json(t):
    return {"shape": list(t.shape), "dtype": str(t.dtype), "values": [float(v) for v in t.reshape(-1)]}


def read(path):
    zf = zipfile.ZipFile(path)
    pkl = [n for n in zf.namelist() if n.endswith("/data.pkl")][0]
    prefix = pkl[: -len("data.pkl")]

    def rebuild(storage, offset, size, stride, *rest):
        item = storage.itemsize
        return np.lib.stride_tricks.as_strided(
            storage[offset:], shape=tuple(size), strides=tuple(s * item for s in stride)
        ).copy()

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if module == "torch._utils" and name == "_rebuild_tensor_v2":
                return rebuild
            if module == "torch" and name in DTYPES:
                return DTYPES[name]
            if module == "collections" and name == "OrderedDict":
                return collections.OrderedDict
            raise pickle.UnpicklingError(f"unexpected global {module}.{name}")

        def persistent_load(self, pid):
            tag, dtype, key, _location, numel = pid
            assert tag == "storage"
            data = zf.read(f"{prefix}data/{key}")
            return np.frombuffer(data, dtype=dtype)[:numel]

    obj = Unpickler(io.BytesIO(zf.read(pkl))).load()
    if isinstance(obj, dict):
        return {"dict": [[k, as_json(v)] for k, v in obj.items()]}
    return {"tensor": as_json(obj)}


def stub_torch():
    torch = types.ModuleType("torch")
    utils = types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*args):
        raise RuntimeError("stub")

    _rebuild_tensor_v2.__module__ = "torch._utils"
    _rebuild_tensor_v2.__qualname__ = "_rebuild_tensor_v2"
    utils._rebuild_tensor_v2 = _rebuild_tensor_v2
    torch._utils = utils
    for name in DTYPES:
        cls = type(name, (), {"__module__": "torch"})
        setattr(torch, name, cls)
    sys.modules["torch"] = torch
    sys.modules["torch._utils"] = utils
    return torch, utils


class Storage:
    def __init__(self, key, cls, array):
        self.key, self.cls, self.array = key, cls, array


class Tensor:
    def __init__(self, storage, offset, size, stride, utils):
        self.args = (storage, offset, tuple(size), tuple(stride), False, collections.OrderedDict())
        self.utils = utils

    def __reduce_ex__(self, proto):
        return (self.utils._rebuild_tensor_v2, self.args)


def write(path):
    torch, utils = stub_torch()
    storages = []

    def storage(arr, cls):
        s = Storage(str(len(storages)), getattr(torch, cls), arr)
        storages.append(s)
        return s

    # A state dict with an f32 matrix viewed transposed (non-contiguous), an f16 vector and an
    # int64 count vector, plus the `_metadata` attribute torch puts on state dicts.
    base = np.arange(6, dtype=np.float32) * 0.5 - 1.0
    fc1 = Tensor(storage(base, "FloatStorage"), 0, (2, 3), (1, 2), utils)
    half = np.array([0.25, -2.0, 65504.0], dtype=np.float16)
    h = Tensor(storage(half, "HalfStorage"), 1, (2,), (1,), utils)
    counts = np.array([3, 0, 7, 1 << 40], dtype=np.int64)
    c = Tensor(storage(counts, "LongStorage"), 0, (4,), (1,), utils)
    sd = collections.OrderedDict([("fc1.weight", fc1), ("fc2.weight", h), ("counts", c)])
    sd._metadata = collections.OrderedDict([("", {"version": 1})])

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, Storage):
                return ("storage", obj.cls, obj.key, "cpu", obj.array.size)
            return None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(sd)
    stem = path.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{stem}/data.pkl", buf.getvalue())
        zf.writestr(f"{stem}/byteorder", "little")
        for s in storages:
            zf.writestr(f"{stem}/data/{s.key}", s.array.tobytes())
        zf.writestr(f"{stem}/version", "3\n")
        zf.writestr(f"{stem}/.data/serialization_id", "1234567890")
    expect = collections.OrderedDict(
        [
            ("fc1.weight", base.reshape(3, 2).T.copy()),
            ("fc2.weight", half[1:3]),
            ("counts", counts),
        ]
    )
    return {"dict": [[k, as_json(v)] for k, v in expect.items()]}


if __name__ == "__main__":
    mode, path = sys.argv[1:3]
    print(json.dumps(read(path) if mode == "read" else write(path)))
