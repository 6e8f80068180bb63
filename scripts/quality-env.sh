# Sourced by quality-vs-llama.sh, type-error-vs-llama.sh and import-agreement.sh (not run on
# its own): the environment they share, with its defaults, and llama.cpp's build.
#
#   BENCH_DIR  llama.cpp's source and build, GGUF files (scripts/bench.sh's)
#              [${XDG_CACHE_HOME:-$HOME/.cache}/krafla-bench]
#   REAL_DIR   the HF checkpoints (smollm2-135m/, gemma3-270m/) [$BENCH_DIR/real]
#   PYTHON     a Python with torch/transformers/gguf [$BENCH_DIR/venv/bin/python]
#   MODELS ["smollm2-135m gemma3-270m"]  CTX [512]  THREADS [2]
#   OUT        results and the files the scripts make [$BENCH_DIR/quality]
#
# Sets `repo` (the repository), `llama` (llama.cpp's unpacked source, if any) and `lb`
# (its build's bin folder).
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BENCH_DIR=${BENCH_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/krafla-bench}
REAL_DIR=${REAL_DIR:-$BENCH_DIR/real}
PYTHON=${PYTHON:-$BENCH_DIR/venv/bin/python}
MODELS=${MODELS:-smollm2-135m gemma3-270m}
CTX=${CTX:-512}
THREADS=${THREADS:-2}
OUT=${OUT:-$BENCH_DIR/quality}
llama=$(ls -d "$BENCH_DIR"/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | sort -V | tail -1 || true)
lb=$BENCH_DIR/build/bin

# need_llama SCRIPT TOOL...: exits 2 naming SCRIPT unless llama.cpp's TOOLs are built.
need_llama() {
  local script=$1 t
  shift
  for t in "$@"; do
    [ -x "$lb/$t" ] && [ -n "$llama" ] ||
      { echo "$script: no llama.cpp build in $BENCH_DIR (run scripts/quality-vs-llama.sh first)" >&2; exit 2; }
  done
}
