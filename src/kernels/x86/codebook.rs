//! Row-major tile kernels of GGUF's codebook types (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS,
//! IQ2_S, IQ1_M) on AVX2 + FMA, bit-identical to `scalar::codebook`. Every x86 tier uses
//! them (the codebook types have no packed layout).
//!
//! A super-block is decoded per row into 8 ymm of 32 level magnitudes `m` and 8 of
//! their signs `s` (±1 bytes), one pair per block of 32, element order: grid entries
//! loaded by index (scalar loads: Zen 4's `vpgatherdd` was slower); signs from a dword
//! of sign bits per block (`vpermd` + `vpshufb` + `vpcmpeqb`), made for the 8 blocks at
//! once, the 7-bit sign indices of IQ2_XXS, IQ3_XXS and IQ2_XS with their parity bits
//! computed in lanes ([`sign_words`]); IQ1_M's levels are `8·g ± 1`, `m = |v|` and
//! `s = v`. Then for every token `vpmaddubsw(m, sign(x, s))` (the IQ4_NL sign trick:
//! `m ≤ 62`, pair sums ≤ 2·62·127, no saturation) and `vpmaddwd` by 1 give 8 exact i32
//! partials per block, reduced to `isum` per block (a scale per 32) or to `Σ_lo`, `Σ_hi`
//! (a scale per 16), then the contract's float step on the 8 blocks as 8 lanes. With one
//! token each block is used as it is decoded (the 16 ymm of a whole super-block spill).
//!
//! Several tokens (every x86 tier) decode a sub-block of rows once into the layout of
//! `kernels::packed` ("Decoded codebook groups": levels + 128 as a packed Q8_0 block,
//! f32 scales per 16 weights; [`decode_groups`]) and run every tile of tokens on it:
//! [`decoded_vnni`] as the packed Q8_0 kernel does, one zmm lane per row, `vpdpbusd`
//! chains started at `−128·Σx` (a scale per 32) or at `−128·Σx_lo` and `−128·Σx_hi`
//! (a scale per 16), then the contract's float step on 16 rows; [`decoded_avx2`] a ymm
//! per half group on levels + 64, `vpmaddubsw` + `vpmaddwd` chains started at `−64·Σx`
//! the same way (no sign trick: pair sums ≤ 2·126·127 fit in i16).

use core::arch::x86_64::*;

use super::packed::{add256, add512, dpbusd_block, lane_tree, store16, store8, with_tokens};
use super::simd::{bit_mask_lane, hsum8, hsum8_halves, reduce_lanes};
use super::tiles::block_rows_of_tile;
use crate::format::iq_grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID,
};
use crate::format::wtype::{WType, QK, QK_K};
use crate::kernels::acts::{ActTile, PACKED_TILE};
use crate::kernels::counters::{count, Op};
use crate::kernels::packed::{lane_start, DecodedView, Line, DECODED_LINES, GROUP};
use crate::kernels::scalar::codebook::CodebookTy;
use crate::kernels::scalar::tiles::LANES;
use crate::kernels::tier::Tier;
use crate::quant::codebook;

/// What [`decode_groups`] adds to the levels for the VNNI kernel: `vpdpbusd` takes them
/// as u8.
pub const OFFSET_VNNI: u8 = 128;
/// What it adds for the AVX2 kernel: `vpmaddubsw`'s pair sums of `(v + 64)·x` stay
/// within i16 (`|v| ≤ 62`), where `v + 128` would saturate them.
pub const OFFSET_AVX2: u8 = 64;

