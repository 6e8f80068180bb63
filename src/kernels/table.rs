//! The kernel table: one [`Kernels`] per instruction-set tier, every entry a function
//! pointer into `scalar/`, `x86/` or `arm/`, and the only place that builds the tables
//! ([`Kernels::for_tier`]) and chooses one ([`kernels`]: the best tier this CPU runs,
//! lowered by `KRAFLA_KERNEL` or [`with_tier`]). The calls on the table that are not
//! matrix products (attention, `exp`, SiLU / GELU, the maximum, the delta rule's head
//! step, the activation quantizer; and the f32 ops with one reference for every tier:
//! RMSNorm, the dot product, the KV cache's rounding) are here; the matrix products and
//! their scheduling over the pool are `matmul`'s.
//!
//! A tier's table holds only kernels its CPU features run, and is only built for a
//! tier this CPU supports: that is what makes calling its `unsafe fn` pointers sound.

use std::cell::Cell;
use std::fmt;
use std::sync::OnceLock;

use super::acts::{ActTile, HalfActs};
use super::error::TierError;
use super::packed::{DecodedView, Line, PackedView};
use super::scalar::attention::{self as scalar_attention, KvView, Query, TILE_QUERIES};
use super::scalar::blocks::{self as scalar_blocks, for_block_type};
use super::scalar::codebook::{self as scalar_codebook, for_codebook_type};
use super::scalar::delta::{self as scalar_delta, DeltaHead};
use super::scalar::kv::{self as scalar_kv, KvType};
use super::scalar::subproduct::{self as scalar_subproduct, Dims, Rows};
use super::scalar::{bf16dot as scalar_bf16dot, half as scalar_half, math as scalar_math};
use super::scalar::{quantize as scalar_quantize, tiles as scalar_tiles};
use super::tier::Tier;
use crate::format::wtype::{WType, QK};

#[cfg(target_arch = "aarch64")]
use super::arm;
#[cfg(target_arch = "x86_64")]
use super::x86;

/// Quantizes whole blocks: `x.len() = q.len() = 32·d.len()`.
pub(super) type QuantFn = unsafe fn(x: &[f32], q: &mut [i8], d: &mut [f32]);

/// Dots `rows` consecutive weight rows (`wq`, `wd`: `rows` rows of quants and scales)
/// with the `nt = out.len() / rows` ≤ [`TILE_TOKENS`](super::acts::TILE_TOKENS) tokens
/// of `x`: `out[r·nt + t]`.
pub(super) type TileFn =
    unsafe fn(rows: usize, wq: &[u8], wd: &[f32], x: &ActTile, out: &mut [f32]);

/// Dots groups `g0..g1` of a packed matrix with the 1..=`PACKED_TILE` tokens of `x`:
/// `y[t·ld + r]` for every real row `r` of those groups.
pub(super) type PackedFn =
    unsafe fn(p: &PackedView, g0: usize, g1: usize, x: &ActTile, y: *mut f32, ld: usize);

/// Decodes groups `g0..g1` (16 rows each) of a row-major codebook matrix (`wq`: its
/// `rows` rows of `cols`) into `buf`, `(g1 − g0)·(cols/32)·DECODED_LINES` lines in the
/// layout of `packed` ("Decoded codebook groups").
pub(super) type DecodeFn =
    unsafe fn(wq: &[u8], rows: usize, cols: usize, g0: usize, g1: usize, buf: &mut [Line]);

/// Dots decoded groups `v` (from [`DecodeFn`]) with the 1..=`PACKED_TILE` tokens of a
/// packed tile `x`: `y[t·ld + r]` for every real row `r` of those groups.
pub(super) type DecodedFn = unsafe fn(v: &DecodedView, x: &ActTile, y: *mut f32, ld: usize);

/// A codebook type's prompt path: decode a sub-block of rows once, then run every
/// token tile on the decoded levels.
#[derive(Clone, Copy)]
pub(super) struct DecodedKernels {
    pub(super) decode: DecodeFn,
    pub(super) run: DecodedFn,
}

/// f16 bits to f32, exactly: `src.len() == dst.len()`.
pub(super) type F16Fn = unsafe fn(src: &[u16], dst: &mut [f32]);

/// Attention of at most [`TILE_QUERIES`] queries of one kv head (shapes checked by
/// [`Kernels::attend`]).
pub(super) type AttendFn = unsafe fn(qs: &mut [Query], kv: &KvView, scale: f32, softcap: f32);

/// An element-wise map of a slice in place.
pub(super) type SliceFn = unsafe fn(v: &mut [f32]);

/// A reduction of a slice to one value.
pub(super) type ReduceFn = unsafe fn(v: &[f32]) -> f32;

