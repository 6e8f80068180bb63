//! One-token kernels of the codebook types (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S,
//! IQ1_M) on AVX-512 VBMI + VNNI, bit-identical to `scalar::codebook` (the same exact integer
//! sums per block of 32 or per 16, then the AVX2 kernel's float step on 8 lanes).
//!
//! The AVX2 kernel ([`super::codebook`]) builds each grid entry with a scalar load and
//! an insert: about 40 instructions per block of 32, and generation is bound by them.
//! Here a super-block's grid entries are looked up 32 or 64 at a time from tables
//! derived from the grids: IQ3_XXS's as one 256-byte table per byte of an entry, read
//! with two `vpermt2b` (128 entries each) and a blend on the index's top bit; IQ3_S's
//! (levels 1, 3, …, 15) as 4 three-bit codes per entry, a u16 read by `vpermt2w`; the
//! types whose levels take 3 values (IQ2_*: 8, 25, 43; IQ1_M: −1, 0, 1) as 8 two-bit
//! codes per entry, a u16 ([`codes16`]), read as two byte tables (IQ2_XXS), by
//! `vpermt2w` and a blend per index bit above the sixth (IQ2_XS, IQ2_S), or gathered
//! (IQ1_M's 2048 entries), the codes then turned into levels by `vpshufb`. Signs:
//! `vpmultishiftqb` cuts the 7-bit sign indices out of their words and `vpermt2b`
//! reads GGUF's `KSIGNS` (or IQ2_S's sign bytes are used as stored), and `vptestmb`
//! gives each lane's sign as a mask bit.
//!
//! So that the looked-up levels need not be put back in element order, the token's
//! activation quants are reordered once per call to match them (position-major within
//! each super-block: [`XPERM_IQ3XXS`], [`XPERM_IQ2XXS`], [`XPERM_HALVES`]): every row of
//! the call reuses them. The signs negate activations (`|x| ≤ 127`), and `vpdpbusd`
//! takes the unsigned levels (`≤ 62`) against them.

use core::arch::x86_64::*;
use std::cell::RefCell;

use crate::format::iq_grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS,
};
use crate::format::wtype::{WType, QK, QK_K};
use crate::kernels::acts::ActTile;
use crate::kernels::counters::{count, Op};
use crate::kernels::scalar::codebook::CodebookTy;
use crate::kernels::tier::Tier;

use super::simd::reduce_lanes;

/// 64-byte aligned tables, so that each quarter is one aligned load.
#[repr(C, align(64))]
struct Table<const N: usize>([u8; N]);

/// A [`Table`] of `N` bytes, byte `i` given by `f` (evaluated at compile time).
macro_rules! table {
    ($n:expr, |$i:ident| $f:expr) => {
        Table({
            let mut t = [0u8; $n];
            let mut $i = 0;
            while $i < $n {
                t[$i] = $f;
                $i += 1;
            }
            t
        })
    };
}

/// Byte `p` of IQ3_XXS's grid entries: table `p`, 256 entries.
static IQ3XXS_BYTES: Table<1024> =
    table!(1024, |i| (IQ3XXS_GRID[i % 256] >> (8 * (i / 256))) as u8);

/// IQ2_XXS's codes ([`codes16`]) as two byte tables: positions 0-3 (table 0) and 4-7
/// (table 1).
static IQ2XXS_CODES: Table<512> = {
    let c = codes16(&IQ2XXS_GRID, [8, 25, 43]);
    table!(512, |i| (c[i % 256] >> (8 * (i / 256))) as u8)
};