/// A decoded super-block of one row.
struct Group {
    /// `|v|` per block of 32 (u8).
    w: [__m256i; LANES],
    /// The signs of `v` per block of 32 for `vpsignb` (±1, or `v`).
    v: [__m256i; LANES],
    /// Per block: the scale of its first 16 weights (the block's scale when the type
    /// has one per 32) and of its last 16.
    dl: __m256,
    dh: __m256,
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// `vpsignb` factors of a sign mask: −1 where set, +1 elsewhere.
#[target_feature(enable = "avx2")]
#[inline]
fn pm1(mask: __m256i) -> __m256i {
    _mm256_or_si256(mask, _mm256_set1_epi8(1))
}

/// The sign bits of the 8 blocks of super-block `b` of type `t`, dword `j` for block
/// `j`, bit `e` set where element `e` is negative (for [`bit_mask_lane`]); for IQ1_M,
/// whose levels carry their signs, set where element `e`'s shift is −1/8. The 7-bit sign
/// indices (IQ2_XXS, IQ3_XXS, IQ2_XS) become GGUF's `KSIGNS` bytes in 8 lanes at once:
/// the index, and its parity in bit 7 (so that every byte has an even count of set
/// bits). A table load and insert per index cost about 16 instructions per block.
#[target_feature(enable = "avx2")]
#[inline]
fn sign_words(t: WType, b: &[u8]) -> __m256i {
    assert!(b.len() >= t.block_bytes());
    let p = b.as_ptr();
    // SAFETY: every load is inside the block (the assert: IQ3_XXS 98 bytes, IQ2_XXS 66,
    // IQ2_XS 74, IQ2_S 82, IQ3_S 110, IQ1_M 56).
    unsafe {
        match t {
            // Bits 0..28 of each block's sign word (bytes 66 + 4j): four 7-bit indices.
            WType::IQ3_XXS => ksigns_of_words(_mm256_loadu_si256(p.add(66) as *const __m256i)),
            // Word 1 of each block's pair (bytes 2 + 8j + 4), as in `scales8`.
            WType::IQ2_XXS => {
                let a = _mm256_loadu_si256(p.add(2) as *const __m256i);
                let c = _mm256_loadu_si256(p.add(34) as *const __m256i);
                let odd = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
                ksigns_of_words(_mm256_blend_epi32::<0xF0>(
                    _mm256_permutevar8x32_epi32(a, odd),
                    _mm256_permutevar8x32_epi32(c, odd),
                ))
            }
            // The top 7 bits of each of a block's four u16 (bytes 2 + 8j + 2l).
            WType::IQ2_XS => {
                let a = _mm256_srli_epi16::<9>(_mm256_loadu_si256(p.add(2) as *const __m256i));
                let c = _mm256_srli_epi16::<9>(_mm256_loadu_si256(p.add(34) as *const __m256i));
                let (a, c) = (with_parity(a), with_parity(c));
                // Per 128-bit lane the pack puts blocks 0, 1, 4, 5 | 2, 3, 6, 7.
                _mm256_permute4x64_epi64::<0xD8>(_mm256_packus_epi16(a, c))
            }
            // A sign bit per weight (bytes 34 + 4j, 74 + 4j).
            WType::IQ2_S => _mm256_loadu_si256(p.add(34) as *const __m256i),
            WType::IQ3_S => _mm256_loadu_si256(p.add(74) as *const __m256i),
            // IQ1_M: not signs but the shifts, byte l of dword j all ones where group
            // 4j + l's shift is −1/8: bit 3 of its `qh` nibble (u16 j of bytes 32..48).
            WType::IQ1_M => {
                let w = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(32) as *const __m128i));
                let one = _mm256_set1_epi32(1);
                let b0 = _mm256_and_si256(_mm256_srli_epi32::<3>(w), one);
                let b1 = _mm256_slli_epi32::<8>(_mm256_and_si256(_mm256_srli_epi32::<7>(w), one));
                let b2 = _mm256_slli_epi32::<16>(_mm256_and_si256(_mm256_srli_epi32::<11>(w), one));
                let b3 = _mm256_slli_epi32::<24>(_mm256_and_si256(_mm256_srli_epi32::<15>(w), one));
                let ones = _mm256_or_si256(_mm256_or_si256(b0, b1), _mm256_or_si256(b2, b3));
                // 0x01 → 0xFF per byte: x·255 = (x << 8) − x, no borrow between bytes.
                _mm256_sub_epi32(_mm256_slli_epi32::<8>(ones), ones)
            }
            _ => _mm256_setzero_si256(),
        }
    }
}

/// Four 7-bit sign indices per dword (bits `7l..7l + 7`) as the `KSIGNS` bytes of
/// groups `l = 0..4`.
#[target_feature(enable = "avx2")]
#[inline]
fn ksigns_of_words(w: __m256i) -> __m256i {
    // No closure: it would not inherit the features (every intrinsic a call).
    let (m0, m1, m2, m3) = (
        _mm256_set1_epi32(0x7F),
        _mm256_set1_epi32(0x7F00),
        _mm256_set1_epi32(0x7F_0000),
        _mm256_set1_epi32(0x7F00_0000),
    );
    let s = _mm256_or_si256(
        _mm256_or_si256(
            _mm256_and_si256(w, m0),
            _mm256_and_si256(_mm256_slli_epi32::<1>(w), m1),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_slli_epi32::<2>(w), m2),
            _mm256_and_si256(_mm256_slli_epi32::<3>(w), m3),
        ),
    );
    with_parity(s)
}

/// Every byte of `s` (bit 7 clear) with bit 7 set where its count of set bits is odd.
/// Bit 0 of byte k after the three folds is the XOR of that byte's 8 bits: the shifts
/// bring in bits of the next byte only above bit 0 (in 16- or 32-bit lanes alike).
#[target_feature(enable = "avx2")]
#[inline]
fn with_parity(s: __m256i) -> __m256i {
    let x = _mm256_xor_si256(s, _mm256_srli_epi32::<4>(s));
    let x = _mm256_xor_si256(x, _mm256_srli_epi32::<2>(x));
    let x = _mm256_xor_si256(x, _mm256_srli_epi32::<1>(x));
    let odd = _mm256_and_si256(x, _mm256_set1_epi8(1));
    _mm256_or_si256(s, _mm256_slli_epi32::<7>(odd))
}

/// Four 8-value grid entries in element order.
#[target_feature(enable = "avx2")]
#[inline]
fn grid8(g: &[u64], i: [usize; 4]) -> __m256i {
    _mm256_setr_epi64x(
        g[i[0]] as i64,
        g[i[1]] as i64,
        g[i[2]] as i64,
        g[i[3]] as i64,
    )
}

/// Eight 4-value grid entries in element order (scalar loads: `vpgatherdd` made Zen 4's
/// decode slower).
#[target_feature(enable = "avx2")]
#[inline]
fn grid4(g: &[u32], i: impl Fn(usize) -> usize) -> __m256i {
    let e = |k: usize| g[i(k)] as i32;
    _mm256_setr_epi32(e(0), e(1), e(2), e(3), e(4), e(5), e(6), e(7))
}

