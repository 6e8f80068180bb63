#!/usr/bin/env bash
# testdata/gguf/qwen3.mixed.gguf: llama.cpp's llama-quantize on the qwen3 bf16 fixture
# (made by make_gguf_fixtures.py), one type per tensor kind, so that every GGUF type
# Krafla stores as it is appears in one file llama.cpp made, q/k rows (rotate-half,
# permuted on import) included. The K types need rows of 256 values: the fixtures'
# 64-wide rows get none (llama-quantize would fall back), so they are tested on
# random blocks (src/convert/gguf_in.rs) and on a real Q4_K_M file (tests/gguf.rs).
#   LLAMA_QUANTIZE  the llama-quantize binary [llama-quantize on PATH]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
"${LLAMA_QUANTIZE:-llama-quantize}" \
  --tensor-type attn_q=q5_1 --tensor-type attn_k=q4_1 --tensor-type attn_v=iq4_nl \
  --tensor-type ffn_up=bf16 --tensor-type ffn_gate=f16 --tensor-type ffn_down=q5_0 \
  --tensor-type attn_output=q8_0 --token-embedding-type q4_0 \
  "$here/gguf/qwen3.bf16.gguf" "$here/gguf/qwen3.mixed.gguf" Q4_0 1
