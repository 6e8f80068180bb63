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
#   Krafla mixes (issues 16 and 43): mlb-convert --target-bpw X --imatrix (Krafla's
#              imatrix, same CALIB text) at X = the bits per weight of llama.cpp's file of each
#              type of SIZES (IQ2_M, IQ3_XXS, IQ3_M, IQ4_XS, Q4_K_M, Q6_K, each + imatrix),
#              and 4.5; each also with --gguf-types, exported by mlb-export and measured
#              inside llama.cpp (llama-perplexity --kl-divergence against llama.cpp's own
#              BF16 logits) beside llama-quantize's file of that size.
#   Error feedback (issue 43): the same --target-bpw mix at each FEEDBACK point, from an
#              imatrix with covariance (mlb-run --imatrix --covariance, same CALIB chunks),
#              with and without --no-error-feedback. Sizes are matched on the matrices, the bits per
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
#   SIZES ["iq2_m iq3_xxs iq3_m iq4_xs q4_k_m q6_k"]: llama-quantize types (+ imatrix) at
#              whose sizes Krafla's mixes are made
#   FEEDBACK ["3.0 4.0"]: bits per weight of the error-feedback comparison ("" skips it)
#   ONLY_TARGETS=1  only the rows the issues' targets compare (Krafla's mixes; llama.cpp's
#              SIZES files, Q6_K without imatrix, IQ4_NL --pure + imatrix)
#   The plot (KLD against bits per weight, both tools) is OUT/quality-vs-llama.png, made by
#   scripts/plot-quality.py (matplotlib, installed into PYTHON's venv if missing); with
#   WRITE_DOC=1 also docs/img/quality-vs-llama.png.
# Slow at the defaults (tens of minutes per model on 2 cores); CHUNKS=2 CALIB_CHUNKS=2
# proves the pipeline in a few minutes. Measure on an idle machine: the figures are
# deterministic, but the run is long.
set -euo pipefail

