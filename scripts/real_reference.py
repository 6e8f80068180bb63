#!/usr/bin/env python3
"""Greedy references on the real checkpoints for the end-to-end test.

For each model folder made by shared/tools/real-checkpoints.sh (smollm2-135m,
gemma3-270m), writes greedy.json beside it: five prompts, their token ids (from the
checkpoint's own tokenizer, as transformers encodes them) and transformers' float32
greedy continuation of 16 tokens.

usage: python scripts/real_reference.py REAL_DIR   (needs torch, transformers)
"""
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
]
N_NEW = 16


def main():
    real = sys.argv[1]
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
                out = model.generate(ids, max_new_tokens=N_NEW, do_sample=False, top_p=None, top_k=None, temperature=None)
            new = out[0, ids.shape[1]:].tolist()
            # Top-1 minus top-2 logit at each generated position: where it is tiny, a
            # quantized model may legitimately pick the runner-up.
            with torch.no_grad():
                lg = model(out).logits[0, ids.shape[1] - 1 : -1]
            top2 = torch.topk(lg, 2).values
            margins = (top2[:, 0] - top2[:, 1]).tolist()
            cases.append({"prompt": p, "prompt_ids": ids[0].tolist(), "greedy_ids": new,
                          "margins": margins, "text": tok.decode(new)})
            print(name, repr(p), "->", repr(tok.decode(new)))
        with open(os.path.join(src, "greedy.json"), "w") as f:
            json.dump({"model": name, "n_new": N_NEW, "cases": cases}, f, indent=1)


if __name__ == "__main__":
    main()
