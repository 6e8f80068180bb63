#!/usr/bin/env bash
# Hashes of what the tools write, to show that a change of the code leaves every output
# byte and every logit bit as it was: run it before and after, then diff the two lists.
#
#   scripts/logit-hashes.sh [BIN_DIR] > hashes.txt
#
# BIN_DIR holds mlb-convert, mlt-convert and mlb-run (default: target/release, built
# first). For every fixture in testdata/models and the bundled default model, at Q8_0,
# Q4_0, BF16 and F16, one line per output: the .mlb file's SHA-256, then per kernel tier
# (KRAFLA_KERNEL) the `--logits` file of the fixture's tokens (prefill) and the ids of a
# greedy continuation (decode), and once `--no-pack`; BF16 files also with
# `--bf16-activations` per tier (when the binary has the flag). The default model adds its .mlt
# and an `--imatrix` file. Tiers the CPU does not have fall back to lower ones (their
# lines then repeat the lower tier's hashes).
#
# Environment (all optional):
#   KRAFLA_HASH_TIERS  tiers to run (default: "scalar avx2 avx512 avx512vnni avx512bf16")
#   KRAFLA_HASH_TYPES  weight types to convert to (default: "q8_0 q4_0 bf16 f16")
#   KRAFLA_REAL_DIR    a folder with real checkpoints (smollm2-135m/, gemma3-270m/, as
#                      shared/tools/real-checkpoints.sh writes them); each one present
#                      is converted and hashed the same way on fixed token ids
#   KRAFLA_HASH_WORK   scratch folder for the converted files (default: a new temporary
#                      folder, removed at the end)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -ge 1 ]; then
    bin=$(cd "$1" && pwd)
else
    (cd "$root" && cargo build --release --bins --quiet)
    bin=$root/target/release
fi
tiers=${KRAFLA_HASH_TIERS:-scalar avx2 avx512 avx512vnni avx512bf16}
types=${KRAFLA_HASH_TYPES:-q8_0 q4_0 bf16 f16}
# Whether mlb-run has --bf16-activations (grep reads all: -q would SIGPIPE mlb-run).
bf16a=0
if "$bin/mlb-run" --help 2>&1 | grep -- --bf16-activations >/dev/null; then bf16a=1; fi
if [ -n "${KRAFLA_HASH_WORK:-}" ]; then
    work=$KRAFLA_HASH_WORK
    mkdir -p "$work"
else
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
fi

hash() { sha256sum "$1" | cut -c1-64; }

# The ids of `"tokens": [...]` in a fixture's reference.json, space-separated.
tokens_of() { sed -n '/"tokens": \[/,/\]/p' "$1" | tr -cd '0-9\n' | tr -s '\n' ' '; }

# run NAME MLB "TOKENS": the logits and greedy ids of MLB on every tier.
run() {
    local name=$1 mlb=$2 toks=$3 t
    for t in $tiers; do
        KRAFLA_KERNEL=$t "$bin/mlb-run" "$mlb" --tokens "$toks" --logits "$work/l.f32" -n 0 \
            2>/dev/null
        echo "$(hash "$work/l.f32")  $name $t logits"
        KRAFLA_KERNEL=$t "$bin/mlb-run" "$mlb" --tokens "$toks" -n 12 --temp 0 --ignore-eos \
            >"$work/ids.txt" 2>/dev/null
        echo "$(hash "$work/ids.txt")  $name $t greedy"
    done
    "$bin/mlb-run" "$mlb" --tokens "$toks" --logits "$work/l.f32" -n 0 --no-pack 2>/dev/null
    echo "$(hash "$work/l.f32")  $name no-pack logits"
    if [ "$bf16a" = 1 ] && [[ $name == *bf16 ]]; then
        for t in $tiers; do
            KRAFLA_KERNEL=$t "$bin/mlb-run" "$mlb" --tokens "$toks" --logits "$work/l.f32" -n 0 \
                --bf16-activations 2>/dev/null
            echo "$(hash "$work/l.f32")  $name $t bf16-activations logits"
        done
    fi
}

# model NAME CHECKPOINT "TOKENS": convert to each type, hash the files, run them.
model() {
    local name=$1 ckpt=$2 toks=$3 wt
    for wt in $types; do
        "$bin/mlb-convert" "$ckpt" -o "$work/$name-$wt.mlb" --wtype "$wt" >/dev/null 2>&1
        echo "$(hash "$work/$name-$wt.mlb")  $name $wt mlb"
        run "$name $wt" "$work/$name-$wt.mlb" "$toks"
        rm -f "$work/$name-$wt.mlb"
    done
}

for dir in "$root"/testdata/models/*/; do
    name=$(basename "$dir")
    model "$name" "$dir" "$(tokens_of "$dir/reference.json")"
done

def=$root/testdata/default
toks=$(tokens_of "$def/reference.json")
model default "$def" "$toks"
"$bin/mlb-convert" "$def" -o "$work/default.mlb" >/dev/null 2>&1
"$bin/mlt-convert" "$def/tokenizer.json" -o "$work/default.mlt" >/dev/null 2>&1
echo "$(hash "$work/default.mlt")  default mlt"
"$bin/mlb-run" "$work/default.mlb" --tokens "$toks $toks $toks" --imatrix "$work/d.mli" \
    --ctx 16 >/dev/null 2>&1
echo "$(hash "$work/d.mli")  default imatrix"

if [ -n "${KRAFLA_REAL_DIR:-}" ]; then
    # Fixed ids below both models' vocabularies (49152, 262144): 80 positions, so that
    # attention runs over more than one block of 64 keys.
    ids="1 504 3456 28 1097 314 253 2114 30 1780 12 9552 2 42 7 19"
    real_toks="$ids $ids $ids $ids $ids"
    for name in smollm2-135m gemma3-270m; do
        if [ -f "$KRAFLA_REAL_DIR/$name/config.json" ]; then
            model "$name" "$KRAFLA_REAL_DIR/$name" "$real_toks"
        fi
    done
fi
