//! Weights repacked at load time for the row-interleaved micro-kernels: 16 rows side by
//! side, so one SIMD lane is one output row and the contract's per-block sum `isum_b`
//! lands in a lane with no horizontal reduction (the row-major kernels spend about as
//! many instructions reducing partials across lanes as multiplying).
//!
//! Layout of a [`PackedMat`] (one 64-byte aligned buffer): `groups = ⌈rows/16⌉` groups
//! of 16 rows, the last padded with zero rows (level 0, scale 0). Per group, blocks come
//! lane by lane, [`block_order`]: blocks 0, 8, 16, … (lane 0), then 4, 12, … (lane 4), in
//! the order the kernels run the lanes ([`LANE_VISIT`]), so a kernel runs one lane's
//! accumulator over consecutive memory and reads the group front to back. Per block of
//! 16 rows:
//!
//! * Q8_0: 8 chunks of 64 bytes; chunk `k` holds, for row `j`, elements `4k..4k+4` at
//!   `4j..4j+4`, stored as `level + 128` (u8, the VNNI offset; padding is `0x80`);
//! * Q4_0: 4 chunks of 64 bytes; chunk `k` holds, for row `j`, the original bytes
//!   `4k..4k+4` of the row's block (low nibbles: elements `4k..4k+4`, high: `16+4k..`).
//!
//! All quants of all groups come first (`groups · nb · 512` or `· 256` bytes), then the
//! scales: per group and block (same order), 16 scales, f16 bits when the file stores
//! f16 scales (exact; converted by the kernel) and f32 otherwise.
//!
//! The arithmetic is the contract's, operation for operation, so a packed matrix gives
//! the bits of the row-major one on every tier (tested against the scalar reference).
//! The runtime packs only when the active tier has a packed kernel
//! (`Kernels::packs`); scalar and NEON keep reading the map.
//!
//! ## The GGUF block types
//!
//! Every type becomes, per block `b` of 32 weights of a row: 32 unsigned levels
//! (0..=15, 31 or 63; IQ4_NL: the nibble, an index into its table), the integer offset
//! the contract subtracts (`16·s_b`, `32·s_b`; Q6_K: `32·` each half's sum, the halves
//! then scaled by their int8 scales) and the float step's `dw_b` (and `mw_b`).
//!
//! Packed layout of a [`PackedMat`] of a block type: groups of 16 rows (the last padded
//! with zero rows: levels 0, scales 0), each group one contiguous record of
//!
//! ```text
//! quants   nb positions × QB bytes       (positions in `block_order`)
//!          4 chunks of 64 bytes: chunk k holds for row j, at 4j..4j+4, the bytes
//!            (level[4k+i] & 15) | (level[16+4k+i] & 15) << 4, i < 4 (Q4_0's packing);
//!          5-bit types: + 64 bytes: row j's byte i at 4j+i has bit k = bit 4 of
//!            level[4k+i] and bit 4+k = bit 4 of level[16+4k+i], k < 4;
//!          6-bit types: + 2 × 64 bytes: plane A, row j's byte i, bits 2k..2k+2 = bits
//!            4-5 of level[4k+i]; plane B the same for level[16+4k+i].
//! scales   nb positions × PS bytes, then padding to 64:
//!            Q4_K, Q5_K: the sub-block's 6-bit codes in 24 bytes: row j's byte j is
//!              sc | (m & 3) << 6, byte 16 + (j % 8) holds m >> 2 in its nibble j / 8;
//!            Q6_K: sc[16] i8 of the block's first 16 weights, sc[16] of its last 16;
//!            Q4_1, Q5_1: d[16] f16, m[16] f16; Q5_0, Q6_0, IQ4_NL: d[16] f16.
//! supers   (K types) per super-block of 256: d[16] f16, dmin[16] f16 (Q4_K, Q5_K) or
//!            d[16] f16 (Q6_K), then padding to 64.
//! ```
//!
//! QB is 256, 320 or 384 bytes (4, 5, 6 bits): the packed matrix is the file's size
//! but for the regions' padding (the K types' codes stay 6-bit), so a decode step
//! streams as many bytes per weight as the file holds. Scales are kept as their f16
//! bits and codes: `d·sc` and `dmin·m` are exact in f32, so a kernel computes them on
//! the fly with the bits of the reference. [`PackedMat::unpack_row`] gives back the
//! row's GGUF bytes exactly.
//!
//! ## Decoded codebook groups
//!
//! The codebook types (IQ3_XXS … IQ1_M) keep no packed copy: their levels come out of
//! grid lookups, which cost more than the products a decode step makes of them. A
//! prompt's product instead decodes a sub-block of rows once into a per-thread buffer of
//! [`Line`]s and runs every token tile on it ([`DECODED_LINES`] lines per block
//! position, groups of 16 rows, positions in `block_order`, padding rows level 0 and
//! scale 0):
//!
//! ```text
//! lines 0..8  the block's levels as a packed Q8_0 block: line k holds, for row j, at
//!             4j..4j+4, level[4k..4k+4] + 128 (u8; + 64 for the AVX2 kernel)
//! line 8      the 16 rows' f32 scales of the block's first 16 weights (`dw_lo`)
//! line 9      the same of its last 16 (`dw_hi`; equal to `dw_lo` for a scale per 32)
//! ```

use std::io;

use super::hugebuf::HugeBuf;
use super::pool;
use super::scalar::blocks::{for_block_type, BlockTy, ScaleKind};
use super::scalar::tiles::LANES;
use crate::format::mat::QMat;
use crate::format::wtype::{WType, QK, QK_K};
use crate::quant::{blocks, blocks32, codebook, kquants, lowbit, mxfp4};

/// Rows per group: one 512-bit vector of i32/f32 lanes.
pub const GROUP: usize = 16;

/// One 64-byte line of a decoded codebook buffer (see the module docs).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct Line(pub [u8; 64]);

/// Lines per block position of a decoded codebook group: 8 of levels, 2 of scales.
pub const DECODED_LINES: usize = 10;

