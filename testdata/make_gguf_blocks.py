#!/usr/bin/env python3
"""Random GGUF blocks and gguf-py's dequantization of them: testdata/gguf_blocks.bin.

The fixture pins Krafla's block layouts to an independent implementation: gguf-py's numpy
dequantizers (`gguf.quants.dequantize`). For each type it writes random blocks (random
quant bytes; the f16 scales drawn from normal values, zero, negatives, subnormals and large
values, never inf/NaN; MXFP4's E8M0 exponent from ordinary values, the subnormal 0 and
1 and the largest that keeps every value finite, 252; IQ1_M's d, spread over the top
nibbles of its scale words, drawn as the f16 scales) and the f32 values gguf-py gives
for them. The IQ codebook types (IQ3_XXS .. IQ1_M) come last, so the sections before
them are the bytes an older run wrote. Krafla's Q6_0 is not a
GGUF type; its blocks are decoded here from the layout (d f16, qh[8], qs[16]: bits 4-5 of
element j < 16 are bits 4*(j//8)..+2 of qh[j % 8], of element j + 16 the two bits above)
into Q8_0 blocks (same d, level q - 32), the lossless GGUF export, and dequantized by
gguf-py's Q8_0.

File (little-endian): b"KQF1", u32 sections; per section: u32 Krafla wtype code,
u32 blocks, u32 bytes per block, u32 weights per block, the blocks' bytes, then
blocks x weights f32.

usage: make_gguf_blocks.py [OUT]     (default: gguf_blocks.bin beside this script)
Needs numpy and gguf (pip install gguf).
"""
import os
import struct
import sys

import numpy as np
from gguf import GGMLQuantizationType as G
from gguf.quants import dequantize

SEED = 20261202
# (Krafla code, GGUF type or None for Q6_0, blocks, bytes, weights, offsets of f16 scales;
# "e8m0": MXFP4's exponent byte at 0; "iq1m": IQ1_M's f16 d in the top nibbles of its
# four scale words at 48)
TYPES = [
    (5, G.Q4_K, 12, 144, 256, (0, 2)),
    (6, G.Q5_K, 12, 176, 256, (0, 2)),
    (7, G.Q6_K, 12, 210, 256, (208,)),
    (8, G.Q4_1, 48, 20, 32, (0, 2)),
    (9, G.Q5_0, 48, 22, 32, (0,)),
    (10, G.Q5_1, 48, 24, 32, (0, 2)),
    (11, G.IQ4_NL, 48, 18, 32, (0,)),
    (12, None, 48, 26, 32, (0,)),
    (13, G.MXFP4, 48, 17, 32, "e8m0"),
    (14, G.Q2_K, 12, 84, 256, (80, 82)),
    (15, G.Q3_K, 12, 110, 256, (108,)),
    (16, G.IQ4_XS, 12, 136, 256, (0,)),
    (17, G.IQ3_XXS, 12, 98, 256, (0,)),
    (18, G.IQ3_S, 12, 110, 256, (0,)),
    (19, G.IQ2_XXS, 12, 66, 256, (0,)),
    (20, G.IQ2_XS, 12, 74, 256, (0,)),
    (21, G.IQ2_S, 12, 82, 256, (0,)),
    (22, G.IQ1_M, 12, 56, 256, "iq1m"),
]


def scale_bits(rng, n):
    """n f16 bit patterns: mostly normal values of either sign, some special ones."""
    v = (rng.standard_normal(n) * 0.01).astype(np.float16).view(np.uint16)
    special = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x8123, 0x7BFF, 0xFBFF, 0x3C00],
                       dtype=np.uint16)
    k = min(len(special), n // 3)
    idx = rng.choice(n, size=k, replace=False)
    v[idx] = special[:k]
    return v


def q6_0_to_q8_0(blocks):
    out = np.zeros((len(blocks), 34), dtype=np.uint8)
    for i, b in enumerate(blocks):
        qh, qs = b[2:10], b[10:26]
        q = np.zeros(32, dtype=np.int32)
        for j in range(16):
            h = int(qh[j % 8]) >> (4 * (j // 8))
            q[j] = (int(qs[j]) & 0x0F) | ((h & 3) << 4)
            q[j + 16] = (int(qs[j]) >> 4) | (((h >> 2) & 3) << 4)
        out[i, 0:2] = b[0:2]
        out[i, 2:34] = (q - 32).astype(np.int8).view(np.uint8)
    return out


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "gguf_blocks.bin")
    rng = np.random.default_rng(SEED)
    parts = [b"KQF1", struct.pack("<I", len(TYPES))]
    for code, gt, n, nbytes, nw, scale_at in TYPES:
        blocks = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
        if scale_at == "e8m0":
            e = rng.integers(100, 140, size=n, dtype=np.uint8)
            e[:4] = [0, 1, 2, 252]
            blocks[:, 0] = e
            scale_at = ()
        elif scale_at == "iq1m":
            d = scale_bits(rng, n)
            w = blocks[:, 48:56].copy().view("<u2").reshape(n, 4)
            for k in range(4):
                w[:, k] = (w[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
            blocks[:, 48:56] = w.view(np.uint8).reshape(n, 8)
            scale_at = ()
        for at in scale_at:
            blocks[:, at:at + 2] = scale_bits(rng, n).view(np.uint8).reshape(n, 2)
        if gt is None:
            vals = dequantize(q6_0_to_q8_0(blocks), G.Q8_0)
        else:
            vals = dequantize(blocks, gt)
        vals = np.asarray(vals, dtype=np.float32).reshape(n, nw)
        assert np.isfinite(vals).all()
        parts += [struct.pack("<4I", code, n, nbytes, nw), blocks.tobytes(),
                  vals.astype("<f4").tobytes()]
    data = b"".join(parts)
    with open(out, "wb") as f:
        f.write(data)
    print(f"wrote {out}: {len(data)} bytes")


if __name__ == "__main__":
    main()
