#!/usr/bin/env python3
"""transformers' float32 references on the real checkpoints, for tests/real.rs.

For each model folder made by shared/tools/real-checkpoints.sh (smollm2-135m,
gemma3-270m), writes beside it:

- greedy.json: ten prompts, their token ids (from the checkpoint's own tokenizer, as
  transformers encodes them), transformers' float32 greedy continuation of 32 tokens,
  and the top-1 minus top-2 logit margin at each generated position;
- text512.json and text512.f32.bin: the first 512 tokens of a real text (Python's
  LICENSE.txt, the licence text every CPython installation ships beside `os.py`) and
  transformers' float32 logits at every position (little-endian f32, 512 × vocab), with
  the text's path and md5 and the per-position margins.

usage: python scripts/real_reference.py REAL_DIR [TEXT]   (needs torch, transformers;
       TEXT defaults to the running Python's LICENSE.txt)
"""
import hashlib
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "The largest planet in our solar system is",
    "To make a cup of tea, first",
    "import numpy as np\n\n",
    "The human heart has four chambers:",
    "In 1969, the Apollo 11 mission",
]
N_NEW = 32
N_TEXT = 512


def margins_of(lg):
    top2 = torch.topk(lg, 2).values
    return (top2[:, 0] - top2[:, 1]).tolist()


def main():
    real = sys.argv[1]
    text_path = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(os.__file__), "LICENSE.txt")
    raw = open(text_path, "rb").read()
    text = raw.decode("utf-8")
    md5 = hashlib.md5(raw).hexdigest()
    torch.set_num_threads(2)
    for name in ("smollm2-135m", "gemma3-270m"):
        src = os.path.join(real, name)
        if not os.path.exists(os.path.join(src, "config.json")):
            print("skip", src)
            continue
        tok = AutoTokenizer.from_pretrained(src)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager")
        model.eval()
        cases = []
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=N_NEW, do_sample=False, top_p=None, top_k=None,
                                     temperature=None)
            new = out[0, ids.shape[1]:].tolist()
            # Top-1 minus top-2 logit at each generated position: where it is tiny, a
            # quantized model may legitimately pick the runner-up.
            with torch.no_grad():
                lg = model(out).logits[0, ids.shape[1] - 1 : -1]
            cases.append({"prompt": p, "prompt_ids": ids[0].tolist(), "greedy_ids": new,
                          "margins": margins_of(lg), "text": tok.decode(new)})
            print(name, repr(p), "->", repr(tok.decode(new)))
        with open(os.path.join(src, "greedy.json"), "w") as f:
            json.dump({"model": name, "n_new": N_NEW, "cases": cases}, f, indent=1)

        ids = tok(text, return_tensors="pt").input_ids[:, :N_TEXT]
        assert ids.shape[1] == N_TEXT, f"{text_path}: fewer than {N_TEXT} tokens"
        with torch.no_grad():
            lg = model(ids, use_cache=False).logits[0].float()
        lg.numpy().astype("<f4").tofile(os.path.join(src, "text512.f32.bin.tmp"))
        os.replace(os.path.join(src, "text512.f32.bin.tmp"), os.path.join(src, "text512.f32.bin"))
        with open(os.path.join(src, "text512.json"), "w") as f:
            json.dump({"model": name, "source": os.path.basename(text_path), "md5": md5,
                       "tokens": ids[0].tolist(), "vocab": int(lg.shape[1]),
                       "margins": margins_of(lg), "torch": torch.__version__,
                       "transformers": __import__("transformers").__version__}, f)
        print(name, "text512:", N_TEXT, "positions ×", lg.shape[1], "logits; source", text_path, md5)


if __name__ == "__main__":
    main()
