#!/usr/bin/env bash
# GGUFs of the low-bit types, made by llama-quantize, read by Krafla (issue 43, "Import"):
# for each TYPE, llama.cpp's own file of the model in that type (`llama-quantize --imatrix`,
# its default mix for the type, from the bf16 GGUF), then
#
# - lossless: `mlb-convert` of the GGUF, exported again by `mlb-export`, gives every
#   tensor's bytes back (compared tensor by tensor with gguf-py);
# - the same logits: llama.cpp's distributions on the evaluation text
#   (`llama-perplexity --kl-divergence-base`: its tokens, 512-token chunks, the second
#   half of each scored) against Krafla's (`mlb-run --tokens ... --logits` on the same ids,
#   BOS put first as llama-perplexity puts it): top-1 agreement (both argmaxes equal) and
#   the mean KL divergence of Krafla's distribution from llama.cpp's. llama.cpp stores its
#   log-probabilities as 16-bit steps of (max − min)/65535 over the 16 nats below the
#   maximum; every KLD here is over the tokens above that floor (both distributions
#   renormalized over them), so it includes the rounding of those steps;
# - both against the exact arithmetic: the float32 forward of the same weights
#   (transformers, the GGUF dequantized by gguf-py) on the same ids: each tool's top-1
#   agreement with it and mean KLD from it. Both tools round activations (llama.cpp to
#   Q8_0/Q8_K blocks, Krafla to its kernels' int8 blocks), so two correct readers of one
#   file disagree on the positions where the top two tokens are close; this column says
#   which of the two is nearer the exact result.
#
# Run scripts/quality-vs-llama.sh first: this reads its OUT (the evaluation text,
# llama.cpp's imatrix, the tokenizer file) and llama.cpp's build.
# Environment (defaults in brackets): BENCH_DIR, REAL_DIR, PYTHON, OUT, MODELS, CTX, THREADS
# as quality-vs-llama.sh's; TYPES ["q2_k q3_k iq4_xs iq3_xxs iq3_s iq2_xxs iq2_xs iq2_s
# iq1_m"]; CHUNKS: evaluation chunks [8]. Prints a table (also OUT/import-agreement.md).
set -euo pipefail

# shellcheck source=quality-env.sh
. "$(dirname "${BASH_SOURCE[0]}")/quality-env.sh"
TYPES=${TYPES:-q2_k q3_k iq4_xs iq3_xxs iq3_s iq2_xxs iq2_xs iq2_s iq1_m}
CHUNKS=${CHUNKS:-8}
log() { printf '[agreement %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
need_llama import-agreement.sh llama-quantize llama-perplexity
(cd "$repo" && cargo build -q --release --bin mlb-convert --bin mlb-export --bin mlb-run)
kb=${CARGO_TARGET_DIR:-$repo/target}/release

table=$OUT/import-agreement.md
{
  echo "llama-quantize --imatrix TYPE of each model's bf16 GGUF, read by Krafla: lossless (mlb-convert, then mlb-export, gives every tensor's bytes back) and the same distributions as llama.cpp's on the same file ($CHUNKS chunks of $CTX tokens of the evaluation text, the second half of each scored)."
  echo
  echo "| model | type | file MB | tensors byte-identical after import + export | positions | top-1 agreement K / L | mean KLD, Krafla from llama.cpp | top-1 agreement with float32: Krafla / llama.cpp | mean KLD from float32: Krafla / llama.cpp |"
  echo "|---|---|---|---|---|---|---|---|---|"
} >"$table.tmp"
for m in $MODELS; do
  d=$OUT/$m
  a=$d/agreement
  bf16=$BENCH_DIR/gguf/$m-bf16.gguf
  for f in "$d/llama-imatrix.gguf" "$bf16" "$OUT/eval.txt"; do
    [ -f "$f" ] || { echo "import-agreement.sh: $f is missing (run scripts/quality-vs-llama.sh first)" >&2; exit 2; }
  done
  mkdir -p "$a"
  for t in $TYPES; do
    g=$a/llama-$t.gguf
    if [ ! -f "$g" ]; then
      log "llama-quantize --imatrix $m $t"
      "$lb/llama-quantize" --imatrix "$d/llama-imatrix.gguf" "$bf16" "$g.tmp" "${t^^}" "$THREADS" >"$a/$t.quantize.log" 2>&1
      mv "$g.tmp" "$g"
    fi
    if [ ! -f "$a/$t-$CHUNKS.kld" ]; then
      log "llama-perplexity --kl-divergence-base $m $t"
      "$lb/llama-perplexity" -m "$g" -f "$OUT/eval.txt" -c "$CTX" --chunks "$CHUNKS" -t "$THREADS" \
        --kl-divergence-base "$a/$t-$CHUNKS.kld.tmp" >"$a/$t.perplexity.log" 2>&1
      mv "$a/$t-$CHUNKS.kld.tmp" "$a/$t-$CHUNKS.kld"
    fi
    if [ ! -f "$a/$t.mlb" ]; then
      log "mlb-convert + mlb-export $m $t"
      "$kb/mlb-convert" "$g" -o "$a/$t.mlb" >"$a/$t.convert.log" 2>&1
      "$kb/mlt-convert" "$g" -o "$a/$t.mlt" -q
      "$kb/mlb-export" "$a/$t.mlb" -o "$a/$t.back.gguf" >>"$a/$t.convert.log" 2>&1
    fi
    log "agreement $m $t"
    PYTHONPATH=$llama/gguf-py "$PYTHON" - "$m" "$t" "$g" "$a" "$kb/mlb-run" "$CHUNKS" "$CTX" "$THREADS" >>"$table.tmp" <<'PY'
import os, subprocess, sys
import numpy as np
import gguf
import torch
from transformers import AutoModelForCausalLM

m, t, g, a, run, chunks, ctx, threads = sys.argv[1:9]
chunks, ctx = int(chunks), int(ctx)

# Lossless: every tensor of the GGUF, after import and export, has the same bytes.
orig = {x.name: x for x in gguf.GGUFReader(g).tensors}
back = {x.name: x for x in gguf.GGUFReader(os.path.join(a, f"{t}.back.gguf")).tensors}
same = sum(1 for n, x in orig.items() if n in back and back[n].tensor_type == x.tensor_type
           and bytes(back[n].data.tobytes()) == bytes(x.data.tobytes()))

# llama-perplexity's --kl-divergence-base file: "_logits_", n_ctx, n_vocab, n_chunk (i32),
# the tokens (n_chunk × n_ctx i32), then per chunk, for positions n_ctx/2 .. n_ctx−2, a
# record of nv u16: the f32 pair (scale, min log-prob), then a step count per token.
raw = np.fromfile(os.path.join(a, f"{t}-{chunks}.kld"), dtype=np.uint8)
assert raw[:8].tobytes() == b"_logits_", "not a llama-perplexity logits file"
n_ctx, n_vocab, n_chunk = np.frombuffer(raw[8:20].tobytes(), dtype=np.int32)
assert n_ctx == ctx, (n_ctx, ctx)
tokens = np.frombuffer(raw[20:20 + 4 * n_chunk * n_ctx].tobytes(), dtype=np.int32).reshape(n_chunk, n_ctx)
nv = 2 * ((n_vocab + 1) // 2) + 4
first = n_ctx // 2
per = n_ctx - 1 - first
recs = np.frombuffer(raw[20 + 4 * n_chunk * n_ctx:].tobytes(), dtype=np.uint16).reshape(n_chunk, per, nv)

fields = gguf.GGUFReader(g).fields
def field(name, default):
    f = fields.get(name)
    return default if f is None else f.parts[f.data[0]][0]
add_bos = bool(field("tokenizer.ggml.add_bos_token", False))
bos = int(field("tokenizer.ggml.bos_token_id", 0))

torch.set_num_threads(int(threads))
ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(g), gguf_file=os.path.basename(g),
                                           torch_dtype=torch.float32).eval()

def log_softmax(x):
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))