/// `g[i] = act(g[i]) · u[i]`.
pub(super) type ActFn = unsafe fn(g: &mut [f32], u: &[f32]);

/// `g[i] = swiglu_clamped(g[i], u[i], limit, alpha)`.
pub(super) type SwigluFn = unsafe fn(g: &mut [f32], u: &[f32], limit: f32, alpha: f32);

/// The delta rule's step of one head: state (dk × dv), output (dv), scratch (dv).
pub(super) type DeltaFn = unsafe fn(x: &DeltaHead, s: &mut [f32], o: &mut [f32], delta: &mut [f32]);

/// `C −= E·U` in f64: dimensions `[m, k, n]`, then E, U and C with their row strides.
pub(super) type SubProductFn = unsafe fn(d: Dims, e: Rows, u: Rows, c: (&mut [f64], usize));

/// `y −= a·x` in f64, unfused: safe, since a table holds it only for a tier the CPU
/// runs (the caller keeps the pointer: error feedback calls it per column).
pub type SubScaledFn = fn(a: f64, x: &[f64], y: &mut [f64]);

/// `y[t·ld + r]` = weight row `r` · activation token `t`, for the `rows` rows of `w`
/// (`rows × cols` 2-byte floats, little-endian bytes) and the `x.len() / cols` tokens
/// of `x`.
pub(super) type HalfFn =
    unsafe fn(rows: usize, cols: usize, w: &[u8], x: &[f32], y: *mut f32, ld: usize);

/// `y[t·ld + r]` = BF16 weight row `r` · token `t` of `x` (BF16 bits, `cols` per token)
/// by the BF16-activation contract; otherwise as [`HalfFn`].
pub(super) type DotFn =
    unsafe fn(rows: usize, cols: usize, w: &[u8], x: &[u16], y: *mut f32, ld: usize);

/// A tier's kernels for the 2-byte float types. They take f32 (or BF16) activations,
/// not quantized ones, so they sit beside the quantized types' [`MatKernels`].
#[derive(Clone, Copy)]
pub(super) struct HalfKernels {
    pub(super) bf16: HalfFn,
    pub(super) f16: HalfFn,
    /// BF16 weights × BF16 activations ([`HalfActs::Bf16`]).
    pub(super) bf16_dot: DotFn,
}

impl HalfKernels {
    pub(super) fn get(&self, t: WType) -> Option<HalfFn> {
        match t {
            WType::BF16 => Some(self.bf16),
            WType::F16 => Some(self.f16),
            _ => None,
        }
    }
}

/// The scalar reference's entries.
const SCALAR_HALF: HalfKernels = HalfKernels {
    bf16: scalar_half::tile_bf16,
    f16: scalar_half::tile_f16,
    bf16_dot: scalar_bf16dot::tile,
};

/// One weight type's matrix kernels in a tier: the row-major micro-kernel, and the
/// packed one where the tier has it. A new weight type adds an entry to every tier
/// (see docs/architecture.md, "How to add a weight type").
#[derive(Clone, Copy)]
pub(super) struct MatKernels {
    pub(super) tile: TileFn,
    pub(super) packed: Option<PackedFn>,
    /// The codebook types' multi-token path, where the tier has one.
    pub(super) decoded: Option<DecodedKernels>,
}

/// Weight types, and so entries of `Kernels::mats`.
const N_WTYPES: usize = WType::ALL.len();

// `Kernels::mats` is indexed by `WType as usize`: `WType::ALL` lists the types in that order.
const _: () = {
    let mut i = 0;
    while i < N_WTYPES {
        assert!(WType::ALL[i] as usize == i);
        i += 1;
    }
};

/// The matrix kernels of every weight type, from `f` (an exhaustive `match` on the
/// type, so that a new type cannot be left without kernels).
fn per_type(f: impl Fn(WType) -> Option<MatKernels>) -> [Option<MatKernels>; N_WTYPES] {
    std::array::from_fn(|i| f(WType::ALL[i]))
}

/// A tier's f32 kernels.
#[derive(Clone, Copy)]
struct F32Kernels {
    /// Attention over an f32 cache.
    attend: AttendFn,
    /// Attention over an f16 cache.
    attend_f16: AttendFn,
    /// Attention over a Q8_0 cache.
    attend_q8: AttendFn,
    exp: SliceFn,
    max: ReduceFn,
    silu_mul: ActFn,
    gelu_mul: ActFn,
    swiglu_mul: SwigluFn,
    delta: DeltaFn,
    /// Error feedback's f64 product (not f32, but its SIMD paths sit here).
    sub_product: SubProductFn,
    /// Error feedback's sequential f64 update.
    sub_scaled: SubScaledFn,
}

