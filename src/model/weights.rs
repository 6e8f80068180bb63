//! Borrowed views of every array of a loaded `.mlb` file: matrices as
//! [`WeightMat`]s (`Mlb::mat`'s [`QMat`] with its packed copy), vectors as `&[f32]`, all
//! pointing into the map, f16 block scales included (the kernels convert those as they
//! read them); and
//! [`Packs`], the matrices' packed copies for tiers with packed kernels.

use crate::format::mlb::{Ffn, Kind, Mixer, Mlb};
use crate::format::QMat;
use crate::format::{FormatError, ShapeError, Status};
use crate::kernels::hugebuf::HugeBuf;
use crate::kernels::packed::LOAD_BATCH_BYTES;
use crate::kernels::{pool, Kernels, PackedMat, WeightMat};

/// The weights of a softmax-attention mixer.
#[derive(Debug, Clone, Copy)]
pub struct AttnWeights<'a> {
    /// q_dim × dim.
    pub wq: WeightMat<'a>,
    /// kv_dim × dim.
    pub wk: WeightMat<'a>,
    /// kv_dim × dim.
    pub wv: WeightMat<'a>,
    /// dim × q_dim.
    pub wo: WeightMat<'a>,
    /// q_dim × dim (attn_gate only).
    pub wg: Option<WeightMat<'a>>,
    /// q_dim, kv_dim, kv_dim (qkv_bias only).
    pub bq: Option<&'a [f32]>,
    pub bk: Option<&'a [f32]>,
    pub bv: Option<&'a [f32]>,
    /// dim (qkv_bias 2 only): added to wo's output.
    pub bo: Option<&'a [f32]>,
    /// head_dim each (qk_norm 1), or q_dim and kv_dim (qk_norm 2: the whole projection).
    pub q_norm: Option<&'a [f32]>,
    pub k_norm: Option<&'a [f32]>,
    /// n_heads sink logits (attn_sinks only).
    pub sinks: Option<&'a [f32]>,
}

/// The weights of a gated-delta-rule mixer.
#[derive(Debug, Clone, Copy)]
pub struct LinearWeights<'a> {
    /// (2·K·dk + V·dv) × dim.
    pub lqkv: WeightMat<'a>,
    /// V·dv × dim.
    pub lz: WeightMat<'a>,
    /// V × dim each.
    pub lb: WeightMat<'a>,
    pub la: WeightMat<'a>,
    /// (2·K·dk + V·dv) × lin_conv taps, row-major.
    pub lconv: &'a [f32],
    /// V each.
    pub dt_bias: &'a [f32],
    pub a_log: &'a [f32],
    /// dv.
    pub lnorm: &'a [f32],
    /// dim × V·dv.
    pub lout: WeightMat<'a>,
}

/// A layer's mixer weights.
#[derive(Debug, Clone, Copy)]
pub enum MixerWeights<'a> {
    Attention(AttnWeights<'a>),
    Linear(LinearWeights<'a>),
}

/// A dense FFN's matrices.
#[derive(Debug, Clone, Copy)]
pub struct DenseWeights<'a> {
    /// hidden_dim × dim (gate).
    pub w1: WeightMat<'a>,
    /// dim × hidden_dim (down).
    pub w2: WeightMat<'a>,
    /// hidden_dim × dim (up).
    pub w3: WeightMat<'a>,
}

/// One expert's FFN: row ranges of the stacked matrices (see [`MoeWeights::expert`]).
#[derive(Debug, Clone, Copy)]
pub struct ExpertWeights<'a> {
    /// eh × dim (gate), eh × dim (up), dim × eh (down).
    pub w1: WeightMat<'a>,
    pub w3: WeightMat<'a>,
    pub w2: WeightMat<'a>,
    /// eh, eh, dim (expert biases only).
    pub b1: Option<&'a [f32]>,
    pub b3: Option<&'a [f32]>,
    pub b2: Option<&'a [f32]>,
}

