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
#              imatrix from llama-imatrix on the bf16 GGUF with the same CALIB text; also
#              Q6_K + imatrix and IQ4_NL --pure + imatrix (its best type at 4.5 bits per
#              weight on every matrix: its K types fall back to larger types on rows that
#              are not whole 256-weight super-blocks, as these models' are).
#   Krafla mixes (issue 16): mlb-convert --target-bpw X --imatrix (Krafla's imatrix, same
#              CALIB text) at X = the bits per weight of llama.cpp's Q4_K_M + imatrix file,
#              of its Q6_K file, and 4.5. Sizes are matched on the matrices, the bits per
#              weight as mlb-inspect counts them: 8 × the bytes of every 2-D tensor of the
#              GGUF (scales included) / their weights, rounded up to 1e-9, is the target, so
#              the budget (mlb-convert floors target × weights / 8) is the GGUF's matrix
#              bytes to the byte; the mix stays at or below it. The file sizes differ by what is not a matrix
#              (norms; the GGUF also carries the tokenizer, which Krafla keeps in the .mlt);
#              the table lists both sizes and both bits per weight, and a targets table the
#              ratio of mean KLDs (the issue's target: ≤ 0.9).
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
#   ONLY_TARGETS=1  only the rows issue 16's targets compare (Krafla's mixes; llama.cpp's
#              Q4_K_M + imatrix, Q6_K with and without, IQ4_NL --pure + imatrix)
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
ONLY_TARGETS=${ONLY_TARGETS:-0}
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
(cd "$repo" && cargo build -q --release --bin mlb-convert --bin mlt-convert --bin mlb-run --bin mlb-inspect)
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
  krow() { # name kl.json: one result line, with the matrices' bits per weight (mlb-inspect's)
    local bpw
    bpw=$("$kb/mlb-inspect" "$d/$1.mlb" --json | python3 -c 'import json, sys
t = json.load(sys.stdin)["totals"]["types"]
print(8 * sum(x["bytes"] for x in t) / sum(x["parameters"] for x in t))')
    echo "{\"tool\": \"krafla\", \"name\": \"$1\", \"bytes\": $(stat -c %s "$d/$1.mlb"), \"bpw\": $bpw, \"kl\": $(cat "$2")}" >>"$res.tmp"
  }
  kld() { # name: the mean KLD of NAME.mlb against bf16.mlb, kept as NAME.kl-CHUNKS.json
    local kj=$d/$1.kl-$CHUNKS.json  # kept: a rerun (e.g. with WRITE_DOC=1) only tabulates
    if [ ! -f "$kj" ]; then
      log "mlb-run --kl-divergence $m $1"
      "$kb/mlb-run" "$d/$1.mlb" --file "$EVAL" --kl-divergence "$d/bf16.mlb" --ctx "$CTX" \
        --chunks "$CHUNKS" --threads "$THREADS" --json >"$kj.tmp" 2>"$d/$1.kl.log"
      mv "$kj.tmp" "$kj"
    fi
  }
  "$kb/mlt-convert" "$src/tokenizer.json" -o "$d/bf16.mlt" -q
  conv bf16 --wtype bf16
  if [ ! -f "$d/krafla.mli" ]; then
    log "mlb-run --imatrix $m ($CALIB_CHUNKS chunks)"
    "$kb/mlb-run" "$d/bf16.mlb" --file "$CALIB" --imatrix "$d/krafla.mli" --ctx "$CTX" \
      --chunks "$CALIB_CHUNKS" --threads "$THREADS" >"$d/krafla-imatrix.log" 2>&1
  fi
  kq="q8_0 q4_0-round-none q4_0-search-none q4_0-imatrix-none q4_0-round-wcls q4_0-search-wcls q4_0-imatrix-wcls"
  lqs="llama-q8_0 llama-q6_k llama-q6_k-imatrix llama-q4_0 llama-q4_0-pure llama-q4_0-imatrix llama-iq4_nl-pure-imatrix llama-q4_k_m-imatrix"
  if [ "$ONLY_TARGETS" = 1 ]; then
    kq="" lqs="llama-q6_k llama-q6_k-imatrix llama-iq4_nl-pure-imatrix llama-q4_k_m-imatrix"
  fi
  [ -z "$kq" ] || conv q8_0 --wtype q8_0
  [ -z "$kq" ] || for q8 in none wcls; do
    q4=(--wtype q4_0 --q8 "$q8")
    conv "q4_0-round-$q8" "${q4[@]}" --q4-rule round
    conv "q4_0-search-$q8" "${q4[@]}" --q4-rule search
    conv "q4_0-imatrix-$q8" "${q4[@]}" --q4-rule search --imatrix "$d/krafla.mli"
  done
  for n in $kq; do
    kld "$n"
    krow "$n" "$d/$n.kl-$CHUNKS.json"
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
  for n in $lqs; do
    case $n in
      llama-q8_0) lq $n Q8_0 ;;
      llama-q6_k) lq $n Q6_K ;;
      llama-q6_k-imatrix) lq $n Q6_K --imatrix "$imat" ;;
      llama-q4_0) lq $n Q4_0 ;;
      llama-q4_0-pure) lq $n Q4_0 --pure ;;
      llama-q4_0-imatrix) lq $n Q4_0 --imatrix "$imat" ;;
      llama-iq4_nl-pure-imatrix) lq $n IQ4_NL --pure --imatrix "$imat" ;;
      llama-q4_k_m-imatrix) lq $n Q4_K_M --imatrix "$imat" ;;
    esac
  done
  gbpw() { # GGUF: bits per weight of its 2-D tensors, scales included (mlb-inspect's count)
    PYTHONPATH=$llama/gguf-py "$PYTHON" - "$1" <<'PY'
import sys, gguf
r = gguf.GGUFReader(sys.argv[1])
w = b = 0
for t in r.tensors:
    if len(t.shape) == 2:
        w += int(t.n_elements); b += int(t.n_bytes)
print(f"{8 * b / w:.15f}")
PY
  }
  base=$d/llama-bf16-$CHUNKS.kld
  if [ ! -f "$base" ]; then
    log "llama-perplexity --kl-divergence-base $m"
    "$lb/llama-perplexity" -m "$bf16" -f "$EVAL" -c "$CTX" --chunks "$CHUNKS" -t "$THREADS" \
      --kl-divergence-base "$base.tmp" >"$d/llama-base.log" 2>&1
    mv "$base.tmp" "$base"
  fi
  for n in $lqs; do
    if [ ! -f "$d/$n.kl-$CHUNKS.log" ]; then
      log "llama-perplexity --kl-divergence $m $n"
      "$lb/llama-perplexity" -m "$d/$n.gguf" --kl-divergence-base "$base" --kl-divergence \
        -c "$CTX" --chunks "$CHUNKS" -t "$THREADS" >"$d/$n.kl-$CHUNKS.log.tmp" 2>&1
      mv "$d/$n.kl-$CHUNKS.log.tmp" "$d/$n.kl-$CHUNKS.log"
    fi
    "$PYTHON" - "$d/$n.kl-$CHUNKS.log" "$n" "$(stat -c %s "$d/$n.gguf")" "$(gbpw "$d/$n.gguf")" >>"$res.tmp" <<'PY'