/// The reference f32 kernels (every tier without SIMD versions of them).
const SCALAR_F32: F32Kernels = F32Kernels {
    attend: scalar_attention::attend,
    attend_f16: scalar_attention::attend,
    attend_q8: scalar_attention::attend,
    exp: scalar_math::exp_slice,
    max: scalar_math::max_slice,
    silu_mul: scalar_math::silu_mul,
    gelu_mul: scalar_math::gelu_mul,
    swiglu_mul: scalar_math::swiglu_mul,
    delta: scalar_delta::delta_head,
    sub_product: scalar_subproduct::sub_product,
    sub_scaled: scalar_subproduct::sub_scaled,
};

/// One tier's kernels: every SIMD path of the crate. Only built for tiers the CPU
/// supports, which is what makes calling its `unsafe fn` pointers sound.
#[derive(Clone, Copy)]
pub struct Kernels {
    tier: Tier,
    quant: QuantFn,
    /// f16 scales to f32 (the matrix products' f16-scale files).
    pub(super) f16: F16Fn,
    /// By `WType as usize`; `None`: the tier has no kernel for that type.
    pub(super) mats: [Option<MatKernels>; N_WTYPES],
    /// BF16 / F16 weights × f32 (or BF16) activations.
    pub(super) half: HalfKernels,
    /// What BF16 weights multiply (`Kernels::with_half_acts`).
    half_acts: HalfActs,
    f32: F32Kernels,
}

impl fmt::Debug for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Kernels({})", self.tier)
    }
}

/// The x86 tiers' table (`base`: the scalar one with the tier set). AVX2 code serves
/// every x86 tier where nothing wider exists (the activation quantizer, exp, SiLU,
/// GELU, the delta rule's step); the AVX-512 tiers add their own matrix kernels and
/// attention.
#[cfg(target_arch = "x86_64")]
fn x86_kernels(t: Tier, base: Kernels) -> Kernels {
    use x86::{attention, delta, features, kv, math, packed as xp, quantize, subproduct, tiles};
    // The AVX2 packed Q4_0 kernel (it needs F16C) serves the AVX2 and AVX-512 BW tiers.
    let q4_avx2 = xp::has_avx2_packed().then_some(xp::q4_avx2 as PackedFn);
    // Per tier: the Q8_0 and Q4_0 tile kernels, their packed ones, and whether the
    // block types' packed kernels are the VNNI ones.
    type Row = (TileFn, Option<PackedFn>, TileFn, Option<PackedFn>, bool);
    let (q8, q8_packed, q4, q4_packed, vnni): Row = match t {
        Tier::Avx2 => (
            tiles::tile_q8_avx2,
            None,
            tiles::tile_q4_avx2,
            q4_avx2,
            false,
        ),
        Tier::Avx512 => (tiles::tile_q8_bw, None, tiles::tile_q4_bw, q4_avx2, false),
        _ => (
            tiles::tile_q8_vnni,
            Some(xp::q8_vnni),
            tiles::tile_q4_vnni,
            Some(xp::q4_vnni),
            true,
        ),
    };
    let mats = per_type(|w| match w {
        WType::Q8_0 => Some(MatKernels {
            tile: q8,
            packed: q8_packed,
            decoded: None,
        }),
        WType::Q4_0 => Some(MatKernels {
            tile: q4,
            packed: q4_packed,
            decoded: None,
        }),
        _ => x86_blocks(w, vnni),
    });
    let (attend, attend_f16, attend_q8) = match t {
        Tier::Avx2 => (
            attention::attend_avx2 as AttendFn,
            if features::has_f16c() {
                kv::attend_f16_avx2 as AttendFn
            } else {
                base.f32.attend_f16
            },
            kv::attend_q8_avx2 as AttendFn,
        ),
        // The AVX-512 tiers need F16C (`features::has_avx512`).
        _ => (
            attention::attend_avx512 as AttendFn,
            kv::attend_f16_avx512 as AttendFn,
            kv::attend_q8_avx512 as AttendFn,
        ),
    };
    Kernels {
        quant: quantize::quantize_act,
        f16: if features::has_f16c() {
            quantize::f16_to_f32
        } else {
            base.f16
        },
        mats,
        half: x86_half(t).unwrap_or(base.half),
        f32: F32Kernels {
            attend,
            attend_f16,
            attend_q8,
            exp: if t == Tier::Avx2 {
                math::exp_slice
            } else {
                math::exp_slice512
            },
            max: math::max_slice,
            silu_mul: math::silu_mul,
            gelu_mul: math::gelu_mul,
            swiglu_mul: math::swiglu_mul,
            delta: delta::delta_head,
            // The fused step needs FMA (every AVX-512 CPU has it).
            sub_product: match t {
                _ if !features::has_avx2_fma() => base.f32.sub_product,
                Tier::Avx2 => subproduct::sub_product_avx2,
                _ => subproduct::sub_product_avx512,
            },
            // SAFETY (both): this table is built only for a tier the CPU runs, which
            // has AVX2, or AVX-512 F above AVX2.
            sub_scaled: match t {
                Tier::Avx2 => |a, x, y| unsafe { subproduct::sub_scaled_avx2(a, x, y) },
                _ => |a, x, y| unsafe { subproduct::sub_scaled_avx512(a, x, y) },
            },
        },
        ..base
    }
}

