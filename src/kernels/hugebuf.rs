//! Owned weight memory: a zeroed anonymous map whose whole 2 MiB ranges are advised for
//! transparent huge pages (`MADV_HUGEPAGE`).
//!
//! A decode step streams every weight once, so with 4 KiB pages it walks a page table
//! entry per 4 KiB and the hardware prefetchers stop at each page's end. With 2 MiB
//! pages, llama1b decode ran BF16 1.12–1.20×, packed Q4_0 1.09× and packed Q4_K
//! 1.00–1.025× as fast on a Zen 4 host (interleaved rounds; docs/history/benchmarks-2026-12.md,
//! 2026-12-05 05:00–06:26). The file's own map did not get them: there, its page cache
//! held 10 MiB of a 2.4 GB file in 2 MiB mappings.
//!
//! The map is 2 MiB longer than asked, so the buffer can start on a 2 MiB boundary; only
//! the buffer's whole 2 MiB ranges are advised, so its tail keeps small pages and a
//! matrix never holds more memory than its bytes (rounding the tail up to a huge page
//! would add up to 2 MiB per matrix). The pages before the start are never touched.
//! Where the kernel has no transparent huge pages (or they are off) the advice is
//! ignored and the buffer is plain memory.

use std::io;

/// The huge page size of x86-64 and of arm64 with 4 KiB pages.
const HUGE: usize = 2 << 20;

/// A zeroed, page-aligned (64-byte aligned and more) buffer of `len` bytes.
pub struct HugeBuf {
    map: memmap2::MmapMut,
    /// Where the buffer starts in the map (a 2 MiB boundary).
    off: usize,
    len: usize,
}

impl HugeBuf {
    /// `len` zero bytes. Fails (rather than aborting) when the system has no memory
    /// to map.
    pub fn zeroed(len: usize) -> io::Result<HugeBuf> {
        let total = len
            .checked_add(HUGE)
            .ok_or_else(|| io::Error::new(io::ErrorKind::OutOfMemory, "buffer too large"))?;
        let map = memmap2::MmapMut::map_anon(total)?;
        let off = map.as_ptr().align_offset(HUGE).min(HUGE);
        let whole = len / HUGE * HUGE;
        #[cfg(unix)]
        if whole > 0 {
            // Advice only: without THP the buffer works the same, on small pages.
            let _ = map.advise_range(memmap2::Advice::HugePage, off, whole);
        }
        Ok(HugeBuf { map, off, len })
    }

    /// The buffer's bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.map[self.off..self.off + self.len]
    }

    /// The buffer's bytes, to fill.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map[self.off..self.off + self.len]
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::fmt::Debug for HugeBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HugeBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_aligned_and_writable() {
        for len in [0, 1, 4096, HUGE - 64, HUGE, 3 * HUGE + 4160] {
            let mut b = HugeBuf::zeroed(len).unwrap();
            assert_eq!(b.len(), len);
            assert!(b.as_slice().iter().all(|&x| x == 0), "len {len}");
            // Every buffer starts on a 2 MiB boundary.
            assert_eq!(b.as_slice().as_ptr() as usize % HUGE, 0, "len {len}");
            for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
                *x = i as u8;
            }
            assert!(b.as_slice().iter().enumerate().all(|(i, &x)| x == i as u8));
        }
    }

    #[test]
    fn too_large_is_an_error() {
        assert!(HugeBuf::zeroed(usize::MAX - 1).is_err());
    }
}