import json, re, sys
log, name, size, bpw = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
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
print(json.dumps({"tool": "llama.cpp", "name": name, "bytes": size, "bpw": bpw,
                  "kl": {"kl_mean": kl, "kl_ci95": 1.96 * ci, "kl_p99": p99,
                         "top1": top / 100, "ppl": ppl, "ppl_ref": ppl_ref}}))
PY
  done

  # ---- Krafla mixes at llama.cpp's sizes (the GGUF's matrix bytes as the budget)
  mixes="mix-q4_k_m:$(gbpw "$d/llama-q4_k_m-imatrix.gguf") mix-q6_k:$(gbpw "$d/llama-q6_k.gguf") mix-4.5:4.5"
  for nb in $mixes; do
    n=${nb%%:*} x=$(python3 -c "import math, sys; print(f'{math.ceil(float(sys.argv[1]) * 1e9) / 1e9:.9f}')" "${nb#*:}")
    # A new target or new mix constants (src/convert/mix.rs) make the mix again.
    stamp="$x $(md5sum <"$repo/src/convert/mix.rs" | cut -c1-32)"
    if [ "$(cat "$d/$n.stamp" 2>/dev/null)" != "$stamp" ]; then
      rm -f "$d/$n.mlb" "$d/$n".kl-*.json
      echo "$stamp" >"$d/$n.stamp"
    fi
    conv "$n" --target-bpw "$x" --imatrix "$d/krafla.mli" --mix-report "$d/$n.mix.json"
    kld "$n"
    krow "$n" "$d/$n.kl-$CHUNKS.json"
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
    "llama-q4_k_m-imatrix": "Q4_K_M + imatrix", "llama-q6_k-imatrix": "Q6_K + imatrix",
    "llama-iq4_nl-pure-imatrix": "IQ4_NL `--pure` + imatrix",
    "mix-q4_k_m": "`--target-bpw` at Q4_K_M's bpw + imatrix", "mix-q6_k": "`--target-bpw` at Q6_K's bpw + imatrix",
    "mix-4.5": "`--target-bpw 4.5` + imatrix",
}
# The issue's targets: Krafla's mix against llama.cpp's file of the same size.
pairs = [("mix-q4_k_m", ["llama-q4_k_m-imatrix"]), ("mix-q6_k", ["llama-q6_k", "llama-q6_k-imatrix"]),
         ("mix-4.5", ["llama-iq4_nl-pure-imatrix"])]
