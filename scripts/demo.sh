#!/usr/bin/env bash
# The main job on the bundled default model (testdata/default): convert the Hugging Face
# checkpoint and its tokenizer, inspect the result, and generate text with it.
set -euo pipefail
cd "$(dirname "$0")/.."
# DEMO_PROFILE=dev: the debug build. DEMO_PROFILE=test: the binaries as `cargo test`
# builds them (its profile, and its features, which the dev-dependencies widen); CI runs
# the demo that way, after the tests, with nothing left to compile.
profile=${DEMO_PROFILE:-release}
if [ "$profile" = test ]; then
    cargo test --no-run --quiet
else
    cargo build --profile "$profile" --bins --quiet
fi
case $profile in
dev | test) bin=target/debug ;;
*) bin=target/$profile ;;
esac
out=target/demo-$profile
mkdir -p "$out"
src=testdata/default
prompt=${1:-"A function is"}

echo "== mlb-convert $src -> $out/default.mlb (Q8_0)"
"$bin/mlb-convert" "$src" -o "$out/default.mlb" --wtype q8_0
echo "== mlt-convert $src/tokenizer.json -> $out/default.mlt"
"$bin/mlt-convert" "$src/tokenizer.json" -o "$out/default.mlt"
echo "== mlb-inspect $out/default.mlb (header and totals)"
"$bin/mlb-inspect" "$out/default.mlb" | sed -n '1,14p;/^layers/,/^$/p;/^totals/,$p'
echo "== mlb-run: greedy continuation of \"$prompt\""
"$bin/mlb-run" "$out/default.mlb" --tokenizer "$out/default.mlt" --prompt "$prompt" -n 48 --temp 0
