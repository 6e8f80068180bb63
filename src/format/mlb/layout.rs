//! Where every array of an `.mlb` file lies: the spec's array order with 64-byte
//! alignment, computed with checked `u64` arithmetic and a checked conversion to usize.
//!
//! A matrix's type comes from the header (`wtype`, and `q8_mask` in a Q4_0 file) or,
//! in a mixed file (`wtype` 128), from the type table: one byte per matrix in array
//! order, stored after the layer flags. Sizes come from the type's [`Geometry`] alone.

use std::fmt;

use super::header::{
    layer_flag, moe_flag, q8_class, qk_norm, qkv_bias, wtype, Header, HEADER_SIZE,
};
use super::validate::Dims;
use crate::format::error::{FormatError, Result};
use crate::format::wtype::{Geometry, WType};

/// Every array starts at a multiple of this.
pub const ALIGN: u64 = 64;

/// A tensor's name: `tok_emb`, `final_norm`, or `layers.N.wq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorName {
    pub layer: Option<u32>,
    pub name: &'static str,
}

impl fmt::Display for TensorName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.layer {
            Some(l) => write!(f, "layers.{l}.{}", self.name),
            None => f.write_str(self.name),
        }
    }
}

/// What a tensor holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The layer flag bytes, or a mixed file's type table.
    U8 { len: usize },
    /// A float32 vector or matrix (norms, biases, conv taps) of `len` floats.
    F32 { len: usize },
    /// A weight matrix: its blocks (quants, or 2-byte floats) at `offset`, the per-block
    /// scales at `d_offset` when its type has them.
    Mat {
        wtype: WType,
        rows: usize,
        cols: usize,
        /// q8_mask class bits of the matrix (0 for lb and la: always Q8_0 in a Q4_0 model).
        class: u32,
        /// Offset of the scale array; for a type without one, the end of the blocks.
        d_offset: u64,
        /// Bytes of the scale array (blocks × 2 or 4; 0 for a type without scales).
        d_bytes: u64,
    },
}

/// One tensor of the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tensor {
    pub name: TensorName,
    pub kind: Kind,
    /// Offset of the (first) array.
    pub offset: u64,
    /// Bytes of the (first) array, without padding.
    pub bytes: u64,
}

impl Tensor {
    /// Offset one past the last byte of the tensor's last array (without padding).
    pub fn end(&self) -> u64 {
        match self.kind {
            Kind::Mat {
                d_offset, d_bytes, ..
            } => d_offset + d_bytes,
            _ => self.offset + self.bytes,
        }
    }

    /// Number of parameters it holds.
    pub fn params(&self) -> u64 {
        match self.kind {
            Kind::U8 { .. } => 0,
            Kind::F32 { len } => len as u64,
            Kind::Mat { rows, cols, .. } => rows as u64 * cols as u64,
        }
    }

    /// Bytes it takes in the file (all arrays, without padding).
    pub fn stored_bytes(&self) -> u64 {
        match self.kind {
            Kind::Mat { d_bytes, .. } => self.bytes + d_bytes,
            _ => self.bytes,
        }
    }
}

/// Indices into [`Layout::tensors`] of one attention layer's arrays.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AttnIdx {
    pub wq: usize,
    pub wk: usize,
    pub wv: usize,
    pub wo: usize,
    pub wg: Option<usize>,
    pub bq: Option<usize>,
    pub bk: Option<usize>,
    pub bv: Option<usize>,
    /// The output projection's bias (qkv_bias 2).
    pub bo: Option<usize>,
    /// head_dim each (qk_norm 1), or q_dim and kv_dim (qk_norm 2).
    pub q_norm: Option<usize>,
    pub k_norm: Option<usize>,
    /// n_heads sink logits (attn_sinks).
    pub sinks: Option<usize>,
}

/// Indices of one linear-attention (gated delta rule) layer's arrays.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LinearIdx {
    pub lqkv: usize,
    pub lz: usize,
    pub lb: usize,
    pub la: usize,
    pub lconv: usize,
    pub dt_bias: usize,
    pub a_log: usize,
    pub lnorm: usize,
    pub lout: usize,
}

/// Attention or linear attention.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mixer {
    Attention(AttnIdx),
    Linear(LinearIdx),
}

