#!/usr/bin/env bash
# The imatrix loop on one checkpoint, as in docs/benchmarks-quality.md:
#   scripts/quality.sh CKPT_DIR CALIB.txt EVAL.txt [CALIB_CHUNKS] [EVAL_CHUNKS] [OUT_DIR]
# converts CKPT_DIR to Q8_0 (the reference), runs mlb-run --imatrix on CALIB.txt,
# converts three Q4_0 files with --q8 none (search, round, imatrix-weighted search) and
# prints mlb-run --kl-divergence of each against the Q8_0 file on EVAL.txt.
set -euo pipefail
ckpt=$1 calib=$2 evtext=$3 cc=${4:-24} ec=${5:-8}
root=$(cd "$(dirname "$0")/.." && pwd)
out=${6:-$root/target/quality/$(basename "$ckpt")}
mkdir -p "$out"
(cd "$root" && cargo build --release --bins --quiet)
bin=$root/target/release
n=$out/m
"$bin/mlb-convert" "$ckpt" -o "$n-q8.mlb"
"$bin/mlt-convert" "$ckpt/tokenizer.json" -o "$n-q8.mlt" -q
"$bin/mlb-run" "$n-q8.mlb" --file "$calib" --imatrix "$n.mli" --ctx 512 --chunks "$cc" --save-every 4
q4=(--wtype q4_0 --q8 none)
"$bin/mlb-convert" "$ckpt" -o "$n-q4-search.mlb" "${q4[@]}" --q4-rule search
"$bin/mlb-convert" "$ckpt" -o "$n-q4-round.mlb" "${q4[@]}" --q4-rule round
"$bin/mlb-convert" "$ckpt" -o "$n-q4-imatrix.mlb" "${q4[@]}" --q4-rule search --imatrix "$n.mli"
for v in search round imatrix; do
    cp "$n-q8.mlt" "$n-q4-$v.mlt"
    echo "== Q4_0 $v"
    "$bin/mlb-run" "$n-q4-$v.mlb" --file "$evtext" --kl-divergence "$n-q8.mlb" --ctx 512 --chunks "$ec"
done