# shellcheck source=quality-env.sh
. "$(dirname "${BASH_SOURCE[0]}")/quality-env.sh"
CHUNKS=${CHUNKS:-16}
CALIB_CHUNKS=${CALIB_CHUNKS:-24}
WRITE_DOC=${WRITE_DOC:-0}
ONLY_TARGETS=${ONLY_TARGETS:-0}
SIZES=${SIZES-iq2_m iq3_xxs iq3_m iq4_xs q4_k_m q6_k}
FEEDBACK=${FEEDBACK-3.0 4.0}
case "$OUT/" in "$repo"/*) echo "quality-vs-llama.sh: OUT must be outside the repository" >&2; exit 2;; esac
mkdir -p "$OUT"
log() { printf '[quality %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# llama.cpp: the source scripts/bench.sh unpacked (quality-env.sh found it), its build,
# three more tools.
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
(cd "$repo" && cargo build -q --release --bin mlb-convert --bin mlt-convert --bin mlb-run --bin mlb-inspect --bin mlb-export)
kb=${CARGO_TARGET_DIR:-$repo/target}/release
# What a mix depends on: a change to the mix or the quantizers makes the mixes again.
mixsrc=$(cat "$repo"/src/convert/pipeline/*.rs "$repo"/src/quant/*.rs | md5sum | cut -c1-32)

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
  krow() { # name kl.json: one result line, with the matrices' bits per weight (mlb-inspect's),
    # the whole file's (8 × file bytes / parameters; the tokenizer is in the .mlt) and the
    # types chosen per class
    "$kb/mlb-inspect" "$d/$1.mlb" --json | python3 -c 'import json, re, sys
d = json.load(sys.stdin)
t = d["totals"]
types = {}
for x in d["tensors"]:
    if len(x["shape"]) == 2:
        c = re.sub(r"^layers\.\d+\.", "", x["name"])
        types.setdefault(c, {}).setdefault(x["type"], 0)
        types[c][x["type"]] += 1
print(json.dumps({"tool": "krafla", "name": sys.argv[1], "bytes": int(sys.argv[2]),
    "bpw": 8 * sum(x["bytes"] for x in t["types"]) / sum(x["parameters"] for x in t["types"]),
    "bpw_file": 8 * int(sys.argv[2]) / t["parameters"], "types": types,
    "kl": json.load(open(sys.argv[3]))}))' "$1" "$(stat -c %s "$d/$1.mlb")" "$2" >>"$res.tmp"
  }
  mixconv() { # name bpw args...: a --target-bpw mix, made again when the target or the mix's sources change
    local n=$1 x=$2 stamp; shift 2
    stamp="$x $* $mixsrc"
    if [ "$(cat "$d/$n.stamp" 2>/dev/null)" != "$stamp" ]; then
      rm -f "$d/$n.mlb" "$d/$n".kl-*.json "$d/$n.gguf" "$d/$n".kl-*.log
      echo "$stamp" >"$d/$n.stamp"
    fi
    conv "$n" --target-bpw "$x" "$@"
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
  sized=""
  for z in $SIZES; do sized+=" llama-$z-imatrix"; done
  lqs="llama-q8_0 llama-q6_k llama-q4_0 llama-q4_0-pure llama-q4_0-imatrix llama-iq4_nl-pure-imatrix$sized"
  if [ "$ONLY_TARGETS" = 1 ]; then
    kq="" lqs="llama-q6_k llama-iq4_nl-pure-imatrix$sized"
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
      llama-q4_0) lq $n Q4_0 ;;
      llama-q4_0-pure) lq $n Q4_0 --pure ;;
      llama-iq4_nl-pure-imatrix) lq $n IQ4_NL --pure --imatrix "$imat" ;;
      llama-*-imatrix) t=${n#llama-}; t=${t%-imatrix}; lq $n "${t^^}" --imatrix "$imat" ;;
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
  lrow() { # name tool: llama-perplexity --kl-divergence of NAME.gguf, one result line
    local n=$1
    if [ ! -f "$d/$n.kl-$CHUNKS.log" ]; then
      log "llama-perplexity --kl-divergence $m $n"
      "$lb/llama-perplexity" -m "$d/$n.gguf" --kl-divergence-base "$base" --kl-divergence \
        -c "$CTX" --chunks "$CHUNKS" -t "$THREADS" >"$d/$n.kl-$CHUNKS.log.tmp" 2>&1
      mv "$d/$n.kl-$CHUNKS.log.tmp" "$d/$n.kl-$CHUNKS.log"
    fi
    PYTHONPATH=$llama/gguf-py "$PYTHON" - "$d/$n.kl-$CHUNKS.log" "$n" "$d/$n.gguf" "$2" >>"$res.tmp" <<'PY'
import json, os, re, sys
import gguf
log, name, path, tool = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
size = os.path.getsize(path)
# Bits per weight of the 2-D tensors (scales included: mlb-inspect's count) and of the
# whole file (tokenizer included) over every parameter; the types chosen per class, by
# Krafla's class names.
cls = {"token_embd": "tok_emb", "output": "wcls", "attn_q": "wq", "attn_k": "wk",
       "attn_v": "wv", "attn_output": "wo", "ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}
w = b = n_all = 0
types = {}
for x in gguf.GGUFReader(path).tensors:
    n_all += int(x.n_elements)
    if len(x.shape) == 2:
        w += int(x.n_elements); b += int(x.n_bytes)
        c = re.sub(r"^blk\.\d+\.", "", x.name).removesuffix(".weight")
        c = cls.get(c, c)
        ty = x.tensor_type.name
        types.setdefault(c, {}).setdefault(ty, 0)
        types[c][ty] += 1
bpw = 8 * b / w
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
print(json.dumps({"tool": tool, "name": name, "bytes": size, "bpw": bpw,
                  "bpw_file": 8 * size / n_all, "types": types,
                  "kl": {"kl_mean": kl, "kl_ci95": 1.96 * ci, "kl_p99": p99,
                         "top1": top / 100, "ppl": ppl, "ppl_ref": ppl_ref}}))
PY
  }
  for n in $lqs; do
    lrow "$n" llama.cpp
  done

  # ---- Krafla mixes at llama.cpp's sizes (the GGUF's matrix bytes as the budget)
  mixes=""
  for z in $SIZES; do mixes+=" $z:$(gbpw "$d/llama-$z-imatrix.gguf")"; done
  for nb in $mixes 4.5:4.5; do
    z=${nb%%:*} x=$(python3 -c "import math, sys; print(f'{math.ceil(float(sys.argv[1]) * 1e9) / 1e9:.9f}')" "${nb#*:}")
    mixconv "mix-$z" "$x" --imatrix "$d/krafla.mli" --mix-report "$d/mix-$z.mix.json"
    kld "mix-$z"
    krow "mix-$z" "$d/mix-$z.kl-$CHUNKS.json"
    [ "$z" = 4.5 ] && continue
    # The same budget in GGUF's types only, exported, measured inside llama.cpp too.
    mixconv "mixg-$z" "$x" --gguf-types --imatrix "$d/krafla.mli"
    kld "mixg-$z"
    krow "mixg-$z" "$d/mixg-$z.kl-$CHUNKS.json"
    [ -f "$d/mixg-$z.gguf" ] || "$kb/mlb-export" "$d/mixg-$z.mlb" -o "$d/mixg-$z.gguf" >"$d/mixg-$z.export.log" 2>&1
    lrow "mixg-$z" "krafla→llama.cpp"
  done

  # ---- Error feedback on its own: the same mix from the covariance imatrix, on and off
  if [ -n "$FEEDBACK" ]; then
    if [ ! -f "$d/krafla-cov.mli" ]; then
      log "mlb-run --imatrix --covariance $m ($CALIB_CHUNKS chunks)"
      "$kb/mlb-run" "$d/bf16.mlb" --file "$CALIB" --imatrix "$d/krafla-cov.mli" --covariance \
        --ctx "$CTX" --chunks "$CALIB_CHUNKS" --threads "$THREADS" >"$d/krafla-cov.log" 2>&1
    fi
    for x in $FEEDBACK; do
      # A point below the model's smallest mix (rows that are not whole super-blocks
      # take 32-weight types of 4.5 bits or more) is measured at that smallest mix.
      at=$x
      if ! "$kb/mlb-convert" "$src" --target-bpw "$x" --imatrix "$d/krafla-cov.mli" -o "$d/fb-probe.mlb" \
          --threads "$THREADS" >"$d/fb-probe.log" 2>&1; then
        at=$(sed -n 's/.*below the smallest mix this model takes (\([0-9.]*\) bits.*/\1/p' "$d/fb-probe.log")
        [ -n "$at" ] || { cat "$d/fb-probe.log" >&2; exit 1; }
        # The message rounds to 10⁻³ bits: one step up is inside the budget.
        at=$(python3 -c 'import sys; print(f"{float(sys.argv[1]) + 0.001:.3f}")' "$at")
        log "$m: --target-bpw $x is below its smallest mix; error feedback measured at $at"
      fi
      rm -f "$d/fb-probe.mlb"
      for fb in on off; do
        flag=()
        [ $fb = off ] && flag=(--no-error-feedback)
        mixconv "fb-$x-$fb" "$at" --imatrix "$d/krafla-cov.mli" "${flag[@]}" --mix-report "$d/fb-$x-$fb.mix.json"
        kld "fb-$x-$fb"
        krow "fb-$x-$fb" "$d/fb-$x-$fb.kl-$CHUNKS.json"
      done
    done
  fi
  mv "$res.tmp" "$res"
  stat -c %s "$d/bf16.mlb" >"$d/bf16.bytes"
  stat -c %s "$bf16" >"$d/llama-bf16.bytes"
