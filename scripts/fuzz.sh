#!/usr/bin/env bash
# Runs every fuzz target (or the ones named) for a bounded time, one at a time, at
# the lowest priority, and prints each target's executions and findings.
#
#   scripts/fuzz.sh                 # every target, FUZZ_SECS (default 60) seconds each
#   FUZZ_SECS=300 scripts/fuzz.sh mlb_view mlt_parse
#   FUZZ_RUNS=1000000 FUZZ_SECS=7200 scripts/fuzz.sh   # 1 M executions each (or 2 h)
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`). Only a stable toolchain exists here,
# so RUSTC_BOOTSTRAP=1 lets it use the nightly flags it needs; the sanitizer is off
# (FUZZ_SANITIZER=address to try ASan). Not part of CI's test command.
# Memory limits: -rss_limit_mb=512 (2048 for convert_pair, whose corpus of inputs up to
# 1 MiB outgrows 512 MiB) and -malloc_limit_mb=256, so a header that makes a parser
# allocate before checking sizes against the file is a finding.
# Corpora grow in fuzz/corpus/<target> (ignored by git), seeded from fuzz/seeds/<target>
# and, for convert_safetensors, from the llama fixture (convert_pair: every fixture's
# config.json, a NUL, its model.safetensors); crashes land in fuzz/artifacts/<target>.
set -uo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${FUZZ_SECS:-60}
runs=()
[ -n "${FUZZ_RUNS:-}" ] && runs=(-runs="$FUZZ_RUNS")
san=${FUZZ_SANITIZER:-none}
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(mlb_parse mlb_view mlt_parse mli_parse gguf_parse tok_encode tok_decode convert_config convert_safetensors convert_pair run_options chat_render gbnf_parse)
fi
export RUSTC_BOOTSTRAP=1
for t in "${targets[@]}"; do
  nice -n 19 cargo fuzz build --release --sanitizer "$san" "$t" >build.log 2>&1 || { tail -20 build.log; exit 1; }
done
status=0
printf '%-22s %12s %10s %8s  %s\n' target executions exec/s corpus findings
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t" "artifacts/$t"
  if [ "$t" = convert_safetensors ]; then
    cp -n ../testdata/models/llama/model.safetensors "corpus/$t/llama.safetensors"
  fi
  if [ "$t" = convert_pair ]; then
    for m in ../testdata/models/*/; do
      n=$(basename "$m")
      [ -f "$m/model.safetensors" ] && [ ! -f "corpus/$t/$n" ] &&
        { cat "$m/config.json"; printf '\0'; cat "$m/model.safetensors"; } >"corpus/$t/$n"
    done
  fi
  max_len=()
  # libFuzzer holds the corpus in memory: convert_pair's inputs reach 1 MiB each, so its
  # corpus alone outgrows 512 MiB. malloc_limit_mb still caps every single allocation.
  rss=512
  [ "$t" = convert_pair ] && rss=2048
  case $t in
    convert_safetensors) max_len=(-max_len=262144) ;;
    convert_pair) max_len=(-max_len=1048576) ;;
    tok_encode | tok_decode | convert_config) max_len=(-max_len=4096) ;;
    chat_render) max_len=(-max_len=16384) ;;
    gbnf_parse) max_len=(-max_len=8192) ;;
  esac
  before=$(ls "artifacts/$t" | wc -l)
  log="artifacts/$t.log"
  seeds=()
  [ -d "seeds/$t" ] && seeds=("seeds/$t")
  [ "$t" = mlb_view ] && seeds=(seeds/mlb_parse)
  timeout=10
  # The tokenizer targets convert six real tokenizers on their first input.
  case $t in tok_*) timeout=300 ;; esac
  nice -n 19 cargo fuzz run --release --sanitizer "$san" "$t" "corpus/$t" "${seeds[@]}" -- \
    -max_total_time="$secs" -rss_limit_mb=$rss -malloc_limit_mb=256 -timeout=$timeout \
    -print_final_stats=1 "${max_len[@]}" "${runs[@]}" >"$log" 2>&1
  rc=$?
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  after=$(ls "artifacts/$t" | wc -l)
  found="none"
  if [ "$rc" -ne 0 ] || [ "$after" -gt "$before" ]; then
    found="rc=$rc: $(grep -m1 -E 'panicked|ERROR: libFuzzer|SUMMARY' "$log" | cut -c1-120); see fuzz/$log"
    status=1
  fi
  printf '%-22s %12s %10s %8s  %s\n' "$t" "${execs:-?}" "${rate:-?}" "$(ls "corpus/$t" | wc -l)" "$found"
done
exit $status
