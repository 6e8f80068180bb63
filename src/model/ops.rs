//! The small operations every part of the forward pass shares, in one place: RMSNorm
//! over the rows of a chunk, the residual add, sigmoid, and row-wise work spread over
//! the pool above a size. The f32 contract they rest on (the dot product's lanes,
//! `exp`, SiLU, RMSNorm) is the kernels', reached through the table ([`Kernels`]).

use crate::kernels::{pool, Kernels};

/// Below this many multiply-adds (or values), element-wise and attention work stays on
/// the calling thread.
pub(crate) const PAR_MIN: usize = 1 << 15;

/// `f(row_index, row)` over the rows of `buf` (rows of `width`), on the pool when there
/// is enough work. Rows are independent, so the result is the same either way.
pub(crate) fn for_rows(buf: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    pool::parallel_if(buf.len() >= PAR_MIN).for_chunks(buf, width, f);
}

/// `out[r] = rmsnorm(x[r], w)` for every row of `width`.
pub(crate) fn rmsnorm_rows(
    k: &Kernels,
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    width: usize,
    eps: f32,
) {
    for_rows(out, width, |i, o| {
        k.rmsnorm(o, &x[i * width..(i + 1) * width], w, eps)
    });
}

/// `x += y`.
pub(crate) fn add(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `1 / (1 + e^−x)` (with the platform's `expf`, as before the kernels' `exp` existed;
/// the attention gate and the delta rule's β).
#[inline]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The zeroed f32 buffers of a `State`, first counted, then allocated without aborting:
/// a `--ctx` near a large max_seq can ask for more memory than the machine has, which
/// must be an error naming the bytes, not an abort. Allocation takes the allocator's
/// zeroed path (calloc: fresh pages from the kernel), so the untouched part of a buffer,
/// such as the KV cache beyond the positions used, takes no memory, as with
/// `vec![0.0; n]` (`Vec::try_reserve_exact` would need the zeros written, touching every
/// page).
#[derive(Debug)]
pub(crate) struct Zeros {
    alloc: bool,
    /// Bytes asked for so far; `None` once the sum overflows.
    bytes: Option<u128>,
    failed: bool,
}

impl Zeros {
    /// Counts the bytes; every buffer comes back empty.
    pub(crate) fn counting() -> Zeros {
        Zeros {
            alloc: false,
            bytes: Some(0),
            failed: false,
        }
    }

    /// Allocates; after a failure, the rest come back empty.
    pub(crate) fn allocating() -> Zeros {
        Zeros {
            alloc: true,
            ..Zeros::counting()
        }
    }

    /// A buffer of the product of `dims` zeros (shape comments stay at the call).
    pub(crate) fn take(&mut self, dims: &[usize]) -> Vec<f32> {
        self.take_of(dims)
    }

    /// [`Zeros::take`] of any element type whose all-zero bytes are a zero (f32, the
    /// KV cache's f16 bits and Q8_0 quants).
    pub(crate) fn take_of<T: ZeroBits>(&mut self, dims: &[usize]) -> Vec<T> {
        let n = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        self.add(n.map(|n| n as u128 * std::mem::size_of::<T>() as u128));
        if !self.alloc || self.failed {
            return Vec::new();
        }
        match n.and_then(try_zeros) {
            Some(v) => v,
            None => {
                self.failed = true;
                Vec::new()
            }
        }
    }

    /// Counts `bytes` allocated elsewhere (`None`: more than a usize holds).
    pub(crate) fn add(&mut self, bytes: Option<u128>) {
        self.bytes = self.bytes.zip(bytes).and_then(|(a, b)| a.checked_add(b));
    }

    /// Whether every allocation so far succeeded (always, when counting).
    pub(crate) fn ok(&self) -> bool {
        !self.failed
    }

    /// The bytes counted, `None` past u128.
    pub(crate) fn bytes(&self) -> Option<u128> {
        self.bytes
    }
}

/// Element types whose all-zero bytes are a valid value.
///
/// # Safety
/// Every bit pattern of zeros must be a valid `Self` (and `Self` not zero-sized).
pub(crate) unsafe trait ZeroBits: Copy {}

// SAFETY: all-zero bytes are 0.0, 0 and 0.
unsafe impl ZeroBits for f32 {}
// SAFETY: as above.
unsafe impl ZeroBits for u16 {}
// SAFETY: as above.
unsafe impl ZeroBits for i8 {}
// SAFETY: as above.
unsafe impl ZeroBits for u32 {}

/// `n` zeros, or `None` when the allocator cannot provide them.
fn try_zeros<T: ZeroBits>(n: usize) -> Option<Vec<T>> {
    if n == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<T>(n).ok()?;
    // SAFETY: the layout's size is not zero (n > 0, T not zero-sized).
    let p = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` comes from the global allocator with the layout of `[T; n]` (so a
    // capacity of n), and n zero-filled `T`s are valid (`ZeroBits`).
    Some(unsafe { Vec::from_raw_parts(p, n, n) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeros_count_then_allocate_or_fail() {
        let mut c = Zeros::counting();
        assert!(c.take(&[3, 4]).is_empty());
        c.add(Some(8));
        assert_eq!(c.bytes(), Some(56));
        let mut a = Zeros::allocating();
        let v = a.take(&[3, 4]);
        assert_eq!(v, vec![0.0; 12]);
        assert!(a.ok());
        // 2^60 bytes, more than any address space: the allocator refuses (no abort);
        // later buffers come back empty, and the count goes on. (black_box: an optimized
        // build may otherwise drop the unused allocation and report it made.)
        assert!(std::hint::black_box(a.take(&[1 << 58])).is_empty());
        assert!(!a.ok());
        assert!(a.take(&[2]).is_empty());
        // A size past isize::MAX is refused before the allocator.
        assert!(a.take(&[1 << 31, 1 << 31]).is_empty());
        assert_eq!(a.bytes(), Some(48 + (1u128 << 60) + 8 + (1u128 << 64)));
        assert!(a.take(&[usize::MAX, 2]).is_empty());
        assert_eq!(a.bytes(), None);
    }
}
