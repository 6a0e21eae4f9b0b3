#!/usr/bin/env bash
# Writes reference.json: llama.cpp's perplexity of the dense twins of `powerinfer synth --shape tiny
# --seed 0` (F16, Q8_0, Q4_0) on text.txt with 256-token chunks, as llama.cpp's own tool prints it.
#
#   LLAMA_BIN=<llama.cpp build>/bin POWERINFER=<powerinfer binary> ./make_reference.sh
#
# Made with llama.cpp from the llama-cpp-python 0.3.36 source distribution on PyPI
# (vendor/llama.cpp, ggml 0.25.3), built with cmake -DGGML_NATIVE=ON -DLLAMA_CURL=OFF, target
# llama-perplexity, run with -c 256 -b 256 -t 2 on a 2-core AVX2 machine.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "{" > "$work/out.json"
first=1
for ty in f16 q8_0 q4_0; do
    "$POWERINFER" synth --shape tiny --type "$ty" --seed 0 --no-activation \
        --out "$work/tiny-$ty.powerinfer.gguf" --dense-out "$work/tiny-$ty.dense.gguf" >/dev/null 2>&1
    log=$(LD_LIBRARY_PATH="$LLAMA_BIN" "$LLAMA_BIN/llama-perplexity" -m "$work/tiny-$ty.dense.gguf" \
        -f "$here/text.txt" -c 256 -b 256 -t 2 2>&1)
    chunks=$(echo "$log" | grep -o '\[[0-9]*\][0-9.]*' | sed 's/\[[0-9]*\]//' | paste -sd, -)
    final=$(echo "$log" | sed -n 's/.*Final estimate: PPL = \([0-9.]*\) +\/- \([0-9.]*\).*/\1 \2/p')
    [ $first = 1 ] || echo "," >> "$work/out.json"
    first=0
    printf '"%s": {"chunks": [%s], "ppl": %s, "ppl_err": %s}' "$ty" "$chunks" ${final% *} ${final#* } >> "$work/out.json"
done
echo "}" >> "$work/out.json"
python3 -m json.tool "$work/out.json" > "$here/reference.json"
