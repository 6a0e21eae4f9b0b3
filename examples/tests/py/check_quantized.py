"""Checks a file written by `powerinfer quantize` with the PyPI gguf package.

usage: check_quantized.py ORIGINAL QUANTIZED MANIFEST

MANIFEST has one line per tensor of QUANTIZED as our reader sees it:
name<TAB>ggml type id<TAB>ne0,ne1,...<TAB>absolute data offset<TAB>byte count.
Checks that gguf.GGUFReader finds the same tensors (names, types, shapes, offsets, sizes),
that all metadata but general.file_type / general.quantization_version is unchanged, and that
every tensor converted from an F32 original equals gguf.quants.quantize of that original.
Prints a one-line summary; exits 1 on the first mismatch.
"""

import shutil
import sys
import tempfile

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q


def open_reader(path):
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PWRI":  # GGUFReader only knows the GGUF magic.
        tmp = tempfile.NamedTemporaryFile(suffix=".gguf", delete=False)
        tmp.close()
        shutil.copyfile(path, tmp.name)
        with open(tmp.name, "r+b") as f:
            f.write(b"GGUF")
        path = tmp.name
    return magic, gguf.GGUFReader(path)


def fail(msg):
    print("MISMATCH: " + msg)
    sys.exit(1)


def field_value(f):
    return [bytes(p).hex() for p in f.parts[3:]] if f.parts else None


def main():
    orig_path, out_path, manifest_path = sys.argv[1:4]
    magic_in, orig = open_reader(orig_path)
    magic_out, out = open_reader(out_path)
    if magic_in != magic_out:
        fail(f"magic {magic_in} became {magic_out}")
    ours = [line.rstrip("\n").split("\t") for line in open(manifest_path) if line.strip()]
    if len(ours) != len(out.tensors):
        fail(f"{len(ours)} tensors in our reader, {len(out.tensors)} in gguf")
    for (name, ty, shape, off, nbytes), t in zip(ours, out.tensors):
        got = (t.name, int(t.tensor_type), [int(d) for d in t.shape], int(t.data_offset), int(t.n_bytes))
        want = (name, int(ty), [int(d) for d in shape.split(",")], int(off), int(nbytes))
        if got != want:
            fail(f"tensor {name}: gguf sees {got}, we see {want}")
    skip = {"general.file_type", "general.quantization_version"}
    a = {k: field_value(f) for k, f in orig.fields.items() if not k.startswith("GGUF.") and k not in skip}
    b = {k: field_value(f) for k, f in out.fields.items() if not k.startswith("GGUF.") and k not in skip}
    if a != b:
        fail(f"metadata differs: {sorted(set(a) ^ set(b))} or values")
    by_name = {t.name: t for t in orig.tensors}
    checked = 0
    for t in out.tensors:
        src = by_name[t.name]
        if src.tensor_type != Q.F32 or t.tensor_type == Q.F32:
            continue
        data = np.asarray(src.data, dtype=np.float32).reshape(-1, int(src.shape[0]))
        expect = gguf.quants.quantize(data, t.tensor_type)
        if expect.tobytes() != np.asarray(t.data).tobytes():
            fail(f"{t.name}: our {t.tensor_type.name} bytes differ from gguf.quants.quantize")
        checked += 1
    print(f"ok: {len(out.tensors)} tensors, {checked} compared with gguf.quants.quantize")


main()