/// An x86 tier's entry of a GGUF block type (`None` for other types): the AVX2 row-major
/// kernel, and the packed one of VNNI (`vnni`) or AVX2. They need F16C and FMA (the
/// contract's fused step; every AVX2 CPU made has both); without them the type keeps the
/// scalar reference's entry.
#[cfg(target_arch = "x86_64")]
fn x86_blocks(w: WType, vnni: bool) -> Option<MatKernels> {
    use x86::{blocks as xb, codebook as xcb, packed_blocks as xpb};
    if !x86::features::has_avx2_fma() {
        return scalar_blocks_entry(w);
    }
    for_block_type!(w, |B| MatKernels {
        tile: xb::tile::<B>,
        packed: Some(if vnni {
            xpb::vnni::<B> as PackedFn
        } else {
            xpb::avx2::<B>
        }),
        decoded: None,
    })
    // The codebook types have no packed layout: every x86 tier reads them from the map,
    // and decodes a prompt's sub-blocks of rows once for all its tokens.
    .or_else(|| {
        for_codebook_type!(w, |C| MatKernels {
            // One token on VBMI: grid lookups 64 at a time.
            tile: if vnni && x86::features::has_avx512vbmi() {
                x86::codebook_vbmi::tile::<C> as TileFn
            } else {
                xcb::tile::<C>
            },
            packed: None,
            decoded: Some(if vnni {
                DecodedKernels {
                    decode: xcb::decode_groups::<C, { xcb::OFFSET_VNNI }>,
                    run: xcb::decoded_vnni::<C>,
                }
            } else {
                DecodedKernels {
                    decode: xcb::decode_groups::<C, { xcb::OFFSET_AVX2 }>,
                    run: xcb::decoded_avx2::<C>,
                }
            }),
        })
    })
}