/// The level of each code, in every 128-bit lane (`vpshufb`).
static IQ2_LEVELS: Table<64> = table!(64, |i| [8, 25, 43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    [i % 16]);

static SIGNS: Table<128> = Table(KSIGNS);

/// The 2-bit codes of a grid of 8-level entries (levels `lv`: code = the level's index)
/// as u16 words: positions 0-3 in the low byte, 4-7 in the high byte, 2 bits each.
const fn codes16<const N: usize>(g: &[u64; N], lv: [u8; 3]) -> [u16; N] {
    let mut t = [0u16; N];
    let mut i = 0;
    while i < N {
        let mut p = 0;
        while p < 8 {
            let b = (g[i] >> (8 * p)) as u8;
            let code = if b == lv[0] {
                0
            } else if b == lv[1] {
                1
            } else if b == lv[2] {
                2
            } else {
                panic!("a grid level outside the three")
            };
            t[i] |= code << (2 * (p % 4) + 8 * (p / 4));
            p += 1;
        }
        i += 1;
    }
    t
}

/// 64-byte aligned words.
#[repr(C, align(64))]
struct Words<const N: usize>([u16; N]);

/// IQ3_S's grid as 3-bit codes (level = 2·code + 1), 3 bits per position.
static IQ3S_CODES: Words<512> = Words({
    let mut t = [0u16; 512];
    let mut i = 0;
    while i < 512 {
        let mut p = 0;
        while p < 4 {
            let level = (IQ3S_GRID[i] >> (8 * p)) as u8;
            assert!(level % 2 == 1 && level <= 15);
            t[i] |= ((level / 2) as u16) << (3 * p);
            p += 1;
        }
        i += 1;
    }
    t
});

/// IQ3_S's levels 1, 3, …, 15 by code, in every 128-bit lane.
static IQ3S_LEVELS: Table<64> = table!(64, |i| if i % 16 < 8 {
    (2 * (i % 16) + 1) as u8
} else {
    0
});

static IQ2XS_CODES: Words<512> = Words(codes16(&IQ2XS_GRID, [8, 25, 43]));
static IQ2S_CODES: Words<1024> = Words(codes16(&IQ2S_GRID, [8, 25, 43]));

/// `c` and a zero word: a 4-byte gather of the last entry stays in the table.
const fn padded<const N: usize, const M: usize>(c: [u16; N]) -> [u16; M] {
    assert!(M == N + 1);
    let mut t = [0u16; M];
    let mut i = 0;
    while i < N {
        t[i] = c[i];
        i += 1;
    }
    t
}
/// IQ1_M's grid values −1, 0, 1 (bytes 0xFF, 0, 1).
static IQ1S_CODES: Words<2049> = Words(padded(codes16(&IQ1S_GRID, [0xFF, 0, 1])));

/// IQ1_M's levels `8g ± 1` by `code | 4·(shift is −1)`: `|v|`, with bit 7 set where
/// `v < 0` (−7, 1, 9; −9, −1, 7), in every 128-bit lane.
static IQ1M_LEVELS: Table<64> = table!(64, |i| [
    0x87, 0x01, 0x09, 0, 0x89, 0x81, 0x07, 0, 0, 0, 0, 0, 0, 0, 0, 0
][i % 16]);

/// Constant byte permutations, 64 bytes each:
/// - `[0, 64)`: lane 4m + r ← byte 4m + (0, 2, 1, 3)[r] (entry 2m and 2m + 1's low
///   bytes, then their high bytes);
/// - `[64, 128)`: lane 4m + r ← byte 2m + r % 2;
/// - `[128, 192)`: word k ← word k / 4;
/// - `[192, 256)`: word k ← word k / 2;
/// - `[256, 320)`: lanes k and 32 + k ← byte 2k;
/// - `[320, 384)`: lane i ← byte 2i of two registers (`vpermt2b`: the low bytes of 64
///   words).
static QUADS: Table<384> = Table({
    let mut t = [0u8; 384];
    let mut i = 0;
    while i < 64 {
        let (m, r) = (i / 4, i % 4);
        t[i] = (4 * m + [0, 2, 1, 3][r]) as u8;
        t[64 + i] = (2 * m + r % 2) as u8;
        if i % 2 == 0 {
            (t[128 + i], t[192 + i]) = ((i / 2 / 4) as u8, (i / 2 / 2) as u8);
        }
        t[256 + i] = (2 * (i % 32)) as u8;
        t[320 + i] = (2 * i) as u8;
        i += 1;
    }
    t
});

/// The activation order of a super-block of the types with 8 weights per grid entry
/// and a scale per 16 (IQ2_XS, IQ2_S, IQ1_M): position `64q + 4m + r` holds byte
/// `q + 4·(r / 2)` of entry `2m + r % 2`, so that each 4 lanes `vpdpbusd` sums are the
/// 16 weights of one scale (entries 2m and 2m + 1).
static XPERM_HALVES: Table<256> = table!(256, |i| {
    let (q, m, r) = (i / 64, i % 64 / 4, i % 4);
    (8 * (2 * m + r % 2) + q + 4 * (r / 2)) as u8
});

/// The activation order of an IQ3_XXS super-block: position `64p + k` holds quant
/// `4k + p` (byte `p` of grid entry `k`).
static XPERM_IQ3XXS: Table<256> = table!(256, |i| (4 * (i % 64) + i / 64) as u8);

/// The activation order of an IQ2_XXS super-block: position `64q + k` holds quant
/// `8k + q` (`k < 32`) or `8(k − 32) + q + 4` (byte `q` or `q + 4` of entry `k`).
static XPERM_IQ2XXS: Table<256> = table!(256, |i| {
    let (q, k) = (i / 64, i % 64);
    (8 * (k % 32) + q + 4 * (k / 32)) as u8
});

/// 64 bytes of `t` at `at`.
///
/// # Safety
/// `at + 64 ≤ t.len()`; the CPU has AVX-512 F.
#[inline(always)]
unsafe fn load<const N: usize>(t: &Table<N>, at: usize) -> __m512i {
    debug_assert!(at + 64 <= N);
    // SAFETY: in bounds (the caller), aligned by `Table` when `at` is a multiple of 64.
    unsafe { _mm512_loadu_si512(t.0.as_ptr().add(at) as *const _) }
}

/// Entry `idx` (per byte, all 8 bits) of the 256-byte table at `t[at..]`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
#[inline]
fn lookup256<const N: usize>(t: &Table<N>, at: usize, idx: __m512i) -> __m512i {
    assert!(at + 256 <= N);
    // SAFETY: in bounds (the assert); the features are enabled.
    unsafe {
        let lo = _mm512_permutex2var_epi8(load(t, at), idx, load(t, at + 64));
        let hi = _mm512_permutex2var_epi8(load(t, at + 128), idx, load(t, at + 192));
        _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), lo, hi)
    }
}