/// The magnitudes `m` (u8) and `vpsignb` signs `s` (±1, or the signed levels for
/// IQ1_M) of block `j` (32 weights) of super-block `b` of type `t`, its sign bits in
/// `words` ([`sign_words`]): the levels are `m·s`.
#[target_feature(enable = "avx2")]
#[inline]
fn levels(t: WType, b: &[u8], words: __m256i, j: usize) -> (__m256i, __m256i) {
    let m = match t {
        WType::IQ2_XXS => {
            let q = &b[2 + 8 * j..][..4];
            grid8(&IQ2XXS_GRID, [0, 1, 2, 3].map(|l| q[l] as usize))
        }
        WType::IQ3_XXS => {
            let q = &b[2 + 8 * j..][..8];
            grid4(&IQ3XXS_GRID, |i| q[i] as usize)
        }
        WType::IQ2_XS => {
            // The block's four u16 as one u64: per-u16 reads were vectorized by LLVM
            // into byte extractions (`vpextrb`).
            let q = u64::from_le_bytes(b[2 + 8 * j..][..8].try_into().expect("8 bytes"));
            grid8(
                &IQ2XS_GRID,
                [0, 1, 2, 3].map(|l| (q >> (16 * l) & 511) as usize),
            )
        }
        WType::IQ2_S => grid8(
            &IQ2S_GRID,
            [0, 1, 2, 3].map(|l| codebook::iq2s_index(b, 4 * j + l)),
        ),
        WType::IQ3_S => grid4(&IQ3S_GRID, |i| codebook::iq3s_index(b, 8 * j + i)),
        WType::IQ1_M => {
            // A loop, not `array::map` over pairs: LLVM left those closures as calls per
            // block (decoding ran 2.6x slower; the other types' maps inline, and loops
            // there were slower).
            let mut i = [0usize; 4];
            for (l, il) in i.iter_mut().enumerate() {
                *il = codebook::iq1m_index(b, 4 * j + l).0;
            }
            let g = grid8(&IQ1S_GRID, i);
            // 8·g per byte (g in −1..=1): the 16-bit shift's carries into a byte's low 3
            // bits are masked off. The shifts ±1 from `words`.
            let g8 = _mm256_and_si256(_mm256_slli_epi16(g, 3), _mm256_set1_epi8(-8));
            let v = _mm256_add_epi8(g8, pm1(bit_mask_lane(words, j)));
            return (_mm256_abs_epi8(v), v);
        }
        _ => unreachable!("a codebook type"),
    };
    (m, pm1(bit_mask_lane(words, j)))
}

