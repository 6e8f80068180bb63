#!/usr/bin/env bash
# Per weight type, Krafla's quantizer against llama-quantize's (issue 43): the relative output
# error tr(ΔW H ΔWᵀ) / tr(W H Wᵀ) of every matrix both tools store in that type, summed over
# the layers, where H = Σ x xᵀ is the matrix's input covariance on a text neither tool
# calibrated on (the evaluation text of scripts/quality-vs-llama.sh, run through the
# checkpoint in float32 by transformers).
#
# - llama.cpp: llama-quantize --pure --imatrix (its imatrix from the calibration text) TYPE
#   of the bf16 GGUF.
# - Krafla: mlb-convert --types w2=TYPE,wo=TYPE --gguf-types --imatrix (its imatrix from the
#   same calibration chunks), exported by mlb-export; with the covariance imatrix too
#   ("+ feedback": error feedback on).
# Both files are decoded by the same code (gguf-py's dequantize), against the bf16 GGUF's W.
# Only matrices whose rows are whole 256-weight super-blocks take the 256-weight types: on
# SmolLM2-135M the down projections, on Gemma 3 270M the down and output projections.
#
# Run scripts/quality-vs-llama.sh first: this reads its OUT (the texts, both imatrices, the
# covariance imatrix, the bf16 GGUF, the tokenizer) and llama.cpp's build.
# Environment (defaults in brackets): BENCH_DIR, REAL_DIR, PYTHON, OUT, MODELS, CTX, THREADS
# as quality-vs-llama.sh's; TYPES ["q2_k q3_k iq2_xs iq3_xxs iq3_s iq4_xs"]; CHUNKS: chunks
# of the evaluation text in H [16]; SHRINKS: other --feedback-shrink values to measure
# with the covariance imatrix, a column each [""]; WRITE_DOC=1 splices the table into
# docs/benchmarks-quality.md between its "type-errors" markers.
set -euo pipefail

# shellcheck source=quality-env.sh
. "$(dirname "${BASH_SOURCE[0]}")/quality-env.sh"
TYPES=${TYPES:-q2_k q3_k iq2_xs iq3_xxs iq3_s iq4_xs}
SHRINKS=${SHRINKS:-}
CHUNKS=${CHUNKS:-16}
WRITE_DOC=${WRITE_DOC:-0}
log() { printf '[type-error %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
need_llama type-error-vs-llama.sh llama-quantize
(cd "$repo" && cargo build -q --release --bin mlb-convert --bin mlb-export)
kb=${CARGO_TARGET_DIR:-$repo/target}/release

for m in $MODELS; do
  d=$OUT/$m
  src=$REAL_DIR/$m
  bf16=$BENCH_DIR/gguf/$m-bf16.gguf
  for f in "$d/krafla.mli" "$d/llama-imatrix.gguf" "$d/bf16.mlt" "$bf16" "$OUT/eval.txt"; do
    [ -f "$f" ] || { echo "type-error-vs-llama.sh: $f is missing (run scripts/quality-vs-llama.sh first)" >&2; exit 2; }
  done
  te=$d/type-error
  mkdir -p "$te"
  for t in $TYPES; do
    if [ ! -f "$te/llama-$t.gguf" ]; then
      log "llama-quantize --pure --imatrix $m $t"
      "$lb/llama-quantize" --pure --imatrix "$d/llama-imatrix.gguf" "$bf16" "$te/llama-$t.gguf.tmp" "${t^^}" "$THREADS" \
        >"$te/llama-$t.log" 2>&1
      mv "$te/llama-$t.gguf.tmp" "$te/llama-$t.gguf"
    fi
    for k in krafla krafla-fb $(for a in $SHRINKS; do echo "krafla-fb$a"; done); do
      imx=$d/krafla.mli
      shrink=()
      case $k in
        krafla-fb?*) shrink=(--feedback-shrink "${k#krafla-fb}");;&
        krafla-fb*) imx=$d/krafla-cov.mli; [ -f "$imx" ] || continue;;
      esac
      if [ ! -f "$te/$k-$t.gguf" ]; then
        log "mlb-convert + mlb-export $m $k $t"
        "$kb/mlb-convert" "$src" --wtype q8_0 --types "w2=$t,wo=$t" --gguf-types --imatrix "$imx" "${shrink[@]}" \
          --threads "$THREADS" -o "$te/$k-$t.mlb" >"$te/$k-$t.log" 2>&1
        cp "$d/bf16.mlt" "$te/$k-$t.mlt"
        "$kb/mlb-export" "$te/$k-$t.mlb" -o "$te/$k-$t.gguf" >>"$te/$k-$t.log" 2>&1
        rm -f "$te/$k-$t.mlb" "$te/$k-$t.mlt"
      fi
    done
  done
done

table=$OUT/type-errors.md
log "input covariances on the evaluation text and the errors"
PYTHONPATH=$llama/gguf-py "$PYTHON" - "$OUT" "$REAL_DIR" "$BENCH_DIR/gguf" "$CHUNKS" "$CTX" "$THREADS" "$MODELS" "$TYPES" "$SHRINKS" >"$table" <<'PY'
import os, re, sys
import numpy as np
import torch
import gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

