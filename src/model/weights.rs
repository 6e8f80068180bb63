//! Borrowed views of every array of a loaded `.mlb` file: matrices as
//! [`kernels::QMat`](crate::kernels::QMat) (from `Mlb::mat`), vectors as `&[f32]`, all
//! pointing into the map, f16 block scales included (the kernels convert those as they
//! read them); and
//! [`Packs`], the matrices' packed copies for tiers with packed kernels.

use crate::format::mlb::{Kind, Mixer, Mlb};
use crate::format::FormatError;
use crate::kernels::{Kernels, PackedMat, QMat};

/// The weights of a softmax-attention mixer.
#[derive(Debug, Clone, Copy)]
pub struct AttnWeights<'a> {
    /// q_dim × dim.
    pub wq: QMat<'a>,
    /// kv_dim × dim.
    pub wk: QMat<'a>,
    /// kv_dim × dim.
    pub wv: QMat<'a>,
    /// dim × q_dim.
    pub wo: QMat<'a>,
    /// q_dim × dim (attn_gate only).
    pub wg: Option<QMat<'a>>,
    /// q_dim, kv_dim, kv_dim (qkv_bias only).
    pub bq: Option<&'a [f32]>,
    pub bk: Option<&'a [f32]>,
    pub bv: Option<&'a [f32]>,
    /// head_dim each (qk_norm only).
    pub q_norm: Option<&'a [f32]>,
    pub k_norm: Option<&'a [f32]>,
}

/// The weights of a gated-delta-rule mixer.
#[derive(Debug, Clone, Copy)]
pub struct LinearWeights<'a> {
    /// (2·K·dk + V·dv) × dim.
    pub lqkv: QMat<'a>,
    /// V·dv × dim.
    pub lz: QMat<'a>,
    /// V × dim each.
    pub lb: QMat<'a>,
    pub la: QMat<'a>,
    /// (2·K·dk + V·dv) × lin_conv taps, row-major.
    pub lconv: &'a [f32],
    /// V each.
    pub dt_bias: &'a [f32],
    pub a_log: &'a [f32],
    /// dv.
    pub lnorm: &'a [f32],
    /// dim × V·dv.
    pub lout: QMat<'a>,
}

/// A layer's mixer weights.
#[derive(Debug, Clone, Copy)]
pub enum MixerWeights<'a> {
    Attention(AttnWeights<'a>),
    Linear(LinearWeights<'a>),
}

/// One layer.
#[derive(Debug, Clone, Copy)]
pub struct LayerWeights<'a> {
    /// dim.
    pub attn_norm: &'a [f32],
    pub mixer: MixerWeights<'a>,
    /// dim.
    pub ffn_norm: &'a [f32],
    /// hidden_dim × dim (gate).
    pub w1: QMat<'a>,
    /// dim × hidden_dim (down).
    pub w2: QMat<'a>,
    /// hidden_dim × dim (up).
    pub w3: QMat<'a>,
    /// dim each (post_norms only).
    pub post_attn_norm: Option<&'a [f32]>,
    pub post_ffn_norm: Option<&'a [f32]>,
}

/// All weights of a model.
#[derive(Debug, Clone)]
pub struct Weights<'a> {
    /// vocab × dim.
    pub tok_emb: QMat<'a>,
    pub layers: Vec<LayerWeights<'a>>,
    /// dim.
    pub final_norm: &'a [f32],
    /// vocab × dim (tok_emb when shared).
    pub wcls: QMat<'a>,
}

/// Packed copies of a file's matrices ([`crate::kernels::packed`]), made once at load
/// for a tier with packed kernels; the matrices' mapped pages are released afterwards,
/// so the copy replaces them in memory rather than adding to it.
#[derive(Debug)]
pub struct Packs {
    /// By tensor index; `None` for vectors (and everything when not packing).
    mats: Vec<Option<PackedMat>>,
}

/// [`Packs::none`] for [`Model::new`](super::Model::new), which borrows one.
pub(crate) static NO_PACKS: Packs = Packs::none();

impl Packs {
    /// No packed matrices: the kernels read the map.
    pub const fn none() -> Packs {
        Packs { mats: Vec::new() }
    }