/// The per-32 scales of super-block `b` of type `t` as 8 lanes: `(dl, dh)`, block `j`'s
/// first and last 16 weights' `dw` (equal for a scale per 32), the bits of
/// `quant::codebook::scales` (the same f32 operations, one lane per block). The small
/// integer codes are taken by loads, shifts and permutes in 8 lanes: as the bytes of a
/// stack array they cost a failed store forward per super-block (IQ1_M decoded 2x
/// slower). Both one-token kernels (this file's and `codebook_vbmi`) take them here.
///
/// # Safety
/// The CPU has AVX2 and F16C. (No closures inside: they would not inherit the caller's
/// features, and every intrinsic in them would become a call.)
#[inline(always)]
pub(super) unsafe fn scales8(t: WType, b: &[u8]) -> (__m256, __m256) {
    assert!(b.len() >= t.block_bytes());
    let p = b.as_ptr();
    // SAFETY: the caller's CPU has AVX2 and F16C; every load is inside the block (the
    // assert: IQ3_XXS 98 bytes, IQ2_XXS 66, IQ2_XS 74, IQ2_S 82, IQ3_S 110, IQ1_M 56).
    unsafe {
        let pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
        let nibble = _mm256_set1_epi32(15);
        // The codes of the 8 blocks' first and last 16 weights (equal for a scale per
        // 32), and `d`'s f16 bits.
        let (nl, nh, d) = match t {
            // The top 4 bits of each block's sign word (bytes 66 + 4j).
            WType::IQ3_XXS => {
                let v = _mm256_srli_epi32::<28>(_mm256_loadu_si256(p.add(66) as *const __m256i));
                (v, v, u16_at(b, 0))
            }
            // The top 4 bits of word 1 of each block's pair (bytes 2 + 8j + 4).
            WType::IQ2_XXS => {
                let a = _mm256_loadu_si256(p.add(2) as *const __m256i);
                let c = _mm256_loadu_si256(p.add(34) as *const __m256i);
                let odd = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
                let v = _mm256_blend_epi32::<0xF0>(
                    _mm256_permutevar8x32_epi32(a, odd),
                    _mm256_permutevar8x32_epi32(c, odd),
                );
                let v = _mm256_srli_epi32::<28>(v);
                (v, v, u16_at(b, 0))
            }
            // A byte per block: the first half's code low, the last half's high.
            WType::IQ2_XS | WType::IQ2_S => {
                let at = if t == WType::IQ2_XS { 66 } else { 74 };
                let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(at) as *const __m128i));
                (
                    _mm256_and_si256(v, nibble),
                    _mm256_srli_epi32::<4>(v),
                    u16_at(b, 0),
                )
            }
            // A nibble per block, two to a byte (bytes 106..110).
            WType::IQ3_S => {
                let v = _mm_cvtsi32_si128(i32::from_le_bytes([b[106], b[107], b[108], b[109]]));
                let v = _mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi32(v), pairs);
                let v = _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
                let v = _mm256_and_si256(v, nibble);
                (v, v, u16_at(b, 0))
            }
            // 3 bits per half h at 3·(h % 4) of scale word h / 4 (bytes 48..56): block
            // j's halves 2j and 2j + 1 are word j / 2 shifted by 6·(j % 2) and 3 more.
            WType::IQ1_M => {
                let w = _mm256_cvtepu16_epi32(_mm_loadl_epi64(p.add(48) as *const __m128i));
                let w = _mm256_permutevar8x32_epi32(w, pairs);
                let seven = _mm256_set1_epi32(7);
                (
                    _mm256_and_si256(
                        _mm256_srlv_epi32(w, _mm256_setr_epi32(0, 6, 0, 6, 0, 6, 0, 6)),
                        seven,
                    ),
                    _mm256_and_si256(
                        _mm256_srlv_epi32(w, _mm256_setr_epi32(3, 9, 3, 9, 3, 9, 3, 9)),
                        seven,
                    ),
                    codebook::iq1m_d_bits(b),
                )
            }
            _ => unreachable!("a codebook type"),
        };
        let d = _mm256_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(d as i32))));
        let (nl, nh) = (_mm256_cvtepi32_ps(nl), _mm256_cvtepi32_ps(nh));
        let (half, one, two) = (
            _mm256_set1_ps(0.5),
            _mm256_set1_ps(1.0),
            _mm256_set1_ps(2.0),
        );
        match t {
            // d·(0.5 + ls)·0.5
            WType::IQ3_XXS => {
                let v = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_add_ps(half, nl)), half);
                (v, v)
            }
            // d·(0.5 + ls)·0.25
            WType::IQ2_XXS => {
                let v = _mm256_mul_ps(
                    _mm256_mul_ps(d, _mm256_add_ps(half, nl)),
                    _mm256_set1_ps(0.25),
                );
                (v, v)
            }
            WType::IQ2_XS | WType::IQ2_S => {
                let q = _mm256_set1_ps(0.25);
                (
                    _mm256_mul_ps(_mm256_mul_ps(d, _mm256_add_ps(half, nl)), q),
                    _mm256_mul_ps(_mm256_mul_ps(d, _mm256_add_ps(half, nh)), q),
                )
            }
            // d·(1 + 2·ls)
            WType::IQ3_S => {
                let v = _mm256_mul_ps(d, _mm256_add_ps(one, _mm256_mul_ps(two, nl)));
                (v, v)
            }
            // d·(2·ls + 1)·0.125
            _ => {
                let e = _mm256_set1_ps(0.125);
                (
                    _mm256_mul_ps(
                        _mm256_mul_ps(d, _mm256_add_ps(_mm256_mul_ps(two, nl), one)),
                        e,
                    ),
                    _mm256_mul_ps(
                        _mm256_mul_ps(d, _mm256_add_ps(_mm256_mul_ps(two, nh), one)),
                        e,
                    ),
                )
            }
        }
    }
}

/// Decodes super-block `b` of type `C`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn decode<C: CodebookTy>(b: &[u8]) -> Group {
    // SAFETY: F16C is enabled here.
    let (dl, dh) = unsafe { scales8(C::W, b) };
    let (mut v, mut w) = (
        [_mm256_setzero_si256(); LANES],
        [_mm256_setzero_si256(); LANES],
    );
    let words = sign_words(C::W, b);
    for j in 0..LANES {
        (w[j], v[j]) = levels(C::W, b, words, j);
    }
    Group { w, v, dl, dh }
}

/// The 8 exact i32 partials of block `j` of `xr` (a token's 8 blocks) against levels
/// `m·s`.
#[target_feature(enable = "avx2")]
#[inline]
fn block_dot(m: __m256i, s: __m256i, xr: &[i8], j: usize) -> __m256i {
    let xr = &xr[QK * j..][..QK];
    // SAFETY: `xr` holds the block's 32 quants.
    let xv = unsafe { _mm256_loadu_si256(xr.as_ptr() as *const __m256i) };
    let d = _mm256_maddubs_epi16(m, _mm256_sign_epi8(xv, s));
    _mm256_madd_epi16(d, _mm256_set1_epi16(1))
}

/// The contract's float step of a super-block's 8 blocks (partials `p`, weight scales
/// `dl`, `dh`, the token's block scales `xd`) into `acc`.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn float_step(
    halves: bool,
    p: &[__m256i; LANES],
    dl: __m256,
    dh: __m256,
    xd: &[f32],
    acc: __m256,
) -> __m256 {
    let xd = &xd[..LANES];
    // SAFETY: `xd` holds the 8 blocks' scales.
    let dx = unsafe { _mm256_loadu_ps(xd.as_ptr()) };
    if halves {
        let (lo, hi) = hsum8_halves(p);
        let l = _mm256_mul_ps(dl, _mm256_cvtepi32_ps(lo));
        let v = _mm256_fmadd_ps(dh, _mm256_cvtepi32_ps(hi), l);
        _mm256_fmadd_ps(dx, v, acc)
    } else {
        let d = _mm256_mul_ps(dl, dx);
        _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(hsum8(p)), acc)
    }
}