/// Decoded groups `g0..g1` of a codebook matrix (see the module docs), as a kernel
/// reads them.
pub struct DecodedView<'a> {
    /// The groups' lines, group `g0` first.
    pub lines: &'a [Line],
    /// Blocks per row.
    pub nb: usize,
    pub g0: usize,
    pub g1: usize,
    /// Real rows of the matrix (outputs at or past it are not written).
    pub rows: usize,
}

impl DecodedView<'_> {
    /// The first byte of group `g`'s record (`g0 ≤ g < g1`; panics past the lines).
    pub fn group(&self, g: usize) -> *const u8 {
        self.lines[(g - self.g0) * self.nb * DECODED_LINES..].as_ptr() as *const u8
    }
}

/// Bytes of a matrix copied at load between two releases of its source rows (packing,
/// `model::Packs`' plain copies): the map and the copy are resident together for about
/// this much of a matrix at a time.
pub const LOAD_BATCH_BYTES: usize = 4 << 20;

/// A matrix in the packed layout (see the module docs); owned, built by [`PackedMat::new`].
pub struct PackedMat {
    pub wtype: WType,
    pub rows: usize,
    pub cols: usize,
    /// Scales stored as f16 bits (else f32).
    pub f16: bool,
    /// A multiple of 64 bytes, on huge pages where the system has them.
    buf: HugeBuf,
    /// Bytes of the quant region.
    qlen: usize,
}

impl std::fmt::Debug for PackedMat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PackedMat({:?} {}x{}, {} scales)",
            self.wtype,
            self.rows,
            self.cols,
            if self.f16 { "f16" } else { "f32" }
        )
    }
}

/// Quant bytes per block of a group.
pub const fn block_bytes(wtype: WType) -> usize {
    match wtype {
        WType::Q8_0 => GROUP * QK,
        WType::Q4_0 => GROUP * QK / 2,
        _ => panic!("no packed layout for this weight type"),
    }
}

/// The order in which the kernels run a group's lanes: the contract's tree pairs
/// (0, 4), (2, 6), (1, 5), (3, 7), and `lane_tree!` runs each lane just before its pair
/// needs it. The buffer stores the lanes in this order, so a kernel reads a group front
/// to back and its prefetch ahead lands on the lanes it runs next (stored lane by lane in
/// index order, 2 of every 4 lanes' lines were never prefetched).
pub const LANE_VISIT: [usize; LANES] = [0, 4, 2, 6, 1, 5, 3, 7];

/// The blocks of a row in packed order: the lanes in [`LANE_VISIT`] order, each lane's
/// blocks (`l, l + 8, …`) in a run.
pub fn block_order(nb: usize) -> impl Iterator<Item = usize> {
    LANE_VISIT
        .into_iter()
        .filter(move |&l| l < nb)
        .flat_map(move |l| (l..nb).step_by(LANES))
}

/// The packed position of lane `l`'s first block: lane `k` holds `⌈(nb − k)/8⌉` blocks,
/// and the lanes before `l` in [`LANE_VISIT`] come first.
#[inline(always)]
pub fn lane_start(nb: usize, l: usize) -> usize {
    LANE_VISIT
        .iter()
        .take_while(|&&k| k != l)
        .filter(|&&k| k < nb)
        .map(|&k| (nb - k).div_ceil(LANES))
        .sum()
}

/// How a row's block bytes are stored: `(bytes per block, XOR applied)`. Q8_0 levels
/// get the VNNI offset (`level + 128` is `level ^ 0x80` as u8); Q4_0 bytes stay as in
/// the file. A padding row stores level 0: `0x80`, resp. `0x88` (both nibbles 8).
fn byte_code(wtype: WType) -> (usize, u8, u8) {
    match wtype {
        WType::Q8_0 => (QK, 0x80, 0x80),
        WType::Q4_0 => (QK / 2, 0, 0x88),
        t => unreachable!("QMat::new refuses {t}"),
    }
}

impl PackedMat {
    /// Packs `w` (on the calling thread's pool, groups in parallel).
    pub fn new(w: &QMat) -> io::Result<PackedMat> {
        Self::new_with(w, |_, _| {})
    }

