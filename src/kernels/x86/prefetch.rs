//! Where the streaming kernels' software prefetches put the weights ahead of them: the
//! hint of every `prefetch*` the packed quantized kernels (`packed`, `packed_blocks`) and
//! the 2-byte float kernels (`half`, `bf16dot`) issue while streaming a matrix once
//! (decode, a single token tile). A prefetch changes no result, only speed, and the best
//! hint differs by core and by how a kernel streams ([`Stream`]), so it is chosen once
//! per process and stream from the CPU; `KRAFLA_PREFETCH=nta|t0|t1|t2` overrides every
//! stream's (docs/kernels.md, "Prefetch hint").
//!
//! Measured with alternating decode runs of one build (llama1b unless named):
//! * AMD Zen 5 (family 1Ah), NTA against T1: Q4_0 1.02, Q8_0 1.04, Q4_K 1.11, BF16 1.10,
//!   SmolLM2 Q8_0 1.05;
//! * AMD Zen 4 (family 19h), T1 against NTA: BF16 rows Gemma 3 1.44, SmolLM2 1.41-1.51
//!   (NTA there fills L1 only, and eight row streams outrun its miss buffers); the block
//!   types Q4_K 1.07-1.09, Q5_K 1.06, Q6_K 1.04; but Q4_0 0.95, Q8_0 0.96 (SmolLM2 0.96,
//!   Gemma 3 0.93). T0 took 0.83 of T1's speed on Q4_K.
//!
//! The same choice sets how many rows AVX-512 BF16/F16 decode reads side by side, each
//! its own stream ([`few_rows`]).
//!
//! Intel cores were tuned with T1 before NTA was tried, and fill L1 on NTA as Zen 4 does:
//! T1 there until measured.

use core::arch::x86_64::*;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering::Relaxed};
use std::sync::Once;

/// A prefetch hint (`KRAFLA_PREFETCH`'s names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Hint {
    Nta = 1,
    T0 = 2,
    T1 = 3,
    T2 = 4,
}

impl Hint {
    const ALL: [Hint; 4] = [Hint::Nta, Hint::T0, Hint::T1, Hint::T2];

    /// The name `KRAFLA_PREFETCH` takes.
    pub fn name(self) -> &'static str {
        match self {
            Hint::Nta => "nta",
            Hint::T0 => "t0",
            Hint::T1 => "t1",
            Hint::T2 => "t2",
        }
    }

    /// The hint stored as `code` (`Hint as u8`); anything else (0: not chosen) is T1.
    fn from_code(code: u8) -> Hint {
        Hint::ALL
            .into_iter()
            .find(|&h| h as u8 == code)
            .unwrap_or(Hint::T1)
    }

    fn from_name(s: &str) -> Option<Hint> {
        let s = s.trim().to_ascii_lowercase();
        Hint::ALL.into_iter().find(|h| h.name() == s)
    }
}

/// The three ways the kernels stream weights, each with its own hint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Packed Q4_0 / Q8_0 (`packed`): one stream per task, a line every few steps.
    Packed = 0,
    /// Packed block types, Q4_K etc. (`packed_blocks`): one stream, group by group.
    Blocks = 1,
    /// BF16 / F16 rows (`half`, `bf16dot`): a micro-tile's 8 rows side by side.
    Rows = 2,
}

impl Stream {
    pub const ALL: [Stream; 3] = [Stream::Packed, Stream::Blocks, Stream::Rows];

    /// The weight types the stream carries, for `--verbose`.
    pub fn name(self) -> &'static str {
        match self {
            Stream::Packed => "q4_0/q8_0",
            Stream::Blocks => "block types",
            Stream::Rows => "bf16/f16",
        }
    }
}

/// The hint for stream `s` on a CPU (`amd`: its vendor is AMD; `family`: CPUID's display
/// family) and a `KRAFLA_PREFETCH` value: the asked one if it names a hint (an unknown
/// name is ignored, as `KRAFLA_KERNEL`'s); else NTA on AMD from family 1Ah (Zen 5) on,
/// NTA for packed Q4_0 / Q8_0 on earlier AMD cores (Zen 4: 1.04-1.07 of T1), and T1
/// everywhere else.
fn choose(s: Stream, amd: bool, family: u32, asked: Option<&str>) -> Hint {
    let nta = amd && (family >= 0x1a || s == Stream::Packed);
    asked
        .and_then(Hint::from_name)
        .unwrap_or(if nta { Hint::Nta } else { Hint::T1 })
}