done

# The tables.
table=$OUT/tables.md
python3 - "$OUT" "$CHUNKS" "$CALIB_CHUNKS" "$CTX" "$MODELS" "$SIZES" "$FEEDBACK" >"$table" <<'PY'
import json, os, sys
out, chunks, cchunks, ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
models, sizes, feedback = sys.argv[5].split(), sys.argv[6].split(), sys.argv[7].split()
label = {
    "q8_0": "Q8_0", "q4_0-round-none": "Q4_0 round, `--q8 none`", "q4_0-search-none": "Q4_0 search, `--q8 none`",
    "q4_0-imatrix-none": "Q4_0 imatrix, `--q8 none`", "q4_0-round-wcls": "Q4_0 round (default `--q8 wcls`)",
    "q4_0-search-wcls": "Q4_0 search (default `--q8 wcls`)", "q4_0-imatrix-wcls": "Q4_0 imatrix (default `--q8 wcls`)",
    "llama-q8_0": "Q8_0", "llama-q6_k": "Q6_K", "llama-q4_0": "Q4_0 (its default mix)",
    "llama-q4_0-pure": "Q4_0 `--pure`", "llama-iq4_nl-pure-imatrix": "IQ4_NL `--pure` + imatrix",
    "mix-4.5": "`--target-bpw 4.5` + imatrix",
}
for z in sizes:
    label[f"llama-{z}-imatrix"] = f"{z.upper()} + imatrix"
    label[f"mix-{z}"] = f"`--target-bpw` at {z.upper()}'s bpw + imatrix"
    label[f"mixg-{z}"] = f"`--target-bpw --gguf-types` at {z.upper()}'s bpw + imatrix"