/// `KSIGNS` of the low 7 bits of each byte of `idx`: the 8 signs of a sign index.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
#[inline]
fn ksigns(idx: __m512i) -> __m512i {
    // SAFETY: 128 bytes; the features are enabled.
    unsafe { _mm512_permutex2var_epi8(load(&SIGNS, 0), idx, load(&SIGNS, 64)) }
}

/// Sums i32 lanes `2j` and `2j + 1` into lane `j` of 8.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
#[inline]
fn pair_sums(v: __m512i) -> __m256i {
    // As u64 lanes: the low half zero-extended plus the high half; the low 32 bits of
    // the sum are the i32 sum.
    let lo = _mm512_and_si512(v, _mm512_set1_epi64(0xFFFF_FFFF));
    _mm512_cvtepi64_epi32(_mm512_add_epi64(lo, _mm512_srli_epi64::<32>(v)))
}

/// `x` negated where `m` is set (`|x| ≤ 127`, so never overflows).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
#[inline]
fn negate(x: __m512i, m: __mmask64) -> __m512i {
    _mm512_mask_sub_epi8(x, m, _mm512_setzero_si512(), x)
}

/// Bits 7f..7f+6 of each 32-bit word (f = 0..3) as bytes, word by word: the sign
/// indices of `vpmultishiftqb` (bit 7 is the next field's, and `vpermt2b` ignores it).
const SIGN_FIELDS: i64 = 0x352E_2720_150E_0700;

/// Byte lane k ← byte k / 2 (of 32): a sign byte per 2 entries of 4 weights.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
#[inline]
fn per_entry(signs: __m256i) -> __m512i {
    _mm512_permutexvar_epi8(
        _mm512_set_epi64(
            0x1F1F_1E1E_1D1D_1C1C,
            0x1B1B_1A1A_1919_1818,
            0x1717_1616_1515_1414,
            0x1313_1212_1111_1010,
            0x0F0F_0E0E_0D0D_0C0C,
            0x0B0B_0A0A_0909_0808,
            0x0707_0606_0505_0404,
            0x0303_0202_0101_0000,
        ),
        _mm512_castsi256_si512(signs),
    )
}

