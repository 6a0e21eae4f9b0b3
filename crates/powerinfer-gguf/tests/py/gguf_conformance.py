"""Conformance helper for crates/powerinfer-gguf/tests/python.rs, driving the PyPI `gguf` package.

  python gguf_conformance.py write OUT ALIGN   write a sample file with gguf.GGUFWriter (every
                                               value type, nested arrays, several tensor types)
                                               and print a JSON manifest of what was written
  python gguf_conformance.py write-split OUT  write OUT's parts NAME-0000i-of-00003.gguf with
                                               GGUFWriter's split_max_tensors=2
  python gguf_conformance.py write-gpuidx OUT write a GPU index as PowerInfer's exporter does
                                               (but with today's I32 id) and print its layers
  python gguf_conformance.py describe FILE     read FILE with gguf.GGUFReader and print a JSON
                                               description in the same format

Manifest format: {"alignment": N, "metadata": [[key, type, value], ...],
"tensors": [{"name", "type" (ggml id), "shape" (ne0 first), "abs_offset", "data" (hex)}]}.
A value is a JSON scalar, or for arrays {"elem": type, "values": [...]} (nested arrays nest
the same object). Types are named u8 i8 u16 i16 u32 i32 f32 bool string array u64 i64 f64.
"""
import json
import shutil
import sys
import tempfile

import numpy as np
import gguf
from gguf import GGUFValueType as T

NAMES = {T.UINT8: "u8", T.INT8: "i8", T.UINT16: "u16", T.INT16: "i16", T.UINT32: "u32",
         T.INT32: "i32", T.FLOAT32: "f32", T.BOOL: "bool", T.STRING: "string", T.ARRAY: "array",
         T.UINT64: "u64", T.INT64: "i64", T.FLOAT64: "f64"}