for x in feedback:
    label[f"fb-{x}-on"] = f"`--target-bpw {x}` + covariance imatrix, error feedback"
    label[f"fb-{x}-off"] = f"`--target-bpw {x}` + covariance imatrix, `--no-error-feedback`"
print(open(os.path.join(out, "texts.txt")).read().strip())
print(f"\n{chunks} evaluation chunks of {ctx} tokens (second halves scored), imatrices from {cchunks} calibration chunks.")
print("Matrix bpw: 8 × the bytes of every 2-D tensor (scales included) / their weights. File bpw: 8 × the "
      "file's bytes / every parameter (a GGUF carries its tokenizer; Krafla's is in the .mlt beside). "
      "Rows of tool `krafla→llama.cpp` are Krafla's `--gguf-types` file exported by mlb-export and measured "
      "by llama-perplexity against llama.cpp's own BF16.")

def ratio_row(cells):
    print("| " + " | ".join(cells) + " |")

def summary(types):
    # "w2 Q4_K×20 Q6_K×10; ..." in class order
    order = ["tok_emb", "wcls", "wq", "wk", "wv", "wo", "w1", "w3", "w2"]
    keys = sorted(types, key=lambda c: (order.index(c) if c in order else 99, c))
    return "; ".join(c + " " + " ".join(f"{t}×{n}" if n > 1 else t for t, n in
                     sorted(types[c].items(), key=lambda kv: -kv[1])) for c in keys)

