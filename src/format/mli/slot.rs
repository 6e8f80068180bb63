//! Which matrix input an importance or covariance row belongs to.

/// The matrix inputs an imatrix sums, per layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// Input of wq, wk, wv (and wg, lqkv, lz, lb, la): dim channels.
    Attn,
    /// Input of wo (and lout): q_dim channels.
    Wo,
    /// Input of w1 and w3: dim channels.
    W13,
    /// Input of w2: hidden_dim channels.
    W2,
}
