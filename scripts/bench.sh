#!/usr/bin/env bash
# Krafla's mlb-run against llama.cpp's llama-bench, side by side, on the same real models
# (SmolLM2-135M, Gemma 3 270M, and a 1B-class model with Llama 3.2 1B's shapes and random
# weights), the same quant types (Q4_0, Q8_0: the same bits on both sides; BF16: the
# checkpoint's own weights, Krafla's `--wtype bf16` against llama.cpp's bf16 GGUF), the
# same thread count: prompt processing of 512 tokens and generation of 128, tokens/s,
# ratio, peak RSS, and the memory-bandwidth bound of generation.
# See docs/benchmarks.md. Not part of `cargo test` or CI: it downloads and builds
# llama.cpp and takes tens of minutes on a fresh machine.
#
# Idempotent: every step whose output exists is skipped; delete a file to redo its step.
# Environment (defaults in brackets):
#   BENCH_DIR    work folder outside the repository: llama.cpp, GGUF/.mlb files, logs
#                [${XDG_CACHE_HOME:-$HOME/.cache}/krafla-bench]
#   BENCH_VENV   Python venv for convert_hf_to_gguf.py; created if absent [$BENCH_DIR/venv]
#   REAL_DIR     the HF checkpoints (smollm2-135m/, gemma3-270m/); made if absent [$BENCH_DIR/real]
#   REAL_CHECKPOINTS  the script that makes them [../shared/tools/real-checkpoints.sh beside the
#                repository, else ../../shared/tools/real-checkpoints.sh (a worktree's)]
#   SYNTH_CHECKPOINT  the script that makes llama1b/ (random weights, Llama 3.2 1B's shapes)
#                [synth-checkpoint.py beside REAL_CHECKPOINTS]
#   THREADS [2]  REPS: repetitions of each measurement, medians reported [5]
#   MODELS ["smollm2-135m gemma3-270m llama1b"]  QUANTS ["q4_0 q8_0 bf16 bf16a"]: also any
#                llama-quantize type (q4_k, q6_k, iq4_nl, ...), which Krafla reads from
#                llama.cpp's --pure GGUF (the same bits; rows must suit the type);
#                bf16a: the BF16 files, mlb-run with --bf16-activations (llama.cpp's arithmetic)
#   N_PROMPT [512]  N_GEN [128]
#   KRAFLA_Q4_RULE [round]: llama.cpp's Q4_0 rounding, so both files hold the same bits
#   KRAFLA_EXTRA ["--f16-scales"]: f16 block scales, as GGUF's Q4_0/Q8_0 blocks
#   LLAMA_DEPTH ["0,N_PROMPT"]: llama-bench's -d; "0" skips the runs after N_PROMPT tokens
#   LLAMA_ONLY=1 measure llama.cpp and bandwidth only (no Krafla build, no mlb-run)
#   FROM_GGUF=1  Krafla's file of every type is mlb-convert of llama.cpp's GGUF of that type
#                (the same bits by construction), and the bf16 GGUF is made only when a
#                quantized one is missing: for the MoE model (qwen3moe, whose bf16 GGUF is 11 GB)
#   PREPARE_ONLY=1 stop after the downloads, builds and GGUF files: measure later, on an idle machine
# On a 2-core machine shared with other work, note `uptime` beside the figures.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BENCH_DIR=${BENCH_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/krafla-bench}
BENCH_VENV=${BENCH_VENV:-$BENCH_DIR/venv}
REAL_DIR=${REAL_DIR:-$BENCH_DIR/real}
THREADS=${THREADS:-2}
REPS=${REPS:-5}
MODELS=${MODELS:-smollm2-135m gemma3-270m llama1b}
QUANTS=${QUANTS:-q4_0 q8_0 bf16 bf16a}
N_PROMPT=${N_PROMPT:-512}
N_GEN=${N_GEN:-128}
KRAFLA_Q4_RULE=${KRAFLA_Q4_RULE:-round}
KRAFLA_EXTRA=${KRAFLA_EXTRA---f16-scales}
LLAMA_ONLY=${LLAMA_ONLY:-0}
PREPARE_ONLY=${PREPARE_ONLY:-0}
LLAMA_DEPTH=${LLAMA_DEPTH:-0,$N_PROMPT}
if [ -z "${REAL_CHECKPOINTS:-}" ]; then
  REAL_CHECKPOINTS=$repo/../shared/tools/real-checkpoints.sh
  [ -f "$REAL_CHECKPOINTS" ] || REAL_CHECKPOINTS=$repo/../../shared/tools/real-checkpoints.sh
