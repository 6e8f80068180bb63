#!/usr/bin/env bash
# mlb-serve against llama.cpp's llama-server, side by side, on the same model bits (the
# GGUF that scripts/bench.sh makes with llama-quantize, and the .mlb that mlb-convert
# makes from the same checkpoint with f16 block scales, as bench.sh does), the same
# threads, PARALLEL slots on both: CLIENTS concurrent streaming clients, each sending
# REQUESTS greedy /v1/completions of N_GEN tokens (EOS banned on both); reported per
# server and concurrency: aggregate generated tokens/s, median time to first token, and
# the server's peak RSS (VmHWM). Each server is started afresh for each concurrency.
# Not part of `cargo test` or CI. Run it on an idle machine; on a shared one, note
# `uptime` beside the figures.
#
# Environment (defaults in brackets):
#   BENCH_DIR   bench.sh's work folder: gguf/MODEL-QUANT.gguf must exist there (make it
#               with `PREPARE_ONLY=1 scripts/bench.sh`)  [${XDG_CACHE_HOME:-$HOME/.cache}/krafla-bench]
#   REAL_DIR    the HF checkpoints (MODEL/config.json, tokenizer.json)  [$BENCH_DIR/real]
#   LLAMA_SRC   llama.cpp's source  [the one bench.sh unpacked: $BENCH_DIR/llama_cpp_python-*/vendor/llama.cpp]
#   BENCH_VENV  a venv with cmake, if cmake is not on PATH (pip installs it)  [$BENCH_DIR/venv]
#   LLAMA_SERVER  the llama-server binary; built from LLAMA_SRC into $BENCH_DIR/build-server
#               if absent  [$BENCH_DIR/build-server/bin/llama-server]
#   MODELS [smollm2-135m]  QUANT [q8_0]  THREADS [2]  PARALLEL [4]  CLIENTS ["1 4 8"]
#   REQUESTS [4]: per client   N_GEN [128]   CTX [1024]: positions per slot
#   KRAFLA_BIN  folder with mlb-convert, mlt-convert, mlb-serve  [target/release, built here]
#   KRAFLA_ONLY=1 skip llama-server   LLAMA_ONLY=1 skip mlb-serve
#   CONSTRAIN   a JSON object merged into mlb-serve's requests, e.g.
#               '{"response_format": {"type": "json_object"}}': mlb-serve then runs twice per
#               concurrency, plain ("krafla") and constrained ("krafla+c"), alternating,
#               so the table shows what the constraint costs  [empty: off]
# Results: $BENCH_DIR/results/serve-MODEL-QUANT.tsv and the table on stdout.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BENCH_DIR=${BENCH_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/krafla-bench}
REAL_DIR=${REAL_DIR:-$BENCH_DIR/real}
BENCH_VENV=${BENCH_VENV:-$BENCH_DIR/venv}
MODELS=${MODELS:-smollm2-135m}
QUANT=${QUANT:-q8_0}
THREADS=${THREADS:-2}
PARALLEL=${PARALLEL:-4}
CLIENTS=${CLIENTS:-1 4 8}
REQUESTS=${REQUESTS:-4}
N_GEN=${N_GEN:-128}
CTX=${CTX:-1024}
KRAFLA_ONLY=${KRAFLA_ONLY:-0}
LLAMA_ONLY=${LLAMA_ONLY:-0}
CONSTRAIN=${CONSTRAIN:-}
LLAMA_SERVER=${LLAMA_SERVER:-$BENCH_DIR/build-server/bin/llama-server}
case "$QUANT" in q8_0) cflags=(--wtype q8_0 --f16-scales) ;; q4_0) cflags=(--wtype q4_0 --q8 none --q4-rule round --f16-scales) ;;
  *) echo "bench-serve.sh: QUANT=$QUANT: expected q8_0 or q4_0" >&2; exit 2 ;; esac
