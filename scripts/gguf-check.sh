#!/usr/bin/env bash
# mlb-export's GGUF files checked by llama.cpp itself, on the real models (SmolLM2-135M,
# Gemma 3 270M): Krafla converts each checkpoint (Q8_0, and Q4_0 with llama.cpp's round
# rule, f16 scales, every matrix Q4_0), exports it with its tokenizer, and llama.cpp
#   - loads and runs it (llama-completion, greedy),
#   - tokenizes a corpus to the ids Krafla's .mlt gives (llama-tokenize vs mlb-inspect --encode),
#   - measures its perplexity beside llama.cpp's own GGUF of the same type,
# and the GGUF's tensors are compared with llama-quantize --pure's from the bf16 GGUF
# (Q4_0 round rule: the same bits; Q8_0: llama.cpp rounds differently). The GGUF is read
# back by mlb-convert and must give the same .mlb bytes.
# BF16 (--wtype bf16) and the real GGUFs of $REAL_DIR/gguf (llama.cpp's Q4_1, Q4_K_M:
# blocks copied by mlb-convert, then exported) must give the source's tensors back.
#
# KLD=1 adds issue 19's comparison (slow; needs an idle machine): Krafla's Q4_0 with the
# imatrix-weighted search against llama-quantize's Q4_0 with llama-imatrix's matrix, both
# from the same checkpoint and calibration text, KL divergence against the bf16 GGUF in
# llama-perplexity's own measurement, with the file sizes.
#
# Not part of `cargo test` or CI. llama.cpp comes from the llama-cpp-python sdist and is
# built by scripts/bench.sh's recipe (PREPARE_ONLY=1 LLAMA_ONLY=1 runs its download, build
# and GGUF steps), plus the targets this script needs. Idempotent: outputs that exist are
# kept; delete a file to redo its step.
# Environment (defaults in brackets):
#   KRAFLA_BENCH_DIR  work folder outside the repository [$BENCH_DIR, else /work/bench]
#   BENCH_VENV        Python venv with torch/transformers/gguf [$KRAFLA_BENCH_DIR/venv]
#   REAL_DIR          the HF checkpoints (smollm2-135m/, gemma3-270m/) [$KRAFLA_BENCH_DIR/real]
#   MODELS ["smollm2-135m gemma3-270m"]  THREADS [2]
#   EVAL_TXT, CALIB_TXT  text files [Python's reference-manual topics, two disjoint halves]
#   PPL_CTX [256] PPL_CHUNKS [16]  KLD_CTX [512] KLD_CHUNKS [32] CALIB_CHUNKS [64]
#   KLD=1              also run the KL-divergence comparison
#   KRAFLA_BIN         Krafla's binaries [built: target/release]
#   KRAFLA_IMATRIX_REF ["--wtype q8_0"]: mlb-convert options of the model mlb-run
#                      --imatrix runs on (bf16 once Krafla has it, to match llama-imatrix)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BENCH_DIR=${KRAFLA_BENCH_DIR:-${BENCH_DIR:-/work/bench}}
BENCH_VENV=${BENCH_VENV:-$BENCH_DIR/venv}
REAL_DIR=${REAL_DIR:-$BENCH_DIR/real}
MODELS=${MODELS:-smollm2-135m gemma3-270m}
THREADS=${THREADS:-2}
PPL_CTX=${PPL_CTX:-256}
PPL_CHUNKS=${PPL_CHUNKS:-16}
KLD=${KLD:-0}
KLD_CTX=${KLD_CTX:-512}
KLD_CHUNKS=${KLD_CHUNKS:-32}
CALIB_CHUNKS=${CALIB_CHUNKS:-64}
KRAFLA_IMATRIX_REF=${KRAFLA_IMATRIX_REF:---wtype q8_0}
case "$BENCH_DIR/" in "$repo"/*) echo "gguf-check.sh: KRAFLA_BENCH_DIR must be outside the repository" >&2; exit 2;; esac
out=$BENCH_DIR/gguf-check
mkdir -p "$out"
log() { printf '[gguf-check %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
py=$BENCH_VENV/bin/python

# 1. llama.cpp, the real checkpoints, llama.cpp's bf16/Q8_0/Q4_0 GGUFs (bench.sh's steps).
BENCH_DIR=$BENCH_DIR BENCH_VENV=$BENCH_VENV REAL_DIR=$REAL_DIR MODELS=$MODELS \
  QUANTS="q4_0 q8_0" THREADS=$THREADS PREPARE_ONLY=1 LLAMA_ONLY=1 "$repo/scripts/bench.sh"
build=$BENCH_DIR/build
lbin=$build/bin
need=(llama-completion llama-perplexity llama-tokenize llama-imatrix llama-quantize)
missing=()
for t in "${need[@]}"; do [ -x "$lbin/$t" ] || missing+=("$t"); done
if [ ${#missing[@]} -gt 0 ]; then
  cmake=$(command -v cmake || echo "$BENCH_VENV/bin/cmake")
  log "building ${missing[*]} (nice 19)"
  nice -n 19 "$cmake" --build "$build" --config Release -j "$(nproc)" --target "${missing[@]}" \
    >"$BENCH_DIR/logs/cmake-build-gguf-check.log" 2>&1
fi
src=$(ls -d "$BENCH_DIR"/llama_cpp_python-*/vendor/llama.cpp | sort -V | tail -1)
"$py" -c 'import gguf' 2>/dev/null || "$BENCH_VENV/bin/pip" install -q "$src/gguf-py"