/// The IQ3 types (64 entries of 4 weights, a scale per 32): the exact per-block sums
/// of the levels `w[p]` (byte lane k: byte p of entry k) with the sign bytes `signs`
/// (lane k: entry k's pair's, [`per_entry`]; byte p has bit 4·(k % 2) + p) against the
/// reordered activation quants `xp` ([`XPERM_IQ3XXS`]).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
#[inline]
fn quads_sums(w: [__m512i; 4], signs: __m512i, xp: &[i8]) -> __m256i {
    assert!(xp.len() >= QK_K);
    let mut acc = _mm512_setzero_si512();
    macro_rules! position {
        ($p:literal) => {
            let bit = _mm512_set1_epi16((0x1000 << $p | 1 << $p) as i16);
            // SAFETY: `xp` holds 256 quants (the assert).
            let x = unsafe { _mm512_loadu_si512(xp.as_ptr().add(64 * $p) as *const _) };
            let x = negate(x, _mm512_test_epi8_mask(signs, bit));
            acc = _mm512_dpbusd_epi32(acc, w[$p], x);
        };
    }
    position!(0);
    position!(1);
    position!(2);
    position!(3);
    // i32 lane m sums entries 4m..4m+3: block m / 2.
    pair_sums(acc)
}

/// The exact per-block sums of one IQ3_XXS super-block `b` against its reordered
/// activation quants `xp` (256).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
#[inline]
fn iq3xxs_sums(b: &[u8], xp: &[i8]) -> __m256i {
    assert!(b.len() >= 98);
    // SAFETY: `b` holds the super-block (98 bytes, the assert).
    let (idx, aux) = unsafe {
        (
            _mm512_loadu_si512(b.as_ptr().add(2) as *const _),
            _mm256_loadu_si256(b.as_ptr().add(66) as *const __m256i),
        )
    };
    // Sign index m = 4j + f (block j, field f of its word) covers grid entries 2m and
    // 2m + 1.
    let sidx = _mm256_multishift_epi64_epi8(_mm256_set1_epi64x(SIGN_FIELDS), aux);
    let signs = ksigns(per_entry(sidx));
    // No `array::map`: its closure would not inherit the features.
    let w = [
        lookup256(&IQ3XXS_BYTES, 0, idx),
        lookup256(&IQ3XXS_BYTES, 256, idx),
        lookup256(&IQ3XXS_BYTES, 512, idx),
        lookup256(&IQ3XXS_BYTES, 768, idx),
    ];
    quads_sums(w, signs, xp)
}

/// The exact per-block sums of one IQ3_S super-block `b` against its reordered
/// activation quants `xp` (256).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
#[inline]
fn iq3s_sums(b: &[u8], xp: &[i8]) -> __m256i {
    assert!(b.len() >= 110);
    // SAFETY: `b` holds the super-block (110 bytes, the assert).
    let (lo_a, lo_b, qh, signs) = unsafe {
        (
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(b.as_ptr().add(2) as *const __m256i)),
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(b.as_ptr().add(34) as *const __m256i)),
            u64::from_le_bytes(b[66..74].try_into().unwrap()),
            _mm256_loadu_si256(b.as_ptr().add(74) as *const __m256i),
        )
    };
    // Entry k's index: byte k of qs and bit k of qh (entries 0-31 in a, 32-63 in b).
    let top = _mm512_set1_epi16(256);
    let a = lookup_words(
        &IQ3S_CODES,
        _mm512_mask_add_epi16(lo_a, qh as u32, lo_a, top),
    );
    let b = lookup_words(
        &IQ3S_CODES,
        _mm512_mask_add_epi16(lo_b, (qh >> 32) as u32, lo_b, top),
    );
    // SAFETY: 64 bytes; the features are enabled.
    let (levels, low) = unsafe { (load(&IQ3S_LEVELS, 0), load(&QUADS, 320)) };
    let seven = _mm512_set1_epi8(7);
    // Byte lane k: the 3-bit code of position p of entry k, then its level.
    macro_rules! position {
        ($p:literal) => {{
            let c = _mm512_permutex2var_epi8(
                _mm512_srli_epi16::<{ 3 * $p }>(a),
                low,
                _mm512_srli_epi16::<{ 3 * $p }>(b),
            );
            _mm512_shuffle_epi8(levels, _mm512_and_si512(c, seven))
        }};
    }
    let w = [position!(0), position!(1), position!(2), position!(3)];
    quads_sums(w, per_entry(signs), xp)
}