/// One row (`wq`: its super-blocks) against `T` tokens of `x`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn row<C: CodebookTy, const T: usize>(wq: &[u8], x: &ActTile, out: &mut [f32]) {
    let nb = x.d.len() / T;
    let cols = nb * QK;
    assert!(wq.len() == C::W.row_bytes(cols) && x.q.len() >= T * cols && out.len() == T);
    let halves = codebook::halves(C::W);
    let mut acc = [_mm256_setzero_ps(); T];
    for (sb, blk) in wq.chunks_exact(C::W.block_bytes()).enumerate() {
        let b0 = sb * LANES;
        if T == 1 {
            // One token: each block's levels are used as they are decoded (a decoded
            // super-block, held for several tokens, spills to the stack).
            // SAFETY: F16C is enabled here.
            let (dl, dh) = unsafe { scales8(C::W, blk) };
            let words = sign_words(C::W, blk);
            let xr = &x.q[b0 * QK..][..QK_K];
            // Unrolled by hand: as a loop LLVM kept it rolled, `p` on the stack.
            macro_rules! dots {
                ($($j:literal)*) => {
                    [$({
                        let (m, s) = levels(C::W, blk, words, $j);
                        block_dot(m, s, xr, $j)
                    }),*]
                };
            }
            let p = dots!(0 1 2 3 4 5 6 7);
            acc[0] = float_step(halves, &p, dl, dh, &x.d[b0..][..LANES], acc[0]);
            continue;
        }
        let g = decode::<C>(blk);
        for (t, acc_t) in acc.iter_mut().enumerate() {
            let xr = &x.q[t * cols + b0 * QK..][..QK_K];
            let mut p = [_mm256_setzero_si256(); LANES];
            for (j, pj) in p.iter_mut().enumerate() {
                *pj = block_dot(g.w[j], g.v[j], xr, j);
            }
            *acc_t = float_step(halves, &p, g.dl, g.dh, &x.d[t * nb + b0..][..LANES], *acc_t);
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = reduce_lanes(a);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn tile_any<C: CodebookTy>(rows: usize, wq: &[u8], x: &ActTile, out: &mut [f32]) {
    block_rows_of_tile!(rows, wq, out, |q, o, N| row::<C, N>(q, x, o));
}

/// Tile kernel of codebook type `C` (see `table::TileFn`; `wd` is empty).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; slice lengths as `TileFn` says.
pub unsafe fn tile<C: CodebookTy>(
    rows: usize,
    wq: &[u8],
    _wd: &[f32],
    x: &ActTile,
    out: &mut [f32],
) {
    count(Tier::Avx2, Op::Tile);
    // SAFETY: the caller's CPU has the features.
    unsafe { tile_any::<C>(rows, wq, x, out) }
}

/// Decodes groups `g0..g1` of type `C`'s rows into `buf` (see `table::DecodeFn`), the
/// levels stored as `v + OFFSET` (u8): [`OFFSET_VNNI`] or [`OFFSET_AVX2`].
///
/// # Safety
/// The CPU has AVX2 and F16C; `wq` holds `rows` rows of `cols`, `g1·16 < rows + 16`,
/// `buf` holds `(g1 − g0)·(cols/32)·DECODED_LINES` lines.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn decode_groups<C: CodebookTy, const OFFSET: u8>(
    wq: &[u8],
    rows: usize,
    cols: usize,
    g0: usize,
    g1: usize,
    buf: &mut [Line],
) {
    // Counted as the packing step it is (AVX2 code on the VNNI tiers).
    count(Tier::Avx2, Op::Packed);
    let (nb, rb, bb) = (cols / QK, C::W.row_bytes(cols), C::W.block_bytes());
    let per_group = nb * DECODED_LINES;
    assert!(wq.len() == rows * rb && buf.len() >= (g1 - g0) * per_group);
    assert!(g0 <= g1 && g1 * GROUP < rows + GROUP);
    // Block b = 8·sb + l of a row sits at position lane_start(l) + sb.
    let starts: [usize; LANES] = std::array::from_fn(|l| lane_start(nb, l));
    let off = _mm256_set1_epi8(OFFSET as i8);
    for (g, rec) in (g0..g1).zip(buf.chunks_exact_mut(per_group)) {
        for j in 0..GROUP {
            let at = 4 * j..4 * j + 4;
            let r = g * GROUP + j;
            if r >= rows {
                for lines in rec.chunks_exact_mut(DECODED_LINES) {
                    for (k, line) in lines.iter_mut().enumerate() {
                        line.0[at.clone()].fill(if k < 8 { OFFSET } else { 0 });
                    }
                }
                continue;
            }
            for (sb, blk) in wq[r * rb..(r + 1) * rb].chunks_exact(bb).enumerate() {
                let (mut dl, mut dh) = ([0f32; LANES], [0f32; LANES]);
                // SAFETY: F16C is enabled here.
                let (vl, vh) = unsafe { scales8(C::W, blk) };
                let words = sign_words(C::W, blk);
                // SAFETY: each array holds 8 f32.
                unsafe {
                    _mm256_storeu_ps(dl.as_mut_ptr(), vl);
                    _mm256_storeu_ps(dh.as_mut_ptr(), vh);
                }
                for (l, &start) in starts.iter().enumerate() {
                    let (m, sg) = levels(C::W, blk, words, l);
                    // |v| ≤ 62: v + 128 and v + 64 are in 0..=255 (wrapping adds).
                    let v = _mm256_add_epi8(_mm256_sign_epi8(m, sg), off);
                    let mut u = [0u8; QK];
                    // SAFETY: `u` holds 32 bytes.
                    unsafe { _mm256_storeu_si256(u.as_mut_ptr() as *mut __m256i, v) };
                    let lines = &mut rec[(start + sb) * DECODED_LINES..][..DECODED_LINES];
                    for (k, line) in lines[..8].iter_mut().enumerate() {
                        line.0[at.clone()].copy_from_slice(&u[4 * k..4 * k + 4]);
                    }
                    lines[8].0[at.clone()].copy_from_slice(&dl[l].to_ne_bytes());
                    lines[9].0[at.clone()].copy_from_slice(&dh[l].to_ne_bytes());
                }
            }
        }
    }
}

/// Lane `l`'s accumulators for `T` tokens over one decoded group (`rec`): blocks `l, l
/// + 8, …`, stored from position `lane_start(nb, l)` on. All zero when `l ≥ nb`.
#[inline(always)]
unsafe fn decoded_lane<const HALVES: bool, const T: usize>(
    rec: *const u8,
    x: &ActTile,
    nb: usize,
    l: usize,
) -> [__m512; T] {
    let mut pos = lane_start(nb, l);
    // SAFETY: the caller's contract (see `decoded_vnni`): the group's lines and a packed
    // tile of T tokens.
    unsafe {
        let (xq, xd, xs, xh) = (x.iq.as_ptr(), x.id.as_ptr(), x.is.as_ptr(), x.ih.as_ptr());
        let mut acc = [_mm512_setzero_ps(); T];
        let mut b = l;
        while b < nb {
            let wp = rec.add(pos * DECODED_LINES * 64);
            let mut w = [_mm512_setzero_si512(); 8];
            for (k, wk) in w.iter_mut().enumerate() {
                *wk = _mm512_load_si512(wp.add(64 * k) as *const _);
            }
            let (lo, hi) = ([w[0], w[1], w[2], w[3]], [w[4], w[5], w[6], w[7]]);
            let dl = _mm512_load_ps(wp.add(512) as *const f32);
            let dh = _mm512_load_ps(wp.add(576) as *const f32);
            let at = b * T;
            for (t, acc_t) in acc.iter_mut().enumerate() {
                let xb = xq.add((at + t) * QK) as *const i32;
                let (s, dx) = (*xs.add(at + t), _mm512_set1_ps(*xd.add(at + t)));
                if HALVES {
                    let h = *xh.add(at + t);
                    let (i0, i1) = dpbusd_block(
                        _mm512_set1_epi32(-(OFFSET_VNNI as i32) * h),
                        _mm512_set1_epi32(-(OFFSET_VNNI as i32) * (s - h)),
                        &lo,
                        &hi,
                        xb,
                    );
                    let l = _mm512_mul_ps(dl, _mm512_cvtepi32_ps(i0));
                    let v = _mm512_fmadd_ps(dh, _mm512_cvtepi32_ps(i1), l);
                    *acc_t = _mm512_fmadd_ps(dx, v, *acc_t);
                } else {
                    let (i0, i1) = dpbusd_block(
                        _mm512_set1_epi32(-(OFFSET_VNNI as i32) * s),
                        _mm512_setzero_si512(),
                        &lo,
                        &hi,
                        xb,
                    );
                    let isum = _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1));
                    *acc_t = _mm512_fmadd_ps(_mm512_mul_ps(dl, dx), isum, *acc_t);
                }
            }
            pos += 1;
            b += LANES;
        }
        acc
    }
}

