#!/usr/bin/env bash
# Fails when an optimized Krafla binary calls a SIMD intrinsic out of line.
#
# usage: scripts/check-intrinsics.sh [BINARY]   (default: target/release/mlb-run)
#
# An intrinsic inlines only into code compiled with its target features. A closure
# inside a `#[target_feature]` kernel (e.g. `std::array::from_fn(|r| ...)`) does not get
# them, so the intrinsics it calls stay functions of their own, taking vectors through
# memory: 6f1aee8 did this to the AVX-512 F emulation of `vdpbf16ps`, which then decoded
# 17x slower, and nothing else noticed. Debug and test builds (opt-level 0-1) keep many
# intrinsics out of line by design: check a release build. `_xgetbv` (CPU detection) is
# called out of line on purpose.
set -euo pipefail
bin=${1:-target/release/mlb-run}
[ -f "$bin" ] || { echo "check-intrinsics: $bin: no such file (build it with cargo build --release)" >&2; exit 2; }
out=$(nm -C "$bin" | awk '{ $1 = ""; $2 = ""; sub(/^  /, ""); print }' |
  grep -E '^core::core_arch::(x86|x86_64|aarch64|arm_shared)::' |
  grep -vE '::(_xgetbv|__cpuid|__cpuid_count)$' | sort -u || true)
if [ -n "$out" ]; then
  echo "check-intrinsics: $bin calls these SIMD intrinsics out of line (a closure in a kernel?):" >&2
  echo "$out" >&2
  exit 1
fi
echo "check-intrinsics: $bin: every SIMD intrinsic is inlined"