def kl_from(lp_p, lp_q, keep):
    """Σ p (log p − log q) over the rows, both distributions restricted to `keep` (the
    tokens above llama.cpp's floor) and renormalized there: the floor holds a mass of
    about n_vocab · e⁻¹⁶ that neither tool's other distribution has."""
    p = np.where(keep, np.exp(lp_p), 0.0)
    q = np.where(keep, np.exp(lp_q), 0.0)
    p /= p.sum(axis=1, keepdims=True)
    q /= q.sum(axis=1, keepdims=True)
    ok = p > 0
    return float(np.where(ok, p * (np.log(np.where(ok, p, 1.0)) - np.log(np.where(ok, q, 1.0))), 0.0).sum())

agree = total = agree_kr = agree_lr = 0
kl = kl_kr = kl_lr = 0.0
logits_path = os.path.join(a, f"{t}.logits.f32")
for c in range(min(chunks, n_chunk)):
    ids = tokens[c].copy()
    if add_bos:
        ids[0] = bos  # as llama-perplexity feeds each chunk
    subprocess.run([run, os.path.join(a, f"{t}.mlb"), "--tokens", " ".join(map(str, ids)),
                    "--logits", logits_path, "--ctx", str(ctx), "--threads", threads],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lk = np.fromfile(logits_path, dtype=np.float32).reshape(ctx, -1)[first:first + per].astype(np.float64)
    r = recs[c]
    scale = r[:, 0:2].copy().view(np.float32)[:, 0].astype(np.float64)
    minlp = r[:, 2:4].copy().view(np.float32)[:, 0].astype(np.float64)
    steps = r[:, 4:4 + n_vocab].astype(np.float64)
    lp_l = log_softmax(scale[:, None] * steps + minlp[:, None])  # the steps' sum is not exactly 1
    lk = lk[:, :n_vocab]
    lp_k = log_softmax(lk)
    with torch.no_grad():
        lr = ref(torch.tensor(ids[None].astype(np.int64))).logits[0, first:first + per, :n_vocab]
    lp_r = log_softmax(lr.double().numpy())
    a_k, a_l, a_r = lk.argmax(axis=1), steps.argmax(axis=1), lp_r.argmax(axis=1)
    agree += int((a_l == a_k).sum())
    agree_kr += int((a_k == a_r).sum())
    agree_lr += int((a_l == a_r).sum())
    total += per
    keep = steps > 0
    kl += kl_from(lp_l, lp_k, keep)
    kl_kr += kl_from(lp_r, lp_k, keep)
    kl_lr += kl_from(lp_r, lp_l, keep)
os.remove(logits_path)
mb = os.path.getsize(g) / 1e6
print(f"| {m} | {t.upper()} | {mb:.1f} | {same} / {len(orig)} | {total} | {agree / total:.4f} | {kl / total:.5f} "
      f"| {agree_kr / total:.4f} / {agree_lr / total:.4f} | {kl_kr / total:.5f} / {kl_lr / total:.5f} |")
PY
  done
done
mv "$table.tmp" "$table"
cat "$table"