/// This CPU's vendor (AMD or not) and display family (base family plus the extended
/// family when the base is 0Fh, as CPUID leaf 1 defines it).
fn cpu() -> (bool, u32) {
    // CPUID leaves 0 and 1 exist on every x86_64 CPU.
    let (v, f) = (__cpuid(0), __cpuid(1));
    let amd = [v.ebx, v.edx, v.ecx] == [0x6874_7541, 0x6974_6e65, 0x444d_4163]; // "AuthenticAMD"
    let base = (f.eax >> 8) & 0xf;
    let family = if base == 0xf {
        base + ((f.eax >> 20) & 0xff)
    } else {
        base
    };
    (amd, family)
}

/// [`Stream`]s as the const parameter of [`line`].
pub(super) const PACKED: u8 = Stream::Packed as u8;
pub(super) const BLOCKS: u8 = Stream::Blocks as u8;
pub(super) const ROWS: u8 = Stream::Rows as u8;

/// Each stream's hint (`Hint as u8`), 0 until [`choose_all`] has run.
static HINTS: [AtomicU8; 3] = [const { AtomicU8::new(0) }; 3];

/// Whether BF16/F16 decode reads few rows side by side ([`few_rows`]).
static FEW_ROWS: AtomicBool = AtomicBool::new(false);

/// Few rows (2) for a CPU's BF16/F16 decode micro-tile: on AMD before family 1Ah. Each
/// row of a micro-tile is its own stream; on Zen 4, llama1b BF16 decode ran 1.19x faster
/// with 2 rows than with 4, which ran 1.06x faster than 8 (SmolLM2 1.06x), and 1 row
/// (one FMA chain) 0.81-0.95x of 2. Zen 5 and Intel keep 8 until measured.
fn choose_few_rows(amd: bool, family: u32) -> bool {
    amd && family < 0x1a
}

/// Chooses every stream's hint and [`few_rows`] from the CPU and `KRAFLA_PREFETCH`, once
/// per process (later calls return at once). The kernel table calls it when it is
/// built, so that [`line`] never has to: a call inside a kernel, even one never taken,
/// makes LLVM save live zmm registers to the stack around it (all are caller-saved).
/// With one, the block types' VNNI kernels held 5924 zmm stores to the stack, without it
/// 1786 (decode speed the same within noise).
pub fn choose_all() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let (amd, family) = cpu();
        let asked = std::env::var("KRAFLA_PREFETCH").ok();
        for s in Stream::ALL {
            let h = choose(s, amd, family, asked.as_deref());
            HINTS[s as usize].store(h as u8, Relaxed);
        }
        FEW_ROWS.store(choose_few_rows(amd, family), Relaxed);
    });
}

/// Stream `s`'s hint in this process ([`choose_all`]).
pub fn hint(s: Stream) -> Hint {
    choose_all();
    Hint::from_code(HINTS[s as usize].load(Relaxed))
}

/// Whether BF16/F16 decode micro-tiles take 2 rows ([`choose_few_rows`]; chosen by
/// [`choose_all`]); the bits do not depend on it (every output is its own chain).
pub fn few_rows() -> bool {
    choose_all();
    FEW_ROWS.load(Relaxed)
}

/// Sets [`few_rows`] (tests: both micro-tiles must give the same bits).
#[cfg(test)]
pub(super) fn set_few_rows(few: bool) {
    choose_all();
    FEW_ROWS.store(few, Relaxed);
}

/// Prefetches the line at `p` with stream `S`'s hint ([`choose_all`] has run; before it,
/// `T1`): one relaxed load and a predictable branch more than a fixed hint, and no call.
#[inline(always)]
pub(super) fn line<const S: u8>(p: *const u8) {
    let p = p as *const i8;
    // SAFETY: a prefetch never faults, even past the end of a buffer; SSE is baseline.
    unsafe {
        match HINTS[S as usize].load(Relaxed) {
            1 => _mm_prefetch::<_MM_HINT_NTA>(p),
            2 => _mm_prefetch::<_MM_HINT_T0>(p),
            4 => _mm_prefetch::<_MM_HINT_T2>(p),
            _ => _mm_prefetch::<_MM_HINT_T1>(p),
        }
    }
}