/// Indices of one mixture-of-experts FFN's arrays (layer flag 16).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MoeIdx {
    /// n_experts × dim, F32.
    pub router: usize,
    pub router_b: Option<usize>,
    /// The stacked experts: ew1 and ew3 n_experts·expert_hidden × dim, ew2
    /// n_experts·dim × expert_hidden; expert e's rows are contiguous.
    pub ew1: usize,
    pub ew2: usize,
    pub ew3: usize,
    /// Expert biases (moe_flags 2): n_experts·expert_hidden, n_experts·dim, n_experts·expert_hidden.
    pub eb1: Option<usize>,
    pub eb2: Option<usize>,
    pub eb3: Option<usize>,
    /// The shared expert (shared_hidden > 0): sw1, sw2, sw3.
    pub shared: Option<[usize; 3]>,
    /// dim floats (moe_flags 4).
    pub sgate: Option<usize>,
}

/// A layer's FFN: one dense FFN or a mixture of experts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ffn {
    Dense { w1: usize, w2: usize, w3: usize },
    Moe(MoeIdx),
}

impl LayerIdx {
    /// The dense FFN's (w1, w2, w3), or `None` in a mixture-of-experts layer.
    pub fn dense(&self) -> Option<(usize, usize, usize)> {
        match self.ffn {
            Ffn::Dense { w1, w2, w3 } => Some((w1, w2, w3)),
            Ffn::Moe(_) => None,
        }
    }
}

/// Indices of one layer's arrays.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerIdx {
    pub flags: u8,
    pub attn_norm: usize,
    pub mixer: Mixer,
    pub ffn_norm: usize,
    pub ffn: Ffn,
    pub post_attn_norm: Option<usize>,
    pub post_ffn_norm: Option<usize>,
}

/// The positions of every array of a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Every tensor in file order.
    pub tensors: Vec<Tensor>,
    pub layer_flags: Option<usize>,
    /// The type table of a mixed file.
    pub type_table: Option<usize>,
    pub tok_emb: usize,
    pub layers: Vec<LayerIdx>,
    pub final_norm: usize,
    /// The classifier: `wcls`, or `tok_emb` when shared.
    pub wcls: usize,
    /// One past the last byte of the last array.
    pub end: u64,
}

/// `v` as usize if it fits under `limit` (the platform's `usize::MAX` in real use;
/// tests pass `u32::MAX` to check what a 32-bit target would do).
pub fn to_usize_limited(v: u64, limit: u64, what: &str) -> Result<usize> {
    if v > limit || v > usize::MAX as u64 {
        return Err(FormatError::shape(
            what,
            v,
            "size does not fit in this platform's address space",
        ));
    }
    Ok(v as usize)
}

/// `v` as usize on this platform.
pub fn to_usize(v: u64, what: &str) -> Result<usize> {
    to_usize_limited(v, usize::MAX as u64, what)
}

fn overflow(what: impl fmt::Display) -> FormatError {
    FormatError::shape(what.to_string(), "overflow", "array size overflows 64 bits")
}

/// `v` rounded up to the next multiple of 64.
pub fn align_up(v: u64) -> Option<u64> {
    v.checked_add(ALIGN - 1).map(|x| x & !(ALIGN - 1))
}

/// A matrix's type in a file whose header gives it (`wtype` not mixed): `wtype`, except
/// in a Q4_0 model, where the `q8_mask` classes and lb/la (class 0) are Q8_0.
pub fn class_wtype(wtype_: u32, q8_mask: u32, class: u32) -> WType {
    match WType::from_code(wtype_) {
        Some(WType::Q4_0) if class == 0 || q8_mask & class != 0 => WType::Q8_0,
        Some(t) => t,
        // validate() admits only known codes and mixed, whose types come from the table.
        None => WType::Q8_0,
    }
}