print(open(os.path.join(out, "texts.txt")).read().strip())
print(f"\n{chunks} evaluation chunks of {ctx} tokens (second halves scored), imatrices from {cchunks} calibration chunks")
for m in models:
    d = os.path.join(out, m)
    rows = [json.loads(l) for l in open(os.path.join(d, "results.jsonl"))]
    n_params_bytes = int(open(os.path.join(d, "bf16.bytes")).read())
    print(f"\n### {m}\n")
    print(f"Reference: each tool's BF16 file (Krafla {n_params_bytes / 1e6:.1f} MB, llama.cpp "
          f"{int(open(os.path.join(d, 'llama-bf16.bytes')).read()) / 1e6:.1f} MB).\n")
    print("| tool | file | size MB | matrix bpw | mean KLD ± 95% CI | KLD p99 | top-1 | PPL | PPL BF16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        k = r["kl"]
        print(f"| {r['tool']} | {label.get(r['name'], r['name'])} | {r['bytes'] / 1e6:.1f} | {r['bpw']:.3f} | "
              f"{k['kl_mean']:.4f} ± {k['kl_ci95']:.4f} | {k['kl_p99']:.3f} | {100 * k['top1']:.2f}% | "
              f"{k['ppl']:.3f} | {k['ppl_ref']:.3f} |")
    by = {r["name"]: r for r in rows}
    print("\nIssue 16's targets (Krafla's mean KLD ≤ 0.9 × llama.cpp's at the same size, ±2%):\n")
    print("| Krafla | llama.cpp | bpw K / L | size MB K / L (ratio) | mean KLD K / L | ratio | ≤ 0.9 |")
    print("|---|---|---|---|---|---|---|")
    for kn, lns in pairs:
        if kn not in by:
            continue
        k = by[kn]
        # The comparator: the best llama.cpp file of that size.
        l = min((by[n] for n in lns if n in by), key=lambda r: r["kl"]["kl_mean"])
        q = k["kl"]["kl_mean"] / l["kl"]["kl_mean"]
        print(f"| {label[kn]} | {label[l['name']]} | {k['bpw']:.3f} / {l['bpw']:.3f} | "
              f"{k['bytes'] / 1e6:.1f} / {l['bytes'] / 1e6:.1f} ({k['bytes'] / l['bytes']:.3f}) | "
              f"{k['kl']['kl_mean']:.4f} / {l['kl']['kl_mean']:.4f} | {q:.2f} | {'yes' if q <= 0.9 else 'no'} |")
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
