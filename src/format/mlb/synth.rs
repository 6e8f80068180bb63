//! Synthetic `.mlb` files with seeded random weights, for tests, fuzz seeds and
//! crafted-error cases. Not used by the tools.

use super::header::{wtype, Header};
use super::layout::Kind;
use super::writer::MlbWriter;
use crate::format::WType;
use crate::quant::{quantize, Q4Rule, QuantOpts};

/// A small valid Llama-like header: dim 64, 2 layers, 4 heads, 2 kv heads.
pub fn tiny_header() -> Header {
    let mut h = Header::new();
    h.dim = 64;
    h.n_layers = 2;
    h.n_heads = 4;
    h.n_kv_heads = 2;
    h.hidden_dim = 128;
    h.vocab = 96;
    h.max_seq = 128;
    h.rope_theta = 10000.0;
    h.norm_eps = 1e-5;
    h.wtype = wtype::Q8_0;
    h
}

/// Deterministic values (xorshift64; also the library's unit tests' generator).
pub struct Rng(pub u64);

impl Rng {
    /// The next 64-bit state.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [-1, 1).
    pub fn next_f32(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_f32()).collect()
    }
}

/// Writes a complete file for `h` and `flags` with random weights (norms near 1).
pub fn synth_file(h: &Header, flags: &[u8], seed: u64) -> Vec<u8> {
    let w = MlbWriter::new(Vec::new(), h, flags).expect("valid synthetic header");
    fill(w, h, seed)
}

/// [`synth_file`] for a mixed header: `types` gives every matrix's type in array order.
pub fn synth_mixed(h: &Header, flags: &[u8], types: &[WType], seed: u64) -> Vec<u8> {
    let w = MlbWriter::new_mixed(Vec::new(), h, flags, types).expect("valid synthetic header");
    fill(w, h, seed)
}

fn fill(mut w: MlbWriter<Vec<u8>>, h: &Header, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed | 1);
    let opts = QuantOpts {
        scale_f16: h.scale_f16 != 0,
        q4_rule: Q4Rule::Round,
        imatrix: None,
    };
    while let Some(t) = w.next_tensor().copied() {
        match t.kind {
            Kind::F32 { len } => {
                let v: Vec<f32> = rng.vec(len).iter().map(|x| 1.0 + 0.1 * x).collect();
                w.write_f32(&v).unwrap();
            }
            Kind::Mat {
                wtype, rows, cols, ..
            } => {
                let x = rng.vec(rows * cols);
                let m = quantize(wtype, rows, cols, &x, &opts).unwrap();
                w.write_mat(&m).unwrap();
            }
            Kind::U8 { .. } => {
                unreachable!("the writer writes the layer flags and the type table itself")
            }
        }
    }
    w.finish().unwrap()
}