/// Bytes of a `rows × cols` matrix of geometry `g`: (blocks, scales). `cols` that is
/// not a multiple of the block is ML_E_SHAPE naming the tensor.
pub fn mat_bytes(
    name: TensorName,
    type_name: &str,
    g: Geometry,
    rows: u64,
    cols: u64,
    scale_f16: bool,
) -> Result<(u64, u64)> {
    let bw = g.block_weights as u64;
    if !cols.is_multiple_of(bw) {
        return Err(FormatError::shape(
            name.to_string(),
            format!("{rows} × {cols}"),
            format!("{type_name} needs columns in whole blocks of {bw} weights"),
        ));
    }
    let blocks = rows.checked_mul(cols / bw).ok_or_else(|| overflow(name))?;
    let q_bytes = blocks
        .checked_mul(g.block_bytes as u64)
        .ok_or_else(|| overflow(name))?;
    let d_bytes = if g.scale_array {
        let d_size = if scale_f16 { 2 } else { 4 };
        blocks.checked_mul(d_size).ok_or_else(|| overflow(name))?
    } else {
        0
    };
    Ok((q_bytes, d_bytes))
}

/// Where matrix types come from.
#[derive(Clone, Copy)]
enum Types<'a> {
    /// The header (`wtype`, `q8_mask`).
    Header,
    /// A mixed file's type table, one code per matrix in array order.
    Table(&'a [u8]),
    /// Counting the matrices of a mixed file (sizes are not needed): no table placed.
    Counting,
}

/// Builder that places arrays one after the other, 64-byte aligned.
struct Placer<'a> {
    h: &'a Header,
    types: Types<'a>,
    /// Matrices placed so far (the index of the next type-table entry).
    mats: usize,
    pos: u64,
    tensors: Vec<Tensor>,
    /// Only sum sizes (no allocation): used to check a header against the file size
    /// before any per-layer structure is allocated.
    count_only: bool,
    limit: u64,
    /// One past the last byte of the last array placed (without its padding).
    last_end: u64,
}

impl Placer<'_> {
    fn place(&mut self, bytes: u64, name: TensorName) -> Result<u64> {
        let at = self.pos;
        let end = at.checked_add(bytes).ok_or_else(|| overflow(name))?;
        self.pos = align_up(end).ok_or_else(|| overflow(name))?;
        self.last_end = end;
        if self.pos > self.limit {
            return Err(FormatError::shape(
                name.to_string(),
                end,
                "array ends past the addressable size",
            ));
        }
        Ok(at)
    }

    fn push(&mut self, t: Tensor) -> usize {
        if !self.count_only {
            self.tensors.push(t);
        }
        self.tensors.len().saturating_sub(1)
    }

    fn u8s(&mut self, name: TensorName, len: usize) -> Result<usize> {
        let offset = self.place(len as u64, name)?;
        Ok(self.push(Tensor {
            name,
            kind: Kind::U8 { len },
            offset,
            bytes: len as u64,
        }))
    }

    fn f32s(&mut self, name: TensorName, len: u64) -> Result<usize> {
        let bytes = len.checked_mul(4).ok_or_else(|| overflow(name))?;
        let offset = self.place(bytes, name)?;
        let len = to_usize_limited(len, self.limit, &name.to_string())?;
        Ok(self.push(Tensor {
            name,
            kind: Kind::F32 { len },
            offset,
            bytes,
        }))
    }

    /// The type of the next matrix, `name` of class `class`.
    fn mat_type(&self, name: TensorName, class: u32) -> Result<WType> {
        let table = match self.types {
            Types::Header => return Ok(class_wtype(self.h.wtype, self.h.q8_mask, class)),
            Types::Counting => return Ok(WType::Q8_0),
            Types::Table(t) => t,
        };
        let i = self.mats;
        let code = *table.get(i).ok_or_else(|| {
            FormatError::format(
                "type_table",
                format!("{} entries", table.len()),
                format!("no entry for matrix {i} ({name})"),
            )
        })?;
        WType::from_code(code as u32).ok_or_else(|| {
            FormatError::format(
                name.to_string(),
                code,
                format!("type table entry {i} is not a known weight type"),
            )
        })
    }

    fn mat(&mut self, name: TensorName, rows: u64, cols: u64, class: u32) -> Result<usize> {
        let wtype = self.mat_type(name, class)?;
        self.mats += 1;
        let (q_bytes, d_bytes) = mat_bytes(
            name,
            wtype.name(),
            wtype.geometry(),
            rows,
            cols,
            self.h.scale_f16 != 0,
        )?;
        let offset = self.place(q_bytes, name)?;
        // A type without scales has no second array (not even an empty aligned one).
        let d_offset = if wtype.has_scales() {
            self.place(d_bytes, name)?
        } else {
            offset + q_bytes
        };
        let rows = to_usize_limited(rows, self.limit, &name.to_string())?;
        let cols = to_usize_limited(cols, self.limit, &name.to_string())?;
        Ok(self.push(Tensor {
            name,
            kind: Kind::Mat {
                wtype,
                rows,
                cols,
                class,
                d_offset,
                d_bytes,
            },
            offset,
            bytes: q_bytes,
        }))
    }
}

