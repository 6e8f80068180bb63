#!/usr/bin/env bash
# Calibrates mix::SENSITIVITY (src/convert/mix.rs) against measured KL divergence
# (docs/convert.md, "Mixes: calibration"). For each model of MODELS:
#
#   1. the reference: mlb-convert CKPT --wtype bf16; an imatrix from
#      mlb-run BF16.mlb --file CALIB --imatrix; the measured relative error r of every
#      matrix in every candidate type from --target-bpw 8.5 --imatrix --mix-report;
#   2. probe files: BF16 everywhere but one group of matrices stored in a candidate
#      type: one file per class (wqk, wv, wo, w13, w2, wcls: the shared embedding of these
#      models is the classifier), its matrices in the candidate below Q8_0 with the
#      largest measured error (on a checkpoint dequantized from GGUF, the type of the
#      source's grid reproduces it almost exactly and would measure nothing); one for the
#      first eighth of the layers and one for the last eighth (all their matrices, each
#      class in its probe type); and two checks: every matrix at the smallest candidate
#      (q4_k; --types stores IQ4_NL on rows that are not whole 256-weight super-blocks, as
#      the mix's candidates are), and every matrix at Q6_K (Q6_0 on other rows);
#   3. the mean KLD of each against BF16: mlb-run P.mlb --file EVAL --kl-divergence BF16.mlb;
#   4. the fit of KLD ≈ Σ_m α_class · β_band · r_m (r_m in the type the probe stores m):
#      α_c = KLD_c / Σ_{m∈c} β_band r_m,
#      β_b = KLD_b / Σ_{m∈b} α_class r_m (β_middle = 1), iterated to a fixed point; the
#      checks compare the measured KLD with the prediction.
#
# Then the constants of both models are put on one scale (each model's α divided by the
# geometric mean of its five layer classes' α, the classifier's also multiplied by the
# number of layers: mix::Sensitivity::band divides a layer matrix's weight by it) and
# averaged geometrically; fit.json and the printed table hold every figure. The KLDs are
# deterministic, so the load only slows it.
#
# usage: scripts/calibrate-mix.sh
# Environment (defaults in brackets):
#   REAL_DIR  the HF checkpoints (smollm2-135m/, gemma3-270m/) [required]
#   OUT       probe files and results [${XDG_CACHE_HOME:-$HOME/.cache}/krafla-mixcal]
#   MODELS ["smollm2-135m gemma3-270m"]  CHUNKS: evaluation chunks [8]
#   CALIB_CHUNKS [8]  CTX [512]  THREADS [2]
#   CALIB, EVAL: the calibration and evaluation texts [required; docs/benchmarks-quality.md,
#             "Texts": scripts/quality-vs-llama.sh writes them as calib.txt and eval.txt]
#   KEEP=1    keep the probe .mlb files (deleted once measured otherwise)
#   BIN       the Krafla binaries [built in target/release]
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
: "${REAL_DIR:?set REAL_DIR to the folder of the HF checkpoints}"
OUT=${OUT:-${XDG_CACHE_HOME:-$HOME/.cache}/krafla-mixcal}
: "${MODELS:=smollm2-135m gemma3-270m}" "${CHUNKS:=8}" "${CALIB_CHUNKS:=8}" "${CTX:=512}" "${THREADS:=2}" "${KEEP:=0}"
case "$OUT/" in "$repo"/*) echo "calibrate-mix.sh: OUT must be outside the repository" >&2; exit 2;; esac
mkdir -p "$OUT"
log() { printf '[mixcal %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# The probes and the relative errors do not depend on mix::SENSITIVITY, so any build of
# the converter will do (BIN: a folder with mlb-convert, mlt-convert and mlb-run).
if [ -z "${BIN:-}" ]; then
  (cd "$repo" && cargo build -q --release --bin mlb-convert --bin mlt-convert --bin mlb-run)
fi
kb=${BIN:-$repo/target/release}

# The texts of docs/benchmarks-quality.md ("Texts"): scripts/quality-vs-llama.sh makes them.
: "${CALIB:?set CALIB and EVAL to the texts (scripts/quality-vs-llama.sh writes calib.txt and eval.txt in its OUT)}"
: "${EVAL:?set EVAL to the evaluation text}"

classes="wqk wv wo w13 w2 wcls"  # the checks' rules
for m in $MODELS; do
  d=$OUT/$m
  mkdir -p "$d"
  src=$REAL_DIR/$m
  [ -f "$src/config.json" ] || { echo "calibrate-mix.sh: no checkpoint $src" >&2; exit 2; }
  "$kb/mlt-convert" "$src/tokenizer.json" -o "$d/bf16.mlt" -q
  if [ ! -f "$d/bf16.mlb" ]; then
    log "mlb-convert $m --wtype bf16"
    "$kb/mlb-convert" "$src" -o "$d/bf16.mlb" --wtype bf16 --threads "$THREADS" >"$d/bf16.convert.log" 2>&1
  fi
  if [ ! -f "$d/krafla.mli" ]; then
    log "mlb-run --imatrix $m ($CALIB_CHUNKS chunks)"
    "$kb/mlb-run" "$d/bf16.mlb" --file "$CALIB" --imatrix "$d/krafla.mli" --ctx "$CTX" \
      --chunks "$CALIB_CHUNKS" --threads "$THREADS" >"$d/imatrix.log" 2>&1
  fi
  if [ ! -f "$d/report.json" ]; then
    log "mlb-convert $m --mix-report (the relative errors)"
    "$kb/mlb-convert" "$src" -o "$d/report.mlb" --target-bpw 8.5 --imatrix "$d/krafla.mli" \
      --mix-report "$d/report.json.tmp" --threads "$THREADS" >"$d/report.convert.log" 2>&1
    rm -f "$d/report.mlb"
    mv "$d/report.json.tmp" "$d/report.json"
  fi
  # Each class's probe type, and the rules for the first and last eighth of the layers
  # (mix::band): their matrices by name, each in its class's probe type.
  read -r probes first last < <(python3 - "$d/report.json" <<'PY'
import json, sys
mats = [m for m in json.load(open(sys.argv[1]))["matrices"] if not m["fixed"]]
cls = lambda m: "wcls" if m["class"] == "tok_emb" and m["layer"] is None else m["class"]
err = {}
for m in mats:
    for c in m["candidates"]:
        if c["type"] != "q8_0":
            k = (cls(m), c["type"])
            err[k] = err.get(k, 0.0) + c["rel_error"]
best = {}
for (c, t), e in err.items():
    if c not in best or e > err[(c, best[c])]:
        best[c] = t
n = 1 + max(m["layer"] for m in mats if m["layer"] is not None)
e = max(1, -(-n // 8))
def rules(ls):
    return ",".join(f"{m['name']}={best[cls(m)]}" for m in mats if m["layer"] in ls)
print(",".join(f"{c}={t}" for c, t in best.items()), rules(range(e)), rules(range(n - e, n)))
PY
)
  probe() { # name --types rules
    local n=$1 rules=$2 kj=$d/$1.kl-$CHUNKS.json
    [ -f "$kj" ] && return
    log "probe $m $n"
    "$kb/mlb-convert" "$src" -o "$d/$n.mlb" --wtype bf16 --types "$rules" --imatrix "$d/krafla.mli" \
      --threads "$THREADS" >"$d/$n.convert.log" 2>&1
    cp "$d/bf16.mlt" "$d/$n.mlt"
    "$kb/mlb-run" "$d/$n.mlb" --file "$EVAL" --kl-divergence "$d/bf16.mlb" --ctx "$CTX" \
      --chunks "$CHUNKS" --threads "$THREADS" --json >"$kj.tmp" 2>"$d/$n.kl.log"
    mv "$kj.tmp" "$kj"
    [ "$KEEP" = 1 ] || rm -f "$d/$n.mlb" "$d/$n.mlt"
  }
  for ct in ${probes//,/ }; do probe "class-${ct/=/-}" "$ct"; done
  probe band-first "$first"
  probe band-last "$last"
  all() { local r=""; for c in $classes; do r+="${r:+,}$c=$1"; done; echo "$r"; }
  probe check-all-q4_k "$(all q4_k)"
  probe check-all-q6_k "$(all q6_k)"
done

# The fit.
python3 - "$OUT" "$CHUNKS" "$MODELS" <<'PY'
import json, math, os, sys
out, chunks, models = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
LAYER = ["wqk", "wv", "wo", "w13", "w2"]
CLS = LAYER + ["wcls"]
LOW = {"q4_k", "iq4_nl"}
SIX = {"q6_k", "q6_0"}
gm = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs))

def klmean(d, n):
    return json.load(open(os.path.join(d, f"{n}.kl-{chunks}.json")))["kl_mean"]

def cls_of(m):
    # A shared embedding is the classifier (mix::Sensitivity::class checks wcls first).
    c = m["class"]
    return "wcls" if c == "tok_emb" and m["layer"] is None else c

class Model:
    def __init__(self, d):
        self.mats = [m for m in json.load(open(os.path.join(d, "report.json")))["matrices"] if not m["fixed"]]
        self.n = 1 + max(m["layer"] for m in self.mats if m["layer"] is not None)
        self.e = max(1, -(-self.n // 8))
        # Each class's probe: the file class-CLASS-TYPE.
        self.probe = {}
        for f in os.listdir(d):
            if f.startswith("class-") and f.endswith(f".kl-{chunks}.json"):
                c, t = f[len("class-"):-len(f".kl-{chunks}.json")].split("-")
                self.probe[c] = t
        self.kld = {c: klmean(d, f"class-{c}-{self.probe[c]}") for c in CLS}
        self.kld_band = {0: klmean(d, "band-first"), 2: klmean(d, "band-last")}
        self.checks = {k: klmean(d, f"check-{k}") for k in ("all-q4_k", "all-q6_k")
                       if os.path.exists(os.path.join(d, f"check-{k}.kl-{chunks}.json"))}

    def band(self, m):
        l = m["layer"]
        return 1 if l is None else 0 if l < self.e else 2 if l + self.e >= self.n else 1

    def r(self, m, kinds):
        return next(c["rel_error"] for c in m["candidates"] if c["type"] in kinds)

    def predict(self, a, b, kinds=None):
        # Σ α β r, each matrix in `kinds` (None: its class's probe type).
        return sum(a[cls_of(m)] * b[self.band(m)] * self.r(m, kinds or {self.probe[cls_of(m)]})
                   for m in self.mats)

    def fit(self):
        R = {}  # (class, band) -> Σ r in the class's probe type
        for m in self.mats:
            k = (cls_of(m), self.band(m))
            R[k] = R.get(k, 0.0) + self.r(m, {self.probe[k[0]]})
        self.sum_r = {c: sum(v for (k, _), v in R.items() if k == c) for c in CLS}
        a, b = {c: 1.0 for c in CLS}, [1.0, 1.0, 1.0]
        for _ in range(200):
            for c in CLS:
                a[c] = self.kld[c] / sum(b[j] * R.get((c, j), 0.0) for j in range(3))
            for j in (0, 2):
                b[j] = self.kld_band[j] / sum(a[c] * R.get((c, j), 0.0) for c in CLS)
        self.a, self.b = a, b
        # On one scale across models: a layer matrix's noise is one of n layers' outputs
        # in the residual stream (mix::Sensitivity::band divides by n), the classifier's
        # is in the logits; the layer classes' geometric mean is 1.
        g = gm([a[c] for c in LAYER])
        self.rel = {c: a[c] / g * (1 if c in LAYER else 1 / self.n) for c in CLS}
        self.scale = g  # KLD per unit of Σ (rel·β·r), the model's own

fits = {}
for model in models:
    f = Model(os.path.join(out, model))
    f.fit()
    fits[model] = f

# One set for both: geometric means of the normalized constants.
alpha = {c: gm([f.rel[c] for f in fits.values()]) for c in CLS}
beta = [gm([f.b[j] for f in fits.values()]) for j in range(3)]
print(f"Mean KLD against BF16, {chunks} chunks. Σ r: the class's relative errors in its probe type;"
      " α: KLD per unit of β-weighted Σ r; normalized: α over the layer classes' geometric mean,"
      " wcls's also × n_layers (a layer matrix weighs α·β/n_layers, the classifier α)\n")
print("| model | " + " | ".join(CLS) + " | band first | band last |")
print("|---|" + "---|" * (len(CLS) + 2))
for model, f in fits.items():
    print(f"| {model} probe type | " + " | ".join(f.probe[c] for c in CLS) + " | all | all |")
    print(f"| {model} KLD | " + " | ".join(f"{f.kld[c]:.5f}" for c in CLS)
          + f" | {f.kld_band[0]:.5f} | {f.kld_band[2]:.5f} |")
    print(f"| {model} Σ r | " + " | ".join(f"{f.sum_r[c]:.5f}" for c in CLS) + " | | |")
    print(f"| {model} α; β | " + " | ".join(f"{f.a[c]:.4g}" for c in CLS)
          + f" | {f.b[0]:.3f} | {f.b[2]:.3f} |")
    print(f"| {model} (n = {f.n}) normalized | " + " | ".join(f"{f.rel[c]:.3f}" for c in CLS) + " | | |")
print("| **both** (geometric mean) | " + " | ".join(f"**{alpha[c]:.3f}**" for c in CLS)
      + f" | **{beta[0]:.3f}** | **{beta[2]:.3f}** |")
print("\nChecks: measured mean KLD against the prediction Σ α β r, by the model's own fit and by"
      " the shared constants (× the model's own scale):\n")
print("| model | file | measured | own fit | shared constants |")
print("|---|---|---|---|---|")
for model, f in fits.items():
    shared = {c: alpha[c] * f.scale * (1 if c in LAYER else f.n) for c in CLS}
    rows = [("band-first", f.kld_band[0], None), ("band-last", f.kld_band[2], None)]
    rows += [(f"class-{c}", f.kld[c], None) for c in CLS]
    rows += [(k, v, LOW if k == "all-q4_k" else SIX) for k, v in f.checks.items()]
    for name, meas, kinds in rows:
        if name.startswith("band"):
            j = 0 if name == "band-first" else 2
            sel = [m for m in f.mats if f.band(m) == j]
            p_own = sum(f.a[cls_of(m)] * f.b[j] * f.r(m, {f.probe[cls_of(m)]}) for m in sel)
            p_sh = sum(shared[cls_of(m)] * beta[j] * f.r(m, {f.probe[cls_of(m)]}) for m in sel)
        elif name.startswith("class"):
            c = name[6:]
            sel = [m for m in f.mats if cls_of(m) == c]
            p_own = sum(f.a[c] * f.b[f.band(m)] * f.r(m, {f.probe[c]}) for m in sel)
            p_sh = sum(shared[c] * beta[f.band(m)] * f.r(m, {f.probe[c]}) for m in sel)
        else:
            p_own, p_sh = f.predict(f.a, f.b, kinds), f.predict(shared, beta, kinds)
        print(f"| {model} | {name} | {meas:.5f} | {p_own:.5f} | {p_sh:.5f} |")
json.dump({"chunks": chunks, "alpha": alpha, "beta": beta,
           "models": {k: {"n_layers": f.n, "probe_type": f.probe, "kld": f.kld,
                          "kld_band": f.kld_band, "checks": f.checks, "sum_r": f.sum_r,
                          "alpha": f.a, "beta": f.b, "normalized": f.rel}
                      for k, f in fits.items()}},
          open(os.path.join(out, "fit.json"), "w"), indent=1)
PY
