//! Row maps from a Hugging Face tensor to a spec array.
//!
//! Rotary embeddings: Hugging Face rotates halves of each head (dimension i pairs
//! with i + rot/2), the spec rotates interleaved pairs (2i, 2i + 1). Per head, over
//! the first `rot` dimensions only, out[2i + j] = in[j·rot/2 + i] for i < rot/2 and
//! j ∈ {0, 1}; dimensions at or past `rot` stay. It applies to the rows of wq and wk
//! and equally to bq, bk, q_norm and k_norm of layers with RoPE. A layer without RoPE
//! (layer flag bit 2, SmolLM3's NoPE layers) has no layout to bridge and keeps the
//! checkpoint's row order (`rot` = 0 there), as the spec reads.
//!
//! Qwen3.5's q_proj holds, per head, head_dim query rows then head_dim gate rows:
//! wq takes the first half of each head's block (then the RoPE permutation), wg the
//! second half.
//!
//! Every transform is a gather of source rows, so a matrix can be converted in row
//! chunks without holding the whole tensor.

/// Where row `r` of the output comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowMap {
    /// Row r is row r.
    Identity,
    /// The RoPE permutation within each head of `head_dim` rows over the first `rot`.
    Rope { head_dim: usize, rot: usize },
    /// Qwen3.5 q_proj → wq: per head the first `head_dim` of `2·head_dim` rows, permuted.
    GateQuery { head_dim: usize, rot: usize },
    /// Qwen3.5 q_proj → wg: per head the second `head_dim` of `2·head_dim` rows.
    GateGate { head_dim: usize },
}

/// The source index of output dimension `d` of one head: the rotate-half → interleaved
/// permutation over the first `rot` dimensions.
pub fn rope_src(d: usize, rot: usize) -> usize {
    if d < rot {
        let (i, j) = (d / 2, d % 2);
        j * (rot / 2) + i
    } else {
        d
    }
}

/// The inverse of [`rope_src`]: the output dimension that reads source dimension `d`.
pub fn rope_dst(d: usize, rot: usize) -> usize {
    let half = rot / 2;
    if d < half {
        2 * d
    } else if d < rot {
        2 * (d - half) + 1
    } else {
        d
    }
}

impl RowMap {
    /// The source row of output row `r`.
    pub fn src(self, r: usize) -> usize {
        match self {
            RowMap::Identity => r,
            RowMap::Rope { head_dim, rot } => {
                let (h, d) = (r / head_dim, r % head_dim);
                h * head_dim + rope_src(d, rot)
            }
            RowMap::GateQuery { head_dim, rot } => {
                let (h, d) = (r / head_dim, r % head_dim);
                h * 2 * head_dim + rope_src(d, rot)
            }
            RowMap::GateGate { head_dim } => {
                let (h, d) = (r / head_dim, r % head_dim);
                h * 2 * head_dim + head_dim + d
            }
        }
    }

    /// Source rows for `n` output rows.
    pub fn src_rows(self, n: usize) -> usize {
        match self {
            RowMap::GateQuery { .. } | RowMap::GateGate { .. } => 2 * n,
            _ => n,
        }
    }

    /// Whether output rows a..b read source rows a..b.
    pub fn is_identity(self) -> bool {
        self == RowMap::Identity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_dst_inverts_rope_src() {
        for (hd, rot) in [(8, 8), (8, 4), (64, 64), (64, 32), (6, 2)] {
            for d in 0..hd {
                assert_eq!(
                    rope_dst(rope_src(d, rot), rot),
                    d,
                    "hd {hd} rot {rot} d {d}"
                );
            }
        }
    }

    /// The source row of every output row: full rotary interleaves the halves of each
    /// head, partial rotary leaves the rest, Qwen3.5's q_proj splits into query and
    /// gate rows.
    #[test]
    fn source_rows() {
        let cases: [(RowMap, &[usize]); 4] = [
            (
                RowMap::Rope {
                    head_dim: 8,
                    rot: 8,
                },
                &[0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15],
            ),
            (
                RowMap::Rope {
                    head_dim: 8,
                    rot: 4,
                },
                &[0, 2, 1, 3, 4, 5, 6, 7],
            ),
            (
                RowMap::GateQuery {
                    head_dim: 4,
                    rot: 4,
                },
                &[0, 2, 1, 3, 8, 10, 9, 11],
            ),
            (
                RowMap::GateGate { head_dim: 4 },
                &[4, 5, 6, 7, 12, 13, 14, 15],
            ),
        ];
        for (m, want) in cases {
            let got: Vec<usize> = (0..want.len()).map(|r| m.src(r)).collect();
            assert_eq!(got, want, "{m:?}");
        }
        let q = RowMap::GateQuery {
            head_dim: 4,
            rot: 4,
        };
        assert_eq!(q.src_rows(8), 16);
    }
}