    /// Packs every matrix of `m` whose type `k` has a packed kernel for (none when it
    /// has none: [`Packs::none`]).
    pub fn new(m: &Mlb, k: &Kernels) -> Result<Packs, FormatError> {
        if !k.packs() {
            return Ok(Packs::none());
        }
        let lay = m.layout();
        // Opening read every Q8_0 quant (the −128 check): unmap it all first, so that
        // the map and the copy are never resident together beyond one batch of rows.
        let wanted = |t: &crate::format::mlb::Tensor| match t.kind {
            Kind::Mat { wtype, .. } => k.packs_type(wtype),
            _ => false,
        };
        for (i, t) in lay.tensors.iter().enumerate() {
            if let (Kind::Mat { rows, .. }, true) = (t.kind, wanted(t)) {
                m.release_rows(i, 0, rows);
            }
        }
        let mut mats = Vec::with_capacity(lay.tensors.len());
        for (i, t) in lay.tensors.iter().enumerate() {
            if !wanted(t) {
                mats.push(None);
                continue;
            }
            let w = m.mat(i);
            mats.push(Some(PackedMat::new_with(&w, |r0, r1| {
                m.release_rows(i, r0, r1)
            })));
        }
        Ok(Packs { mats })
    }

    /// Bytes of all packed matrices.
    pub fn bytes(&self) -> usize {
        self.mats.iter().flatten().map(PackedMat::bytes).sum()
    }

    fn get(&self, idx: usize) -> Option<&PackedMat> {
        self.mats.get(idx).and_then(Option::as_ref)
    }
}

impl<'a> Weights<'a> {
    /// Views of every array of `m`, matrices with their packed form from `packs`.
    pub fn new(m: &'a Mlb, packs: &'a Packs) -> Result<Weights<'a>, FormatError> {
        let lay = m.layout();
        // A matrix type without a kernel on this tier (the GGUF block types until their
        // kernels land) is refused here, naming the tensor, rather than when first
        // multiplied.
        let k = crate::kernels::kernels();
        for t in &lay.tensors {
            if let Kind::Mat {
                wtype, rows, cols, ..
            } = t.kind
            {
                if !k.supports(wtype) {
                    let e = FormatError::shape(
                        t.name.to_string(),
                        "matrix",
                        format!("matrix {rows}x{cols} {wtype}: no kernel for this weight type yet"),
                    );
                    return Err(match &m.path {
                        Some(p) => e.in_file(p),
                        None => e,
                    });
                }
            }
        }
        let mat = |i: usize| -> QMat<'a> {
            let w = m.mat(i);
            match packs.get(i) {
                // A pack made from this file always fits.
                Some(p) => w.with_packed(p).unwrap_or(w),
                None => w,
            }
        };
        let vec = |i: usize| m.f32s(i);
        let opt = |i: Option<usize>| i.map(|i| m.f32s(i));
        let mut layers = Vec::with_capacity(lay.layers.len());
        for l in &lay.layers {
            let mixer = match &l.mixer {
                Mixer::Attention(a) => MixerWeights::Attention(AttnWeights {
                    wq: mat(a.wq),
                    wk: mat(a.wk),
                    wv: mat(a.wv),
                    wo: mat(a.wo),
                    wg: a.wg.map(mat),
                    bq: opt(a.bq),
                    bk: opt(a.bk),
                    bv: opt(a.bv),
                    q_norm: opt(a.q_norm),
                    k_norm: opt(a.k_norm),
                }),
                Mixer::Linear(x) => MixerWeights::Linear(LinearWeights {
                    lqkv: mat(x.lqkv),
                    lz: mat(x.lz),
                    lb: mat(x.lb),
                    la: mat(x.la),
                    lconv: vec(x.lconv),
                    dt_bias: vec(x.dt_bias),
                    a_log: vec(x.a_log),
                    lnorm: vec(x.lnorm),
                    lout: mat(x.lout),
                }),
            };
            layers.push(LayerWeights {
                attn_norm: vec(l.attn_norm),
                mixer,
                ffn_norm: vec(l.ffn_norm),
                w1: mat(l.w1),
                w2: mat(l.w2),
                w3: mat(l.w3),
                post_attn_norm: opt(l.post_attn_norm),
                post_ffn_norm: opt(l.post_ffn_norm),
            });
        }
        Ok(Weights {
            tok_emb: mat(lay.tok_emb),
            layers,
            final_norm: vec(lay.final_norm),
            wcls: mat(lay.wcls),
        })
    }
}
