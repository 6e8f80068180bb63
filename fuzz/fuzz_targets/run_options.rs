//! What mlb-run does with its options: `--tokens` text through `parse_ids` against an
//! arbitrary vocabulary size, and the sampler with any `--temp`, `--top-k`, `--top-p`
//! and `--seed` that mlb-run's own checks accept, on arbitrary logits (NaN and ±inf
//! included: a hostile model's scales can make them). Ids stay below the vocabulary;
//! a sampled id is inside the logits; never a panic.
//!
//! Input: temp f32, top_p f32, top_k u16, seed u64, n_vocab u32 (little-endian), then
//! the `--tokens` text up to the first NUL, then the logits as f32s.
#![no_main]
use krafla::model::{Sampler, SamplerOptions};
use krafla::tokenizer::parse_ids;
use libfuzzer_sys::fuzz_target;

fn f32_at(d: &[u8], i: usize) -> f32 {
    f32::from_le_bytes(d[i..i + 4].try_into().unwrap())
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 22 {
        return;
    }
    let temp = f32_at(data, 0);
    let top_p = f32_at(data, 4);
    let top_k = u16::from_le_bytes([data[8], data[9]]) as usize;
    let seed = u64::from_le_bytes(data[10..18].try_into().unwrap());
    let n_vocab = u32::from_le_bytes(data[18..22].try_into().unwrap()) as usize;
    let rest = &data[22..];
    let nul = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
    let text = String::from_utf8_lossy(&rest[..nul]);
    if let Ok(ids) = parse_ids(&text, n_vocab) {
        assert!(
            ids.iter().all(|&i| (i as usize) < n_vocab),
            "{ids:?} ≥ {n_vocab}"
        );
    }
    // mlb-run's checks (bin/mlb-run.rs): temp finite ≥ 0, top_p in (0, 1].
    if !(temp >= 0.0 && temp.is_finite() && top_p > 0.0 && top_p <= 1.0) {
        return;
    }
    let logits: Vec<f32> = rest[(nul + 1).min(rest.len())..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    if logits.is_empty() {
        return;
    }
    let mut s = Sampler::new(SamplerOptions {
        temp,
        top_k,
        top_p,
        seed,
        ..SamplerOptions::default()
    });
    for _ in 0..3 {
        let t = s.sample(&logits) as usize;
        assert!(t < logits.len(), "sampled {t} of {}", logits.len());
    }
});