for m in models:
    d = os.path.join(out, m)
    rows = [json.loads(l) for l in open(os.path.join(d, "results.jsonl"))]
    n_params_bytes = int(open(os.path.join(d, "bf16.bytes")).read())
    print(f"\n### {m}\n")
    print(f"Reference: each tool's BF16 file (Krafla {n_params_bytes / 1e6:.1f} MB, llama.cpp "
          f"{int(open(os.path.join(d, 'llama-bf16.bytes')).read()) / 1e6:.1f} MB).\n")
    print("| tool | file | size MB | matrix bpw | file bpw | mean KLD ± 95% CI | KLD p99 | top-1 | PPL | PPL BF16 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["tool"], -r["bpw"])):
        k = r["kl"]
        fb = f"{r['bpw_file']:.3f}" if "bpw_file" in r else ""
        print(f"| {r['tool']} | {label.get(r['name'], r['name'])} | {r['bytes'] / 1e6:.1f} | {r['bpw']:.3f} | {fb} | "
              f"{k['kl_mean']:.4f} ± {k['kl_ci95']:.4f} | {k['kl_p99']:.3f} | {100 * k['top1']:.2f}% | "
              f"{k['ppl']:.3f} | {k['ppl_ref']:.3f} |")
    by = {(r["tool"], r["name"]): r for r in rows}
    kby = {r["name"]: r for r in rows if r["tool"] == "krafla"}
    lby = {r["name"]: r for r in rows if r["tool"] == "llama.cpp"}
    xby = {r["name"]: r for r in rows if r["tool"] == "krafla→llama.cpp"}

    low = [z for z in sizes if z != "q6_k" and f"mix-{z}" in kby and f"llama-{z}-imatrix" in lby]
    if low:
        print("\nIssue 43's targets, at llama.cpp's sizes (±2% of the matrix bytes): Krafla's mix ≤ 0.7 × "
              "llama.cpp's mean KLD; Krafla's `--gguf-types` mix exported and measured inside llama.cpp "
              "≤ 0.8 × llama-quantize's file:\n")
        print("| size of | bpw K / L | matrix bytes K / L | mean KLD K / L | ratio | ≤ 0.7 | exported: KLD in llama.cpp | ratio | ≤ 0.8 |")
        print("|---|---|---|---|---|---|---|---|---|")
        for z in low:
            k, l = kby[f"mix-{z}"], lby[f"llama-{z}-imatrix"]
            q = k["kl"]["kl_mean"] / l["kl"]["kl_mean"]
            x = xby.get(f"mixg-{z}")
            xs = (f"{x['kl']['kl_mean']:.4f}", f"{x['kl']['kl_mean'] / l['kl']['kl_mean']:.2f}",
                  "yes" if x["kl"]["kl_mean"] <= 0.8 * l["kl"]["kl_mean"] else "no") if x else ("", "", "")
            ratio_row([z.upper(), f"{k['bpw']:.3f} / {l['bpw']:.3f}", f"{k['bpw'] / l['bpw']:.3f}",
                       f"{k['kl']['kl_mean']:.4f} / {l['kl']['kl_mean']:.4f}", f"{q:.2f}",
                       "yes" if q <= 0.7 else "no", *xs])

    # Issue 16's targets: ≤ 0.9 × at Q4_K_M's, Q6_K's sizes and 4.5 bits.
    pairs = [("mix-q4_k_m", ["llama-q4_k_m-imatrix"]), ("mix-q6_k", ["llama-q6_k", "llama-q6_k-imatrix"]),
             ("mix-4.5", ["llama-iq4_nl-pure-imatrix"])]
    pairs = [(kn, [n for n in lns if n in lby]) for kn, lns in pairs if kn in kby]
    pairs = [(kn, lns) for kn, lns in pairs if lns]
    if pairs:
        print("\nIssue 16's targets (Krafla's mean KLD ≤ 0.9 × llama.cpp's best file of the same size):\n")
        print("| Krafla | llama.cpp | bpw K / L | size MB K / L (ratio) | mean KLD K / L | ratio | ≤ 0.9 |")
        print("|---|---|---|---|---|---|---|")
        for kn, lns in pairs:
            k = kby[kn]
            l = min((lby[n] for n in lns), key=lambda r: r["kl"]["kl_mean"])
            q = k["kl"]["kl_mean"] / l["kl"]["kl_mean"]
            ratio_row([label[kn], label[l["name"]], f"{k['bpw']:.3f} / {l['bpw']:.3f}",
                       f"{k['bytes'] / 1e6:.1f} / {l['bytes'] / 1e6:.1f} ({k['bytes'] / l['bytes']:.3f})",
                       f"{k['kl']['kl_mean']:.4f} / {l['kl']['kl_mean']:.4f}", f"{q:.2f}", "yes" if q <= 0.9 else "no"])

    fbs = [x for x in feedback if f"fb-{x}-on" in kby and f"fb-{x}-off" in kby]
    if fbs:
        print("\nError feedback on its own (the same `--target-bpw` mix from the covariance imatrix; a target "
              "below the model's smallest mix is measured at that smallest mix, as the matrix bpw shows):\n")
        print("| target bpw | matrix bpw | mean KLD, feedback off | on | on / off |")
        print("|---|---|---|---|---|")
        for x in fbs:
            on, off = kby[f"fb-{x}-on"], kby[f"fb-{x}-off"]
            ratio_row([x, f"{on['bpw']:.3f}", f"{off['kl']['kl_mean']:.4f} ± {off['kl']['kl_ci95']:.4f}",
                       f"{on['kl']['kl_mean']:.4f} ± {on['kl']['kl_ci95']:.4f}",
                       f"{on['kl']['kl_mean'] / off['kl']['kl_mean']:.2f}"])

    chosen = [(f"mix-{z}", f"llama-{z}-imatrix") for z in sizes if f"mix-{z}" in kby]
    if chosen:
        print("\nWhat each tool chose per class (type × layers):\n")
        print("| size of | Krafla | llama.cpp |")
        print("|---|---|---|")
        for kn, ln in chosen:
            ratio_row([kn[4:].upper(), summary(kby[kn].get("types", {})),
                       summary(lby[ln].get("types", {})) if ln in lby else ""])
PY
cat "$table"

"$PYTHON" -c 'import matplotlib' 2>/dev/null || "$(dirname "$PYTHON")/pip" install -q matplotlib
"$PYTHON" "$repo/scripts/plot-quality.py" "$OUT/quality-vs-llama.png" $(for m in $MODELS; do echo "$OUT/$m/results.jsonl"; done)

if [ "$WRITE_DOC" = 1 ]; then
  mkdir -p "$repo/docs/img"
  cp "$OUT/quality-vs-llama.png" "$repo/docs/img/quality-vs-llama.png"
  doc=$repo/docs/benchmarks-quality.md
  python3 "$repo/scripts/splice-doc.py" "$doc" quality-vs-llama "$table" \
    "$(date -u '+%Y-%m-%d %H:%M UTC'); $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'); threads $THREADS; load $(cut -d' ' -f1-3 /proc/loadavg)" \
    "scripts/quality-vs-llama.sh"
  log "wrote the tables into $doc"
fi