/// The software prefetch hint of each kind of weight stream and the rows BF16/F16 decode
/// reads side by side on the tier in use, as `--verbose` shows them (`x86::prefetch`: chosen per
/// CPU, `KRAFLA_PREFETCH` overrides the hints); `None` off x86.
pub fn prefetch_hints() -> Option<String> {
    #[cfg(target_arch = "x86_64")]
    {
        use x86::prefetch::{hint, Stream};
        let each = Stream::ALL.map(|s| format!("{} {}", s.name(), hint(s).name()));
        let hints = each.join(", ");
        Some(match x86::half::decode_rows(tier()) {
            Some(rows) => format!("{hints}; bf16/f16 decode {rows} rows side by side"),
            None => hints,
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// Tiers this CPU can run, lowest first (always starts with `Scalar`).
pub fn supported_tiers() -> Vec<Tier> {
    Tier::ALL.iter().copied().filter(|&t| cpu_has(t)).collect()
}

fn cpu_has(t: Tier) -> bool {
    match t {
        Tier::Scalar => true,
        #[cfg(target_arch = "x86_64")]
        Tier::Avx2 => x86::features::has_avx2(),
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512 => x86::features::has_avx512(),
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512Vnni => x86::features::has_avx512vnni(),
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512Bf16 => x86::features::has_avx512bf16(),
        #[cfg(target_arch = "aarch64")]
        Tier::Neon => true,
        #[allow(unreachable_patterns)]
        _ => false,
    }
}

/// The 2-byte float kernels of x86 tier `t` (`None`: the scalar reference's).
#[cfg(target_arch = "x86_64")]
fn x86_half(t: Tier) -> Option<HalfKernels> {
    use x86::{bf16dot, half};
    match t {
        Tier::Avx2 if x86::features::has_avx2_fma() => Some(HalfKernels {
            bf16: half::bf16_avx2,
            f16: half::f16_avx2,
            bf16_dot: bf16dot::bf16_dot_avx2,
        }),
        // The AVX-512 tiers have AVX-512 F (`has_avx512`). Without `vdpbf16ps`, BF16
        // activations run its emulation.
        Tier::Avx512 | Tier::Avx512Vnni => Some(HalfKernels {
            bf16: half::bf16_avx512,
            f16: half::f16_avx512,
            bf16_dot: bf16dot::bf16_dot_avx512,
        }),
        Tier::Avx512Bf16 => Some(HalfKernels {
            bf16: half::bf16_avx512,
            f16: half::f16_avx512,
            bf16_dot: bf16dot::bf16_dot_avx512bf16,
        }),
        _ => None,
    }
}

impl Kernels {
    /// The kernels of tier `t`, or `None` when this CPU (or build) cannot run it.
    pub fn for_tier(t: Tier) -> Option<Kernels> {
        if !cpu_has(t) {
            return None;
        }
        let s = Kernels {
            tier: t,
            ..scalar_kernels()
        };
        Some(match t {
            Tier::Scalar => s,
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 => {
                x86::prefetch::choose_all();
                x86_kernels(t, s)
            }
            #[cfg(target_arch = "aarch64")]
            Tier::Neon => Kernels {
                mats: per_type(|w| match w {
                    WType::Q8_0 => Some(MatKernels {
                        tile: arm::tiles::tile_q8,
                        packed: None,
                        decoded: None,
                    }),
                    WType::Q4_0 => Some(MatKernels {
                        tile: arm::tiles::tile_q4,
                        packed: None,
                        decoded: None,
                    }),
                    _ => None,
                }),
                ..s
            },
            #[allow(unreachable_patterns)]
            _ => return None,
        })
    }

    /// This set's tier.
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// Whether this tier reads packed matrices ([`WeightMat::packed`]) of some type.
    pub fn packs(&self) -> bool {
        self.mats.iter().flatten().any(|m| m.packed.is_some())
    }

    /// Whether this tier multiplies matrices of type `t` (a model with a matrix of
    /// another type is refused at load).
    pub fn supports(&self, t: WType) -> bool {
        self.mats[t as usize].is_some() || self.half_fn(t).is_some()
    }

    /// Whether this tier reads packed matrices of type `t`: worth packing those for.
    pub fn packs_type(&self, t: WType) -> bool {
        self.packed_fn(t).is_some()
    }

    /// The tier's packed kernel of type `t`, if it has one.
    pub(super) fn packed_fn(&self, t: WType) -> Option<PackedFn> {
        self.mats[t as usize].and_then(|m| m.packed)
    }

    /// The tier's decoded (codebook) path of type `t`, if it has one.
    pub(super) fn decoded_fn(&self, t: WType) -> Option<DecodedKernels> {
        self.mats[t as usize].and_then(|m| m.decoded)
    }

    /// The tier's kernel for 2-byte float weights of type `t` and f32 activations;
    /// `None` for other types.
    pub(super) fn half_fn(&self, t: WType) -> Option<HalfFn> {
        self.half.get(t)
    }

    /// What BF16 weights multiply under these kernels (see [`Kernels::with_half_acts`]).
    pub fn half_acts(&self) -> HalfActs {
        self.half_acts
    }

    /// These kernels with BF16 weights multiplying `a` activations: [`HalfActs::F32`]
    /// (the default) or [`HalfActs::Bf16`] (docs/kernels.md, "BF16 activations").
    pub fn with_half_acts(self, a: HalfActs) -> Kernels {
        Kernels {
            half_acts: a,
            ..self
        }
    }

    /// Attention of queries that share one kv head over `kv`, by the arithmetic of
    /// [`scalar_attention`]: each query's `out` gets the bits the reference gives it alone,
    /// whatever the tier and however the queries are grouped (a tile of prompt tokens
    /// and the query heads of the kv head is read from memory once per block of keys).
    ///
    /// The cache may hold f32, f16 or Q8_0 keys and values ([`KvData`], both of one
    /// type): each row is widened to f32 as the reference does ([`scalar_kv`]), then
    /// the f32 arithmetic runs, so the bits are those of f32 attention over the widened
    /// cache, on every tier.
    ///
    /// Panics unless every query has `q.len() == out.len() == hd` (one head_dim), an
    /// `att` at least as long as its visible span, and a span that fits the cache;
    /// and `kv` holds `cap × stride` keys and values with the head inside a slot (for
    /// Q8_0: a scale per 32, `stride` and `off` multiples of 32).
    pub fn attend(&self, qs: &mut [Query], kv: &KvView, scale: f32, softcap: f32) {
        let Some(hd) = qs.first().map(|q| q.q.len()) else {
            return;
        };
        let ty = kv.k.kv_type();
        let blocks =
            ty != KvType::Q8_0 || (kv.stride.is_multiple_of(QK) && kv.off.is_multiple_of(QK));
        assert!(
            kv.cap > 0
                && kv.off + hd <= kv.stride
                && kv.k.len() == kv.cap * kv.stride
                && kv.v.len() == kv.k.len()
                && kv.v.kv_type() == ty
                && kv.k.consistent()
                && kv.v.consistent()
                && blocks,
            "attend: head at {} of {} in a {ty} cache of {} x {}",
            kv.off,
            kv.stride,
            kv.cap,
            kv.stride
        );
        for q in qs.iter() {
            let span = q.pos + 1 - kv.first_visible(q.pos);
            assert!(
                q.q.len() == hd && q.out.len() == hd && span <= q.att.len() && span <= kv.cap,
                "attend: query of {} values at {} (span {span}, att {}, cap {})",
                q.q.len(),
                q.pos,
                q.att.len(),
                kv.cap
            );
        }
        let f = match ty {
            KvType::F32 => self.f32.attend,
            KvType::F16 => self.f32.attend_f16,
            KvType::Q8_0 => self.f32.attend_q8,
        };
        for tile in qs.chunks_mut(TILE_QUERIES) {
            // SAFETY: a supported tier's kernel; shapes checked above.
            unsafe { f(tile, kv, scale, softcap) }
        }
    }

    /// `v[i] = exp(v[i])` ([`scalar_math::exp`]).
    pub fn exp(&self, v: &mut [f32]) {
        // SAFETY: a supported tier's kernel.
        unsafe { (self.f32.exp)(v) }
    }

    /// The largest non-NaN value of `v`, −inf when there is none ([`scalar_math::max`]).
    pub fn max(&self, v: &[f32]) -> f32 {
        // SAFETY: a supported tier's kernel.
        unsafe { (self.f32.max)(v) }
    }

    /// `g[i] = silu(g[i]) · u[i]` ([`scalar_math::silu`]).
    ///
    /// Panics if the lengths differ.
    pub fn silu_mul(&self, g: &mut [f32], u: &[f32]) {
        assert_eq!(g.len(), u.len(), "silu_mul lengths");
        // SAFETY: a supported tier's kernel.
        unsafe { (self.f32.silu_mul)(g, u) }
    }

    /// `g[i] = gelu_tanh(g[i]) · u[i]` ([`scalar_math::gelu_tanh`]).
    ///
    /// Panics if the lengths differ.
    pub fn gelu_mul(&self, g: &mut [f32], u: &[f32]) {
        assert_eq!(g.len(), u.len(), "gelu_mul lengths");
        // SAFETY: a supported tier's kernel.
        unsafe { (self.f32.gelu_mul)(g, u) }
    }

    /// `g[i] = swiglu_clamped(g[i], u[i], limit, alpha)`
    /// ([`scalar_math::swiglu_clamped`]: gpt-oss's experts).
    ///
    /// Panics if the lengths differ.
    pub fn swiglu_mul(&self, g: &mut [f32], u: &[f32], limit: f32, alpha: f32) {
        assert_eq!(g.len(), u.len(), "swiglu_mul lengths");
        // SAFETY: a supported tier's kernel.
        unsafe { (self.f32.swiglu_mul)(g, u, limit, alpha) }
    }

    /// The gated delta rule's step of one value head ([`scalar_delta`]): state `s`
    /// (dk × dv), output `o` (dv), scratch `delta` (dv).
    ///
    /// Panics if the lengths disagree.
    pub fn delta_head(&self, x: &DeltaHead, s: &mut [f32], o: &mut [f32], delta: &mut [f32]) {
        let (dk, dv) = (x.k.len(), o.len());
        assert!(
            x.q.len() == dk
                && s.len() == dk * dv
                && [x.v.len(), x.z.len(), x.lnorm.len(), delta.len()] == [dv; 4],
            "delta_head: dk {dk}, dv {dv}, state {}",
            s.len()
        );
        // SAFETY: a supported tier's kernel.
        unsafe { (self.f32.delta)(x, s, o, delta) }
    }

    /// `C −= E·U` in f64 ([`scalar_subproduct`]: per element, `c = fma(−e_p, u_p, c)` for
    /// `p` in increasing order): `d = [m, k, n]`; `E` m × k, `U` k × n, `C` m × n, each
    /// row-major with its row stride.
    ///
    /// Panics if an operand does not hold its rows.
    pub fn sub_product(&self, d: Dims, e: Rows, u: Rows, c: (&mut [f64], usize)) {
        assert!(
            scalar_subproduct::fits(d, e, u, (&*c.0, c.1)),
            "sub_product: {d:?}, strides {} {} {}, lengths {} {} {}",
            e.1,
            u.1,
            c.1,
            e.0.len(),
            u.0.len(),
            c.0.len()
        );
        // SAFETY: a supported tier's kernel; shapes checked above.
        unsafe { (self.f32.sub_product)(d, e, u, c) }
    }

    /// `y −= a·x` in f64 ([`scalar_subproduct::scaled`]: the product rounded, then the
    /// difference), as a pointer to keep: error feedback's per-column update.
    pub fn sub_scaled(&self) -> SubScaledFn {
        self.f32.sub_scaled
    }

    /// Quantizes `x` (a multiple of 32 values) into `q` (same length) and `d` (one per 32).
    ///
    /// Panics if the lengths disagree.
    pub fn quantize_act(&self, x: &[f32], q: &mut [i8], d: &mut [f32]) {
        assert!(
            x.len().is_multiple_of(QK) && q.len() == x.len() && d.len() * QK == x.len(),
            "quantize_act: x {} q {} d {}",
            x.len(),
            q.len(),
            d.len()
        );
        // SAFETY: `self` exists only for a tier the CPU supports; lengths checked above.
        unsafe { (self.quant)(x, q, d) }
    }

    // The f32 operations with one code for every tier: the reference
    // ([`scalar_math`], [`scalar_kv`]), reached through the table like the rest.

    /// The dot product of the f32 contract ([`scalar_math::dot`]: 8 lanes, the tree,
    /// the tail in order).
    #[inline]
    pub fn dot(&self, a: &[f32], b: &[f32]) -> f32 {
        scalar_math::dot(a, b)
    }

    /// The sigmoid of one value with the contract's `exp` ([`scalar_math::sigmoid`]).
    #[inline]
    pub fn sigmoid(&self, x: f32) -> f32 {
        scalar_math::sigmoid(x)
    }

    /// SiLU of one value ([`scalar_math::silu`]).
    #[inline]
    pub fn silu(&self, x: f32) -> f32 {
        scalar_math::silu(x)
    }

    /// `out = rmsnorm(x, w, eps)` ([`scalar_math::rmsnorm`]).
    #[inline]
    pub fn rmsnorm(&self, out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
        scalar_math::rmsnorm(out, x, w, eps)
    }

    /// [`Kernels::rmsnorm`] in place.
    #[inline]
    pub fn rmsnorm_inplace(&self, x: &mut [f32], w: &[f32], eps: f32) {
        scalar_math::rmsnorm_inplace(x, w, eps)
    }

    /// Stores `x` into an f16 KV cache (`out`, f16 bits, same length): round to nearest
    /// even ([`scalar_kv::store_f16`]).
    ///
    /// Panics if the lengths differ.
    pub fn store_kv_f16(&self, x: &[f32], out: &mut [u16]) {
        scalar_kv::store_f16(x, out)
    }

    /// Stores `x` (heads of `hd` values) into a Q8_0 KV cache (`q`, `d`; `pad`: a head's
    /// stride of scratch) with this tier's activation quantizer, which gives the
    /// reference's bits ([`scalar_kv::store_q8_0`]).
    ///
    /// Panics if the lengths disagree.
    pub fn store_kv_q8_0(
        &self,
        x: &[f32],
        hd: usize,
        pad: &mut [f32],
        q: &mut [i8],
        d: &mut [f32],
    ) {
        scalar_kv::store_q8_0(x, hd, pad, q, d, |x, q, d| self.quantize_act(x, q, d))
    }
}

thread_local! {
    /// A tier forced on this thread by [`with_tier`].
    static FORCED: Cell<Option<Kernels>> = const { Cell::new(None) };
}

/// The tier to use given the supported ones (ascending) and a `KRAFLA_KERNEL` value:
/// the highest supported tier not above the asked one (an unknown name is ignored).
fn choose_tier(supported: &[Tier], asked: Option<&str>) -> Tier {
    let cap = asked.and_then(Tier::from_name);
    let ok = |t: &Tier| cap.is_none_or(|c| *t <= c);
    supported.iter().copied().rfind(ok).unwrap_or(Tier::Scalar)
}

/// The best supported tier, lowered (never raised) by `KRAFLA_KERNEL`; chosen once.
fn detected() -> &'static Kernels {
    static K: OnceLock<Kernels> = OnceLock::new();
    K.get_or_init(|| {
        let asked = std::env::var("KRAFLA_KERNEL").ok();
        let t = choose_tier(&supported_tiers(), asked.as_deref());
        Kernels::for_tier(t).unwrap_or_else(scalar_kernels)
    })
}

/// The scalar reference kernels, available everywhere.
fn scalar_kernels() -> Kernels {
    Kernels {
        tier: Tier::Scalar,
        quant: scalar_quantize::quantize_act,
        f16: scalar_quantize::f16_to_f32,
        mats: per_type(|w| {
            let tile = match w {
                WType::Q8_0 => scalar_tiles::tile_q8,
                WType::Q4_0 => scalar_tiles::tile_q4,
                _ => return scalar_blocks_entry(w),
            };
            Some(MatKernels {
                tile,
                packed: None,
                decoded: None,
            })
        }),
        half: SCALAR_HALF,
        half_acts: HalfActs::F32,
        f32: SCALAR_F32,
    }
}

/// The scalar reference's entry of a GGUF block or codebook type (`None` for other
/// types).
fn scalar_blocks_entry(w: WType) -> Option<MatKernels> {
    for_block_type!(w, |B| MatKernels {
        tile: scalar_blocks::tile::<B>,
        packed: None,
        decoded: None,
    })
    .or_else(|| {
        for_codebook_type!(w, |C| MatKernels {
            tile: scalar_codebook::tile::<C>,
            packed: None,
            decoded: None,
        })
    })
}

/// The kernels the free functions use: [`with_tier`]'s on this thread, else the detected.
pub fn kernels() -> Kernels {
    FORCED.with(|f| f.get()).unwrap_or(*detected())
}

/// The active tier on this thread.
pub fn tier() -> Tier {
    kernels().tier
}

/// Runs `f` with tier `t` forced for the free functions called on this thread (the
/// parallel work they start inherits it). `Err` if the CPU cannot run `t`.
pub fn with_tier<R>(t: Tier, f: impl FnOnce() -> R) -> Result<R, TierError> {
    let k = Kernels::for_tier(t).ok_or(TierError(t))?;
    let prev = FORCED.with(|c| c.replace(Some(k)));
    struct Restore(Option<Kernels>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FORCED.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(prev);
    Ok(f())
}

/// Quantizes activations with the active tier (see [`Kernels::quantize_act`]).
pub fn quantize_act(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    kernels().quantize_act(x, q, d)
}

/// `C −= E·U` in f64 with the active tier (see [`Kernels::sub_product`]).
pub fn sub_product(d: Dims, e: Rows, u: Rows, c: (&mut [f64], usize)) {
    kernels().sub_product(d, e, u, c)
}

/// Error feedback's f64 kernels with the active tier: the product and the sequential
/// update.
pub fn feedback_kernels() -> crate::quant::feedback::F64Kernels {
    crate::quant::feedback::F64Kernels {
        product: sub_product,
        sub_scaled: kernels().sub_scaled(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::QMat;
    use crate::kernels::acts::QActs;
    use crate::kernels::mat::WeightMat;

    #[test]
    fn env_var_only_lowers() {
        use Tier::*;
        let x86 = [Scalar, Avx2, Avx512, Avx512Vnni, Avx512Bf16];
        assert_eq!(choose_tier(&x86, None), Avx512Bf16);
        assert_eq!(choose_tier(&x86, Some("avx2")), Avx2);
        assert_eq!(choose_tier(&x86, Some("avx512vnni")), Avx512Vnni);
        assert_eq!(choose_tier(&x86, Some("scalar")), Scalar);
        assert_eq!(choose_tier(&x86, Some("bogus")), Avx512Bf16);
        assert_eq!(choose_tier(&[Scalar, Avx2], Some("avx512vnni")), Avx2);
        assert_eq!(choose_tier(&x86[..4], Some("avx512bf16")), Avx512Vnni);
        // NEON sorts above the x86 tiers but is never in an x86 list.
        assert_eq!(choose_tier(&[Scalar, Neon], Some("avx2")), Scalar);
        assert_eq!(choose_tier(&x86, Some("neon")), Avx512Bf16);
    }

    #[test]
    fn tiers_agree_on_a_small_case() {
        let (rows, cols, n) = (5, 96, 3);
        let q: Vec<u8> = (0..rows * cols)
            .map(|i| ((i * 37 % 255) as i32 - 127) as i8 as u8)
            .collect();
        let d: Vec<f32> = (0..rows * cols / QK)
            .map(|i| 0.01 * (i as f32 - 3.0))
            .collect();
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 13 % 17) as f32 - 8.0) * 0.3)
            .collect();
        let w = WeightMat::from(QMat::new(WType::Q8_0, rows, cols, &q, &d).unwrap());
        let mut xa = QActs::new();
        scalar_kernels().quantize_acts(&x, cols, &mut xa);
        let mut y0 = vec![0.0; n * rows];
        scalar_kernels().matmul(&w, &xa, &mut y0);
        for t in supported_tiers() {
            let k = Kernels::for_tier(t).unwrap();
            let mut y = vec![0.0; n * rows];
            k.matmul(&w, &xa, &mut y);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&y), bits(&y0), "tier {t}");
        }
    }
}
