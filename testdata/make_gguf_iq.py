#!/usr/bin/env python3
"""testdata/gguf/llama256.iq.gguf: llama.cpp's own IQ codebook blocks in a tiny model.

    python testdata/make_gguf_iq.py --llama-cpp DIR [--llama-quantize BIN]

The IQ types need rows of 256 values, which the fixtures of testdata/models/ (64 wide)
lack, so this makes its own: a seeded random Llama (hidden 256, intermediate 512, one
layer, 4 heads of 64, 2 kv heads, vocab 256, untied output) saved as BF16, converted by
DIR's convert_hf_to_gguf.py (as make_gguf_fixtures.py does), then quantized by
llama-quantize with one IQ type per tensor kind:

    attn_q IQ3_XXS, attn_k IQ3_S, attn_v IQ2_XXS, attn_output IQ2_XS,
    ffn_gate IQ2_S, ffn_up IQ1_M, ffn_down IQ3_XXS, token_embd and output Q8_0

llama-quantize needs an importance matrix for IQ2_XXS, IQ2_XS and IQ1_M: the script
writes one in llama.cpp's legacy imatrix format with every column's importance 1 (the
blocks are what llama.cpp's quantizer makes of these weights under a flat importance).
The BF16 model is not kept. Two runs write identical bytes. Needs numpy, torch,
transformers, tokenizers.
"""

import argparse
import os
import shutil
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "gguf", "llama256.iq.gguf")
SEED = 20261206
TYPES = {
    "attn_q": "iq3_xxs", "attn_k": "iq3_s", "attn_v": "iq2_xxs", "attn_output": "iq2_xs",
    "ffn_gate": "iq2_s", "ffn_up": "iq1_m", "ffn_down": "iq3_xxs",
}


def checkpoint(dst):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, initializer_range=0.05)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(dst)


def imatrix(gguf_path, dst):
    """Legacy imatrix (int32 count; per tensor: int32 name length, name, int32 ncall,
    int32 nval, f32 values; int32 last call; int32 dataset name length, name) with every
    matrix's column importances 1."""
    import numpy as np
    from gguf import GGUFReader

    r = GGUFReader(gguf_path)
    mats = [(t.name, int(t.shape[0])) for t in r.tensors if len(t.shape) == 2]
    parts = [struct.pack("<i", len(mats))]
    for name, cols in mats:
        b = name.encode()
        parts += [struct.pack("<i", len(b)), b, struct.pack("<ii", 1, cols),
                  np.ones(cols, dtype="<f4").tobytes()]
    ds = b"flat"
    parts += [struct.pack("<i", 1), struct.pack("<i", len(ds)), ds]
    with open(dst, "wb") as f:
        f.write(b"".join(parts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_DIR"),
                    help="llama.cpp source tree (default $LLAMA_CPP_DIR)")
    ap.add_argument("--llama-quantize", default=os.environ.get("LLAMA_QUANTIZE", "llama-quantize"))
    args = ap.parse_args()
    if not args.llama_cpp:
        raise SystemExit("need --llama-cpp DIR (a llama.cpp source tree with convert_hf_to_gguf.py)")
    llama = os.path.abspath(args.llama_cpp)
    sys.path.insert(0, os.path.join(llama, "gguf-py"))
    sys.path.insert(0, HERE)
    from make_gguf_fixtures import byte_tokenizer, convert

    with tempfile.TemporaryDirectory() as tmp:
        work = os.path.join(tmp, "llama256")
        checkpoint(work)
        byte_tokenizer(work)
        flt = os.path.join(tmp, "llama256.bf16.gguf")
        convert(llama, work, flt, "bf16")
        imat = os.path.join(tmp, "flat.imatrix")
        imatrix(flt, imat)
        # Relative to the temporary folder: the file records the imatrix's path.
        cmd = [os.path.abspath(args.llama_quantize) if os.sep in args.llama_quantize
               else args.llama_quantize, "--imatrix", "flat.imatrix",
               "--token-embedding-type", "q8_0",
               "--output-tensor-type", "q8_0"]
        for k, v in TYPES.items():
            cmd += ["--tensor-type", f"{k}={v}"]
        cmd += [flt, OUT, "IQ4_XS", "1"]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        if r.returncode != 0:
            sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
            raise SystemExit("llama-quantize failed")
    from gguf import GGUFReader

    for t in GGUFReader(OUT).tensors:
        print(f"{t.name:28} {t.tensor_type.name:8} {list(t.shape)}")
    print("wrote", OUT, os.path.getsize(OUT))


if __name__ == "__main__":
    main()