/// The groups of `v` against `T` tokens, the lanes combined by `lane_tree!`.
#[inline(always)]
unsafe fn decoded_groups<const HALVES: bool, const T: usize>(
    v: &DecodedView,
    x: &ActTile,
    y: *mut f32,
    ld: usize,
) {
    let nb = v.nb;
    for g in v.g0..v.g1 {
        let rec = v.group(g);
        // SAFETY: the caller's contract (see `decoded_vnni`).
        unsafe {
            let r = lane_tree!(|l: usize| decoded_lane::<HALVES, T>(rec, x, nb, l), add512);
            store16(r, v.rows, g, y, ld);
        }
    }
}

/// Decoded groups of codebook type `C` against a packed tile, AVX-512 VNNI (see
/// `table::DecodedFn`).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VNNI; `v` holds its groups from [`decode_groups`]; `x` is a
/// packed tile of 1..=8 tokens of `v.nb` blocks; `y[t·ld + r]` is writable for every
/// token and real row of the groups.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vnni")]
pub unsafe fn decoded_vnni<C: CodebookTy>(v: &DecodedView, x: &ActTile, y: *mut f32, ld: usize) {
    count(Tier::Avx512Vnni, Op::Packed);
    let nt = checked_tokens(v, x);
    // SAFETY: forwarded caller contract; the lengths checked.
    unsafe {
        if codebook::halves(C::W) {
            with_tokens!(nt, const T => decoded_groups::<true, T>(v, x, y, ld))
        } else {
            with_tokens!(nt, const T => decoded_groups::<false, T>(v, x, y, ld))
        }
    }
}