fi
SYNTH_CHECKPOINT=${SYNTH_CHECKPOINT:-$(dirname "$REAL_CHECKPOINTS")/synth-checkpoint.py}
case "$BENCH_DIR/" in "$repo"/*) echo "bench.sh: BENCH_DIR must be outside the repository" >&2; exit 2;; esac

mkdir -p "$BENCH_DIR"/{gguf,mlb,logs,results}
# The files a QUANTS entry runs on: bf16a is the bf16 files with BF16 activations.
file_q() { if [ "$1" = bf16a ]; then echo bf16; else echo "$1"; fi; }
log() { printf '[bench %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
py=$BENCH_VENV/bin/python
# shellcheck source=llama-build.sh
. "$repo/scripts/llama-build.sh"

# 1. Python venv (torch, transformers, sentencepiece, safetensors, cmake).
if [ ! -x "$py" ]; then
  log "creating venv $BENCH_VENV"
  python3 -m venv "$BENCH_VENV"
  # accelerate and gguf: real-checkpoints.sh dequantizes its GGUF sources with them.
  "$BENCH_VENV/bin/pip" install -q torch transformers accelerate gguf safetensors sentencepiece tokenizers numpy protobuf cmake
fi

# 2. The real checkpoints (and the random-weight 1B-class one).
for m in $MODELS; do
  if [ "$m" != llama1b ] && [ "$m" != qwen3moe ] && [ ! -f "$REAL_DIR/$m/config.json" ]; then
    log "making the real checkpoints in $REAL_DIR"
    bash "$REAL_CHECKPOINTS" "$REAL_DIR" "$BENCH_VENV"
    break
  fi
done
case " $MODELS " in *" llama1b "*)
  if [ ! -f "$REAL_DIR/llama1b/config.json" ]; then
    log "making llama1b (random weights) in $REAL_DIR"
    "$py" "$SYNTH_CHECKPOINT" "$REAL_DIR"
  fi;;
esac
case " $MODELS " in *" qwen3moe "*)
  if [ ! -f "$REAL_DIR/qwen3moe/config.json" ]; then
    log "making qwen3moe (random weights, Qwen3-30B-A3B's layer shape) in $REAL_DIR"
    "$py" "$SYNTH_CHECKPOINT" "$REAL_DIR" qwen3moe
  fi;;
esac

# 3. llama.cpp's source: the llama-cpp-python sdist carries it under vendor/llama.cpp.
#    (--no-binary for this package only: with :all: pip would also build cmake and ninja
#    from source just to read the sdist's metadata.)
sdist=$(ls "$BENCH_DIR"/llama_cpp_python-*.tar.gz 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$sdist" ]; then
  log "downloading the llama-cpp-python sdist"
  "$BENCH_VENV/bin/pip" download -q --no-deps --no-binary llama-cpp-python llama-cpp-python -d "$BENCH_DIR"
  sdist=$(ls "$BENCH_DIR"/llama_cpp_python-*.tar.gz | sort -V | tail -1)
fi
src=${sdist%.tar.gz}
if [ ! -f "$src/vendor/llama.cpp/CMakeLists.txt" ]; then
  log "unpacking $sdist"
  tar -xzf "$sdist" -C "$BENCH_DIR"
fi
llama=$src/vendor/llama.cpp
build=$BENCH_DIR/build
bench_bin=$build/bin/llama-bench
quant_bin=$build/bin/llama-quantize

# 4. Build llama-bench and llama-quantize, CPU only. AMX is off: its path crashes here.
if [ ! -x "$bench_bin" ] || [ ! -x "$quant_bin" ]; then
  log "building llama.cpp in $build (nice 19)"
  build_llama "$llama" "$build" OFF "" llama-bench llama-quantize
fi
# llama-quantize refuses these types without an importance matrix. Speed does not depend
# on it, so a small one from llama-imatrix on a short text serves (made once per model).
needs_imatrix() { case $1 in iq3_xxs|iq3_s|iq2_xxs|iq2_xs|iq2_s|iq1_s|iq1_m|q2_k_s) return 0;; esac; return 1; }
imatrix_bin=$build/bin/llama-imatrix
for q in $QUANTS; do
  if needs_imatrix "$q" && [ ! -x "$imatrix_bin" ]; then
    log "building llama-imatrix in $build (nice 19)"
    build_llama "$llama" "$build" OFF "" llama-imatrix
    break
  fi
done

# 5. GGUF files: convert_hf_to_gguf.py to bf16 (lossless from the bf16 checkpoint), then
#    llama-quantize --pure (every matrix, token embeddings included, in the one type).
#    convert_hf_to_gguf.py puts the vendored gguf-py first on sys.path; it is also
#    installed into a venv that lacks `gguf`.
"$py" -c 'import gguf' 2>/dev/null || "$BENCH_VENV/bin/pip" install -q "$llama/gguf-py"
for m in $MODELS; do
  bf16=$BENCH_DIR/gguf/$m-bf16.gguf
  need_bf16=0
  for q in $QUANTS; do
    [ -f "$BENCH_DIR/gguf/$m-$(file_q "$q").gguf" ] || need_bf16=1
  done
  [ "${FROM_GGUF:-0}" = 1 ] || need_bf16=1
  if [ ! -f "$bf16" ] && [ "$need_bf16" = 1 ]; then
    log "convert_hf_to_gguf.py $m"
    /usr/bin/time -v -o "$BENCH_DIR/logs/time-convert-$m.txt" \
      "$py" "$llama/convert_hf_to_gguf.py" "$REAL_DIR/$m" --outtype bf16 --outfile "$bf16.tmp" \
      >"$BENCH_DIR/logs/convert-$m.log" 2>&1
    mv "$bf16.tmp" "$bf16"
  fi
  for q in $QUANTS; do
    out=$BENCH_DIR/gguf/$m-$q.gguf
    # bf16 (and bf16a): the converted GGUF itself.
    if [ "$(file_q "$q")" != bf16 ] && [ ! -f "$out" ]; then
      imx=()
      if needs_imatrix "$q"; then
        imf=$BENCH_DIR/gguf/$m-imatrix.gguf
        if [ ! -f "$imf" ]; then
          log "llama-imatrix $m (4 chunks of 256 tokens of GPL-3)"
          "$imatrix_bin" -m "$bf16" -f /usr/share/common-licenses/GPL-3 -c 256 --chunks 4 \
            -t "$THREADS" -o "$imf.tmp.gguf" >"$BENCH_DIR/logs/imatrix-$m.log" 2>&1
          mv "$imf.tmp.gguf" "$imf"
        fi
        imx=(--imatrix "$imf")
        # ggml asserts for these without importance data, and an imatrix holds none for
        # the token embedding (a row lookup): that one tensor is Q8_0 in both tools' file.
        case $q in iq2_xxs|iq2_xs|iq1_s|iq1_m) imx+=(--token-embedding-type q8_0);; esac
      fi
      log "llama-quantize --pure $m $q"
      /usr/bin/time -v -o "$BENCH_DIR/logs/time-quantize-$m-$q.txt" \
        "$quant_bin" --pure "${imx[@]}" "$bf16" "$out.tmp" "${q^^}" "$THREADS" >"$BENCH_DIR/logs/quantize-$m-$q.log" 2>&1
      mv "$out.tmp" "$out"
    fi
  done
done

if [ "$PREPARE_ONLY" = 1 ]; then
  log "prepared in $BENCH_DIR; nothing measured (PREPARE_ONLY=1)"
  exit 0
fi

# 6. Read bandwidth with THREADS threads (benches/membw.rs), once per run of the script.
bw_file=$BENCH_DIR/results/bandwidth.txt
if [ ! -f "$bw_file" ]; then
  log "measuring read bandwidth ($THREADS threads)"
  # Built with the release profile (the bench profile would build the library once more).
  membw=$(cd "$repo" && cargo build -q --release --bench membw --message-format=json |
    python3 -c 'import json,sys
for l in sys.stdin:
    r = json.loads(l)
    if r.get("reason") == "compiler-artifact" and r["target"]["name"] == "membw" and r.get("executable"):
        print(r["executable"])')
  "$membw" --threads "$THREADS" --reps 9 >"$bw_file.tmp"
  mv "$bw_file.tmp" "$bw_file"
fi
bw=$(sed -n 's/^read_bandwidth_gbs=//p' "$bw_file")

# 7. llama-bench: pp N_PROMPT and tg N_GEN from an empty context (its defaults, weight
#    repacking on), and tg N_GEN after N_PROMPT tokens (-d), as mlb-run generates.
#    With Krafla measured too, the two alternate: one llama-bench repetition, then one
#    pair of mlb-run runs, REPS times, so that a machine whose speed drifts over minutes
#    (a shared VM) slows both alike.
llama_rep() { # model quant reps -> appends jsonl to $out.tmp
  /usr/bin/time -v -o "$BENCH_DIR/results/llama-$1-$2.time" \
    "$bench_bin" -m "$BENCH_DIR/gguf/$1-$(file_q "$2").gguf" -t "$THREADS" -r "$3" \
    -p "$N_PROMPT" -n "$N_GEN" -d "$LLAMA_DEPTH" -o jsonl >>"$BENCH_DIR/results/llama-$1-$2.jsonl.tmp" \
    2>>"$BENCH_DIR/logs/llama-bench-$1-$2.log"
}
if [ "$LLAMA_ONLY" = 1 ]; then
  for m in $MODELS; do
    for q in $QUANTS; do
      out=$BENCH_DIR/results/llama-$m-$q.jsonl
      if [ ! -f "$out" ]; then
        log "llama-bench $m $q"
        : >"$out.tmp"
        llama_rep "$m" "$q" "$REPS"
        mv "$out.tmp" "$out"
      fi
    done
  done
fi

# 8. Krafla: build, convert, run (alternating with llama-bench, see 7). The prompt is
#    N_PROMPT fixed pseudo-random ids within the vocabulary (as llama-bench's); generation
#    is greedy.
if [ "$LLAMA_ONLY" != 1 ]; then
  (cd "$repo" && cargo build -q --release --bin mlb-convert --bin mlb-run)
  kbin=${CARGO_TARGET_DIR:-$repo/target}/release
  # A kernel whose intrinsics are called out of line measures a broken build.
  "$repo/scripts/check-intrinsics.sh" "$kbin/mlb-run" >/dev/null
  ignore_eos=()
  # grep reads all of it: with -q it would stop early, mlb-run would die of SIGPIPE,
  # and pipefail would fail the test.
  if "$kbin/mlb-run" --help 2>&1 | grep -- '--ignore-eos' >/dev/null; then
    ignore_eos=(--ignore-eos)
  else
    log "warning: mlb-run has no --ignore-eos; a run that samples EOS generates fewer than $N_GEN tokens (reported)"
  fi
  for m in $MODELS; do
    vocab=$(python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); print((c.get("text_config") or c)["vocab_size"])' "$REAL_DIR/$m/config.json")
    ids=$(awk -v n="$N_PROMPT" -v v="$vocab" 'BEGIN { x = 12345; for (i = 0; i < n; i++) { x = (x * 1103515245 + 12345) % 2147483648; printf "%s%d", (i ? " " : ""), 3 + x % (v - 3) } }')
    for q in $QUANTS; do
      mlb=$BENCH_DIR/mlb/$m-$(file_q "$q").mlb
      run_flags=()
      [ "$q" = bf16a ] && run_flags=(--bf16-activations)
      if [ ! -f "$mlb" ]; then
        src=$REAL_DIR/$m
        case $(file_q "$q") in
          q4_0) cflags=(--wtype q4_0 --q8 none --q4-rule "$KRAFLA_Q4_RULE");;
          q8_0) cflags=(--wtype q8_0);;
          bf16) cflags=(--wtype bf16);;
          # The block types (q4_k, q6_k, iq4_nl, ...): llama-quantize --pure's GGUF,
          # copied block for block by mlb-convert, so both tools run the same bits.
          *) src=$BENCH_DIR/gguf/$m-$q.gguf; cflags=();;
        esac
        # shellcheck disable=SC2206
        if [ "${FROM_GGUF:-0}" = 1 ]; then src=$BENCH_DIR/gguf/$m-$(file_q "$q").gguf; cflags=(); fi
        case $q in q4_0|q8_0) [ "${FROM_GGUF:-0}" = 1 ] || cflags+=($KRAFLA_EXTRA);; esac  # scales of the spec's types
        log "mlb-convert $src ${cflags[*]}"
        /usr/bin/time -v -o "$BENCH_DIR/logs/time-mlb-convert-$m-$q.txt" \
          "$kbin/mlb-convert" "$src" "${cflags[@]}" --threads "$THREADS" -o "$mlb" \
          >"$BENCH_DIR/logs/mlb-convert-$m-$q.log" 2>&1
      fi
      # No tokenizer beside the model: mlb-run runs on ids and loads none (llama-bench
      # loads its vocabulary, a few MiB; Gemma 3's .mlt would add ~30 MiB of RSS).
      rm -f "${mlb%.mlb}.mlt"
      out=$BENCH_DIR/results/krafla-$m-$q.txt
      lout=$BENCH_DIR/results/llama-$m-$q.jsonl
      if [ ! -f "$out" ] || [ ! -f "$lout" ]; then
        log "llama-bench and mlb-run $m $q, alternating x$REPS"
        : >"$out.tmp"
        : >"$lout.tmp"
        for r in $(seq "$REPS"); do
          llama_rep "$m" "$q" 1
          # pp N_PROMPT then tg N_GEN at depth N_PROMPT ...
          /usr/bin/time -v -o "$out.time" "$kbin/mlb-run" "$mlb" --threads "$THREADS" --temp 0 \
            --ctx $((N_PROMPT + N_GEN)) --tokens "$ids" -n "$N_GEN" "${ignore_eos[@]}" "${run_flags[@]}" \
            >/dev/null 2>"$out.err" || { cat "$out.err" >&2; exit 1; }
          echo "run=pp rss_kib=$(sed -n 's/.*Maximum resident set size (kbytes): //p' "$out.time") $(grep -E '^(prompt|memory):' "$out.err" | tr '\n' ' ')" >>"$out.tmp"
          # ... and tg N_GEN from an empty context (one prompt token, N_GEN decode steps), as llama-bench's tg.
          /usr/bin/time -v -o "$out.time" "$kbin/mlb-run" "$mlb" --threads "$THREADS" --temp 0 \
            --ctx $((N_GEN + 1)) --tokens "${ids%% *}" -n $((N_GEN + 1)) "${ignore_eos[@]}" "${run_flags[@]}" \
            >/dev/null 2>"$out.err" || { cat "$out.err" >&2; exit 1; }
          echo "run=tg rss_kib=$(sed -n 's/.*Maximum resident set size (kbytes): //p' "$out.time") $(grep -E '^(prompt|memory):' "$out.err" | tr '\n' ' ')" >>"$out.tmp"
        done
        rm -f "$out.err" "$out.time"
        mv "$out.tmp" "$out"
        mv "$lout.tmp" "$lout"
      fi
    done
  done
fi

# 9. The table.
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'); $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'); threads $THREADS; load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# read bandwidth: $(head -1 "$bw_file")"
python3 "$repo/scripts/bench_table.py" "$BENCH_DIR" "$bw" "$N_PROMPT" "$N_GEN" "$MODELS" "$QUANTS" "$LLAMA_ONLY"