/// A mixture-of-experts FFN's arrays, the stacked experts cut into one view per
/// expert at load.
#[derive(Debug, Clone)]
pub struct MoeWeights<'a> {
    /// E × dim, F32.
    pub router: &'a [f32],
    /// E (router bias only).
    pub router_b: Option<&'a [f32]>,
    /// Expert e's rows of ew1, ew3, ew2 (and of the biases).
    pub experts: Vec<ExpertWeights<'a>>,
    /// The shared expert's sw1, sw2, sw3 (shared_hidden > 0).
    pub shared: Option<DenseWeights<'a>>,
    /// dim (the shared expert's gate only).
    pub sgate: Option<&'a [f32]>,
}

impl<'a> MoeWeights<'a> {
    /// Expert `e`'s matrices.
    pub fn expert(&self, e: usize) -> &ExpertWeights<'a> {
        &self.experts[e]
    }
}

/// A layer's FFN.
#[derive(Debug, Clone)]
pub enum FfnWeights<'a> {
    Dense(DenseWeights<'a>),
    Moe(MoeWeights<'a>),
}

/// One layer.
#[derive(Debug, Clone)]
pub struct LayerWeights<'a> {
    /// dim.
    pub attn_norm: &'a [f32],
    pub mixer: MixerWeights<'a>,
    /// dim.
    pub ffn_norm: &'a [f32],
    pub ffn: FfnWeights<'a>,
    /// dim each (post_norms only).
    pub post_attn_norm: Option<&'a [f32]>,
    pub post_ffn_norm: Option<&'a [f32]>,
}

/// All weights of a model.
#[derive(Debug, Clone)]
pub struct Weights<'a> {
    /// vocab × dim.
    pub tok_emb: WeightMat<'a>,
    pub layers: Vec<LayerWeights<'a>>,
    /// dim.
    pub final_norm: &'a [f32],
    /// vocab × dim (tok_emb when shared).
    pub wcls: WeightMat<'a>,
}

/// The copies of a file's matrices the runtime makes once at load, each on huge pages
/// where the system has them ([`crate::kernels::hugebuf`]): packed ones
/// ([`crate::kernels::packed`]) for a tier with packed kernels of the type, and plain
/// copies of BF16/F16 matrices, which have no packed layout but stream faster from huge
/// pages than from the file's map. The matrices' mapped pages are released as each is
/// copied, so a copy replaces them in memory rather than adding to it.
#[derive(Debug)]
pub struct Packs {
    /// By tensor index; `None` for vectors and matrices read from the map.
    mats: Vec<Option<Held>>,
}

/// One matrix's copy.
#[derive(Debug)]
enum Held {
    Packed(PackedMat),
    /// The file's bytes of a BF16/F16 matrix (its rows, unchanged).
    Half(HugeBuf),
}

/// [`Packs::none`] for [`Model::new`](super::Model::new), which borrows one.
pub(crate) static NO_PACKS: Packs = Packs::none();

impl Packs {
    /// No copies: the kernels read the map.
    pub const fn none() -> Packs {
        Packs { mats: Vec::new() }
    }