/// The tile's token count, after checking that `v` and `x` hold what the decoded kernels
/// read.
fn checked_tokens(v: &DecodedView, x: &ActTile) -> usize {
    let nt = x.d.len() / v.nb;
    assert!((1..=PACKED_TILE).contains(&nt));
    assert!(v.g0 <= v.g1 && v.lines.len() >= (v.g1 - v.g0) * v.nb * DECODED_LINES);
    let blocks = nt * v.nb;
    assert!(x.iq.len() == blocks * QK && x.id.len() == blocks);
    assert!(x.is.len() == blocks && x.ih.len() == blocks);
    nt
}

/// [`decoded_lane`] on AVX2 for the half group `half` (rows `8·half..8·half + 8`) and
/// tokens `t0..t0 + T` of a tile of `nt`: the levels are stored as `u = v + 64`, so
/// `vpmaddubsw(u, x)` gives each row's pair sums (≤ 2·126·127 = 32,004, no saturation)
/// and `vpmaddwd` by 1 sums them exactly into `Σ_lo` (chunks 0..4) and `Σ_hi` (4..8;
/// into `Σ_lo` when the type has a scale per 32), each started at `−64·Σx` of its part
/// (`starts`: [`avx2_starts`]), so that they end at `Σ v·x`.
#[inline(always)]
unsafe fn decoded_lane_avx2<const HALVES: bool, const T: usize>(
    rec: *const u8,
    (x, starts): (&ActTile, &[i32]),
    nb: usize,
    nt: usize,
    t0: usize,
    half: usize,
    l: usize,
) -> [__m256; T] {
    let mut pos = lane_start(nb, l);
    // SAFETY: the caller's contract (see `decoded_avx2`).
    unsafe {
        let (xq, xd, st) = (x.iq.as_ptr(), x.id.as_ptr(), starts.as_ptr());
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); T];
        let mut b = l;
        while b < nb {
            let wp = rec.add(pos * DECODED_LINES * 64 + 32 * half);
            let at = b * nt + t0;
            // Broadcasts from memory: made in this loop from the sums, each start took
            // 6 instructions.
            let mut lo: [__m256i; T] =
                std::array::from_fn(|t| _mm256_set1_epi32(*st.add(2 * (at + t))));
            // Unused (and zero) for a scale per 32.
            let mut hi: [__m256i; T] = std::array::from_fn(|t| {
                if HALVES {
                    _mm256_set1_epi32(*st.add(2 * (at + t) + 1))
                } else {
                    _mm256_setzero_si256()
                }
            });
            for k in 0..8 {
                let u = _mm256_loadu_si256(wp.add(64 * k) as *const __m256i);
                for t in 0..T {
                    let xp = xq.add((at + t) * QK + 4 * k) as *const i32;
                    let p = _mm256_maddubs_epi16(u, _mm256_set1_epi32(xp.read_unaligned()));
                    let p = _mm256_madd_epi16(p, ones);
                    if k < 4 || !HALVES {
                        lo[t] = _mm256_add_epi32(lo[t], p);
                    } else {
                        hi[t] = _mm256_add_epi32(hi[t], p);
                    }
                }
            }
            let dl = _mm256_loadu_ps(wp.add(512) as *const f32);
            let dh = _mm256_loadu_ps(wp.add(576) as *const f32);
            for t in 0..T {
                let dx = _mm256_set1_ps(*xd.add(at + t));
                acc[t] = if HALVES {
                    let l = _mm256_mul_ps(dl, _mm256_cvtepi32_ps(lo[t]));
                    let v = _mm256_fmadd_ps(dh, _mm256_cvtepi32_ps(hi[t]), l);
                    _mm256_fmadd_ps(dx, v, acc[t])
                } else {
                    let isum = _mm256_cvtepi32_ps(lo[t]);
                    _mm256_fmadd_ps(_mm256_mul_ps(dl, dx), isum, acc[t])
                };
            }
            pos += 1;
            b += LANES;
        }
        acc
    }
}

/// Tokens `t0..t0 + T` of decoded group `g` of `v` on AVX2 (a tile of `nt` tokens), both
/// half groups.
#[inline(always)]
unsafe fn decoded_pass_avx2<const HALVES: bool, const T: usize>(
    v: &DecodedView,
    g: usize,
    x: (&ActTile, &[i32]),
    nt: usize,
    t0: usize,
    y: *mut f32,
    ld: usize,
) {
    let (rec, nb) = (v.group(g), v.nb);
    for half in 0..2 {
        let r0 = g * GROUP + 8 * half;
        if r0 >= v.rows {
            break;
        }
        // SAFETY: the caller's contract (see `decoded_avx2`).
        unsafe {
            let lane = |l: usize| decoded_lane_avx2::<HALVES, T>(rec, x, nb, nt, t0, half, l);
            let r = lane_tree!(lane, add256);
            store8(r, v.rows, r0, t0, y, ld);
        }
    }
}