    /// [`PackedMat::new`], calling `done(r0, r1)` after each batch of rows is packed
    /// (in order), so a caller can release the source rows as it goes.
    /// Fails when the system has no memory for the copy, or for a type without a packed
    /// layout (the codebook types: no tier has a packed kernel for them).
    pub fn new_with(w: &QMat, mut done: impl FnMut(usize, usize)) -> io::Result<PackedMat> {
        if codebook::is_codebook(w.wtype) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} has no packed layout", w.wtype),
            ));
        }
        if has_blocks_layout(w.wtype) {
            return pack_blocks(w, done);
        }
        let nb = w.blocks();
        let groups = w.rows.div_ceil(GROUP);
        let bb = block_bytes(w.wtype);
        let f16 = !w.d16.is_empty();
        let ss = if f16 { 2 } else { 4 };
        let qlen = groups * nb * bb;
        let slen = groups * nb * GROUP * ss;
        let mut buf = HugeBuf::zeroed((qlen + slen).next_multiple_of(64))?;
        let bytes = buf.as_mut_slice();
        let (qreg, sreg) = bytes.split_at_mut(qlen);
        let order: Vec<usize> = block_order(nb).collect();
        let rb = w.wtype.row_bytes(w.cols);
        let (per, xor, pad_byte) = byte_code(w.wtype);
        let xor4 = u32::from_ne_bytes([xor; 4]);
        let pack_group = |g: usize, qg: &mut [u8], sg: &mut [u8]| {
            for (p, &b) in order.iter().enumerate() {
                let qb = &mut qg[p * bb..(p + 1) * bb];
                let sb = &mut sg[p * GROUP * ss..(p + 1) * GROUP * ss];
                for j in 0..GROUP {
                    let r = g * GROUP + j;
                    let s = &mut sb[j * ss..(j + 1) * ss];
                    // Chunk k of the block holds this row's bytes 4k..4k+4 at 4j..4j+4:
                    // whole 4-byte words (a byte loop with computed indices made packing
                    // 2.3x slower at load, llama1b Q8_0).
                    let chunks = qb.chunks_exact_mut(64).map(|c| &mut c[4 * j..4 * j + 4]);
                    if r >= w.rows {
                        chunks.for_each(|d| d.fill(pad_byte));
                        s.fill(0);
                        continue;
                    }
                    let src = &w.q[r * rb + b * per..][..per];
                    for (d, v) in chunks.zip(src.chunks_exact(4)) {
                        let v = u32::from_ne_bytes(v.try_into().expect("4 bytes")) ^ xor4;
                        d.copy_from_slice(&v.to_ne_bytes());
                    }
                    let si = r * nb + b;
                    if f16 {
                        s.copy_from_slice(&w.d16[si].to_le_bytes());
                    } else {
                        s.copy_from_slice(&w.d[si].to_le_bytes());
                    }
                }
            }
        };
        // Batches of about 4 MiB of quants: the source rows of one batch are mapped at
        // a time when the caller releases them after it.
        let batch = LOAD_BATCH_BYTES / (nb * bb).max(1) + 1;
        let (qsz, ssz) = (nb * bb, nb * GROUP * ss);
        for g0 in (0..groups).step_by(batch) {
            let g1 = (g0 + batch).min(groups);
            let qb = &mut qreg[g0 * qsz..g1 * qsz];
            let sb = &mut sreg[g0 * ssz..g1 * ssz];
            pool::for_chunks2(qb, qsz, sb, ssz, |i, qg, sg| pack_group(g0 + i, qg, sg));
            done(g0 * GROUP, (g1 * GROUP).min(w.rows));
        }
        Ok(PackedMat {
            wtype: w.wtype,
            rows: w.rows,
            cols: w.cols,
            f16,
            buf,
            qlen,
        })
    }

    /// Row `r` back in the file's layout: its quants (`row_bytes(cols)`) and f32 scales.
    /// The runtime reads embedding rows from here, so the released map stays unmapped.
    pub fn unpack_row(&self, r: usize, q: &mut Vec<u8>, d: &mut Vec<f32>) {
        assert!(r < self.rows, "row {r} of {}", self.rows);
        if has_blocks_layout(self.wtype) {
            d.clear(); // the scales are inside the GGUF blocks
            return unpack_blocks_row(self, r, q);
        }
        let nb = self.cols / QK;
        let (g, j) = (r / GROUP, r % GROUP);
        let bb = block_bytes(self.wtype);
        let v = self.view();
        let qg = &v.q[g * nb * bb..(g + 1) * nb * bb];
        let ss = if self.f16 { 2 } else { 4 };
        let sg = &v.s[g * nb * GROUP * ss..(g + 1) * nb * GROUP * ss];
        let (per, xor, _) = byte_code(self.wtype);
        q.resize(nb * per, 0);
        d.resize(nb, 0.0);
        for (p, b) in block_order(nb).enumerate() {
            let src = &qg[p * bb..(p + 1) * bb];
            for (e, o) in q[b * per..(b + 1) * per].iter_mut().enumerate() {
                *o = src[64 * (e / 4) + 4 * j + e % 4] ^ xor;
            }
            let s = &sg[(p * GROUP + j) * ss..(p * GROUP + j + 1) * ss];
            d[b] = if self.f16 {
                half::f16::from_bits(u16::from_le_bytes([s[0], s[1]])).to_f32_const()
            } else {
                f32::from_le_bytes([s[0], s[1], s[2], s[3]])
            };
        }
    }

    /// An all-zero matrix of `len` bytes in the GGUF block types' layout, filled
    /// through [`PackedMat::bytes_mut`].
    fn zeroed(wtype: WType, rows: usize, cols: usize, len: usize) -> io::Result<PackedMat> {
        Ok(PackedMat {
            wtype,
            rows,
            cols,
            f16: false,
            buf: HugeBuf::zeroed(len.next_multiple_of(64))?,
            qlen: len,
        })
    }

    /// The buffer's bytes, to fill.
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.buf.as_mut_slice()
    }

    /// Groups of 16 rows (the last may be partly padding).
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }

    /// Bytes this matrix holds.
    pub fn bytes(&self) -> usize {
        self.buf.len()
    }

    /// Whether this is the packed form of `w` (same type, shape and scale kind).
    pub fn fits(&self, w: &QMat) -> bool {
        self.wtype == w.wtype
            && self.rows == w.rows
            && self.cols == w.cols
            && self.f16 != w.d16.is_empty()
    }

    /// The view the micro-kernels take.
    pub fn view(&self) -> PackedView<'_> {
        let bytes = self.buf.as_slice();
        let (q, s) = bytes.split_at(self.qlen);
        PackedView {
            q,
            s,
            nb: self.cols / QK,
            rows: self.rows,
            f16: self.f16,
        }
    }
}

/// The groups `g0..g1` of `p` as the micro-kernels read them: the quants (and scales) of
/// those groups only, group `g0` as group 0, `rows` real rows.
fn view_groups(p: &PackedMat, g0: usize, g1: usize, rows: usize) -> PackedView<'_> {
    let all = p.view();
    let (q, s) = if has_blocks_layout(p.wtype) {
        // One record per group, scales inside.
        let g = GroupLayout::of(p.wtype, all.nb).group;
        (&all.q[g0 * g..g1 * g], &all.s[..0])
    } else {
        let qb = all.nb * block_bytes(p.wtype);
        let sb = all.nb * GROUP * if p.f16 { 2 } else { 4 };
        (&all.q[g0 * qb..g1 * qb], &all.s[g0 * sb..g1 * sb])
    };
    PackedView { q, s, rows, ..all }
}

/// A packed matrix as a product reads it: all of a [`PackedMat`], or a run of its rows
/// that starts on a group boundary and ends on one (or at its last row), such as one
/// expert of a stacked expert matrix. In the packed layout such a run is a contiguous
/// part of the quants and of the scales, so the kernels read it as a matrix of its own.
#[derive(Debug, Clone, Copy)]
pub struct PackedRows<'a> {
    mat: &'a PackedMat,
    /// The first group.
    g0: usize,
    /// Rows, from row `g0·GROUP` on.
    rows: usize,
}

