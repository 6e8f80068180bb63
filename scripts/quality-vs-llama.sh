#!/usr/bin/env bash
# Quality of Krafla's and llama.cpp's quantizations against each one's own BF16 model of
# the same checkpoint, side by side (docs/benchmarks-quality.md, "Against the original"):
#
#   Krafla:    mlb-run Q.mlb --file EVAL --kl-divergence BF16.mlb --ctx 512 --chunks N
#              for Q8_0 and Q4_0 (round, search, imatrix) with --q8 none and the default
#              (--q8 wcls); the imatrix from mlb-run BF16.mlb --imatrix on CALIB.
#   llama.cpp: llama-perplexity --kl-divergence-base from its bf16 GGUF
#              (convert_hf_to_gguf.py --outtype bf16), then --kl-divergence for Q8_0, Q6_K,
#              Q4_0 (its default mix), Q4_0 --pure, Q4_0 + imatrix and Q4_K_M + imatrix; the
#              imatrix from llama-imatrix on the bf16 GGUF with the same CALIB text.
#
# The same evaluation text, 512-token chunks, the second half of each chunk scored (both
# tools' rule), the same calibration text and chunk count for both imatrices; file sizes
# beside. Prints the tables; with WRITE_DOC=1 also puts them into docs/benchmarks-quality.md
# between its "quality-vs-llama" markers (one run regenerates that section).
#
# usage: scripts/quality-vs-llama.sh            (every model of MODELS)
# Environment (defaults in brackets):
#   BENCH_DIR  llama.cpp's source and build, GGUF files (scripts/bench.sh's)
#              [${XDG_CACHE_HOME:-$HOME/.cache}/krafla-bench]
#   REAL_DIR   the HF checkpoints (smollm2-135m/, gemma3-270m/) [$BENCH_DIR/real]
#   PYTHON     a Python with torch/transformers/gguf for convert_hf_to_gguf.py
#              [$BENCH_DIR/venv/bin/python]
#   MODELS ["smollm2-135m gemma3-270m"]  CHUNKS: evaluation chunks [16]
#   CALIB_CHUNKS: calibration chunks for both imatrices [24]  CTX [512]  THREADS [2]
#   CALIB, EVAL: the texts [made in OUT: Python's pydoc_data topics; Debian's common-licenses]
#   OUT        results and the files it makes [$BENCH_DIR/quality]
#   WRITE_DOC=1  splice the tables into docs/benchmarks-quality.md
# Slow at the defaults (tens of minutes per model on 2 cores); CHUNKS=2 CALIB_CHUNKS=2
# proves the pipeline in a few minutes. Measure on an idle machine: the figures are
# deterministic, but the run is long.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BENCH_DIR=${BENCH_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/krafla-bench}
REAL_DIR=${REAL_DIR:-$BENCH_DIR/real}
PYTHON=${PYTHON:-$BENCH_DIR/venv/bin/python}
MODELS=${MODELS:-smollm2-135m gemma3-270m}
CHUNKS=${CHUNKS:-16}
CALIB_CHUNKS=${CALIB_CHUNKS:-24}
CTX=${CTX:-512}
THREADS=${THREADS:-2}
OUT=${OUT:-$BENCH_DIR/quality}
WRITE_DOC=${WRITE_DOC:-0}
case "$OUT/" in "$repo"/*) echo "quality-vs-llama.sh: OUT must be outside the repository" >&2; exit 2;; esac
mkdir -p "$OUT"
log() { printf '[quality %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# llama.cpp: the source scripts/bench.sh unpacked, its build, three more tools.
llama=$(ls -d "$BENCH_DIR"/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | sort -V | tail -1 || true)
build=$BENCH_DIR/build
if [ -z "$llama" ] || [ ! -f "$build/CMakeCache.txt" ]; then
  echo "quality-vs-llama.sh: no llama.cpp build in $BENCH_DIR (run PREPARE_ONLY=1 scripts/bench.sh first)" >&2
  exit 2
fi
lb=$build/bin
if [ ! -x "$lb/llama-perplexity" ] || [ ! -x "$lb/llama-imatrix" ] || [ ! -x "$lb/llama-quantize" ]; then
  cmake=$(sed -n 's/^CMAKE_COMMAND:INTERNAL=//p' "$build/CMakeCache.txt")
  log "building llama-perplexity, llama-imatrix, llama-quantize (nice 19)"
  nice -n 19 "$cmake" --build "$build" --config Release -j "$(nproc)" \
    --target llama-perplexity llama-imatrix llama-quantize >"$OUT/cmake-build.log" 2>&1
fi

# Krafla.
(cd "$repo" && cargo build -q --release --bin mlb-convert --bin mlt-convert --bin mlb-run)
kb=$repo/target/release

# The texts (docs/benchmarks-quality.md, "Texts"), unless given.
if [ -z "${CALIB:-}" ] || [ -z "${EVAL:-}" ]; then
  python3 - "$OUT" <<'PY'
import os, sys
from pydoc_data.topics import topics as t
out = sys.argv[1]
open(os.path.join(out, 'calib.txt'), 'w').write('\n\n'.join(t[k] for k in sorted(t)))
names = ['GPL-3', 'GPL-2', 'LGPL-2.1', 'MPL-2.0', 'Apache-2.0', 'GFDL-1.3', 'Artistic',
         'CC0-1.0', 'MPL-1.1', 'GPL-1']
open(os.path.join(out, 'eval.txt'), 'w').write('\n\n'.join(
    open('/usr/share/common-licenses/' + n, encoding='utf-8', errors='replace').read()
    for n in names))
PY
fi
CALIB=${CALIB:-$OUT/calib.txt}
EVAL=${EVAL:-$OUT/eval.txt}
echo "Texts: calibration $(basename "$CALIB") $(md5sum <"$CALIB" | cut -c1-32), evaluation $(basename "$EVAL") $(md5sum <"$EVAL" | cut -c1-32)" >"$OUT/texts.txt"

for m in $MODELS; do
  d=$OUT/$m
  mkdir -p "$d"
  src=$REAL_DIR/$m
  [ -f "$src/config.json" ] || { echo "quality-vs-llama.sh: no checkpoint $src" >&2; exit 2; }
  res=$d/results.jsonl
  : >"$res.tmp"

  # ---- Krafla
  conv() { # name args...
    local n=$1; shift
    if [ ! -f "$d/$n.mlb" ]; then
      log "mlb-convert $m $n: $*"
      "$kb/mlb-convert" "$src" -o "$d/$n.mlb" --threads "$THREADS" "$@" >"$d/$n.convert.log" 2>&1
    fi
    [ "$n" = bf16 ] || cp "$d/bf16.mlt" "$d/$n.mlt"
  }
  "$kb/mlt-convert" "$src/tokenizer.json" -o "$d/bf16.mlt" -q
  conv bf16 --wtype bf16
  if [ ! -f "$d/krafla.mli" ]; then
    log "mlb-run --imatrix $m ($CALIB_CHUNKS chunks)"
    "$kb/mlb-run" "$d/bf16.mlb" --file "$CALIB" --imatrix "$d/krafla.mli" --ctx "$CTX" \
      --chunks "$CALIB_CHUNKS" --threads "$THREADS" >"$d/krafla-imatrix.log" 2>&1
  fi
  conv q8_0 --wtype q8_0
  for q8 in none wcls; do
    q4=(--wtype q4_0 --q8 "$q8")
    conv "q4_0-round-$q8" "${q4[@]}" --q4-rule round
    conv "q4_0-search-$q8" "${q4[@]}" --q4-rule search
    conv "q4_0-imatrix-$q8" "${q4[@]}" --q4-rule search --imatrix "$d/krafla.mli"
  done
  for n in q8_0 q4_0-round-none q4_0-search-none q4_0-imatrix-none q4_0-round-wcls q4_0-search-wcls q4_0-imatrix-wcls; do
    kj=$d/$n.kl-$CHUNKS.json  # kept: a rerun (e.g. with WRITE_DOC=1) only tabulates
    if [ ! -f "$kj" ]; then
      log "mlb-run --kl-divergence $m $n"
      "$kb/mlb-run" "$d/$n.mlb" --file "$EVAL" --kl-divergence "$d/bf16.mlb" --ctx "$CTX" \
        --chunks "$CHUNKS" --threads "$THREADS" --json >"$kj.tmp" 2>"$d/$n.kl.log"
      mv "$kj.tmp" "$kj"
    fi
    echo "{\"tool\": \"krafla\", \"name\": \"$n\", \"bytes\": $(stat -c %s "$d/$n.mlb"), \"kl\": $(cat "$kj")}" >>"$res.tmp"
  done

  # ---- llama.cpp
  bf16=$BENCH_DIR/gguf/$m-bf16.gguf
  if [ ! -f "$bf16" ]; then
    log "convert_hf_to_gguf.py $m --outtype bf16"
    "$PYTHON" "$llama/convert_hf_to_gguf.py" "$src" --outtype bf16 --outfile "$bf16.tmp" >"$d/convert-gguf.log" 2>&1
    mv "$bf16.tmp" "$bf16"
  fi
  imat=$d/llama-imatrix.gguf
  if [ ! -f "$imat" ]; then
    log "llama-imatrix $m ($CALIB_CHUNKS chunks)"
    "$lb/llama-imatrix" -m "$bf16" -f "$CALIB" -c "$CTX" --chunks "$CALIB_CHUNKS" -t "$THREADS" \
      -o "$imat.tmp.gguf" >"$d/llama-imatrix.log" 2>&1
    mv "$imat.tmp.gguf" "$imat"
  fi
  lq() { # name type [quantize flags...]
    local n=$1 t=$2; shift 2
    if [ ! -f "$d/$n.gguf" ]; then
      log "llama-quantize $m $n"
      "$lb/llama-quantize" "$@" "$bf16" "$d/$n.gguf.tmp" "$t" "$THREADS" >"$d/$n.quantize.log" 2>&1
      mv "$d/$n.gguf.tmp" "$d/$n.gguf"
    fi
  }
  lq llama-q8_0 Q8_0
  lq llama-q6_k Q6_K
  lq llama-q4_0 Q4_0
  lq llama-q4_0-pure Q4_0 --pure
  lq llama-q4_0-imatrix Q4_0 --imatrix "$imat"
  lq llama-q4_k_m-imatrix Q4_K_M --imatrix "$imat"
  base=$d/llama-bf16-$CHUNKS.kld
  if [ ! -f "$base" ]; then
    log "llama-perplexity --kl-divergence-base $m"
    "$lb/llama-perplexity" -m "$bf16" -f "$EVAL" -c "$CTX" --chunks "$CHUNKS" -t "$THREADS" \
      --kl-divergence-base "$base.tmp" >"$d/llama-base.log" 2>&1
    mv "$base.tmp" "$base"
  fi
  for n in llama-q8_0 llama-q6_k llama-q4_0 llama-q4_0-pure llama-q4_0-imatrix llama-q4_k_m-imatrix; do
    if [ ! -f "$d/$n.kl-$CHUNKS.log" ]; then
      log "llama-perplexity --kl-divergence $m $n"
      "$lb/llama-perplexity" -m "$d/$n.gguf" --kl-divergence-base "$base" --kl-divergence \
        -c "$CTX" --chunks "$CHUNKS" -t "$THREADS" >"$d/$n.kl-$CHUNKS.log.tmp" 2>&1
      mv "$d/$n.kl-$CHUNKS.log.tmp" "$d/$n.kl-$CHUNKS.log"
    fi
    python3 - "$d/$n.kl-$CHUNKS.log" "$n" "$(stat -c %s "$d/$n.gguf")" >>"$res.tmp" <<'PY'
import json, re, sys
log, name, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
t = open(log, errors="replace").read()
def pm(label):
    m = re.search(re.escape(label) + r"\s*:\s*([-\d.]+)(?:\s*±\s*([-\d.]+))?", t)
    if not m:
        sys.exit(f"{log}: no '{label}'")
    return float(m.group(1)), float(m.group(2) or 0)
kl, ci = pm("Mean    KLD")
p99, _ = pm("99.0%   KLD")
top, topci = pm("Same top p")
ppl, _ = pm("Mean PPL(Q)")
ppl_ref, _ = pm("Mean PPL(base)")
# llama-perplexity prints ± one standard error; Krafla's ± is 1.96 of them (95% CI).
print(json.dumps({"tool": "llama.cpp", "name": name, "bytes": size,
                  "kl": {"kl_mean": kl, "kl_ci95": 1.96 * ci, "kl_p99": p99,
                         "top1": top / 100, "ppl": ppl, "ppl_ref": ppl_ref}}))
PY
  done
  mv "$res.tmp" "$res"
  stat -c %s "$d/bf16.mlb" >"$d/bf16.bytes"
  stat -c %s "$bf16" >"$d/llama-bf16.bytes"
done

# The tables.
table=$OUT/tables.md
python3 - "$OUT" "$CHUNKS" "$CALIB_CHUNKS" "$CTX" "$MODELS" >"$table" <<'PY'
import json, os, sys
out, chunks, cchunks, ctx, models = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5].split()
label = {
    "q8_0": "Q8_0", "q4_0-round-none": "Q4_0 round, `--q8 none`", "q4_0-search-none": "Q4_0 search, `--q8 none`",
    "q4_0-imatrix-none": "Q4_0 imatrix, `--q8 none`", "q4_0-round-wcls": "Q4_0 round (default `--q8 wcls`)",
    "q4_0-search-wcls": "Q4_0 search (default `--q8 wcls`)", "q4_0-imatrix-wcls": "Q4_0 imatrix (default `--q8 wcls`)",
    "llama-q8_0": "Q8_0", "llama-q6_k": "Q6_K", "llama-q4_0": "Q4_0 (its default mix)",
    "llama-q4_0-pure": "Q4_0 `--pure`", "llama-q4_0-imatrix": "Q4_0 + imatrix",
    "llama-q4_k_m-imatrix": "Q4_K_M + imatrix",
}
print(open(os.path.join(out, "texts.txt")).read().strip())
print(f"\n{chunks} evaluation chunks of {ctx} tokens (second halves scored), imatrices from {cchunks} calibration chunks")
for m in models:
    d = os.path.join(out, m)
    rows = [json.loads(l) for l in open(os.path.join(d, "results.jsonl"))]
    n_params_bytes = int(open(os.path.join(d, "bf16.bytes")).read())
    print(f"\n### {m}\n")
    print(f"Reference: each tool's BF16 file (Krafla {n_params_bytes / 1e6:.1f} MB, llama.cpp "
          f"{int(open(os.path.join(d, 'llama-bf16.bytes')).read()) / 1e6:.1f} MB).\n")
    print("| tool | file | size MB | mean KLD ± 95% CI | KLD p99 | top-1 | PPL | PPL BF16 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        k = r["kl"]
        print(f"| {r['tool']} | {label.get(r['name'], r['name'])} | {r['bytes'] / 1e6:.1f} | "
              f"{k['kl_mean']:.4f} ± {k['kl_ci95']:.4f} | {k['kl_p99']:.3f} | {100 * k['top1']:.2f}% | "
              f"{k['ppl']:.3f} | {k['ppl_ref']:.3f} |")
PY
cat "$table"

if [ "$WRITE_DOC" = 1 ]; then
  doc=$repo/docs/benchmarks-quality.md
  python3 - "$doc" "$table" "$(date -u '+%Y-%m-%d %H:%M UTC'); $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'); threads $THREADS; load $(cut -d' ' -f1-3 /proc/loadavg)" <<'PY'
import sys
doc, table, stamp = sys.argv[1], sys.argv[2], sys.argv[3]
s = open(doc).read()
b, e = "<!-- quality-vs-llama:begin -->", "<!-- quality-vs-llama:end -->"
i, j = s.index(b) + len(b), s.index(e)
s = s[:i] + "\n\nMeasured " + stamp + " by `scripts/quality-vs-llama.sh`.\n\n" + open(table).read().strip() + "\n\n" + s[j:]
open(doc + ".tmp", "w").write(s)
import os; os.replace(doc + ".tmp", doc)
PY
  log "wrote the tables into $doc"
fi
