#!/usr/bin/env python3
"""Dump llama.cpp logits for a dense GGUF and a token list.

Output: n_tokens * n_vocab little-endian f32 (row-major, one row per position),
plus <out>.json with metadata.

Usage:
  LLAMA_CPP_LIB_PATH=/tmp/llama/build/bin PYTHONPATH=/tmp/llama/llama_cpp_python-0.3.36 \
    /tmp/llama/venv/bin/python /tmp/llama/golden.py MODEL.gguf OUT.logits.bin \
    --tokens "1 2 3 4 5 6 7 8" [--kv f32|f16|q8_0|q4_0] [--threads 2]

A quantized KV cache (q8_0, q4_0: K and V both) runs with flash attention on, which llama.cpp
needs to quantize V; f16 and f32 with it off.
"""
import argparse
import json
import sys

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--tokens", default="1 2 3 4 5 6 7 8")
    ap.add_argument("--kv", default="f16", choices=["f16", "f32", "q8_0", "q4_0"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=64)
    args = ap.parse_args()

    import llama_cpp
    from llama_cpp import Llama

    kv = {
        "f16": llama_cpp.GGML_TYPE_F16,
        "f32": llama_cpp.GGML_TYPE_F32,
        "q8_0": llama_cpp.GGML_TYPE_Q8_0,
        "q4_0": llama_cpp.GGML_TYPE_Q4_0,
    }[args.kv]
    flash_attn = args.kv in ("q8_0", "q4_0")
    tokens = [int(t) for t in args.tokens.split()]
    llm = Llama(
        model_path=args.model,
        n_ctx=args.n_ctx,
        n_batch=args.n_ctx,
        n_ubatch=args.n_ctx,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=True,
        type_k=kv,
        type_v=kv,
        flash_attn=flash_attn,
        verbose=False,
    )
    llm.eval(tokens)
    logits = np.ascontiguousarray(llm.scores[: len(tokens), :], dtype="<f4")
    finite = bool(np.isfinite(logits).all())
    logits.tofile(args.out)
    meta = {
        "model": args.model,
        "tokens": tokens,
        "n_vocab": int(logits.shape[1]),
        "n_tokens": len(tokens),
        "kv_type": args.kv,
        "threads": args.threads,
        "flash_attn": flash_attn,
        "layout": "row-major [n_tokens][n_vocab] little-endian f32",
        "all_finite": finite,
        "argmax_per_pos": [int(i) for i in logits.argmax(axis=1)],
        "first5_last_pos": [float(x) for x in logits[-1, :5]],
        "llama_cpp_python": "0.3.36 (vendor/llama.cpp, ggml 0.25.3 commit 0c1e570)",
    }
    with open(args.out + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps({k: meta[k] for k in ("model", "n_vocab", "n_tokens", "kv_type", "all_finite", "argmax_per_pos", "first5_last_pos")}))
    return 0 if finite else 2


if __name__ == "__main__":
    sys.exit(main())