impl<'a> PackedRows<'a> {
    /// All of `mat`.
    pub fn all(mat: &'a PackedMat) -> Self {
        PackedRows {
            mat,
            g0: 0,
            rows: mat.rows,
        }
    }

    /// Rows `r0..r1` of these rows; `None` unless `r0` is a multiple of [`GROUP`], `r1`
    /// one too or the last row, and `r0 < r1 ≤ rows`.
    pub fn range(self, r0: usize, r1: usize) -> Option<Self> {
        let ok = r0 < r1
            && r1 <= self.rows
            && r0.is_multiple_of(GROUP)
            && (r1.is_multiple_of(GROUP) || r1 == self.rows);
        ok.then(|| PackedRows {
            mat: self.mat,
            g0: self.g0 + r0 / GROUP,
            rows: r1 - r0,
        })
    }

    pub fn wtype(&self) -> WType {
        self.mat.wtype
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.mat.cols
    }

    /// Groups of 16 rows (the last may be partly padding).
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }

    /// Bytes of these groups (of the whole matrix's share per group).
    pub fn bytes(&self) -> usize {
        self.mat.bytes() / self.mat.groups().max(1) * self.groups()
    }

    /// Whether these are the packed rows of `w` (same type, shape and scale kind).
    pub fn fits(&self, w: &QMat) -> bool {
        self.mat.wtype == w.wtype
            && self.rows == w.rows
            && self.mat.cols == w.cols
            && self.mat.f16 != w.d16.is_empty()
    }

    /// The view the micro-kernels take.
    pub fn view(&self) -> PackedView<'a> {
        view_groups(self.mat, self.g0, self.g0 + self.groups(), self.rows)
    }

    /// Row `r` of these rows in the file's layout ([`PackedMat::unpack_row`]).
    pub fn unpack_row(&self, r: usize, q: &mut Vec<u8>, d: &mut Vec<f32>) {
        assert!(r < self.rows, "row {r} of {}", self.rows);
        self.mat.unpack_row(self.g0 * GROUP + r, q, d)
    }
}

/// A packed matrix as the micro-kernels read it.
#[derive(Clone, Copy)]
pub struct PackedView<'a> {
    /// The quant region: `groups · nb · block_bytes`.
    pub q: &'a [u8],
    /// The scale region (and the buffer's zero tail).
    pub s: &'a [u8],
    /// Blocks per row.
    pub nb: usize,
    /// Real rows (outputs at or past it are not written).
    pub rows: usize,
    /// Scales are f16 bits.
    pub f16: bool,
}

// The GGUF block types' layout (see the module docs).

/// Bits per level of block type `t` (its kernels' [`BlockTy::BITS`]).
fn bits(t: WType) -> u32 {
    for_block_type!(t, |B| B::BITS).expect("a GGUF block type")
}

/// How block type `t` stores its scales (its kernels' [`BlockTy::SC`]).
fn scale_kind(t: WType) -> ScaleKind {
    for_block_type!(t, |B| B::SC).expect("a GGUF block type")
}

/// Whether `t` is packed in the GGUF block types' layout.
pub fn has_blocks_layout(t: WType) -> bool {
    blocks::is_block_type(t) && !codebook::is_codebook(t)
}

/// Quant bytes of one block position of a group: 64 per level bit.
pub const fn quant_bytes(bits: u32) -> usize {
    64 * bits as usize
}

/// Scale bytes of one block position of a group.
pub const fn pos_scale_bytes(sc: ScaleKind) -> usize {
    match sc {
        ScaleKind::DMin => 64,
        // 16 rows' two 6-bit codes, as the file packs them.
        ScaleKind::K45 => 24,
        ScaleKind::E8M0 | ScaleKind::KXs => 16,
        ScaleKind::D | ScaleKind::K6 | ScaleKind::K3 | ScaleKind::K2 => 32,
    }
}

/// Scale bytes of one super-block of a group (K types).
pub const fn super_scale_bytes(sc: ScaleKind) -> usize {
    match sc {
        ScaleKind::K45 | ScaleKind::K2 => 64,
        ScaleKind::K6 | ScaleKind::K3 | ScaleKind::KXs => 32,
        ScaleKind::D | ScaleKind::DMin | ScaleKind::E8M0 => 0,
    }
}

/// Whether the super-block scales of kind `sc` hold a `dmin` beside `d`.
const fn has_dmin(sc: ScaleKind) -> bool {
    matches!(sc, ScaleKind::K45 | ScaleKind::K2)
}

/// Where a group's parts are, for `nb` blocks per row: the super-block scales first,
/// then the position scales, then the quants, every part 64-byte aligned. A kernel
/// reads the super-block scales when it starts a group, so they come right after the
/// previous group's quants: reading a matrix is one forward stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupLayout {
    pub quant_bytes: usize,
    pub pos_scale_bytes: usize,
    pub super_bytes: usize,
    /// Offset of the super-block scales in a group (0).
    pub supers_at: usize,
    /// Offset of the position scales.
    pub scales_at: usize,
    /// Offset of the quants.
    pub quants_at: usize,
    /// Bytes per group.
    pub group: usize,
    /// Group bytes per block position, rounded up: the rate at which a kernel that
    /// reads the group front to back moves through memory.
    pub stride: usize,
}

impl GroupLayout {
    pub const fn new(bits: u32, sc: ScaleKind, nb: usize) -> GroupLayout {
        let (qb, ps, sb) = (
            quant_bytes(bits),
            pos_scale_bytes(sc),
            super_scale_bytes(sc),
        );
        let nsb = nb / (QK_K / QK);
        let scales_at = (sb * nsb).next_multiple_of(64);
        let quants_at = scales_at + (ps * nb).next_multiple_of(64);
        let group = quants_at + qb * nb;
        GroupLayout {
            quant_bytes: qb,
            pos_scale_bytes: ps,
            super_bytes: sb,
            supers_at: 0,
            scales_at,
            quants_at,
            group,
            stride: group.div_ceil(if nb == 0 { 1 } else { nb }),
        }
    }

