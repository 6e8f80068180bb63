//! Helpers shared by the integration tests: the one test kit. `tool::tool` runs a
//! binary (`.ok()`, `.fails()`), `fixtures` builds and converts the fixtures, and
//! `first_diff` compares bits.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Output;

pub mod fixtures;
pub mod schema;
pub mod tiers;
pub mod tool;

/// The bits of `x`, every NaN as one value: which NaN operand propagates is not fixed by
/// Rust or LLVM (it may commute `a + b`), so NaN sign and payload are outside the
/// kernels' contract (docs/kernels.md). At opt-level 1 the scalar and AVX2 attention
/// gave NaNs of different signs.
pub fn nan_bits(x: f32) -> u32 {
    if x.is_nan() {
        f32::NAN.to_bits()
    } else {
        x.to_bits()
    }
}

/// `a` and `b` are the same value to the bit, or both NaN.
pub fn same_f32(a: f32, b: f32) -> bool {
    nan_bits(a) == nan_bits(b)
}

/// Values the tests compare bit for bit: an f32 by its bits (so -0.0 is not 0.0, and a NaN
/// equals only the same NaN), an integer as it is.
pub trait Bits: Copy {
    fn bits(self) -> u64;
}

impl Bits for f32 {
    fn bits(self) -> u64 {
        self.to_bits() as u64
    }
}

impl Bits for u8 {
    fn bits(self) -> u64 {
        self as u64
    }
}

impl Bits for u32 {
    fn bits(self) -> u64 {
        self as u64
    }
}

/// The first index where `a` and `b` differ in bits (the shorter length if one is a
/// prefix of the other); `None` when they are the same.
pub fn first_diff<T: Bits>(a: &[T], b: &[T]) -> Option<usize> {
    match a.iter().zip(b).position(|(x, y)| x.bits() != y.bits()) {
        Some(i) => Some(i),
        None if a.len() != b.len() => Some(a.len().min(b.len())),
        None => None,
    }
}

/// The path of one of the package's binaries.
pub fn bin_path(name: &str) -> PathBuf {
    match name {
        "mlb-inspect" => PathBuf::from(env!("CARGO_BIN_EXE_mlb-inspect")),
        "mlb-convert" => PathBuf::from(env!("CARGO_BIN_EXE_mlb-convert")),
        "mlt-convert" => PathBuf::from(env!("CARGO_BIN_EXE_mlt-convert")),
        "mlb-run" => PathBuf::from(env!("CARGO_BIN_EXE_mlb-run")),
        "mlb-export" => PathBuf::from(env!("CARGO_BIN_EXE_mlb-export")),
        "mlb-serve" => PathBuf::from(env!("CARGO_BIN_EXE_mlb-serve")),
        _ => panic!("unknown binary {name}"),
    }
}

/// The repository's testdata folder.
pub fn testdata() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// FNV-1a of `b`: the determinism tests compare the hashes of outputs.
pub fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100000001b3)
    })
}

/// Whether a test of the kernels' call counters cannot run (they need debug
/// assertions); says SKIP if so.
pub fn skip_without_counters() -> bool {
    if !krafla::kernels::counters::ENABLED {
        eprintln!("SKIP: call counters need debug assertions");
    }
    !krafla::kernels::counters::ENABLED
}

/// xorshift64*: small, deterministic test data for the kernel tests.
pub struct Rng(pub u64);

impl Rng {
    /// A generator whose state is `seed` mixed (never zero).
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Issue 42's hostile chat templates: each once aborted a tool (a 4 GB allocation, a
/// stack overflow) or took GiBs; under the render budget each is a clean error. One per
/// line of testdata/hostile_templates.txt (the fuzz seeds read the same file).
pub fn hostile_templates() -> Vec<&'static str> {
    let v: Vec<_> = include_str!("../../testdata/hostile_templates.txt")
        .lines()
        .collect();
    assert_eq!(
        v.len(),
        8,
        "testdata/hostile_templates.txt: one template per line"
    );
    v
}

#[test]
fn first_diff_compares_bits_and_lengths() {
    assert_eq!(first_diff(&[1.0f32, 0.0], &[1.0, -0.0]), Some(1));
    assert_eq!(first_diff(&[f32::NAN], &[f32::NAN]), None);
    assert_eq!(first_diff(&[1u8, 2], &[1, 2, 3]), Some(2));
    assert_eq!(first_diff::<u32>(&[], &[]), None);
}