/// The exact per-block sums of one IQ2_XXS super-block `b` against its reordered
/// activation quants `xp` (256).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
#[inline]
fn iq2xxs_sums(b: &[u8], xp: &[i8]) -> __m256i {
    assert!(b.len() >= 66 && xp.len() >= QK_K);
    // SAFETY: `b` holds the super-block (66 bytes), `xp` 256 quants (the assert).
    unsafe {
        // Word pair j: grid indices 4j..4j+3, then the sign and scale word of block j.
        let v = _mm512_loadu_si512(b.as_ptr().add(2) as *const _);
        // Entry k = 4j + l (byte l of pair j) in lanes k and 32 + k.
        let entries = _mm512_set_epi64(
            0x3B3A_3938_3332_3130,
            0x2B2A_2928_2322_2120,
            0x1B1A_1918_1312_1110,
            0x0B0A_0908_0302_0100,
            0x3B3A_3938_3332_3130,
            0x2B2A_2928_2322_2120,
            0x1B1A_1918_1312_1110,
            0x0B0A_0908_0302_0100,
        );
        let idx = _mm512_permutexvar_epi8(entries, v);
        // Sign field l of block j (bits 32 + 7l of pair j) belongs to entry 4j + l.
        let fields = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(SIGN_FIELDS >> 32), v);
        let signs = ksigns(_mm512_permutexvar_epi8(entries, fields));
        // Codes of positions 0-3 in lanes 0-31, of 4-7 in lanes 32-63.
        let codes = _mm512_mask_blend_epi8(
            0xFFFF_FFFF_0000_0000,
            lookup256(&IQ2XXS_CODES, 0, idx),
            lookup256(&IQ2XXS_CODES, 256, idx),
        );
        let (levels, three) = (load(&IQ2_LEVELS, 0), _mm512_set1_epi8(3));
        let mut acc = _mm512_setzero_si512();
        macro_rules! position {
            ($q:literal) => {
                let c = _mm512_and_si512(_mm512_srli_epi16::<{ 2 * $q }>(codes), three);
                let w = _mm512_shuffle_epi8(levels, c);
                let bit = _mm512_set_epi64(
                    0x1010_1010_1010_1010 << $q,
                    0x1010_1010_1010_1010 << $q,
                    0x1010_1010_1010_1010 << $q,
                    0x1010_1010_1010_1010 << $q,
                    0x0101_0101_0101_0101 << $q,
                    0x0101_0101_0101_0101 << $q,
                    0x0101_0101_0101_0101 << $q,
                    0x0101_0101_0101_0101 << $q,
                );
                let x = _mm512_loadu_si512(xp.as_ptr().add(64 * $q) as *const _);
                let x = negate(x, _mm512_test_epi8_mask(signs, bit));
                acc = _mm512_dpbusd_epi32(acc, w, x);
            };
        }
        position!(0);
        position!(1);
        position!(2);
        position!(3);
        // i32 lane m < 8 sums entries 4m..4m+3 at positions 0-3: block m; lane 8 + m
        // the same block at positions 4-7.
        _mm256_add_epi32(
            _mm512_castsi512_si256(acc),
            _mm512_extracti64x4_epi64::<1>(acc),
        )
    }
}

/// Word `idx & (N − 1)` (u16 lanes) of table `t`: `vpermt2w` on each 64 words, then a
/// blend per index bit above the sixth.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
#[inline]
fn lookup_words<const N: usize>(t: &Words<N>, idx: __m512i) -> __m512i {
    const { assert!(N.is_power_of_two() && N >= 128 && N <= 1024) };
    let mut r = [_mm512_setzero_si512(); 16];
    let chunks = N / 64;
    for (c, rc) in r.iter_mut().enumerate().take(chunks) {
        // SAFETY: words 64c..64c+64 are in the table.
        *rc = unsafe {
            let p = t.0.as_ptr().add(64 * c);
            _mm512_permutex2var_epi16(
                _mm512_loadu_si512(p as *const _),
                idx,
                _mm512_loadu_si512(p.add(32) as *const _),
            )
        };
    }
    let mut n = chunks;
    let mut bit = 64;
    while n > 1 {
        let m = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(bit));
        for i in 0..n / 2 {
            r[i] = _mm512_mask_blend_epi16(m, r[2 * i], r[2 * i + 1]);
        }
        n /= 2;
        bit *= 2;
    }
    r[0]
}