    /// The layout of type `t`'s groups.
    pub fn of(t: WType, nb: usize) -> GroupLayout {
        GroupLayout::new(bits(t), scale_kind(t), nb)
    }
}

/// One row of a block type in the kernels' terms: every level (one per weight) and the
/// stored scale bits per block (see [`ScaleKind`]).
struct RowParts {
    levels: Vec<u8>,
    /// Per block: `[a, b]` as stored in the position scales (f16 bits or codes).
    pos: Vec<[u16; 2]>,
    /// Per super-block: `[d, dmin]` f16 bits (K types).
    sup: Vec<[u16; 2]>,
}

fn f16_bits(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// Splits row `q` (its GGUF blocks) of type `t` into levels and scale bits.
fn row_parts(t: WType, q: &[u8], cols: usize, p: &mut RowParts) {
    let nb = cols / QK;
    p.levels.clear();
    p.pos.clear();
    p.sup.clear();
    for blk in q.chunks_exact(t.block_bytes()) {
        match t {
            WType::Q4_K | WType::Q5_K => {
                p.levels.extend_from_slice(&kquants::levels_q45(t, blk));
                p.sup.push([f16_bits(blk, 0), f16_bits(blk, 2)]);
                for j in 0..QK_K / QK {
                    let (sc, m) = kquants::scale_min(j, &blk[4..16]);
                    p.pos.push([sc as u16, m as u16]);
                }
            }
            WType::Q6_K => {
                p.levels.extend_from_slice(&kquants::levels_q6(blk));
                p.sup.push([f16_bits(blk, 208), 0]);
                for j in 0..QK_K / QK {
                    p.pos
                        .push([blk[192 + 2 * j] as u16, blk[193 + 2 * j] as u16]);
                }
            }
            WType::Q2_K => {
                p.levels.extend_from_slice(&lowbit::levels_q2(blk));
                p.sup.push([f16_bits(blk, 80), f16_bits(blk, 82)]);
                for j in 0..QK_K / QK {
                    p.pos.push([blk[2 * j] as u16, blk[2 * j + 1] as u16]);
                }
            }
            WType::Q3_K => {
                p.levels.extend_from_slice(&lowbit::levels_q3(blk));
                p.sup.push([f16_bits(blk, 108), 0]);
                for j in 0..QK_K / QK {
                    let s = &blk[96..108];
                    let (lo, hi) = (lowbit::q3_code(2 * j, s), lowbit::q3_code(2 * j + 1, s));
                    p.pos.push([lo as u16, hi as u16]);
                }
            }
            WType::IQ4_XS => {
                p.levels.extend_from_slice(&lowbit::levels_iq4xs(blk));
                p.sup.push([f16_bits(blk, 0), 0]);
                for j in 0..QK_K / QK {
                    p.pos.push([lowbit::iq4xs_code(j, blk) as u16, 0]);
                }
            }
            WType::MXFP4 => {
                p.levels.extend_from_slice(&mxfp4::unpack(blk));
                p.pos.push([blk[0] as u16, 0]);
            }
            _ => {
                p.levels.extend_from_slice(&blocks32::unpack(t, blk));
                let m = if scale_kind(t) == ScaleKind::DMin {
                    f16_bits(blk, 2)
                } else {
                    0
                };
                p.pos.push([f16_bits(blk, 0), m]);
            }
        }
    }
    debug_assert_eq!((p.levels.len(), p.pos.len()), (cols, nb));
}

/// Row `q` of type `t` back from its parts (the inverse of [`row_parts`]).
fn row_bytes(t: WType, p: &RowParts, out: &mut [u8]) {
    let bb = t.block_bytes();
    let per = t.block_weights() / QK;
    for (s, blk) in out.chunks_exact_mut(bb).enumerate() {
        let lv = &p.levels[s * t.block_weights()..(s + 1) * t.block_weights()];
        let pos = &p.pos[s * per..(s + 1) * per];
        match t {
            WType::Q4_K | WType::Q5_K => {
                blk[0..2].copy_from_slice(&p.sup[s][0].to_le_bytes());
                blk[2..4].copy_from_slice(&p.sup[s][1].to_le_bytes());
                let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
                for j in 0..8 {
                    (sc[j], m[j]) = (pos[j][0] as u8, pos[j][1] as u8);
                }
                kquants::pack_scale_min(&sc, &m, &mut blk[4..16]);
                kquants::pack_q45(t, lv.try_into().expect("256 levels"), blk);
            }
            WType::Q6_K => {
                kquants::pack_q6(lv.try_into().expect("256 levels"), blk);
                for j in 0..8 {
                    blk[192 + 2 * j] = pos[j][0] as u8;
                    blk[193 + 2 * j] = pos[j][1] as u8;
                }
                blk[208..210].copy_from_slice(&p.sup[s][0].to_le_bytes());
            }
            WType::Q2_K => {
                for j in 0..8 {
                    (blk[2 * j], blk[2 * j + 1]) = (pos[j][0] as u8, pos[j][1] as u8);
                }
                lowbit::pack_q2_levels(lv.try_into().expect("256 levels"), blk);
                blk[80..82].copy_from_slice(&p.sup[s][0].to_le_bytes());
                blk[82..84].copy_from_slice(&p.sup[s][1].to_le_bytes());
            }
            WType::Q3_K => {
                lowbit::pack_q3_levels(lv.try_into().expect("256 levels"), blk);
                let codes: [u8; 16] = std::array::from_fn(|j| pos[j / 2][j % 2] as u8);
                lowbit::pack_q3_codes(&codes, &mut blk[96..108]);
                blk[108..110].copy_from_slice(&p.sup[s][0].to_le_bytes());
            }
            WType::IQ4_XS => {
                blk[0..2].copy_from_slice(&p.sup[s][0].to_le_bytes());
                let codes: [u8; 8] = std::array::from_fn(|j| pos[j][0] as u8);
                lowbit::pack_iq4xs_codes(&codes, blk);
                lowbit::pack_iq4xs_levels(lv.try_into().expect("256 levels"), blk);
            }
            WType::MXFP4 => {
                blk[0] = pos[0][0] as u8;
                let q: &[u8; 32] = lv.try_into().expect("32 levels");
                for j in 0..16 {
                    blk[1 + j] = q[j] | (q[j + 16] << 4);
                }
            }
            _ => {
                blk[0..2].copy_from_slice(&pos[0][0].to_le_bytes());
                if scale_kind(t) == ScaleKind::DMin {
                    blk[2..4].copy_from_slice(&pos[0][1].to_le_bytes());
                }
                blocks32::pack(t, lv.try_into().expect("32 levels"), blk);
            }
        }
    }
}

/// Byte `i` of row `j` in chunk `k` of a position, and the high-bit planes' bytes.
#[inline(always)]
fn at(k: usize, j: usize, i: usize) -> usize {
    64 * k + 4 * j + i
}

/// Writes row `j`'s block (levels `lv`, 32) into position record `qp` (QB bytes): row
/// `j`'s 4 bytes of each chunk and plane. Works on the levels as little-endian u32 words
/// (word `k` = levels `4k..4k + 4`, word `4 + k` = `16 + 4k..`), so that every byte of a
/// word goes through the same shifts and masks at once (loading a packed model runs this
/// for every block; byte by byte it was most of the load time of Q5_K and Q6_K).
fn put_levels<const BITS: u32>(lv: &[u8], j: usize, qp: &mut [u8]) {
    const LOW: u32 = 0x0f0f_0f0f;
    let word = |w: usize| u32::from_le_bytes(lv[4 * w..4 * w + 4].try_into().expect("4 levels"));
    if BITS <= 3 {
        // Two planes of 2-bit fields (the low half's levels, the high half's), then bit 2
        // of each level in a third (3 bits).
        let (mut p0, mut p1, mut p2) = (0u32, 0u32, 0u32);
        for k in 0..4 {
            let (lo, hi) = (word(k), word(4 + k));
            p0 |= (lo & 0x0303_0303) << (2 * k);
            p1 |= (hi & 0x0303_0303) << (2 * k);
            p2 |= (lo >> 2 & 0x0101_0101) << k | (hi >> 2 & 0x0101_0101) << (4 + k);
        }
        qp[at(0, j, 0)..at(0, j, 4)].copy_from_slice(&p0.to_le_bytes());
        qp[at(1, j, 0)..at(1, j, 4)].copy_from_slice(&p1.to_le_bytes());
        if BITS == 3 {
            qp[at(2, j, 0)..at(2, j, 4)].copy_from_slice(&p2.to_le_bytes());
        }
        return;
    }
    let (mut pa, mut pb) = (0u32, 0u32);
    for k in 0..4 {
        let (lo, hi) = (word(k), word(4 + k));
        let nib = (lo & LOW) | (hi & LOW) << 4;
        qp[at(k, j, 0)..at(k, j, 4)].copy_from_slice(&nib.to_le_bytes());
        // Bit 4 (and 5) of each level, moved within its own byte.
        match BITS {
            5 => pa |= (lo >> 4 & 0x0101_0101) << k | (hi >> 4 & 0x0101_0101) << (4 + k),
            6 => {
                pa |= (lo >> 4 & 0x0303_0303) << (2 * k);
                pb |= (hi >> 4 & 0x0303_0303) << (2 * k);
            }
            _ => {}
        }
    }
    if BITS >= 5 {
        qp[at(4, j, 0)..at(4, j, 4)].copy_from_slice(&pa.to_le_bytes());
    }
    if BITS == 6 {
        qp[at(5, j, 0)..at(5, j, 4)].copy_from_slice(&pb.to_le_bytes());
    }
}

/// Row `j`'s 32 levels of a position record (the inverse of [`put_levels`]).
fn get_levels(bits: u32, qp: &[u8], j: usize, lv: &mut [u8]) {
    if bits <= 3 {
        for k in 0..4 {
            for i in 0..4 {
                let mut lo = (qp[at(0, j, i)] >> (2 * k)) & 3;
                let mut hi = (qp[at(1, j, i)] >> (2 * k)) & 3;
                if bits == 3 {
                    let h = qp[at(2, j, i)];
                    lo |= ((h >> k) & 1) << 2;
                    hi |= ((h >> (4 + k)) & 1) << 2;
                }
                (lv[4 * k + i], lv[16 + 4 * k + i]) = (lo, hi);
            }
        }
        return;
    }
    for k in 0..4 {
        for i in 0..4 {
            let v = qp[at(k, j, i)];
            let (mut lo, mut hi) = (v & 15, v >> 4);
            match bits {
                5 => {
                    let h = qp[at(4, j, i)];
                    lo |= ((h >> k) & 1) << 4;
                    hi |= ((h >> (4 + k)) & 1) << 4;
                }
                6 => {
                    lo |= ((qp[at(4, j, i)] >> (2 * k)) & 3) << 4;
                    hi |= ((qp[at(5, j, i)] >> (2 * k)) & 3) << 4;
                }
                _ => {}
            }
            (lv[4 * k + i], lv[16 + 4 * k + i]) = (lo, hi);
        }
    }
}

/// Stores one position's scale pair of row `j` (`sp`: PS bytes).
fn put_pos_scales(sc: ScaleKind, v: [u16; 2], j: usize, sp: &mut [u8]) {
    match sc {
        ScaleKind::K45 => {
            let (code, m) = (v[0] as u8, v[1] as u8);
            sp[j] = code | (m & 3) << 6;
            let (at, shift) = (16 + j % 8, 4 * (j / 8));
            sp[at] = sp[at] & !(15 << shift) | (m >> 2) << shift;
        }
        ScaleKind::K6 | ScaleKind::K2 => {
            (sp[j], sp[16 + j]) = (v[0] as u8, v[1] as u8);
        }
        // 6-bit codes as the signed scales `code − 32`.
        ScaleKind::K3 => {
            (sp[j], sp[16 + j]) = ((v[0] as u8).wrapping_sub(32), (v[1] as u8).wrapping_sub(32));
        }
        ScaleKind::KXs => sp[j] = (v[0] as u8).wrapping_sub(32),
        ScaleKind::E8M0 => sp[j] = v[0] as u8,
        ScaleKind::D => sp[2 * j..2 * j + 2].copy_from_slice(&v[0].to_le_bytes()),
        ScaleKind::DMin => {
            sp[2 * j..2 * j + 2].copy_from_slice(&v[0].to_le_bytes());
            sp[32 + 2 * j..32 + 2 * j + 2].copy_from_slice(&v[1].to_le_bytes());
        }
    }
}

fn get_pos_scales(sc: ScaleKind, sp: &[u8], j: usize) -> [u16; 2] {
    match sc {
        ScaleKind::K45 => {
            let m_hi = sp[16 + j % 8] >> (4 * (j / 8)) & 15;
            [(sp[j] & 63) as u16, (sp[j] >> 6 | m_hi << 2) as u16]
        }
        ScaleKind::K6 | ScaleKind::K2 => [sp[j] as u16, sp[16 + j] as u16],
        ScaleKind::K3 => [
            sp[j].wrapping_add(32) as u16,
            sp[16 + j].wrapping_add(32) as u16,
        ],
        ScaleKind::KXs => [sp[j].wrapping_add(32) as u16, 0],
        ScaleKind::E8M0 => [sp[j] as u16, 0],
        ScaleKind::D => [f16_bits(sp, 2 * j), 0],
        ScaleKind::DMin => [f16_bits(sp, 2 * j), f16_bits(sp, 32 + 2 * j)],
    }
}

/// Packs `w` (a block type) as [`PackedMat::new_with`] does: groups in parallel on the
/// pool, `done(r0, r1)` after each batch of about 4 MiB.
fn pack_blocks(w: &QMat, mut done: impl FnMut(usize, usize)) -> io::Result<PackedMat> {
    let t = w.wtype;
    let (nb, bits, sc) = (w.blocks(), bits(t), scale_kind(t));
    let lay = GroupLayout::of(t, nb);
    let groups = w.rows.div_ceil(GROUP);
    let mut pm = PackedMat::zeroed(t, w.rows, w.cols, groups * lay.group)?;
    let order: Vec<usize> = block_order(nb).collect();
    let rb = t.row_bytes(w.cols);
    let pack_group = |g: usize, out: &mut [u8]| {
        let mut parts = RowParts {
            levels: Vec::new(),
            pos: Vec::new(),
            sup: Vec::new(),
        };
        for j in 0..GROUP.min(w.rows - g * GROUP) {
            let r = g * GROUP + j;
            row_parts(t, &w.q[r * rb..(r + 1) * rb], w.cols, &mut parts);
            let (ssr, rest) = out.split_at_mut(lay.scales_at);
            let (sr, qr) = rest.split_at_mut(lay.quants_at - lay.scales_at);
            for (p, &b) in order.iter().enumerate() {
                let qp = &mut qr[p * lay.quant_bytes..(p + 1) * lay.quant_bytes];
                let lv = &parts.levels[QK * b..QK * (b + 1)];
                match bits {
                    2 => put_levels::<2>(lv, j, qp),
                    3 => put_levels::<3>(lv, j, qp),
                    5 => put_levels::<5>(lv, j, qp),
                    6 => put_levels::<6>(lv, j, qp),
                    _ => put_levels::<4>(lv, j, qp),
                }
                let sp = &mut sr[p * lay.pos_scale_bytes..(p + 1) * lay.pos_scale_bytes];
                put_pos_scales(sc, parts.pos[b], j, sp);
            }
            for (s, v) in parts.sup.iter().enumerate() {
                let sp = &mut ssr[s * lay.super_bytes..(s + 1) * lay.super_bytes];
                sp[2 * j..2 * j + 2].copy_from_slice(&v[0].to_le_bytes());
                if has_dmin(sc) {
                    sp[32 + 2 * j..34 + 2 * j].copy_from_slice(&v[1].to_le_bytes());
                }
            }
        }
    };
    let batch = LOAD_BATCH_BYTES / lay.group + 1;
    let buf = pm.bytes_mut();
    for g0 in (0..groups).step_by(batch) {
        let g1 = (g0 + batch).min(groups);
        let chunk = &mut buf[g0 * lay.group..g1 * lay.group];
        pool::for_chunks(chunk, lay.group, |i, out: &mut [u8]| {
            pack_group(g0 + i, out)
        });
        done(g0 * GROUP, (g1 * GROUP).min(w.rows));
    }
    Ok(pm)
}

/// Row `r` of packed matrix `p` (a block type) as its GGUF bytes, into `q`.
fn unpack_blocks_row(p: &PackedMat, r: usize, q: &mut Vec<u8>) {
    let t = p.wtype;
    let (nb, bits, sc) = (p.cols / QK, bits(t), scale_kind(t));
    let lay = GroupLayout::of(t, nb);
    let (g, j) = (r / GROUP, r % GROUP);
    let grp = &p.view().q[g * lay.group..(g + 1) * lay.group];
    let mut parts = RowParts {
        levels: vec![0; p.cols],
        pos: vec![[0; 2]; nb],
        sup: Vec::new(),
    };
    for (pos, b) in block_order(nb).enumerate() {
        let qp = &grp[lay.quants_at + pos * lay.quant_bytes..][..lay.quant_bytes];
        get_levels(bits, qp, j, &mut parts.levels[QK * b..QK * (b + 1)]);
        let at = lay.scales_at + pos * lay.pos_scale_bytes;
        parts.pos[b] = get_pos_scales(sc, &grp[at..at + lay.pos_scale_bytes], j);
    }
    let supers = if lay.super_bytes > 0 {
        nb / (QK_K / QK)
    } else {
        0
    };
    for s in 0..supers {
        let sp = &grp[lay.supers_at + s * lay.super_bytes..];
        let dmin = if has_dmin(sc) {
            f16_bits(sp, 32 + 2 * j)
        } else {
            0
        };
        parts.sup.push([f16_bits(sp, 2 * j), dmin]);
    }
    q.resize(t.row_bytes(p.cols), 0);
    row_bytes(t, &parts, q);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::blocks::quantize_matrix;
    use crate::rng::Rng;

    #[test]
    fn block_order_is_lane_major_in_visit_order() {
        let o: Vec<usize> = block_order(18).collect();
        assert_eq!(o.len(), 18);
        assert_eq!(&o[..5], &[0, 8, 16, 4, 12]);
        let o3: Vec<usize> = block_order(3).collect();
        assert_eq!(o3, vec![0, 2, 1]);
        // Every lane's run starts where `lane_start` says.
        for nb in [1, 3, 8, 18, 64] {
            let o: Vec<usize> = block_order(nb).collect();
            for l in 0..LANES.min(nb) {
                assert_eq!(o[lane_start(nb, l)], l, "nb {nb} lane {l}");
            }
        }
    }

    #[test]
    fn packing_places_each_byte() {
        // 17 rows: one full group and one with 15 padding rows.
        let (rows, cols) = (17, 64);
        let q: Vec<u8> = (0..rows * cols).map(|i| (i % 251) as u8 & 0x7F).collect();
        let d: Vec<f32> = (0..rows * 2).map(|i| i as f32).collect();
        let w = QMat::new(WType::Q8_0, rows, cols, &q, &d).unwrap();
        let p = PackedMat::new(&w).unwrap();
        let v = p.view();
        assert_eq!(p.groups(), 2);
        // Group 1, block 1 (packed position 1), row 0 (= row 16), element 5: chunk 1.
        let at = (2 + 1) * 512 + 64 + 1;
        assert_eq!(v.q[at], q[16 * cols + 32 + 5] ^ 0x80);
        // A padding row is level 0.
        assert_eq!(v.q[2 * 512 + 4 * 3], 0x80);
        // Scales: group 1, block 1, row 0 is d[16·2 + 1]; row 1 is padding.
        let s = |i: usize| f32::from_le_bytes(v.s[4 * i..4 * i + 4].try_into().unwrap());
        assert_eq!(s((2 + 1) * 16), d[33]);
        assert_eq!(s((2 + 1) * 16 + 1), 0.0);
    }

    #[test]
    fn a_group_is_supers_then_scales_then_quants() {
        for t in WType::ALL.into_iter().filter(|&t| has_blocks_layout(t)) {
            for nb in [8, 64, 256, 448] {
                let lay = GroupLayout::of(t, nb);
                let supers = nb / (QK_K / QK) * lay.super_bytes;
                let scales = nb * lay.pos_scale_bytes;
                // In reading order, each part ends where the next begins (padded to 64).
                assert_eq!(lay.supers_at, 0, "{t} nb {nb}");
                assert_eq!(lay.scales_at, supers.next_multiple_of(64), "{t} nb {nb}");
                assert_eq!(lay.quants_at, lay.scales_at + scales.next_multiple_of(64));
                assert_eq!(lay.group, lay.quants_at + nb * lay.quant_bytes);
                assert_eq!(lay.group % 64, 0, "{t} nb {nb}");
            }
        }
    }

    #[test]
    fn the_stride_keeps_up_with_a_group() {
        // The x86 kernels' prefetch cursor moves `stride` bytes per position: over a
        // group's positions it must cover the group, by less than a position's more.
        for t in WType::ALL.into_iter().filter(|&t| has_blocks_layout(t)) {
            let step = t.block_weights() / QK;
            for nb in (step..=600).step_by(step) {
                let lay = GroupLayout::of(t, nb);
                assert!(lay.stride * nb >= lay.group, "{t} nb {nb}");
                assert!(lay.stride * nb < lay.group + nb, "{t} nb {nb}");
            }
        }
    }

    #[test]
    fn rows_round_trip_through_the_packed_layout() {
        let mut rng = Rng(0x5eed);
        for t in WType::ALL.into_iter().filter(|&t| has_blocks_layout(t)) {
            for (rows, cols) in [(1, 256), (17, 512), (33, 768)] {
                let x: Vec<f32> = (0..rows * cols).map(|_| rng.next_f32() * 0.1).collect();
                let q = quantize_matrix(t, rows, cols, &x, None).unwrap();
                let w = QMat::new_blocks(t, rows, cols, &q).unwrap();
                let p = PackedMat::new(&w).unwrap();
                assert_eq!(
                    p.bytes(),
                    rows.div_ceil(GROUP) * GroupLayout::of(t, cols / QK).group
                );
                let rb = t.row_bytes(cols);
                let mut back = Vec::new();
                for r in 0..rows {
                    unpack_blocks_row(&p, r, &mut back);
                    assert_eq!(back, &q[r * rb..(r + 1) * rb], "{t} {rows}x{cols} row {r}");
                }
            }
        }
    }

    #[test]
    fn levels_sit_where_the_docs_say() {
        // One 6-bit block, row 3: level[5] = 0b10_0110 (k = 1, i = 1), level[21] =
        // 0b01_1001 (the high half's k = 1, i = 1).
        let mut lv = [0u8; 32];
        (lv[5], lv[21]) = (0b10_0110, 0b01_1001);
        let mut qp = vec![0u8; quant_bytes(6)];
        put_levels::<6>(&lv, 3, &mut qp);
        assert_eq!(qp[64 + 12 + 1], 0x96);
        assert_eq!(qp[256 + 12 + 1], 0b10 << 2);
        assert_eq!(qp[320 + 12 + 1], 0b01 << 2);
        let mut back = [0u8; 32];
        get_levels(6, &qp, 3, &mut back);
        assert_eq!(back, lv);
        let mut q5 = vec![0u8; quant_bytes(5)];
        (lv[5], lv[21]) = (0b1_0110, 0b1_1001);
        put_levels::<5>(&lv, 3, &mut q5);
        assert_eq!(q5[256 + 12 + 1], 1 << 1 | 1 << 5);
    }
}