    /// Packs every matrix of `m` whose type `k` has a packed kernel for, and copies its
    /// BF16/F16 matrices. Fails only when the system has no memory for a copy.
    pub fn new(m: &Mlb, k: &Kernels) -> Result<Packs, FormatError> {
        let lay = m.layout();
        let wanted = |t: &crate::format::mlb::Tensor| match t.kind {
            Kind::Mat { wtype, .. } => k.packs_type(wtype) || wtype.is_half(),
            _ => false,
        };
        // Opening read every Q8_0 quant (the −128 check): unmap it all first, so that
        // the map and the copy are never resident together beyond one batch of rows.
        for (i, t) in lay.tensors.iter().enumerate() {
            if let (Kind::Mat { rows, .. }, true) = (t.kind, wanted(t)) {
                m.release_rows(i, 0, rows);
            }
        }
        let no_memory = |name: &dyn std::fmt::Display, e: std::io::Error| {
            let e = FormatError::new(
                Status::Io,
                name.to_string(),
                "copy at load",
                format!("no memory for the tensor's copy: {e}"),
            );
            match &m.path {
                Some(p) => e.in_file(p),
                None => e,
            }
        };
        let mut mats = Vec::with_capacity(lay.tensors.len());
        for (i, t) in lay.tensors.iter().enumerate() {
            if !wanted(t) {
                mats.push(None);
                continue;
            }
            let w = m.mat(i);
            let held = if w.wtype.is_half() {
                copy_half(&w, |r0, r1| m.release_rows(i, r0, r1)).map(Held::Half)
            } else {
                PackedMat::new_with(&w, |r0, r1| m.release_rows(i, r0, r1)).map(Held::Packed)
            };
            mats.push(Some(held.map_err(|e| no_memory(&t.name, e))?));
        }
        Ok(Packs { mats })
    }

    /// Bytes of all copies.
    pub fn bytes(&self) -> usize {
        let len = |h: &Held| match h {
            Held::Packed(p) => p.bytes(),
            Held::Half(b) => b.len(),
        };
        self.mats.iter().flatten().map(len).sum()
    }

    fn get(&self, idx: usize) -> Option<&Held> {
        self.mats.get(idx).and_then(Option::as_ref)
    }
}