# 2. Krafla.
if [ -n "${KRAFLA_BIN:-}" ]; then
  kbin=$KRAFLA_BIN
else
  (cd "$repo" && cargo build -q --release --bin mlb-convert --bin mlt-convert --bin mlb-export --bin mlb-run --bin mlb-inspect)
  kbin=$repo/target/release
fi

# 3. Texts.
if [ -z "${EVAL_TXT:-}" ] || [ -z "${CALIB_TXT:-}" ]; then
  "$py" - "$out" <<'PY'
import os, sys
from pydoc_data.topics import topics
text = "\n\n".join(topics[k] for k in sorted(topics))
half = len(text) // 2
open(os.path.join(sys.argv[1], "calib.txt"), "w").write(text[:half])
open(os.path.join(sys.argv[1], "eval.txt"), "w").write(text[half:])
PY
fi
EVAL_TXT=${EVAL_TXT:-$out/eval.txt}
CALIB_TXT=${CALIB_TXT:-$out/calib.txt}
head -c 20000 "$EVAL_TXT" >"$out/corpus.txt"

same_tensors() { # a.gguf b.gguf -> prints a verdict
  "$py" - "$1" "$2" <<'PY'
import sys, numpy as np, gguf
a, b = (gguf.GGUFReader(p) for p in sys.argv[1:3])
tb = {t.name: t for t in b.tensors}
same = diff = 0
for t in a.tensors:
    u = tb.get(t.name)
    if u is not None and t.tensor_type == u.tensor_type and np.array_equal(np.asarray(t.data), np.asarray(u.data)):
        same += 1
    else:
        diff += 1
print(f"{same} tensors identical, {diff} differ ({len(b.tensors)} in the export)")
PY
}

