#!/usr/bin/env python3
"""Makes Krafla's GGUF test fixtures (testdata/gguf/) with llama.cpp's own tools.

    /work/venv/bin/python testdata/make_gguf_fixtures.py --llama-cpp DIR

DIR is a llama.cpp source tree (the one vendored in the llama-cpp-python sdist:
`pip download --no-deps --no-binary llama-cpp-python llama-cpp-python`, then
`tar xzf` and pass `.../vendor/llama.cpp`; or set LLAMA_CPP_DIR). Its
convert_hf_to_gguf.py converts the fixtures of testdata/models/ and its gguf-py
writes and quantizes. See testdata/README.md ("GGUF fixtures").

What it writes:
- `<fixture>.<dtype>.gguf` for the fixtures in FLOAT: convert_hf_to_gguf.py with
  `--outtype` the checkpoint's own dtype (bf16, f16 or f32), so every weight is the
  checkpoint's exact value.
- `<fixture>.q8_0.gguf` for the fixtures in QUANT: `--outtype q8_0` (gguf-py's Q8_0,
  bit-exact with ggml's quantize_row_q8_0_ref).
- `<fixture>.q4_0.gguf` for QUANT: the float GGUF with every matrix (token_embd and
  output included, as `llama-quantize --pure`) quantized by gguf-py's Q4_0 (ggml's
  quantize_row_q4_0_ref), everything else copied.
- `default.vocab.gguf`: `--vocab-only` of testdata/default (its byte-level BPE
  tokenizer) for mlt-convert.
- `dequant.gguf`: random blocks of every type Krafla dequantizes, each beside
  gguf-py's dequantization of it (`<TYPE>.blocks`, `<TYPE>.expected`).

The random fixtures carry no tokenizer; convert_hf_to_gguf.py needs one, so each is
copied to a temporary folder with a minimal byte-level tokenizer (256 byte tokens, no
merges), and the converter is told its pre-tokenizer is "gpt-2" (its hash of an
unknown tokenizer would stop it) and to read every vocabulary through its byte-level
path. The weights and model metadata are what llama.cpp's converter writes.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "models")
OUT = os.path.join(HERE, "gguf")

FLOAT = [
    "llama", "llama_tied", "llama_rope_llama3", "llama_rope_yarn",
    "mistral_sliding", "qwen2", "qwen3", "gemma2", "gemma3_text", "smollm3", "qwen3_5_text",
]
# Mixtures of experts: olmoe, llama with experts, gpt-oss, qwen35moe. Not qwen3_moe:
# its fixture has a dense layer (mlp_only_layers), which llama.cpp's qwen3moe cannot map.
MOE = ["olmoe", "mixtral", "gpt_oss", "qwen3_5_moe_text"]
FLOAT += MOE
QUANT = ["llama", "qwen3", "gemma3_text", "olmoe"]
DTYPE = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}

BOOTSTRAP = r"""
import runpy, sys
llama, args = sys.argv[1], sys.argv[2:]
sys.path.insert(0, llama + "/gguf-py")
sys.path.insert(0, llama)
from conversion.base import TextModel
import conversion.gemma as gemma
import conversion.llama as llama_mod
# Fixtures only: an unknown tokenizer's hash would stop the converter, and the Gemma 2 /
# Llama classes look for a SentencePiece model first.
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
gemma.Gemma2Model.set_vocab = TextModel._set_vocab_gpt2
llama_mod.LlamaModel.set_vocab = TextModel._set_vocab_gpt2
sys.argv = [llama + "/convert_hf_to_gguf.py"] + args
runpy.run_path(llama + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def byte_tokenizer(dst):
    """A byte-level BPE tokenizer.json of the 256 byte symbols (GPT-2 spelling)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(dst, "tokenizer.json"))
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        # No special tokens: some tokenizer classes add their defaults (Qwen2's
        # <|endoftext|>) past the model's 256 ids otherwise.
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
                   "eos_token": None, "unk_token": None, "pad_token": None}, f)


def convert(llama, src, out, outtype, extra=()):
    cmd = [sys.executable, "-c", BOOTSTRAP, llama, src, "--outfile", out, "--outtype", outtype, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
        raise SystemExit(f"convert_hf_to_gguf.py failed on {src}")


def requant_q4_0(gguf, src, dst):
    """The float GGUF with every matrix in Q4_0, other tensors and metadata copied."""
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch=arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vt = f.types[0]
        if name == "general.file_type":
            w.add_key_value(name, int(gguf.LlamaFileType.MOSTLY_Q4_0), vt)
        elif vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, f.contents(), vt, sub_type=f.types[-1])
        else:
            w.add_key_value(name, f.contents(), vt)
    for t in r.tensors:
        floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                  gguf.GGMLQuantizationType.BF16)
        # Matrices, and the experts' 3-D stacks ([E, rows, cols] in numpy order).
        # Routers (ffn_gate_inp) stay F32, as llama-quantize keeps them.
        matrix = t.name.endswith(".weight") and "ffn_gate_inp" not in t.name
        if len(t.shape) in (2, 3) and matrix and t.tensor_type in floats:
            x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            x = x.reshape(*[int(n) for n in reversed(t.shape)])
            q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q4_0)
            w.add_tensor(t.name, q, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        else:
            data = t.data
            if len(t.shape) == 2:
                data = data.reshape(int(t.shape[1]), -1)
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Byte offsets of the f16 scale fields of one block, per type (set to sane values so
# that random blocks dequantize to finite numbers).
SCALES = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}


def dequant_fixture(gguf, dst):
    rng = np.random.default_rng(20261202)
    w = gguf.GGUFWriter(dst, arch="krafla-dequant-test")
    cols, rows = 512, 2
    for name in ["F16", "BF16", *SCALES]:
        qt = gguf.GGMLQuantizationType[name]
        bs, bb = gguf.GGML_QUANT_SIZES[qt]
        if name == "F16":
            blocks = rng.normal(size=(rows, cols)).astype(np.float16).view(np.uint8)
        elif name == "BF16":
            f = rng.normal(size=(rows, cols)).astype(np.float32)
            blocks = (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
        else:
            blocks = rng.integers(0, 256, size=(rows * cols // bs, bb), dtype=np.uint8)
            for off in SCALES[name]:
                d = (rng.normal(size=blocks.shape[0]) * 0.01).astype(np.float16)
                blocks[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
            blocks = blocks.reshape(rows, -1)
        expected = gguf.quants.dequantize(blocks, qt).astype(np.float32).reshape(rows, cols)
        assert np.isfinite(expected).all(), name
        w.add_tensor(f"{name}.blocks", blocks, raw_dtype=qt)
        w.add_tensor(f"{name}.expected", expected)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_DIR"),
                    help="llama.cpp source tree (default $LLAMA_CPP_DIR)")
    ap.add_argument("--only", nargs="+", metavar="FIXTURE",
                    help="convert only these fixtures (no vocab or dequant files)")
    args = ap.parse_args()
    if not args.llama_cpp or not os.path.isfile(os.path.join(args.llama_cpp, "convert_hf_to_gguf.py")):
        raise SystemExit("need --llama-cpp DIR (a llama.cpp source tree with convert_hf_to_gguf.py)")
    llama = os.path.abspath(args.llama_cpp)
    sys.path.insert(0, os.path.join(llama, "gguf-py"))
    import gguf

    os.makedirs(OUT, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in FLOAT:
            if args.only and name not in args.only:
                continue
            src = os.path.join(MODELS, name)
            ref = json.load(open(os.path.join(src, "reference.json")))
            dt = DTYPE[ref["dtype"]]
            work = os.path.join(tmp, name)  # the folder name becomes general.name
            shutil.copytree(src, work)
            byte_tokenizer(work)
            flt = os.path.join(OUT, f"{name}.{dt}.gguf")
            # --no-mtp: the fixtures have no multi-token-prediction layers.
            extra = ["--no-mtp"] if name.startswith("qwen3_5") else []
            convert(llama, work, flt, dt, extra)
            print("wrote", flt, os.path.getsize(flt))
            if name in QUANT:
                q8 = os.path.join(OUT, f"{name}.q8_0.gguf")
                convert(llama, work, q8, "q8_0", extra)
                print("wrote", q8, os.path.getsize(q8))
                q4 = os.path.join(OUT, f"{name}.q4_0.gguf")
                requant_q4_0(gguf, flt, q4)
                print("wrote", q4, os.path.getsize(q4))
        if args.only:
            return
        # The default model's tokenizer (an unknown hash too: its regex is GPT-2's).
        work = os.path.join(tmp, "default")
        shutil.copytree(os.path.join(HERE, "default"), work)
        voc = os.path.join(OUT, "default.vocab.gguf")
        convert(llama, work, voc, "bf16", ["--vocab-only"])
        print("wrote", voc, os.path.getsize(voc))
    deq = os.path.join(OUT, "dequant.gguf")
    dequant_fixture(gguf, deq)
    print("wrote", deq, os.path.getsize(deq))


if __name__ == "__main__":
    main()
