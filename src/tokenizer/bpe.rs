//! The BPE merge loop: repeatedly apply the lowest-ranked applicable merge, the
//! leftmost among equal ranks, until none applies (what the tokenizers library does).
//! Short words use a direct scan; long ones a heap over a linked list of symbols.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// A fast non-cryptographic hasher for small integer and short byte keys.
#[derive(Default, Clone, Copy)]
pub struct FxHasher(u64);

const K: u64 = 0x517c_c1b7_2722_0a95;

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let v = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
            self.write_u64(v);
        }
        let mut tail = 0u64;
        for (i, &b) in chunks.remainder().iter().enumerate() {
            tail |= u64::from(b) << (8 * i);
        }
        self.write_u64(tail ^ (bytes.len() as u64) << 56);
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(K);
    }
    #[inline]
    fn write_u8(&mut self, v: u8) {
        self.write_u64(u64::from(v));
    }
    #[inline]
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
    /// A final mix: the multiply only carries low bits upwards, and hashbrown takes
    /// the bucket from the low bits, so without it pairs sharing a right token collide.
    #[inline]
    fn finish(&self) -> u64 {
        let h = self.0;
        (h ^ (h >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9) ^ (h >> 32)
    }
}

pub type FxBuild = BuildHasherDefault<FxHasher>;
pub type FxMap<K, V> = HashMap<K, V, FxBuild>;

/// The merge table: (left, right) → (rank, merged).
pub struct Merges {
    map: FxMap<u64, (u32, u32)>,
}

#[inline]
fn key(a: u32, b: u32) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

/// Above this many symbols the heap version is used.
const SCAN_MAX: usize = 48;

impl Merges {
    /// Builds the table from rules in rank order; a repeated pair keeps its first rank.
    pub fn new(rules: impl Iterator<Item = (u32, u32, u32)>) -> Merges {
        let mut map = FxMap::default();
        for (rank, (l, r, m)) in rules.enumerate() {
            map.entry(key(l, r)).or_insert((rank as u32, m));
        }
        Merges { map }
    }

    #[inline]
    fn get(&self, a: u32, b: u32) -> Option<(u32, u32)> {
        self.map.get(&key(a, b)).copied()
    }

    /// Merges `syms` in place.
    pub fn apply(&self, syms: &mut Vec<u32>) {
        if syms.len() <= SCAN_MAX {
            self.apply_scan(syms)
        } else {
            self.apply_heap(syms)
        }
    }

    fn apply_scan(&self, syms: &mut Vec<u32>) {
        // Ranks of the pair starting at each position; u32::MAX when none.
        let mut ranks: Vec<(u32, u32)> = Vec::with_capacity(syms.len());
        for w in syms.windows(2) {
            ranks.push(self.get(w[0], w[1]).unwrap_or((u32::MAX, 0)));
        }
        loop {
            let mut best = u32::MAX;
            let mut at = 0;
            for (i, &(r, _)) in ranks.iter().enumerate() {
                if r < best {
                    best = r;
                    at = i;
                }
            }
            if best == u32::MAX {
                return;
            }
            syms[at] = ranks[at].1;
            syms.remove(at + 1);
            ranks.remove(at);
            if at < ranks.len() {
                ranks[at] = self.get(syms[at], syms[at + 1]).unwrap_or((u32::MAX, 0));
            }
            if at > 0 {
                ranks[at - 1] = self.get(syms[at - 1], syms[at]).unwrap_or((u32::MAX, 0));
            }
        }
    }

    fn apply_heap(&self, syms: &mut Vec<u32>) {
        let n = syms.len();
        const NONE: usize = usize::MAX;
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut next: Vec<usize> = (1..=n).map(|i| if i == n { NONE } else { i }).collect();
        let mut alive = vec![true; n];
        // (rank, left position, pair, merged id): min-heap by rank then position.
        let mut heap = BinaryHeap::with_capacity(n);
        for i in 0..n - 1 {
            if let Some((r, m)) = self.get(syms[i], syms[i + 1]) {
                heap.push(Reverse((r, i, key(syms[i], syms[i + 1]), m)));
            }
        }
        while let Some(Reverse((_, i, pair, m))) = heap.pop() {
            let j = next[i];
            // Stale entry: the left symbol died or the pair at i is no longer this one.
            if !alive[i] || j == NONE || key(syms[i], syms[j]) != pair {
                continue;
            }
            syms[i] = m;
            alive[j] = false;
            let k = next[j];
            next[i] = k;
            if k != NONE {
                prev[k] = i;
                if let Some((r, mm)) = self.get(m, syms[k]) {
                    heap.push(Reverse((r, i, key(m, syms[k]), mm)));
                }
            }
            let p = prev[i];
            if p != NONE {
                if let Some((r, mm)) = self.get(syms[p], m) {
                    heap.push(Reverse((r, p, key(syms[p], m), mm)));
                }
            }
        }
        let mut w = 0;
        for i in 0..n {
            if alive[i] {
                syms[w] = syms[i];
                w += 1;
            }
        }
        syms.truncate(w);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_and_heap_agree() {
        // Tokens 0..3 are a b c; merges build ab, bc, abc, aa.
        let m = Merges::new([(0, 1, 3), (1, 2, 4), (3, 2, 5), (0, 0, 6), (6, 6, 7)].into_iter());
        let mut seed = 12345u64;
        for len in 1..200 {
            let mut v = Vec::new();
            for _ in 0..len {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                v.push(((seed >> 33) % 3) as u32);
            }
            let (mut a, mut b) = (v.clone(), v.clone());
            m.apply_scan(&mut a);
            m.apply_heap(&mut b);
            assert_eq!(a, b, "{v:?}");
        }
    }

    #[test]
    fn leftmost_among_equal_ranks() {
        let m = Merges::new([(0, 0, 1)].into_iter());
        let mut v = vec![0, 0, 0];
        m.apply(&mut v);
        assert_eq!(v, [1, 0]);
    }
}
