"""Writes a random Hugging Face LLaMA/Bamboo checkpoint plus a PowerInfer predictor folder,
without torch, safetensors or sentencepiece (numpy only). Used by hand to check `powerinfer
convert` byte for byte against PowerInfer's own convert.py / convert-dense.py (which need
sentencepiece and numpy<2, not available to the tests); not run by the test suite.

usage: make_hf_checkpoint.py OUT_DIR [small|medium]
  small:  bamboo, 3 layers, n_embd 256, GQA 8/2 heads, linear rope scaling, n_ctx 4096,
          2 safetensors shards mixing F32/F16/BF16, vocab 512
  medium: llama, 8 layers, n_embd 1024, n_ff 2816, 16 heads, vocab 32000, one F16 file (~330 MB)
writes OUT_DIR/model (config.json, model*.safetensors, tokenizer.model) and OUT_DIR/pred
(model_N.pt with contiguous fc1.weight f32 [r, n_embd] and fc2.weight f16 [n_ff, r],
config.json with sparse_threshold).
"""

import collections
import io
import json
import os
import pickle
import struct
import sys
import zipfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "crates", "powerinfer-predictor", "tests", "py"))
from pt_tool import Storage, Tensor, stub_torch  # noqa: E402

out, size = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "small")
if size == "small":
    E, FF, L, V, H, KV, R, arch, ctx, shards, mixed = 256, 768, 3, 512, 8, 2, 64, "bamboo", 4096, 2, True
else:
    E, FF, L, V, H, KV, R, arch, ctx, shards, mixed = 1024, 2816, 8, 32000, 16, 16, 128, "llama", 2048, 1, False
os.makedirs(out + "/model", exist_ok=True)
os.makedirs(out + "/pred", exist_ok=True)
rng = np.random.default_rng(0)
DT = {np.float16: "F16", np.float32: "F32", np.uint16: "BF16"}


def write_safetensors(path, tensors):
    hdr, off, blobs = {}, 0, []
    for n, a in tensors:
        b = a.tobytes()
        hdr[n] = {"dtype": DT[a.dtype.type], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


count = [0]


def mat(*s):
    count[0] += 1
    a = rng.standard_normal(s, dtype=np.float32) * 0.02
    k = count[0] % 3 if mixed else 0
    if k == 0:
        return a.astype(np.float16)
    if k == 1:
        return a
    return (a.view(np.uint32) >> 16).astype(np.uint16)  # BF16 by truncation


kv = E // H * KV
ts = [("model.embed_tokens.weight", mat(V, E)), ("model.norm.weight", np.ones(E, np.float16)), ("lm_head.weight", mat(V, E))]
for l in range(L):
    p = f"model.layers.{l}."
    ts += [
        (p + "input_layernorm.weight", np.ones(E, np.float16)),
        (p + "self_attn.q_proj.weight", mat(E, E)),
        (p + "self_attn.k_proj.weight", mat(kv, E)),
        (p + "self_attn.v_proj.weight", mat(kv, E)),
        (p + "self_attn.o_proj.weight", mat(E, E)),
        (p + "post_attention_layernorm.weight", np.ones(E, np.float16)),
        (p + "mlp.gate_proj.weight", mat(FF, E)),
        (p + "mlp.up_proj.weight", mat(FF, E)),
        (p + "mlp.down_proj.weight", mat(E, FF)),
    ]
if shards == 1:
    write_safetensors(out + "/model/model.safetensors", ts)
else:
    k = len(ts) // 2
    write_safetensors(out + "/model/model-00001-of-00002.safetensors", ts[:k])
    write_safetensors(out + "/model/model-00002-of-00002.safetensors", ts[k:])
config = {"model_type": arch, "vocab_size": V, "hidden_size": E, "intermediate_size": FF, "num_hidden_layers": L,
          "num_attention_heads": H, "num_key_value_heads": KV, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "max_position_embeddings": ctx, "bos_token_id": 1, "eos_token_id": 2}
if mixed:
    config["rope_scaling"] = {"type": "linear", "factor": 4.0}
json.dump(config, open(out + "/model/config.json", "w"))


def varint(v):
    b = bytearray()
    while True:
        x = v & 0x7F
        v >>= 7
        if v:
            b.append(x | 0x80)
        else:
            b.append(x)
            return bytes(b)


def field(n, b):
    return varint(n << 3 | 2) + varint(len(b)) + b


pieces = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)] + [(f"<0x{i:02X}>", 0.0, 6) for i in range(256)]
pieces += [(f"\u2581t{i}", -float(i), 1) for i in range(V - len(pieces))]
sp = b"".join(
    field(1, field(1, p.encode()) + bytes([0x15]) + struct.pack("<f", s) + (bytes([0x18, t]) if t != 1 else b""))
    for p, s, t in pieces
)
# trainer_spec: model_type BPE, byte_fallback, unk 0, bos 1, eos 2
trainer = b"".join(varint(f << 3) + varint(v) for f, v in [(3, 2), (35, 1), (40, 0), (41, 1), (42, 2)])
open(out + "/model/tokenizer.model", "wb").write(sp + field(2, trainer))

torch, utils = stub_torch()


class Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return ("storage", obj.cls, obj.key, "cpu", obj.array.size) if isinstance(obj, Storage) else None


for l in range(L):
    a1 = rng.standard_normal((R, E), dtype=np.float32)
    a2 = rng.standard_normal((FF, R), dtype=np.float32).astype(np.float16)
    s1, s2 = Storage("0", torch.FloatStorage, a1), Storage("1", torch.HalfStorage, a2)
    sd = collections.OrderedDict([
        ("fc1.weight", Tensor(s1, 0, (R, E), (E, 1), utils)),
        ("fc2.weight", Tensor(s2, 0, (FF, R), (R, 1), utils)),
    ])
    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(sd)
    with zipfile.ZipFile(out + f"/pred/model_{l}.pt", "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", buf.getvalue())
        zf.writestr("archive/byteorder", "little")
        for s in (s1, s2):
            zf.writestr(f"archive/data/{s.key}", s.array.tobytes())
        zf.writestr("archive/version", "3\n")
json.dump({"sparse_threshold": 0.0}, open(out + "/pred/config.json", "w"))
