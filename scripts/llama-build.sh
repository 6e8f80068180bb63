# Sourced by bench.sh and bench-serve.sh (not run on its own): llama.cpp's CMake build,
# CPU only. Needs BENCH_DIR (logs in $BENCH_DIR/logs) and BENCH_VENV.
#
# build_llama SRC BUILD SERVER LOG TARGET...: configures llama.cpp's source SRC into
# BUILD (-DLLAMA_BUILD_SERVER=SERVER, ON or OFF) and builds the TARGETs, at nice 19;
# the output goes to $BENCH_DIR/logs/cmake-LOGconfigure.log and cmake-LOGbuild.log.
# AMX is off: its path crashes here. cmake is the one on PATH, else $BENCH_VENV's (pip
# installs it, making the venv first if there is none).
build_llama() {
  local src=$1 build=$2 server=$3 logname=$4
  shift 4
  local cmake flags
  cmake=$(command -v cmake || true)
  if [ -z "$cmake" ]; then
    [ -x "$BENCH_VENV/bin/cmake" ] || { [ -x "$BENCH_VENV/bin/pip" ] || python3 -m venv "$BENCH_VENV"; "$BENCH_VENV/bin/pip" install -q cmake; }
    cmake=$BENCH_VENV/bin/cmake
  fi
  flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  nice -n 19 "$cmake" -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER="$server" \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" >"$BENCH_DIR/logs/cmake-${logname}configure.log" 2>&1
  nice -n 19 "$cmake" --build "$build" --config Release -j "$(nproc)" --target "$@" \
    >"$BENCH_DIR/logs/cmake-${logname}build.log" 2>&1
}