def write(out, align):
    w = gguf.GGUFWriter(out, "conformance")
    if align != 32:
        w.add_custom_alignment(align)
    meta = [["general.architecture", "string", "conformance"]]
    if align != 32:
        meta.append(["general.alignment", "u32", align])
    scalars = [
        ("t.u8", T.UINT8, 200), ("t.i8", T.INT8, -100), ("t.u16", T.UINT16, 60000),
        ("t.i16", T.INT16, -30000), ("t.u32", T.UINT32, 4000000000), ("t.i32", T.INT32, -2000000000),
        ("t.f32", T.FLOAT32, -1048576.5), ("t.bool", T.BOOL, True), ("t.bool_false", T.BOOL, False),
        ("t.string", T.STRING, "héllo wörld ✓"), ("t.empty_string", T.STRING, ""),
        ("t.u64", T.UINT64, 18000000000000000000), ("t.i64", T.INT64, -9000000000000000000),
        ("t.f64", T.FLOAT64, 0.1),
    ]
    for key, ty, val in scalars:
        w.add_key_value(key, val, ty)
        meta.append([key, NAMES[ty], val])
    arrays = [
        ("a.u8", T.UINT8, [0, 1, 255]), ("a.i8", T.INT8, [-128, 127]), ("a.u16", T.UINT16, [65535, 1]),
        ("a.i16", T.INT16, [-32768]), ("a.u32", T.UINT32, [1, 2, 3]), ("a.i32", T.INT32, [-1, 0, 1]),
        ("a.f32", T.FLOAT32, [0.5, -0.25, 1e-3]), ("a.bool", T.BOOL, [True, False, True]),
        ("a.string", T.STRING, ["a", "", "ü", "<0x0A>"]), ("a.u64", T.UINT64, [2**64 - 1]),
        ("a.i64", T.INT64, [-(2**63)]), ("a.f64", T.FLOAT64, [1.0, -2.5]),
    ]
    for key, ty, vals in arrays:
        w.add_key_value(key, vals, T.ARRAY, sub_type=ty)
        if ty == T.FLOAT32:
            vals = [float(np.float32(v)) for v in vals]
        meta.append([key, "array", {"elem": NAMES[ty], "values": vals}])
    w.add_array("a.nested", [[1, 2], [3], ["x", "y"]])
    meta.append(["a.nested", "array", {"elem": "array", "values": [
        {"elem": "i32", "values": [1, 2]}, {"elem": "i32", "values": [3]},
        {"elem": "string", "values": ["x", "y"]}]}])
    w.add_array("a.nested2", [[[1.5], [2.5, 3.5]]])
    meta.append(["a.nested2", "array", {"elem": "array", "values": [
        {"elem": "array", "values": [{"elem": "f32", "values": [1.5]},
                                     {"elem": "f32", "values": [2.5, 3.5]}]}]}])

    rng = np.random.default_rng(7)
    tensors = [
        ("f32", rng.standard_normal((3, 5)).astype(np.float32), None, None),
        ("f16", rng.standard_normal((2, 7)).astype(np.float16), None, None),
        ("f64", rng.standard_normal((4,)).astype(np.float64), None, None),
        ("i8", rng.integers(-128, 127, (9,), dtype=np.int8), None, None),
        ("i16", rng.integers(-3000, 3000, (2, 3), dtype=np.int16), None, None),
        ("i32", rng.integers(-10**9, 10**9, (5,), dtype=np.int32), None, None),
        ("i64", rng.integers(-10**18, 10**18, (1, 2, 3), dtype=np.int64), None, None),
        ("bf16", rng.integers(0, 255, (2, 16), dtype=np.uint8), None, gguf.GGMLQuantizationType.BF16),
        ("q8_0", rng.integers(0, 255, (2, 34 * 2), dtype=np.uint8), None, gguf.GGMLQuantizationType.Q8_0),
        ("q4_0", rng.integers(0, 255, (3, 18), dtype=np.uint8), None, gguf.GGMLQuantizationType.Q4_0),
        ("blk.0.q4_k", rng.integers(0, 255, (1, 144), dtype=np.uint8), None, gguf.GGMLQuantizationType.Q4_K),
        ("empty", np.zeros((0,), dtype=np.int32), None, None),
        ("scalar_like", np.array([42.0], dtype=np.float32), None, None),
    ]
    for name, arr, shape, raw in tensors:
        w.add_tensor(name, arr, raw_shape=shape, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    desc = describe(out)
    desc["metadata"] = meta
    return desc


def decode_array(parts, i):
    """Decodes an array value starting at parts[i] (its element type); returns (obj, next i)."""
    elem = T(int(parts[i][0]))
    count = int(parts[i + 1][0])
    i += 2
    values = []
    for _ in range(count):
        if elem == T.ARRAY:
            v, i = decode_array(parts, i)
        elif elem == T.STRING:
            v = bytes(parts[i + 1]).decode("utf-8")
            i += 2
        else:
            v = parts[i][0].item()
            i += 1
        values.append(v)
    return {"elem": NAMES[elem], "values": values}, i


def describe(path):
    src = path
    with open(path, "rb") as f:
        magic = f.read(4)
    tmp = None
    if magic == b"PWRI":  # GGUFReader only knows the GGUF magic.
        tmp = tempfile.NamedTemporaryFile(suffix=".gguf", delete=False)
        tmp.close()
        shutil.copyfile(path, tmp.name)
        with open(tmp.name, "r+b") as f:
            f.write(b"GGUF")
        src = tmp.name
    r = gguf.GGUFReader(src)
    meta = []
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        ty = T(f.types[0])
        if ty == T.ARRAY:
            value, _ = decode_array(f.parts, 3)
        elif ty == T.STRING:
            value = bytes(f.parts[-1]).decode("utf-8")
        else:
            value = f.parts[-1][0].item()
        meta.append([f.name, NAMES[ty], value])
    align = r.alignment
    tensors = [{"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in t.shape],
                "abs_offset": int(t.data_offset), "data": t.data.tobytes().hex()} for t in r.tensors]
    return {"magic": magic.decode(), "alignment": int(align), "metadata": meta, "tensors": tensors}


def write_split(out):
    """Five 3-element F32 tensors t0..t4 (filled with i) over three parts of OUT."""
    w = gguf.GGUFWriter(out, "llama", split_max_tensors=2)
    for i in range(5):
        w.add_tensor(f"t{i}", np.full((3,), i, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"tensors": 5}


def write_gpuidx(out):
    """A GPU index laid out as PowerInfer's powerinfer-py export_split writes it (tensors
    gpu_idx(i), gpu_bucket(i) added in that order, then the block count and VRAM capacity keys,
    magic and version patched afterwards), except that PyPI gguf numbers I32 as 26 where
    PowerInfer's bundled gguf-py used 18."""
    rng = np.random.default_rng(3)
    counts = [3, 0, 8, 5]
    w = gguf.GGUFWriter(out, "generic.gpu_index")
    layers = []
    for i, k in enumerate(counts):
        act = rng.permutation(8).astype(np.float32)
        indices = np.argsort(-act, kind="stable")[:k].astype(np.int32)
        gpu_idx = np.zeros(8, dtype=np.int32)
        gpu_idx[indices] = 1
        w.add_tensor(f"blk.{i}.gpu_idx", gpu_idx, raw_shape=gpu_idx.shape[::-1],
                     raw_dtype=gguf.GGMLQuantizationType.I32)
        bucket = np.sort(indices)
        w.add_tensor(f"blk.{i}.gpu_bucket", bucket, raw_shape=bucket.shape[::-1],
                     raw_dtype=gguf.GGMLQuantizationType.I32)
        layers.append({"n_ff": 8, "bucket": bucket.tolist()})
    w.add_block_count(len(counts))
    w.add_uint64("split.vram_capacity", 123456789)  # PowerInfer's gguf.Keys.Split.VRAM_CAPACITY
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(out, "r+b") as f:
        f.write(b"PWRI")
        f.write((3).to_bytes(4, "little"))
    return {"layers": layers, "vram_capacity": 123456789}


if __name__ == "__main__":
    if sys.argv[1] == "write":
        print(json.dumps(write(sys.argv[2], int(sys.argv[3]))))
    elif sys.argv[1] == "write-split":
        print(json.dumps(write_split(sys.argv[2])))
    elif sys.argv[1] == "write-gpuidx":
        print(json.dumps(write_gpuidx(sys.argv[2])))
    elif sys.argv[1] == "describe":
        print(json.dumps(describe(sys.argv[2])))
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