/// Word `idx` (u16 lanes, each `< N − 1`) of table `t` by two `vpgatherdd`: for
/// IQ1_M's 2048 entries, faster than 32 `vpermt2w` and 31 blends (one thread, 1B-class
/// model: 8.7 against 6.5 tok/s); for 512 and 1024 entries slower (10.5 against 16.2,
/// 8.9 against 12.1).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
#[inline]
fn gather_words<const N: usize>(t: &Words<N>, idx: __m512i) -> __m512i {
    let lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(idx));
    let hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64::<1>(idx));
    // SAFETY: every index < N − 1 reads 4 bytes inside the table.
    let (a, b) = unsafe {
        (
            _mm512_i32gather_epi32::<2>(lo, t.0.as_ptr() as *const i32),
            _mm512_i32gather_epi32::<2>(hi, t.0.as_ptr() as *const i32),
        )
    };
    let a = _mm512_cvtepi32_epi16(a);
    let b = _mm512_cvtepi32_epi16(b);
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b)
}

/// The types with 8 weights per grid entry and a scale per 16 (IQ2_XS, IQ2_S, IQ1_M):
/// the exact sums of each block's first and last 16 weights from the entries' codes
/// (u16 lane k: [`codes16`]), their sign bytes (byte lane k: bit p negates position p;
/// IQ2_XS, IQ2_S) or their shifts (byte lane k: 4 where the shift is −1; IQ1_M), and
/// the reordered activation quants `xp` ([`XPERM_HALVES`]).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
#[inline]
fn halves_sums<const IQ1: bool>(codes: __m512i, signs: __m512i, xp: &[i8]) -> (__m256i, __m256i) {
    assert!(xp.len() >= QK_K);
    // SAFETY: 64 bytes each; the features are enabled.
    let (quad, pair) = unsafe { (load(&QUADS, 0), load(&QUADS, 64)) };
    // Lane 4m + r: byte r / 2 (positions 0-3, 4-7) of entry 2m + r % 2.
    let codes = _mm512_permutexvar_epi8(quad, codes);
    // Lane 4m + r: the sign byte (or shift) of entry 2m + r % 2.
    let signs = _mm512_permutexvar_epi8(pair, signs);
    // SAFETY: 64 bytes each; the features are enabled.
    let levels = unsafe { load(if IQ1 { &IQ1M_LEVELS } else { &IQ2_LEVELS }, 0) };
    let three = _mm512_set1_epi8(3);
    let mut acc = _mm512_setzero_si512();
    macro_rules! position {
        ($q:literal) => {
            let c = _mm512_and_si512(_mm512_srli_epi16::<{ 2 * $q }>(codes), three);
            let (w, neg) = if IQ1 {
                let v = _mm512_shuffle_epi8(levels, _mm512_or_si512(c, signs));
                (
                    _mm512_and_si512(v, _mm512_set1_epi8(0x7F)),
                    _mm512_movepi8_mask(v),
                )
            } else {
                let bit = _mm512_set1_epi32((0x1010_0101u32 << $q) as i32);
                (
                    _mm512_shuffle_epi8(levels, c),
                    _mm512_test_epi8_mask(signs, bit),
                )
            };
            // SAFETY: `xp` holds 256 quants (the assert).
            let x = unsafe { _mm512_loadu_si512(xp.as_ptr().add(64 * $q) as *const _) };
            acc = _mm512_dpbusd_epi32(acc, w, negate(x, neg));
        };
    }
    position!(0);
    position!(1);
    position!(2);
    position!(3);
    // i32 lane 2j + h: half h of block j.
    (
        _mm512_cvtepi64_epi32(acc),
        _mm512_cvtepi64_epi32(_mm512_srli_epi64::<32>(acc)),
    )
}

/// IQ2_XS: codes and sign bytes of super-block `b`'s 32 entries.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
#[inline]
fn iq2xs_entries(b: &[u8]) -> (__m512i, __m512i) {
    assert!(b.len() >= 74);
    // SAFETY: bytes 2..66 are in `b`.
    let q = unsafe { _mm512_loadu_si512(b.as_ptr().add(2) as *const _) };
    let codes = lookup_words(&IQ2XS_CODES, _mm512_and_si512(q, _mm512_set1_epi16(511)));
    // The 7-bit sign index is bits 9-15: byte lane k takes word k's high byte shifted
    // by one (bit 7, the next word's, is ignored by the lookup).
    let hi = _mm512_permutexvar_epi8(odd_bytes(), _mm512_srli_epi16::<1>(q));
    (codes, ksigns(hi))
}

