//! Deterministic values for synthetic weights and tests: xorshift64, seeded.

/// xorshift64 (Marsaglia's 13/7/17 triple); the state must not be 0.
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

    /// `n` standard normal values (Box–Muller), bell-shaped like trained weights.
    pub fn gaussian(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let (u, v) = (1.0 - self.next_f64(), self.next_f64());
                ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
            })
            .collect()
    }
}

/// Relative RMS error ‖x − y‖ / ‖x‖, in f64: how the tests and benches score a quantizer.
pub fn rel_rms(x: &[f32], y: &[f32]) -> f64 {
    let e: f64 = x
        .iter()
        .zip(y)
        .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
        .sum();
    let n: f64 = x.iter().map(|&a| (a as f64).powi(2)).sum();
    (e / n).sqrt()
}
