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
//! ([`Kernels::packs`](super::Kernels::packs)); scalar and NEON keep reading the map.

use std::io;

use super::hugebuf::HugeBuf;
use super::{packed_blocks, pool, QMat, WType};
use crate::quant::QK;

/// Rows per group: one 512-bit vector of i32/f32 lanes.
pub const GROUP: usize = 16;

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
pub const LANE_VISIT: [usize; super::LANES] = [0, 4, 2, 6, 1, 5, 3, 7];

/// The blocks of a row in packed order: the lanes in [`LANE_VISIT`] order, each lane's
/// blocks (`l, l + 8, …`) in a run.
pub fn block_order(nb: usize) -> impl Iterator<Item = usize> {
    LANE_VISIT
        .into_iter()
        .filter(move |&l| l < nb)
        .flat_map(move |l| (l..nb).step_by(super::LANES))
}

/// The packed position of lane `l`'s first block: lane `k` holds `⌈(nb − k)/8⌉` blocks,
/// and the lanes before `l` in [`LANE_VISIT`] come first.
#[inline(always)]
pub fn lane_start(nb: usize, l: usize) -> usize {
    LANE_VISIT
        .iter()
        .take_while(|&&k| k != l)
        .filter(|&&k| k < nb)
        .map(|&k| (nb - k).div_ceil(super::LANES))
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
    /// Fails only when the system has no memory for the copy.
    pub fn new_with(w: &QMat, mut done: impl FnMut(usize, usize)) -> io::Result<PackedMat> {
        if packed_blocks::has_layout(w.wtype) {
            return packed_blocks::pack(w, done);
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
        if packed_blocks::has_layout(self.wtype) {
            d.clear(); // the scales are inside the GGUF blocks
            return packed_blocks::unpack_row(self, r, q);
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

    /// An all-zero matrix of `len` bytes in a layout of another module (the GGUF block
    /// types': [`packed_blocks`]), which fills it through [`PackedMat::bytes_mut`].
    pub(super) fn zeroed(
        wtype: WType,
        rows: usize,
        cols: usize,
        len: usize,
    ) -> io::Result<PackedMat> {
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
    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
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

#[cfg(test)]
mod tests {
    use super::*;

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
            for l in 0..crate::kernels::LANES.min(nb) {
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
}