thread_local! {
    /// [`avx2_starts`]' buffer, kept per thread: a vector collected per call was 1.3%
    /// of a 512-token IQ1_M prompt.
    static STARTS: std::cell::RefCell<Vec<i32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Into `out`: where each (block, token)'s sums start in [`decoded_lane_avx2`], in the
/// order of `x.is`: `-64·Σx_lo` then `-64·Σx_hi` (a scale per 16), or `-64·Σx` then 0.
fn avx2_starts(x: &ActTile, halves: bool, out: &mut Vec<i32>) {
    let off = OFFSET_AVX2 as i32;
    out.clear();
    for (&s, &h) in x.is.iter().zip(x.ih) {
        out.extend(if halves {
            [-off * h, -off * (s - h)]
        } else {
            [-off * s, 0]
        });
    }
}

/// Decoded groups of codebook type `C` against a packed tile, AVX2 (the AVX2 and AVX-512
/// BW tiers; see `table::DecodedFn`).
///
/// # Safety
/// The CPU has AVX2 and FMA; the rest as [`decoded_vnni`].
#[target_feature(enable = "avx2,fma")]
pub unsafe fn decoded_avx2<C: CodebookTy>(v: &DecodedView, x: &ActTile, y: *mut f32, ld: usize) {
    count(Tier::Avx2, Op::Packed);
    let nt = checked_tokens(v, x);
    // Taken out of the thread's slot, not borrowed in a closure: a closure would not
    // inherit this function's target features.
    let mut starts = STARTS.take();
    avx2_starts(x, codebook::halves(C::W), &mut starts);
    let x = (x, &starts[..]);
    for g in v.g0..v.g1 {
        // Passes of up to 4 tokens: their sums, accumulators, a level chunk and the
        // constant fill the 16 ymm.
        let mut t0 = 0;
        while t0 < nt {
            let n = (nt - t0).min(4);
            // SAFETY: forwarded caller contract; the lengths checked.
            unsafe {
                match (codebook::halves(C::W), n) {
                    (true, 4) => decoded_pass_avx2::<true, 4>(v, g, x, nt, t0, y, ld),
                    (true, 3) => decoded_pass_avx2::<true, 3>(v, g, x, nt, t0, y, ld),
                    (true, 2) => decoded_pass_avx2::<true, 2>(v, g, x, nt, t0, y, ld),
                    (true, _) => decoded_pass_avx2::<true, 1>(v, g, x, nt, t0, y, ld),
                    (false, 4) => decoded_pass_avx2::<false, 4>(v, g, x, nt, t0, y, ld),
                    (false, 3) => decoded_pass_avx2::<false, 3>(v, g, x, nt, t0, y, ld),
                    (false, 2) => decoded_pass_avx2::<false, 2>(v, g, x, nt, t0, y, ld),
                    (false, _) => decoded_pass_avx2::<false, 1>(v, g, x, nt, t0, y, ld),
                }
            }
            t0 += n;
        }
    }
    STARTS.set(starts);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::iq_grids::KSIGNS;

    /// The sign bytes made in lanes are GGUF's `KSIGNS`, bit for bit, for every 7-bit
    /// index in every group position, from 32-bit words (IQ2_XXS, IQ3_XXS) and from
    /// u16 (IQ2_XS).
    #[test]
    fn lane_signs_are_ksigns() {
        if !is_x86_feature_detected!("avx2") {
            eprintln!("skipped: no AVX2");
            return;
        }
        for i in 0..128u32 {
            let k = u32::from(KSIGNS[i as usize]);
            // Index i in group l of dword j (the other groups: other indices).
            let words: [u32; 8] = std::array::from_fn(|j| {
                (0..4).fold(0, |w, l| w | ((i + 37 * (j as u32 + l)) % 128) << (7 * l))
            });
            let u16s: [u16; 16] = std::array::from_fn(|e| (((i + 5 * e as u32) % 128) << 9) as u16);
            let mut got = [0u32; 8];
            let mut got16 = [0u32; 8];
            // SAFETY: AVX2 checked above; the arrays hold 32 bytes each.
            unsafe {
                let w = ksigns_of_words(_mm256_loadu_si256(words.as_ptr().cast()));
                _mm256_storeu_si256(got.as_mut_ptr().cast(), w);
                let a = with_parity(_mm256_srli_epi16::<9>(_mm256_loadu_si256(
                    u16s.as_ptr().cast(),
                )));
                let w16 = _mm256_permute4x64_epi64::<0xD8>(_mm256_packus_epi16(a, a));
                _mm256_storeu_si256(got16.as_mut_ptr().cast(), w16);
            }
            for (j, &w) in words.iter().enumerate() {
                for l in 0..4 {
                    let want = u32::from(KSIGNS[(w >> (7 * l) & 127) as usize]);
                    assert_eq!(got[j] >> (8 * l) & 255, want, "dword {j} group {l}");
                }
            }
            assert_eq!(got[0] & 255, k);
            // Lanes 0..4 of the pack hold the first four u16 pairs (a packed twice).
            for (e, &q) in u16s[..8].iter().enumerate() {
                let want = u32::from(KSIGNS[(q >> 9) as usize]);
                assert_eq!(got16[e / 4] >> (8 * (e % 4)) & 255, want, "u16 {e}");
            }
        }
    }
}
