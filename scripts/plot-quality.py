#!/usr/bin/env python3
"""Mean KLD against bits per weight, Krafla and llama.cpp side by side, one panel per model.

usage: plot-quality.py OUT.png MODEL/results.jsonl...

Reads the result lines scripts/quality-vs-llama.sh writes (one JSON object per file:
tool, name, matrix bpw, kl.kl_mean, kl.kl_ci95) and draws, per model:
- llama.cpp's files made with its imatrix (llama-*-imatrix, IQ4_NL --pure + imatrix);
- Krafla's --target-bpw mixes (mix-*);
- Krafla's --gguf-types mixes exported to GGUF, measured inside llama.cpp (mixg-*).
The y axis is logarithmic: KLD falls by orders of magnitude over 2-8 bits.
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # no display: write the file only
import matplotlib.pyplot as plt  # noqa: E402


def series(rows):
    """(label, style, [(bpw, kld, ci)]) for the three families, sorted by bpw."""
    fams = [
        ("llama.cpp (llama-quantize + imatrix)", dict(color="tab:red", marker="s"),
         lambda r: r["tool"] == "llama.cpp" and r["name"].endswith("-imatrix")),
        ("Krafla --target-bpw + imatrix", dict(color="tab:blue", marker="o"),
         lambda r: r["tool"] == "krafla" and r["name"].startswith("mix-")),
        ("Krafla --gguf-types, exported, in llama.cpp", dict(color="tab:green", marker="^", linestyle="--"),
         lambda r: r["tool"] == "krafla→llama.cpp"),
    ]
    for name, style, keep in fams:
        pts = sorted((r["bpw"], r["kl"]["kl_mean"], r["kl"]["kl_ci95"]) for r in rows if keep(r))
        if pts:
            yield name, style, pts


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__.strip().splitlines()[2])
    out, files = sys.argv[1], sys.argv[2:]
    fig, axes = plt.subplots(1, len(files), figsize=(6 * len(files), 4.5), squeeze=False)
    for ax, f in zip(axes[0], files):
        rows = [json.loads(line) for line in open(f)]
        for name, style, pts in series(rows):
            x, y, ci = zip(*pts)
            ax.errorbar(x, y, yerr=ci, label=name, capsize=2, **style)
        ax.set_yscale("log")
        ax.set_xlabel("bits per weight (matrices, scales included)")
        ax.set_ylabel("mean KLD against its tool's BF16")
        ax.set_title(os.path.basename(os.path.dirname(os.path.abspath(f))))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, out)  # whole or not at all


if __name__ == "__main__":
    main()
