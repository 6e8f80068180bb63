#!/usr/bin/env bash
# Runs every fuzz target (or the ones named) for a bounded time, one at a time, at
# the lowest priority, and prints each target's executions and findings.
#
#   scripts/fuzz.sh                 # every target, FUZZ_SECS (default 60) seconds each
#   FUZZ_SECS=300 scripts/fuzz.sh mlb_view mlt_parse
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`). Only a stable toolchain exists here,
# so RUSTC_BOOTSTRAP=1 lets it use the nightly flags it needs; the sanitizer is off
# (FUZZ_SANITIZER=address to try ASan). Not part of CI's test command.
# Memory limits: -rss_limit_mb=512 and -malloc_limit_mb=256, so a header that makes a
# parser allocate before checking sizes against the file is a finding.
# Corpora grow in fuzz/corpus/<target> (ignored by git), seeded from fuzz/seeds/<target>
# and, for convert_safetensors, from the llama fixture; crashes land in
# fuzz/artifacts/<target>.
set -uo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${FUZZ_SECS:-60}
san=${FUZZ_SANITIZER:-none}
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(mlb_parse mlb_view mlt_parse mli_parse gguf_parse tok_encode tok_decode convert_config convert_safetensors)
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
  max_len=()
  case $t in
    convert_safetensors) max_len=(-max_len=262144) ;;
    tok_encode | tok_decode | convert_config) max_len=(-max_len=4096) ;;
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
    -max_total_time="$secs" -rss_limit_mb=512 -malloc_limit_mb=256 -timeout=$timeout \
    -print_final_stats=1 "${max_len[@]}" >"$log" 2>&1
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
