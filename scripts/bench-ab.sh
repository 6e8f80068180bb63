#!/usr/bin/env bash
# Two Krafla builds against each other, alternating, on the same .mlb files: did a change
# slow anything down? Builds BASE (a git revision) in a worktree under BENCH_DIR and this
# checkout, converts each model once with this checkout's mlb-convert (a refactor that
# keeps the bytes keeps the files readable by both), then runs mlb-run of A (BASE) and
# B (this checkout) in turns, the order swapped every repetition, so a shared VM whose
# speed drifts slows both alike. Prints medians of prompt and generation tok/s, B/A.
#   scripts/bench-ab.sh BASE
# Environment (defaults in brackets):
#   BENCH_DIR  work folder outside the repository [${XDG_CACHE_HOME:-$HOME/.cache}/krafla-bench]
#   REAL_DIR   the HF checkpoints [$BENCH_DIR/real]
#   MODELS ["smollm2-135m llama1b"]  QUANTS ["q4_0 q8_0"]  THREADS [2]  REPS [7]
#   N_PROMPT [512]  N_GEN [128]
# Not part of `cargo test` or CI. Note `uptime` beside the figures.
set -euo pipefail
base=${1:?usage: bench-ab.sh BASE_REV}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BENCH_DIR=${BENCH_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/krafla-bench}
REAL_DIR=${REAL_DIR:-$BENCH_DIR/real}
MODELS=${MODELS:-smollm2-135m llama1b}
QUANTS=${QUANTS:-q4_0 q8_0}
THREADS=${THREADS:-2}
REPS=${REPS:-7}
N_PROMPT=${N_PROMPT:-512}
N_GEN=${N_GEN:-128}
case "$BENCH_DIR/" in "$repo"/*) echo "bench-ab.sh: BENCH_DIR must be outside the repository" >&2; exit 2;; esac
log() { printf '[bench-ab %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
rev=$(git -C "$repo" rev-parse --short "$base")
wt=$BENCH_DIR/ab-$rev
out=$BENCH_DIR/ab
mkdir -p "$out"

if [ ! -d "$wt" ]; then
  log "worktree $wt at $rev"
  git -C "$repo" worktree add --detach "$wt" "$rev" >/dev/null
fi
log "building A ($rev) and B (this checkout), release"
(cd "$wt" && cargo build -q --release --bin mlb-run)
(cd "$repo" && cargo build -q --release --bin mlb-run --bin mlb-convert)
a=$wt/target/release/mlb-run
b=$repo/target/release/mlb-run

run() { # BIN MLB TOKENS N -> "prompt_tok_s gen_tok_s"
  "$1" "$2" --threads "$THREADS" --temp 0 --ctx $((N_PROMPT + N_GEN + 1)) --tokens "$3" \
    -n "$4" --ignore-eos 2>&1 >/dev/null |
    sed -n 's/^prompt: \([0-9]*\) tokens in \([0-9.]*\) s.*generated: \([0-9]*\) tokens in \([0-9.]*\) s.*/\1 \2 \3 \4/p' |
    awk '{ printf "%.3f %.3f\n", $1 / $2, ($3 - 1) / $4 }'
}

echo "# $(date -u '+%Y-%m-%d %H:%M UTC'); A=$rev B=$(git -C "$repo" rev-parse --short HEAD)$(git -C "$repo" diff --quiet || echo +dirty); threads $THREADS; reps $REPS; load $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-14s %-5s %-16s %10s %10s %7s\n' model quant measure A B B/A
for m in $MODELS; do
  vocab=$(python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); print((c.get("text_config") or c)["vocab_size"])' "$REAL_DIR/$m/config.json")
  ids=$(awk -v n="$N_PROMPT" -v v="$vocab" 'BEGIN { x = 12345; for (i = 0; i < n; i++) { x = (x * 1103515245 + 12345) % 2147483648; printf "%s%d", (i ? " " : ""), 3 + x % (v - 3) } }')
  for q in $QUANTS; do
    mlb=$out/$m-$q.mlb
    if [ ! -f "$mlb" ]; then
      case $q in
        q4_0) cflags=(--wtype q4_0 --q8 none --q4-rule round --f16-scales);;
        q8_0) cflags=(--wtype q8_0 --f16-scales);;
        # The block types and BF16/F16 have no scale array: --f16-scales is refused.
        *) cflags=(--wtype "$q");;
      esac
      log "mlb-convert $m ${cflags[*]}"
      "$repo/target/release/mlb-convert" "$REAL_DIR/$m" "${cflags[@]}" -o "$mlb" >/dev/null
    fi
    rm -f "${mlb%.mlb}.mlt"
    res=$out/$m-$q.txt
    : >"$res"
    log "$m $q: A and B alternating x$REPS"
    for r in $(seq "$REPS"); do
      order="a b"; [ $((r % 2)) = 0 ] && order="b a"
      for w in $order; do
        bin=$a; [ "$w" = b ] && bin=$b
        echo "$w pp $(run "$bin" "$mlb" "$ids" "$N_GEN")" >>"$res"
        echo "$w tg $(run "$bin" "$mlb" "${ids%% *}" $((N_GEN + 1)))" >>"$res"
      done
    done
    python3 - "$res" "$m" "$q" "$N_PROMPT" "$N_GEN" <<'PY'
import statistics, sys
res, m, q, n_p, n_g = sys.argv[1:6]
v = {}
for line in open(res):
    w, kind, pp, gen = line.split()
    if kind == "pp":
        v.setdefault((w, f"pp{n_p}"), []).append(float(pp))
        v.setdefault((w, f"tg{n_g} @ d{n_p}"), []).append(float(gen))
    else:
        v.setdefault((w, f"tg{n_g}"), []).append(float(gen))
for meas in (f"pp{n_p}", f"tg{n_g}", f"tg{n_g} @ d{n_p}"):
    a = statistics.median(v[("a", meas)])
    b = statistics.median(v[("b", meas)])
    print(f"{m:<14} {q:<5} {meas:<16} {a:10.2f} {b:10.2f} {b / a:7.3f}")
PY
  done
done