/// A copy of half matrix `w`'s bytes, on the pool, calling `done(r0, r1)` after each
/// batch of rows so the caller can release them.
fn copy_half(w: &QMat, mut done: impl FnMut(usize, usize)) -> std::io::Result<HugeBuf> {
    let mut buf = HugeBuf::zeroed(w.q.len())?;
    let row = w.q.len() / w.rows;
    let per = (LOAD_BATCH_BYTES / row).max(1);
    // Pieces of a batch on the pool's threads: one thread copies at about half the
    // memory bandwidth.
    let piece = (per * row).div_ceil(pool::threads()).max(1);
    for r0 in (0..w.rows).step_by(per) {
        let r1 = (r0 + per).min(w.rows);
        let (src, dst) = (
            &w.q[r0 * row..r1 * row],
            &mut buf.as_mut_slice()[r0 * row..r1 * row],
        );
        pool::for_chunks(dst, piece, |j, out| {
            out.copy_from_slice(&src[j * piece..j * piece + out.len()])
        });
        done(r0, r1);
    }
    Ok(buf)
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
        let mat = |i: usize| -> WeightMat<'a> {
            let w = WeightMat::from(m.mat(i));
            match packs.get(i) {
                // A pack made from this file always fits.
                Some(Held::Packed(p)) => w.with_packed(p).unwrap_or(w),
                // A half matrix's bytes are its rows: same length, nothing else to view.
                Some(Held::Half(b)) => WeightMat::from(QMat {
                    q: b.as_slice(),
                    ..w.mat
                }),
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
                    bo: opt(a.bo),
                    q_norm: opt(a.q_norm),
                    k_norm: opt(a.k_norm),
                    sinks: opt(a.sinks),
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
            let ffn = match &l.ffn {
                Ffn::Dense { w1, w2, w3 } => FfnWeights::Dense(DenseWeights {
                    w1: mat(*w1),
                    w2: mat(*w2),
                    w3: mat(*w3),
                }),
                Ffn::Moe(x) => {
                    let shape = |e: ShapeError| {
                        let e = FormatError::shape(
                            lay.tensors[x.ew1].name.to_string(),
                            "expert",
                            e.to_string(),
                        );
                        match &m.path {
                            Some(p) => e.in_file(p),
                            None => e,
                        }
                    };
                    let (ew1, ew2, ew3) = (mat(x.ew1), mat(x.ew2), mat(x.ew3));
                    let n = m.dims().n_experts;
                    let (eh, dim) = (ew1.mat.rows / n, ew2.mat.rows / n);
                    let mut experts = Vec::with_capacity(n);
                    for e in 0..n {
                        let (h, o) = (e * eh..(e + 1) * eh, e * dim..(e + 1) * dim);
                        let part = |b: Option<usize>, r: &std::ops::Range<usize>| {
                            b.map(|i| &m.f32s(i)[r.clone()])
                        };
                        experts.push(ExpertWeights {
                            w1: ew1.row_range(h.start, h.end).map_err(shape)?,
                            w3: ew3.row_range(h.start, h.end).map_err(shape)?,
                            w2: ew2.row_range(o.start, o.end).map_err(shape)?,
                            b1: part(x.eb1, &h),
                            b3: part(x.eb3, &h),
                            b2: part(x.eb2, &o),
                        });
                    }
                    FfnWeights::Moe(MoeWeights {
                        router: vec(x.router),
                        router_b: opt(x.router_b),
                        experts,
                        shared: x.shared.map(|[w1, w2, w3]| DenseWeights {
                            w1: mat(w1),
                            w2: mat(w2),
                            w3: mat(w3),
                        }),
                        sgate: opt(x.sgate),
                    })
                }
            };
            layers.push(LayerWeights {
                attn_norm: vec(l.attn_norm),
                mixer,
                ffn_norm: vec(l.ffn_norm),
                ffn,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::mlb::header::wtype::MIXED;
    use crate::format::wtype::WType;
    use crate::synth::{synth_mixed, tiny_header};

    /// Every BF16/F16 matrix is read from its copy, byte for byte the file's; packed
    /// types from their packed form; the rest from the map.
    #[test]
    fn half_matrices_are_read_from_copies() {
        let mut h = tiny_header();
        h.wtype = MIXED;
        // tok_emb, 2 × (wq wk wv wo w1 w2 w3), wcls.
        let mut types = vec![WType::BF16; 16];
        types[2] = WType::F16;
        types[8] = WType::Q4_0;
        let bytes = synth_mixed(&h, &[], &types, 11);
        let m = Mlb::from_bytes(&bytes).unwrap();
        let k = crate::kernels::kernels();
        let packs = Packs::new(&m, &k).unwrap();
        let w = Weights::new(&m, &packs).unwrap();
        // The views point into the copies, not into the file's bytes.
        let file = m.bytes().as_ptr_range();
        let lay = m.layout();
        let MixerWeights::Attention(a) = &w.layers[0].mixer else {
            panic!("attention layer")
        };
        let Mixer::Attention(ai) = &lay.layers[0].mixer else {
            panic!("attention layer")
        };
        for (q, i) in [(w.tok_emb, lay.tok_emb), (a.wk, ai.wk)] {
            let Some(Held::Half(b)) = packs.get(i) else {
                panic!("{} not copied", lay.tensors[i].name)
            };
            let q = q.mat;
            assert!(q.wtype.is_half() && !file.contains(&q.q.as_ptr()));
            assert_eq!(q.q.as_ptr_range(), b.as_slice().as_ptr_range());
        }
        // Each copy holds exactly the file's bytes of its matrix.
        for (i, t) in lay.tensors.iter().enumerate() {
            if let Kind::Mat { wtype, .. } = t.kind {
                match packs.get(i) {
                    Some(Held::Half(b)) => {
                        assert!(wtype.is_half(), "{}", t.name);
                        assert_eq!(b.as_slice(), m.mat(i).q, "{}", t.name);
                    }
                    Some(Held::Packed(_)) => assert!(k.packs_type(wtype), "{}", t.name),
                    None => assert!(!wtype.is_half() && !k.packs_type(wtype), "{}", t.name),
                }
            }
        }
        assert_eq!(
            lay.tensors
                .iter()
                .enumerate()
                .filter(|(i, _)| matches!(packs.get(*i), Some(Held::Half(_))))
                .count(),
            15
        );
    }
}