out, real, ggufs, chunks, ctx, threads = sys.argv[1:7]
chunks, ctx = int(chunks), int(ctx)
models, types, shrinks = sys.argv[7].split(), sys.argv[8].split(), sys.argv[9].split()
torch.set_num_threads(int(threads))
# GGUF tensor name ↔ the module whose input it reads (Krafla's class beside it)
hf = {"ffn_down": ("mlp.down_proj", "w2"), "attn_output": ("self_attn.o_proj", "wo")}

def covariances(path):
    """H = Σ x xᵀ (float64) of the input of every down/output projection on the evaluation text."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.eval()
    ids = tok(open(os.path.join(out, "eval.txt")).read(), return_tensors="pt").input_ids[0]
    h, hooks = {}, []
    for name, mod in model.named_modules():
        mm = re.fullmatch(r"model\.layers\.(\d+)\.(mlp\.down_proj|self_attn\.o_proj)", name)
        if not mm:
            continue
        key = (int(mm.group(1)), mm.group(2))
        def hook(_m, inp, _o, key=key):
            x = inp[0].reshape(-1, inp[0].shape[-1]).double()
            h[key] = h.get(key, 0) + x.T @ x
        hooks.append(mod.register_forward_hook(hook))
    n = 0
    with torch.no_grad():
        for c in range(chunks):
            part = ids[c * ctx:(c + 1) * ctx]
            if len(part) < ctx:
                break
            model(part[None])
            n += len(part)
    return {k: v.numpy() for k, v in h.items()}, n

def matrices(path):
    """{(layer, module): (ggml type name, float64 W)} of the compared tensors."""
    res = {}
    for t in gguf.GGUFReader(path).tensors:
        mm = re.fullmatch(r"blk\.(\d+)\.(ffn_down|attn_output)\.weight", t.name)
        if mm:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
            res[(int(mm.group(1)), hf[mm.group(2)][0])] = (t.tensor_type.name, w.reshape(-1, w.shape[-1]))
    return res

print("Relative output error tr(ΔW H ΔWᵀ) / tr(W H Wᵀ), summed over the layers, of the matrices "
      "both tools store in the type (rows of whole 256-weight super-blocks); H from "
      f"{chunks} chunks of {ctx} tokens of the evaluation text, which neither imatrix saw.")
for m in models:
    d = os.path.join(out, m, "type-error")
    h, ntok = covariances(os.path.join(real, m))
    ref = matrices(os.path.join(ggufs, f"{m}-bf16.gguf"))
    print(f"\n### {m}\n")
    print(f"H over {ntok} tokens.\n")
    extra = "".join(f" + feedback, α = {a} | ratio |" for a in shrinks)
    print(f"| type | matrices | llama.cpp | Krafla | ratio | ≤ 0.8 | Krafla + feedback | ratio |{extra}")
    print("|---|---|---|---|---|---|---|---|" + "---|---|" * len(shrinks))
    for t in types:
        kinds = ["llama", "krafla", "krafla-fb"] + [f"krafla-fb{a}" for a in shrinks]
        files = {k: os.path.join(d, f"{k}-{t}.gguf") for k in kinds}
        got = {k: matrices(f) for k, f in files.items() if os.path.exists(f)}
        want = t.upper()
        # The matrices every file stores in the type itself (not a fallback).
        keys = sorted(k for k in ref if all(g.get(k, ("",))[0] == want for g in got.values()))
        if not keys:
            print(f"| {want} | none | | | | | | |")
            continue
        def err(g):
            num = den = 0.0
            for k in keys:
                w, hk = ref[k][1], h[k]
                dw = g[k][1] - w
                num += np.sum((dw @ hk) * dw)
                den += np.sum((w @ hk) * w)
            return num / den
        e = {k: err(g) for k, g in got.items()}
        cls = {mod: c for mod, c in hf.values()}
        classes = sorted({cls[mod] for _, mod in keys})
        def cells(k):
            return f" {100 * e[k]:.3f}% | {e[k] / e['llama']:.2f} |" if k in e else "  |  |"
        q = e["krafla"] / e["llama"]
        print(f"| {want} | {len(keys)} ({', '.join(classes)}) | {100 * e['llama']:.3f}% | {100 * e['krafla']:.3f}% | "
              f"{q:.2f} | {'yes' if q <= 0.8 else 'no'} |" + "".join(cells(k) for k in kinds[2:]))
PY
cat "$table"

if [ "$WRITE_DOC" = 1 ]; then
  doc=$repo/docs/benchmarks-quality.md
  python3 "$repo/scripts/splice-doc.py" "$doc" type-errors "$table" \
    "$(date -u '+%Y-%m-%d %H:%M UTC'); $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')" \
    "scripts/type-error-vs-llama.sh"
  log "wrote the table into $doc"
fi
