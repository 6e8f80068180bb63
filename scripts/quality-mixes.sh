#!/usr/bin/env bash
# Krafla's mixes against llama.cpp's K-quant mixes on one checkpoint (issue 16):
#   scripts/quality-mixes.sh CKPT_DIR CALIB.txt EVAL.txt [CALIB_CHUNKS] [EVAL_CHUNKS] [OUT_DIR]
# Environment:
#   LLAMA_BIN  folder with llama-quantize, llama-imatrix, llama-perplexity (required)
#   LLAMA_SRC  llama.cpp source tree, for convert_hf_to_gguf.py (required)
#   PYTHON     a python with llama.cpp's gguf requirements [default: python3]
#   PRESETS    Krafla presets to measure [default: "q4_k_m q6_k"]
#
# Krafla: a Q8_0 file as the reference (use BF16 once mlb-run runs it), an imatrix from
# CALIB.txt (mlb-run --imatrix), one file per preset with that imatrix, and a
# --target-bpw file at each llama.cpp file's own bits per weight; mean KL divergence
# from mlb-run --kl-divergence on EVAL.txt.
# llama.cpp: a BF16 GGUF as the reference, llama-imatrix on the same CALIB.txt,
# Q4_K_M and Q6_K with that imatrix, mean KLD from llama-perplexity --kl-divergence.
# Both tools see the same texts with --ctx 512 chunks. No speed figures (see bench.sh).
set -euo pipefail
ckpt=$1 calib=$2 evtext=$3 cc=${4:-24} ec=${5:-8}
: "${LLAMA_BIN:?set LLAMA_BIN to llama.cpp's bin folder}"
: "${LLAMA_SRC:?set LLAMA_SRC to llama.cpp's source tree}"
py=${PYTHON:-python3}
presets=${PRESETS:-"q4_k_m q6_k"}
root=$(cd "$(dirname "$0")/.." && pwd)
out=${6:-$root/target/quality-mixes/$(basename "$ckpt")}
mkdir -p "$out"
(cd "$root" && cargo build --release --bins --quiet)
bin=$root/target/release
n=$out/k

# Krafla
"$bin/mlb-convert" "$ckpt" -o "$n-ref.mlb" --wtype q8_0
"$bin/mlt-convert" "$ckpt/tokenizer.json" -o "$n-ref.mlt" -q
"$bin/mlb-run" "$n-ref.mlb" --file "$calib" --imatrix "$n.mli" --ctx 512 --chunks "$cc"
kld() { # MODEL.mlb -> mean KLD against the reference
    cp "$n-ref.mlt" "${1%.mlb}.mlt"
    "$bin/mlb-run" "$1" --file "$evtext" --kl-divergence "$n-ref.mlb" --ctx 512 \
        --chunks "$ec" --json
}
for p in $presets; do
    "$bin/mlb-convert" "$ckpt" -o "$n-$p.mlb" --preset "$p" --imatrix "$n.mli" \
        --mix-report "$n-$p.mix.json"
    echo "== krafla --preset $p: $("$bin/mlb-inspect" "$n-$p.mlb" --json |
        "$py" -c 'import json,sys; print(json.load(sys.stdin)["totals"]["bits_per_weight"])') bpw"
    kld "$n-$p.mlb"
done

# llama.cpp
g=$out/g
"$py" "$LLAMA_SRC/convert_hf_to_gguf.py" "$ckpt" --outtype bf16 --outfile "$g-bf16.gguf"
"$LLAMA_BIN/llama-imatrix" -m "$g-bf16.gguf" -f "$calib" -o "$g.imatrix" -c 512 \
    --chunks "$cc"
"$LLAMA_BIN/llama-perplexity" -m "$g-bf16.gguf" -f "$evtext" -c 512 --chunks "$ec" \
    --kl-divergence-base "$g.kldbase" > /dev/null
for q in Q4_K_M Q6_K; do
    "$LLAMA_BIN/llama-quantize" --imatrix "$g.imatrix" "$g-bf16.gguf" "$g-$q.gguf" "$q"
    echo "== llama.cpp $q: $(stat -c %s "$g-$q.gguf") bytes"
    "$LLAMA_BIN/llama-perplexity" -m "$g-$q.gguf" -f "$evtext" -c 512 --chunks "$ec" \
        --kl-divergence-base "$g.kldbase" --kl-divergence | grep -E "Mean +KLD"
    # Krafla at the same size: the GGUF's bytes over its weights (as mlb-inspect counts:
    # every matrix, scales included), minus nothing for norms (they are small).
    bpw=$("$py" - "$g-$q.gguf" <<'PY'
import sys, gguf
r = gguf.GGUFReader(sys.argv[1])
w = b = 0
for t in r.tensors:
    if len(t.shape) == 2:
        w += int(t.n_elements); b += int(t.n_bytes)
print(f"{8 * b / w:.3f}")
PY
)
    "$bin/mlb-convert" "$ckpt" -o "$n-at-$q.mlb" --target-bpw "$bpw" --imatrix "$n.mli"
    echo "== krafla --target-bpw $bpw (the size of llama.cpp's $q)"
    kld "$n-at-$q.mlb"
done