fn top(name: &'static str) -> TensorName {
    TensorName { layer: None, name }
}

impl Layout {
    /// Places every array of a validated header whose `wtype` is not mixed. `flags` are
    /// the layer flag bytes (empty when the header has none). `limit` caps every size
    /// and offset: pass `usize::MAX as u64` (see [`Layout::new`]) or a smaller one to
    /// model a 32-bit target.
    pub fn with_limit(h: &Header, d: &Dims, flags: &[u8], limit: u64) -> Result<Layout> {
        Self::with_table(h, d, flags, &[], limit)
    }

    /// Places every array on this platform (a header whose `wtype` is not mixed).
    pub fn new(h: &Header, d: &Dims, flags: &[u8]) -> Result<Layout> {
        Self::with_limit(h, d, flags, usize::MAX as u64)
    }

    /// Places every array; `table` is a mixed file's type table (one code per matrix,
    /// [`Layout::matrix_count`] of them) and must be empty for any other `wtype`.
    pub fn with_table(
        h: &Header,
        d: &Dims,
        flags: &[u8],
        table: &[u8],
        limit: u64,
    ) -> Result<Layout> {
        Self::walk(h, d, flags, Self::types(h, table)?, limit, false)
    }

    /// The end offset of the arrays (for checking against the file size before
    /// allocating anything per layer).
    pub fn end_offset(h: &Header, d: &Dims, flags: &[u8], table: &[u8], limit: u64) -> Result<u64> {
        Ok(Self::walk(h, d, flags, Self::types(h, table)?, limit, true)?.end)
    }

    /// The number of matrices of the file: a mixed file's type table has this many
    /// entries (tok_emb, each layer's matrices, then wcls unless shared).
    pub fn matrix_count(h: &Header, d: &Dims, flags: &[u8]) -> Result<usize> {
        let mut p = Self::placer(h, Types::Counting, u64::MAX, true);
        Self::place_all(&mut p, h, d, flags)?;
        Ok(p.mats)
    }

    /// Offset of a mixed file's type table: right after the layer flags (padded to 64),
    /// or at the end of the header without them.
    pub fn type_table_offset(h: &Header, d: &Dims) -> u64 {
        let flags = if h.layer_flags != 0 {
            align_up(d.n_layers as u64).expect("n_layers ≤ 65536")
        } else {
            0
        };
        HEADER_SIZE as u64 + flags
    }