fail=0
for m in $MODELS; do
  for q in q8_0 q4_0; do
    base=$out/$m-$q
    if [ "$q" = q4_0 ]; then cflags=(--wtype q4_0 --q8 none --q4-rule round); else cflags=(--wtype q8_0); fi
    [ -f "$base.mlb" ] || "$kbin/mlb-convert" "$REAL_DIR/$m" "${cflags[@]}" --f16-scales --threads "$THREADS" -o "$base.mlb"
    [ -f "$base.mlt" ] || "$kbin/mlt-convert" "$REAL_DIR/$m/tokenizer.json" -o "$base.mlt" -q
    [ -f "$base.gguf" ] || "$kbin/mlb-export" "$base.mlb" -o "$base.gguf"
    log "$m $q: $(stat -c %s "$base.gguf") bytes"

    echo "== $m $q: tensors against llama-quantize --pure $q from bf16"
    same_tensors "$BENCH_DIR/gguf/$m-$q.gguf" "$base.gguf"

    echo "== $m $q: read back by mlb-convert"
    "$kbin/mlb-convert" "$base.gguf" -o "$base.back.mlb" >/dev/null
    if cmp -s "$base.mlb" "$base.back.mlb"; then echo "same .mlb bytes"; else echo "DIFFERENT .mlb bytes"; fail=1; fi

    echo "== $m $q: llama-completion (greedy)"
    "$lbin/llama-completion" -m "$base.gguf" -p "The capital of France is" -n 24 --temp 0 \
      -t "$THREADS" -no-cnv --no-warmup 2>"$base.completion.log" </dev/null || { echo "llama-completion FAILED (see $base.completion.log)"; fail=1; }
    echo

    echo "== $m $q: token ids, llama-tokenize vs mlb-inspect --encode"
    ids() { tr ',[]' '   ' | tr -s ' \n' ' ' | sed 's/^ //; s/ $//'; }
    "$lbin/llama-tokenize" -m "$base.gguf" -f "$out/corpus.txt" --ids --log-disable 2>/dev/null | ids >"$base.llama.ids"
    "$kbin/mlb-inspect" "$base.mlt" --encode <"$out/corpus.txt" | ids >"$base.krafla.ids"
    if cmp -s "$base.llama.ids" "$base.krafla.ids"; then
      echo "identical ($(wc -w <"$base.llama.ids") ids)"
    else
      echo "DIFFERENT: $(wc -w <"$base.llama.ids") vs $(wc -w <"$base.krafla.ids") ids (see $base.*.ids)"; fail=1
    fi

    echo "== $m $q: llama-perplexity (ctx $PPL_CTX, $PPL_CHUNKS chunks): Krafla's export, then llama.cpp's own"
    for g in "krafla:$base.gguf" "llama.cpp:$BENCH_DIR/gguf/$m-$q.gguf"; do
      "$lbin/llama-perplexity" -m "${g#*:}" -f "$EVAL_TXT" -c "$PPL_CTX" --chunks "$PPL_CHUNKS" -t "$THREADS" \
        2>&1 | grep -oE "Final estimate.*" | sed "s|^|${g%%:*}: |" || { echo "llama-perplexity FAILED on ${g#*:}"; fail=1; }
    done
  done
done

# BF16 and GGUF's block types: exported as the same GGUF types. The bf16 conversion
# against convert_hf_to_gguf.py's bf16 file; the real GGUFs in $REAL_DIR/gguf
# (llama.cpp's Q4_1, Q4_K_M, ...) converted with no flag (blocks copied) and exported
# again: the same tensors, the same perplexity.
ppl() { # label file
  "$lbin/llama-perplexity" -m "$2" -f "$EVAL_TXT" -c "$PPL_CTX" --chunks "$PPL_CHUNKS" -t "$THREADS" \
    2>&1 | grep -oE "Final estimate.*" | sed "s|^|$1: |" || { echo "llama-perplexity FAILED on $2"; fail=1; }
}
for m in $MODELS; do
  base=$out/$m-bf16
  [ -f "$base.mlb" ] || "$kbin/mlb-convert" "$REAL_DIR/$m" --wtype bf16 --threads "$THREADS" -o "$base.mlb"
  [ -f "$base.gguf" ] || "$kbin/mlb-export" "$base.mlb" --tokenizer "$out/$m-q8_0.mlt" -o "$base.gguf"
  echo "== $m bf16: tensors against convert_hf_to_gguf.py's bf16"
  same_tensors "$BENCH_DIR/gguf/$m-bf16.gguf" "$base.gguf"
  echo "== $m bf16: llama-perplexity (ctx $PPL_CTX, $PPL_CHUNKS chunks)"
  ppl krafla "$base.gguf"
  ppl llama.cpp "$BENCH_DIR/gguf/$m-bf16.gguf"