/// IQ2_S: codes and sign bytes of super-block `b`'s 32 entries.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
#[inline]
fn iq2s_entries(b: &[u8]) -> (__m512i, __m512i) {
    assert!(b.len() >= 82);
    // SAFETY: bytes 2..66 and 66..74 are in `b`.
    let (lo, signs, qh) = unsafe {
        (
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(b.as_ptr().add(2) as *const __m256i)),
            _mm512_castsi256_si512(_mm256_loadu_si256(b.as_ptr().add(34) as *const __m256i)),
            _mm_loadl_epi64(b.as_ptr().add(66) as *const __m128i),
        )
    };
    // Entry k's top 2 bits: bits 2·(k % 4) of qh byte k / 4.
    let qh = _mm512_permutexvar_epi16(
        // SAFETY: 64 bytes; the features are enabled.
        unsafe { load(&QUADS, 128) },
        _mm512_cvtepu8_epi16(_mm256_castsi128_si256(qh)),
    );
    let top = _mm512_srlv_epi16(qh, _mm512_set1_epi64(0x0006_0004_0002_0000));
    let idx = _mm512_or_si512(
        lo,
        _mm512_slli_epi16::<8>(_mm512_and_si512(top, _mm512_set1_epi16(3))),
    );
    (lookup_words(&IQ2S_CODES, idx), signs)
}

/// IQ1_M: codes and shifts (4 where −1) of super-block `b`'s 32 entries.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
#[inline]
fn iq1m_entries(b: &[u8]) -> (__m512i, __m512i) {
    assert!(b.len() >= 56);
    // SAFETY: bytes 0..32 and 32..48 are in `b`.
    let (lo, qh) = unsafe {
        (
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(b.as_ptr() as *const __m256i)),
            _mm256_cvtepu8_epi16(_mm_loadu_si128(b.as_ptr().add(32) as *const __m128i)),
        )
    };
    // Entry k's nibble: bits 4·(k % 2) of qh byte k / 2: the top 3 index bits, then the
    // shift's sign.
    let qh = _mm512_permutexvar_epi16(
        // SAFETY: 64 bytes; the features are enabled.
        unsafe { load(&QUADS, 192) },
        _mm512_castsi256_si512(qh),
    );
    let nib = _mm512_and_si512(
        _mm512_srlv_epi16(qh, _mm512_set1_epi32(0x0004_0000)),
        _mm512_set1_epi16(15),
    );
    let idx = _mm512_or_si512(
        lo,
        _mm512_slli_epi16::<8>(_mm512_and_si512(nib, _mm512_set1_epi16(7))),
    );
    // 4 where bit 3 is set, as byte lane k.
    let neg = _mm512_srli_epi16::<1>(_mm512_and_si512(nib, _mm512_set1_epi16(8)));
    (
        gather_words(&IQ1S_CODES, idx),
        _mm512_permutexvar_epi8(even_bytes(), neg),
    )
}

/// Byte lane k (and 32 + k) ← byte 2k + 1, the high byte of word k.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
#[inline]
fn odd_bytes() -> __m512i {
    _mm512_add_epi8(even_bytes(), _mm512_set1_epi8(1))
}

/// Byte lane k (and 32 + k) ← byte 2k, the low byte of word k.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
#[inline]
fn even_bytes() -> __m512i {
    // SAFETY: 64 bytes; the features are enabled.
    unsafe { load(&QUADS, 256) }
}

/// `x`'s quants (one token, `cols`) reordered super-block by super-block by `perm`
/// into `xp`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
fn reorder(perm: &Table<256>, x: &[i8], xp: &mut [i8]) {
    assert!(x.len().is_multiple_of(QK_K) && xp.len() == x.len());
    for (s, d) in x.chunks_exact(QK_K).zip(xp.chunks_exact_mut(QK_K)) {
        // SAFETY: 256 bytes each (chunks_exact); the features are enabled.
        unsafe {
            // Loads, not a closure: it would not inherit the features.
            let q0 = _mm512_loadu_si512(s.as_ptr() as *const _);
            let q1 = _mm512_loadu_si512(s.as_ptr().add(64) as *const _);
            let q2 = _mm512_loadu_si512(s.as_ptr().add(128) as *const _);
            let q3 = _mm512_loadu_si512(s.as_ptr().add(192) as *const _);
            for o in 0..4 {
                let p = load(perm, 64 * o);
                let v = _mm512_mask_blend_epi8(
                    _mm512_movepi8_mask(p),
                    _mm512_permutex2var_epi8(q0, p, q1),
                    _mm512_permutex2var_epi8(q2, p, q3),
                );
                _mm512_storeu_si512(d.as_mut_ptr().add(64 * o) as *mut _, v);
            }
        }
    }
}