/// How far ahead a decode call of the BF16 / F16 kernels (`half`, `bf16dot`) prefetches
/// the weights it streams: 1 KiB per row of an
/// 8-row micro-tile. 4 KiB took 1.04-1.06x the time of the products in llama1b BF16
/// decode and 16 KiB 1.02x (alternating steps of one process); SmolLM2 and Gemma 3
/// were the same within 1%.
const PF_DIST: usize = 8192;

/// Prefetches, for each of the `R` rows of a micro-tile at `w` (`rb` bytes each, adjacent),
/// the line `PF_DIST / R` bytes ahead of column byte `at` in that row, or, past the row's
/// end, at that offset in the row `R` (or a multiple) below: the next micro-tile's, which
/// the stream reaches next. The tile reads its rows side by side, R streams `rb` bytes
/// apart, so one pointer running `PF_DIST` ahead through the tile's range (as the packed
/// kernels' single stream does) would mostly land on lines already being read: with
/// 2048-column rows it was one row ahead, the very line loaded in the same step.
#[inline(always)]
pub(super) fn rows<const R: usize>(w: *const u8, rb: usize, at: usize) {
    let ahead = at + PF_DIST / R;
    let (down, off) = (ahead / rb * R, ahead % rb);
    for r in 0..R {
        let p = w.wrapping_add((r + down) * rb + off);
        // The hint is the CPU's for row streams (`x86::prefetch`): NTA on Zen 5 (llama1b
        // BF16 decode 1.10x of T1, which was 1.13-1.45x of T0), T1 on Zen 4 (1.41-1.51x
        // of NTA on SmolLM2 and Gemma 3).
        line::<ROWS>(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zen5_takes_nta_zen4_nta_for_q4_0_only_and_the_rest_t1() {
        for s in Stream::ALL {
            assert_eq!(choose(s, true, 0x1a, None), Hint::Nta);
            assert_eq!(choose(s, true, 0x1b, None), Hint::Nta);
            // An Intel family 6 core, and a family number that only AMD's would be NTA.
            assert_eq!(choose(s, false, 6, None), Hint::T1);
            assert_eq!(choose(s, false, 0x1a, None), Hint::T1);
        }
        assert_eq!(choose(Stream::Packed, true, 0x19, None), Hint::Nta);
        assert_eq!(choose(Stream::Blocks, true, 0x19, None), Hint::T1);
        assert_eq!(choose(Stream::Rows, true, 0x19, None), Hint::T1);
        assert_eq!(choose(Stream::Rows, true, 0x17, None), Hint::T1);
    }

    #[test]
    fn zen4_and_earlier_amd_decode_few_rows() {
        assert!(choose_few_rows(true, 0x19));
        assert!(choose_few_rows(true, 0x17));
        assert!(!choose_few_rows(true, 0x1a));
        assert!(!choose_few_rows(false, 6));
    }

    #[test]
    fn the_environment_overrides_and_unknown_names_are_ignored() {
        assert_eq!(choose(Stream::Rows, true, 0x19, Some("nta")), Hint::Nta);
        assert_eq!(choose(Stream::Blocks, true, 0x1a, Some(" T1 ")), Hint::T1);
        assert_eq!(choose(Stream::Packed, false, 6, Some("t0")), Hint::T0);
        assert_eq!(choose(Stream::Packed, false, 6, Some("t2")), Hint::T2);
        assert_eq!(choose(Stream::Rows, true, 0x1a, Some("l2")), Hint::Nta);
        assert_eq!(choose(Stream::Rows, false, 6, Some("")), Hint::T1);
        for h in Hint::ALL {
            assert_eq!(Hint::from_name(h.name()), Some(h));
        }
    }

    #[test]
    fn each_hint_is_chosen_once_and_kept() {
        for s in Stream::ALL {
            let h = hint(s);
            choose_all();
            assert_eq!(hint(s), h);
            assert_eq!(HINTS[s as usize].load(Relaxed), h as u8);
        }
        line::<ROWS>(std::ptr::null());
        for h in Hint::ALL {
            assert_eq!(Hint::from_code(h as u8), h);
        }
        assert_eq!(Hint::from_code(0), Hint::T1);
    }
}