    fn types<'a>(h: &Header, table: &'a [u8]) -> Result<Types<'a>> {
        match (h.wtype == wtype::MIXED, table.is_empty()) {
            (true, _) => Ok(Types::Table(table)),
            (false, true) => Ok(Types::Header),
            (false, false) => Err(FormatError::format(
                "type_table",
                format!("{} entries", table.len()),
                format!("a type table needs wtype 128 (mixed), not {}", h.wtype),
            )),
        }
    }

    fn placer<'a>(h: &'a Header, types: Types<'a>, limit: u64, count_only: bool) -> Placer<'a> {
        Placer {
            h,
            types,
            mats: 0,
            pos: HEADER_SIZE as u64,
            tensors: Vec::new(),
            count_only,
            limit,
            last_end: HEADER_SIZE as u64,
        }
    }

    fn walk(
        h: &Header,
        d: &Dims,
        flags: &[u8],
        types: Types,
        limit: u64,
        count_only: bool,
    ) -> Result<Layout> {
        let mut p = Self::placer(h, types, limit, count_only);
        let mut layout = Self::place_all(&mut p, h, d, flags)?;
        if let Types::Table(t) = types {
            if p.mats != t.len() {
                return Err(FormatError::format(
                    "type_table",
                    format!("{} entries", t.len()),
                    format!("the model has {} matrices", p.mats),
                ));
            }
        }
        layout.tensors = std::mem::take(&mut p.tensors);
        Ok(layout)
    }

    /// Places the arrays in the spec's order (the tensors stay in `p`).
    fn place_all(p: &mut Placer, h: &Header, d: &Dims, flags: &[u8]) -> Result<Layout> {
        let nl = d.n_layers;
        let (dim, hid, vocab) = (d.dim as u64, d.hidden_dim as u64, d.vocab as u64);
        let (q_dim, kv_dim, hd) = (d.q_dim as u64, d.kv_dim as u64, d.head_dim as u64);
        let layer_flags = if h.layer_flags != 0 {
            Some(p.u8s(top("layer_flags"), nl)?)
        } else {
            None
        };
        let type_table = match p.types {
            Types::Table(t) => Some(p.u8s(top("type_table"), t.len())?),
            _ => None,
        };
        let tok_emb = p.mat(
            top("tok_emb"),
            vocab,
            dim,
            q8_class::TOK_EMB | tok_emb_extra(h),
        )?;
        let mut layers = Vec::new();
        if !p.count_only {
            layers.reserve(nl);
        }
        for l in 0..nl {
            let f = flags.get(l).copied().unwrap_or(0);
            let n = |name| TensorName {
                layer: Some(l as u32),
                name,
            };
            let attn_norm = p.f32s(n("attn_norm"), dim)?;
            let mixer = if f & layer_flag::LINEAR != 0 {
                let (qkv, vt) = (d.lin_qkv as u64, d.lin_v_total as u64);
                let v = h.lin_v_heads as u64;
                Mixer::Linear(LinearIdx {
                    lqkv: p.mat(n("lqkv"), qkv, dim, q8_class::WQK)?,
                    lz: p.mat(n("lz"), vt, dim, q8_class::WV)?,
                    lb: p.mat(n("lb"), v, dim, 0)?,
                    la: p.mat(n("la"), v, dim, 0)?,
                    lconv: p.f32s(
                        n("lconv"),
                        qkv.checked_mul(h.lin_conv as u64)
                            .ok_or_else(|| overflow(n("lconv")))?,
                    )?,
                    dt_bias: p.f32s(n("dt_bias"), v)?,
                    a_log: p.f32s(n("A_log"), v)?,
                    lnorm: p.f32s(n("lnorm"), h.lin_v_dim as u64)?,
                    lout: p.mat(n("lout"), dim, vt, q8_class::WO)?,
                })
            } else {
                let mut a = AttnIdx {
                    wq: p.mat(n("wq"), q_dim, dim, q8_class::WQK)?,
                    wk: p.mat(n("wk"), kv_dim, dim, q8_class::WQK)?,
                    wv: p.mat(n("wv"), kv_dim, dim, q8_class::WV)?,
                    wo: p.mat(n("wo"), dim, q_dim, q8_class::WO)?,
                    ..AttnIdx::default()
                };
                if h.attn_gate != 0 {
                    a.wg = Some(p.mat(n("wg"), q_dim, dim, q8_class::WQK)?);
                }
                if h.qkv_bias != qkv_bias::NONE {
                    a.bq = Some(p.f32s(n("bq"), q_dim)?);
                    a.bk = Some(p.f32s(n("bk"), kv_dim)?);
                    a.bv = Some(p.f32s(n("bv"), kv_dim)?);
                }
                if h.qkv_bias == qkv_bias::QKVO {
                    a.bo = Some(p.f32s(n("bo"), dim)?);
                }
                match h.qk_norm {
                    qk_norm::NONE => {}
                    qk_norm::WHOLE => {
                        a.q_norm = Some(p.f32s(n("q_norm"), q_dim)?);
                        a.k_norm = Some(p.f32s(n("k_norm"), kv_dim)?);
                    }
                    _ => {
                        a.q_norm = Some(p.f32s(n("q_norm"), hd)?);
                        a.k_norm = Some(p.f32s(n("k_norm"), hd)?);
                    }
                }
                if h.attn_sinks != 0 {
                    a.sinks = Some(p.f32s(n("sinks"), d.n_heads as u64)?);
                }
                Mixer::Attention(a)
            };
            let ffn_norm = p.f32s(n("ffn_norm"), dim)?;
            let ffn = if f & layer_flag::MOE != 0 {
                Ffn::Moe(Self::place_moe(p, h, d, &n)?)
            } else {
                Ffn::Dense {
                    w1: p.mat(n("w1"), hid, dim, q8_class::W13)?,
                    w2: p.mat(n("w2"), dim, hid, q8_class::W2)?,
                    w3: p.mat(n("w3"), hid, dim, q8_class::W13)?,
                }
            };
            let (post_attn_norm, post_ffn_norm) = if h.post_norms != 0 {
                (
                    Some(p.f32s(n("post_attn_norm"), dim)?),
                    Some(p.f32s(n("post_ffn_norm"), dim)?),
                )
            } else {
                (None, None)
            };
            if !p.count_only {
                layers.push(LayerIdx {
                    flags: f,
                    attn_norm,
                    mixer,
                    ffn_norm,
                    ffn,
                    post_attn_norm,
                    post_ffn_norm,
                });
            }
        }
        let final_norm = p.f32s(top("final_norm"), dim)?;
        let wcls = if h.shared_classifier != 0 {
            tok_emb
        } else {
            p.mat(top("wcls"), vocab, dim, q8_class::WCLS)?
        };
        let end = p.last_end;
        Ok(Layout {
            tensors: Vec::new(),
            layer_flags,
            type_table,
            tok_emb,
            layers,
            final_norm,
            wcls,
            end,
        })
    }

    /// A MoE layer's FFN arrays after ffn_norm (docs/file-format.md, "Array order").
    fn place_moe(
        p: &mut Placer,
        h: &Header,
        d: &Dims,
        n: &dyn Fn(&'static str) -> TensorName,
    ) -> Result<MoeIdx> {
        let (dim, e) = (d.dim as u64, d.n_experts as u64);
        let (eh, sh) = (d.expert_hidden as u64, d.shared_hidden as u64);
        // e ≤ 1024 and eh, dim ≤ 65536: every product fits in u64.
        let stacked_h = e * eh;
        let stacked_d = e * dim;
        let mut m = MoeIdx {
            router: p.f32s(n("router"), e * dim)?,
            ..MoeIdx::default()
        };
        if h.moe_flags & moe_flag::ROUTER_BIAS != 0 {
            m.router_b = Some(p.f32s(n("router_b"), e)?);
        }
        m.ew1 = p.mat(n("ew1"), stacked_h, dim, q8_class::W13)?;
        m.ew2 = p.mat(n("ew2"), stacked_d, eh, q8_class::W2)?;
        m.ew3 = p.mat(n("ew3"), stacked_h, dim, q8_class::W13)?;
        if h.moe_flags & moe_flag::EXPERT_BIAS != 0 {
            m.eb1 = Some(p.f32s(n("eb1"), stacked_h)?);
            m.eb2 = Some(p.f32s(n("eb2"), stacked_d)?);
            m.eb3 = Some(p.f32s(n("eb3"), stacked_h)?);
        }
        if sh > 0 {
            m.shared = Some([
                p.mat(n("sw1"), sh, dim, q8_class::W13)?,
                p.mat(n("sw2"), dim, sh, q8_class::W2)?,
                p.mat(n("sw3"), sh, dim, q8_class::W13)?,
            ]);
        }
        if h.moe_flags & moe_flag::SHARED_GATE != 0 {
            m.sgate = Some(p.f32s(n("sgate"), dim)?);
        }
        Ok(m)
    }

    /// Parameters of every tensor (a shared classifier counts once).
    pub fn params(&self) -> u64 {
        self.tensors.iter().map(|t| t.params()).sum()
    }

    /// The tensor named `name` (as displayed, e.g. `layers.0.wq`).
    pub fn find(&self, name: &str) -> Option<&Tensor> {
        self.tensors.iter().find(|t| t.name.to_string() == name)
    }
}

/// With a shared classifier tok_emb is also the classifier: it has the wcls class bit
/// too (in a Q4_0 model it is Q8_0 if the tok_emb or the wcls bit is set).
fn tok_emb_extra(h: &Header) -> u32 {
    if h.shared_classifier != 0 {
        q8_class::WCLS
    } else {
        0
    }
}