/// `rows` rows (`wq`) of type `C` (IQ3_XXS or IQ2_XXS) against one token `x`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
fn rows_one<C: CodebookTy>(rows: usize, wq: &[u8], x: &ActTile, xp: &mut [i8], out: &mut [f32]) {
    let cols = x.q.len();
    let (nb, bb) = (cols / QK, C::W.block_bytes());
    assert!(
        cols.is_multiple_of(QK_K)
            && x.d.len() == nb
            && wq.len() == rows * C::W.row_bytes(cols)
            && out.len() == rows
    );
    let perm = match C::W {
        WType::IQ3_XXS | WType::IQ3_S => &XPERM_IQ3XXS,
        WType::IQ2_XXS => &XPERM_IQ2XXS,
        _ => &XPERM_HALVES,
    };
    reorder(perm, x.q, xp);
    for (o, row) in out.iter_mut().zip(wq.chunks_exact(C::W.row_bytes(cols))) {
        let mut acc = _mm256_setzero_ps();
        for (sb, b) in row.chunks_exact(bb).enumerate() {
            let xs = &xp[sb * QK_K..][..QK_K];
            let xd = &x.d[sb * 8..][..8];
            // SAFETY: `xd` holds the 8 blocks' scales.
            let dx = unsafe { _mm256_loadu_ps(xd.as_ptr()) };
            // SAFETY: the features include AVX2 and F16C.
            let (dl, dh) = unsafe { super::codebook::scales8(C::W, b) };
            // The contract's float step per block, as the AVX2 kernel takes it.
            acc = match C::W {
                WType::IQ3_XXS | WType::IQ3_S | WType::IQ2_XXS => {
                    let isum = match C::W {
                        WType::IQ3_XXS => iq3xxs_sums(b, xs),
                        WType::IQ3_S => iq3s_sums(b, xs),
                        _ => iq2xxs_sums(b, xs),
                    };
                    _mm256_fmadd_ps(_mm256_mul_ps(dl, dx), _mm256_cvtepi32_ps(isum), acc)
                }
                _ => {
                    let (lo, hi) = match C::W {
                        WType::IQ2_XS => {
                            let (c, s) = iq2xs_entries(b);
                            halves_sums::<false>(c, s, xs)
                        }
                        WType::IQ2_S => {
                            let (c, s) = iq2s_entries(b);
                            halves_sums::<false>(c, s, xs)
                        }
                        _ => {
                            let (c, s) = iq1m_entries(b);
                            halves_sums::<true>(c, s, xs)
                        }
                    };
                    let l = _mm256_mul_ps(dl, _mm256_cvtepi32_ps(lo));
                    let v = _mm256_fmadd_ps(dh, _mm256_cvtepi32_ps(hi), l);
                    _mm256_fmadd_ps(dx, v, acc)
                }
            };
        }
        *o = reduce_lanes(acc);
    }
}

thread_local! {
    /// A token's reordered quants, per thread.
    static REORDERED: RefCell<Vec<i8>> = const { RefCell::new(Vec::new()) };
}

/// Tile kernel of codebook type `C` (see `table::TileFn`; `wd` is empty): one token
/// here, several by the AVX2 kernel.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C and AVX-512 F, BW, VL, VBMI and VNNI; slice lengths as `TileFn` says.
pub unsafe fn tile<C: CodebookTy>(
    rows: usize,
    wq: &[u8],
    wd: &[f32],
    x: &ActTile,
    out: &mut [f32],
) {
    if out.len() != rows {
        // SAFETY: the features include the AVX2 kernel's.
        return unsafe { super::codebook::tile::<C>(rows, wq, wd, x, out) };
    }
    count(Tier::Avx512Vnni, Op::Tile);
    REORDERED.with_borrow_mut(|xp| {
        xp.resize(x.q.len(), 0);
        // SAFETY: the caller's CPU has the features.
        unsafe { rows_one::<C>(rows, wq, x, xp, out) }
    })
}