done
for src in "$REAL_DIR"/gguf/*.gguf; do
  [ -f "$src" ] || continue
  base=$out/$(basename "$src" .gguf)
  [ -f "$base.mlb" ] || "$kbin/mlb-convert" "$src" --threads "$THREADS" -o "$base.mlb" >/dev/null
  [ -f "$base.mlt" ] || "$kbin/mlt-convert" "$src" -o "$base.mlt" -q
  [ -f "$base.gguf" ] || "$kbin/mlb-export" "$base.mlb" -o "$base.gguf"
  echo "== $(basename "$src"): blocks copied, exported again: tensors against the source"
  same_tensors "$src" "$base.gguf"
  echo "== $(basename "$src"): llama-perplexity (ctx $PPL_CTX, $PPL_CHUNKS chunks)"
  ppl krafla "$base.gguf"
  ppl source "$src"
done

if [ "$KLD" = 1 ]; then
  for m in $MODELS; do
    k=$out/kld-$m
    bf16=$BENCH_DIR/gguf/$m-bf16.gguf
    [ -f "$k.base.kld" ] || "$lbin/llama-perplexity" -m "$bf16" -f "$EVAL_TXT" -c "$KLD_CTX" --chunks "$KLD_CHUNKS" \
      -t "$THREADS" --kl-divergence-base "$k.base.kld" >"$k.base.log" 2>&1
    # llama.cpp: llama-imatrix on bf16, llama-quantize --pure Q4_0 with it.
    [ -f "$k.imatrix.gguf" ] || "$lbin/llama-imatrix" -m "$bf16" -f "$CALIB_TXT" -c "$KLD_CTX" --chunks "$CALIB_CHUNKS" \
      -t "$THREADS" -o "$k.imatrix.gguf" >"$k.imatrix.log" 2>&1
    [ -f "$k.llama-q4_0.gguf" ] || "$lbin/llama-quantize" --pure --imatrix "$k.imatrix.gguf" "$bf16" "$k.llama-q4_0.gguf" Q4_0 "$THREADS" >"$k.quantize.log" 2>&1
    # Krafla: mlb-run --imatrix on the same text, the imatrix-weighted Q4_0 search.
    # shellcheck disable=SC2206
    ref=($KRAFLA_IMATRIX_REF)
    [ -f "$k.ref.mlb" ] || "$kbin/mlb-convert" "$REAL_DIR/$m" "${ref[@]}" -o "$k.ref.mlb"
    cp -n "$out/$m-q8_0.mlt" "$k.ref.mlt"
    [ -f "$k.mli" ] || "$kbin/mlb-run" "$k.ref.mlb" --file "$CALIB_TXT" --imatrix "$k.mli" --ctx "$KLD_CTX" --chunks "$CALIB_CHUNKS" --threads "$THREADS"
    [ -f "$k.krafla-q4_0.mlb" ] || "$kbin/mlb-convert" "$REAL_DIR/$m" --wtype q4_0 --q8 none --q4-rule search \
      --imatrix "$k.mli" --f16-scales -o "$k.krafla-q4_0.mlb"
    [ -f "$k.krafla-q4_0.gguf" ] || "$kbin/mlb-export" "$k.krafla-q4_0.mlb" --tokenizer "$out/$m-q8_0.mlt" -o "$k.krafla-q4_0.gguf"
    echo "== $m: KL divergence against bf16 (llama-perplexity, ctx $KLD_CTX, $KLD_CHUNKS chunks)"
    for g in "$k.llama-q4_0.gguf" "$k.krafla-q4_0.gguf"; do
      echo "$(basename "$g") ($(stat -c %s "$g") bytes):"
      "$lbin/llama-perplexity" -m "$g" -f "$EVAL_TXT" -c "$KLD_CTX" --chunks "$KLD_CHUNKS" -t "$THREADS" \
        --kl-divergence-base "$k.base.kld" --kl-divergence 2>&1 | grep -E "Mean +KLD|Same top|Mean PPL\(Q\)" || true
    done
  done
fi
exit $fail