case "$BENCH_DIR/" in "$repo"/*) echo "bench-serve.sh: BENCH_DIR must be outside the repository" >&2; exit 2;; esac

pid=
mkdir -p "$BENCH_DIR"/{mlb-serve,logs,results}
log() { printf '[bench-serve %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
client=$repo/scripts/bench_serve_client.py
# shellcheck source=llama-build.sh
. "$repo/scripts/llama-build.sh"

# 1. llama-server, built once (CPU only, AMX off as in bench.sh).
if [ "$KRAFLA_ONLY" != 1 ] && [ ! -x "$LLAMA_SERVER" ]; then
  if [ -z "${LLAMA_SRC:-}" ]; then
    LLAMA_SRC=$(ls -d "$BENCH_DIR"/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | sort -V | tail -1 || true)
  fi
  [ -f "${LLAMA_SRC:-}/CMakeLists.txt" ] || { echo "bench-serve.sh: no llama.cpp source (set LLAMA_SRC, or run scripts/bench.sh first)" >&2; exit 1; }
  build=$(dirname "$(dirname "$LLAMA_SERVER")")
  log "building llama-server in $build (nice 19)"
  build_llama "$LLAMA_SRC" "$build" ON server- llama-server
fi

# 2. Krafla's tools.
kbin=${KRAFLA_BIN:-$repo/target/release}
if [ "$LLAMA_ONLY" != 1 ] && [ -z "${KRAFLA_BIN:-}" ]; then
  (cd "$repo" && cargo build -q --release --bin mlb-convert --bin mlt-convert --bin mlb-serve)
fi

# Starts a server in the background; sets pid and url.
start_krafla() { # model
  local out=$BENCH_DIR/logs/serve-krafla-$1.out
  "$kbin/mlb-serve" "$BENCH_DIR/mlb-serve/$1-$QUANT.mlb" --port 0 --threads "$THREADS" \
    --parallel "$PARALLEL" --ctx "$CTX" >"$out" 2>"$BENCH_DIR/logs/serve-krafla-$1.err" &
  pid=$!
  for _ in $(seq 600); do
    url=$(sed -n 's/^listening on //p' "$out")
    [ -n "$url" ] && return 0
    kill -0 "$pid" 2>/dev/null || { cat "$BENCH_DIR/logs/serve-krafla-$1.err" >&2; exit 1; }
    sleep 0.1
  done
  echo "bench-serve.sh: mlb-serve did not start" >&2; exit 1
}
start_llama() { # model
  local port
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  # -c is the whole context, split over the slots; --no-webui: an API server, as ours.
  "$LLAMA_SERVER" -m "$BENCH_DIR/gguf/$1-$QUANT.gguf" -t "$THREADS" -np "$PARALLEL" \
    -c $((CTX * PARALLEL)) --host 127.0.0.1 --port "$port" --no-webui \
    >"$BENCH_DIR/logs/serve-llama-$1.log" 2>&1 &
  pid=$!
  url=http://127.0.0.1:$port
  for _ in $(seq 1200); do
    python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/health", timeout=1)' "$url" 2>/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || { tail -5 "$BENCH_DIR/logs/serve-llama-$1.log" >&2; exit 1; }
    sleep 0.1
  done
  echo "bench-serve.sh: llama-server did not start" >&2; exit 1
}
start_krafla_c() { start_krafla "$@"; }
stop() { kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; }
trap 'stop' EXIT

for m in $MODELS; do
  [ -f "$REAL_DIR/$m/config.json" ] || { echo "bench-serve.sh: $REAL_DIR/$m: no checkpoint (set REAL_DIR)" >&2; exit 1; }
  # The EOS id, banned so that every request generates N_GEN tokens.
  eos=$(python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); c=c.get("text_config") or c; e=c.get("eos_token_id", 0); print(e[0] if isinstance(e, list) else e)' "$REAL_DIR/$m/config.json")
  if [ "$LLAMA_ONLY" != 1 ]; then
    mlb=$BENCH_DIR/mlb-serve/$m-$QUANT.mlb
    if [ ! -f "$mlb" ]; then
      log "mlb-convert $m ${cflags[*]}"
      "$kbin/mlb-convert" "$REAL_DIR/$m" "${cflags[@]}" --threads "$THREADS" -o "$mlb" >"$BENCH_DIR/logs/serve-convert-$m.log" 2>&1
    fi
    [ -f "${mlb%.mlb}.mlt" ] || "$kbin/mlt-convert" "$REAL_DIR/$m/tokenizer.json" -o "${mlb%.mlb}.mlt" -q
  fi
  if [ "$KRAFLA_ONLY" != 1 ] && [ ! -f "$BENCH_DIR/gguf/$m-$QUANT.gguf" ]; then
    echo "bench-serve.sh: $BENCH_DIR/gguf/$m-$QUANT.gguf missing (PREPARE_ONLY=1 scripts/bench.sh makes it)" >&2; exit 1
  fi
  tsv=$BENCH_DIR/results/serve-$m-$QUANT.tsv
  printf 'server\tclients\trequests\ttokens\ttok_s\tttft_ms_median\tpeak_rss_mib\terrors\n' >"$tsv.tmp"
  servers=()
  [ "$KRAFLA_ONLY" = 1 ] || servers+=(llama)
  [ "$LLAMA_ONLY" = 1 ] || servers+=(krafla)
  [ "$LLAMA_ONLY" = 1 ] || [ -z "$CONSTRAIN" ] || servers+=(krafla_c)
  # Concurrency outermost: the two servers alternate, so a drifting machine slows both.
  for c in $CLIENTS; do
    for s in "${servers[@]}"; do
      "start_$s" "$m"
      # One short request first: both servers touch their weights before the clock runs.
      python3 "$client" "$url" 1 1 4 "$eos" >/dev/null
      log "$s $m $QUANT: $c client(s) x $REQUESTS request(s) x $N_GEN tokens"
      extra=
      [ "$s" = krafla_c ] && extra=$CONSTRAIN
      r=$(python3 "$client" "$url" "$c" "$REQUESTS" "$N_GEN" "$eos" "$extra")
      rss=$(awk '/^VmHWM:/ { printf "%.1f", $2 / 1024 }' "/proc/$pid/status")
      stop
      python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print("\t".join(str(x) for x in [sys.argv[2].replace("krafla_c", "krafla+c"), r["clients"], r["requests"], r["tokens"], r["tok_s"], r["ttft_ms_median"], sys.argv[3], r["errors"]]))' \
        "$r" "$s" "$rss" >>"$tsv.tmp"
    done
  done
  mv "$tsv.tmp" "$tsv"
  echo "# $m $QUANT, $THREADS threads, --parallel $PARALLEL, $REQUESTS request(s) per client, $N_GEN tokens each ($(uptime | sed 's/.*load average/load average/'))"
  column -t -s "$(printf '\t')" "$tsv"
done
