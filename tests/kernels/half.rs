//! f32 activations × BF16 / F16 weights: every tier's kernels through the table
//! (`Kernels::matmul_f32`, `matmul_f32_each`, `project`, `project_each`) against the
//! scalar reference `scalar_half::dot_half`, bit for bit, over the shapes of the fixtures
//! and the real models, prompt and decode tiles, 1–3 threads, and edge values.

use krafla::format::half_float;
use krafla::kernels::counters::{self, Op};
use krafla::kernels::pool::Pool;
use krafla::kernels::scalar::bf16dot::{self as scalar_bf16dot, round_bf16};
use krafla::kernels::scalar::half::{dot_half, reduce_half_lanes, HALF_LANES};
use krafla::kernels::{self, HalfActs, QActs, QMat, Tier, WType, WeightMat};

use crate::util::tiers::{all_kernels, scalar};
use crate::util::{same_f32, Rng};

const TYPES: [WType; 2] = [WType::BF16, WType::F16];

/// Random weights (their bits, as a file stores them: little-endian bytes); `edge` mixes
/// in subnormals, zeros of both signs, the extremes and (with `nonfinite`) inf and NaN.
fn weights(rng: &mut Rng, t: WType, n: usize, edge: bool, nonfinite: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 * n);
    for _ in 0..n {
        let v = rng.unit() * 0.1;
        let b = if !edge {
            half_float::round(t, v)
        } else {
            match rng.below(16) {
                0 => rng.next() as u16 & 0x807F, // BF16 subnormal / F16 small
                1 => (rng.next() as u16 & 0x8000) | 0x3FF, // F16 subnormal / BF16 tiny
                2 => 0x8000,
                3 => half_float::round(t, half_float::max_finite(t) * rng.unit()),
                4 if nonfinite => match t {
                    WType::BF16 => [0x7F80, 0xFF80, 0x7FC0][rng.below(3) as usize],
                    _ => [0x7C00, 0xFC00, 0x7E00][rng.below(3) as usize],
                },
                _ => half_float::round(t, v),
            }
        };
        out.extend_from_slice(&b.to_le_bytes());
    }
    out
}

/// Random activations; `edge`: subnormals, huge values, cancellation, ±0 and (with
/// `nonfinite`) inf and NaN.
fn activations(rng: &mut Rng, n: usize, edge: bool, nonfinite: bool) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let v = rng.unit() * 3.0;
            if !edge {
                return v;
            }
            match rng.below(16) {
                0 => f32::from_bits(rng.next() as u32 & 0x807F_FFFF),
                1 => v * 1e30,
                2 => -0.0,
                3 => v * 1e-38,
                4 if nonfinite => {
                    [f32::INFINITY, f32::NEG_INFINITY, f32::NAN][rng.below(3) as usize]
                }
                _ => v,
            }
        })
        .collect()
}

fn bits16(w: &[u8]) -> Vec<u16> {
    w.chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

/// The reference's `y[t·rows + r]` for the rows `which` (all when `None`).
fn reference(
    t: WType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    which: &[usize],
) -> Vec<(usize, usize, f32)> {
    let wb = bits16(w);
    let n = x.len() / cols;
    let mut out = Vec::new();
    for &r in which {
        for tk in 0..n {
            let d = dot_half(
                t,
                &wb[r * cols..(r + 1) * cols],
                &x[tk * cols..(tk + 1) * cols],
            );
            out.push((tk, r, d));
        }
    }
    let _ = rows;
    out
}

/// Checks `got` (n × rows) against the reference entries; panics with the first
/// differing (token, row) and both bit patterns.
fn check(at: &str, got: &[f32], rows: usize, want: &[(usize, usize, f32)]) {
    for &(tk, r, d) in want {
        let g = got[tk * rows + r];
        assert!(
            same_f32(g, d),
            "{at}: token {tk} row {r}: got {g:e} ({:#010x}), reference {d:e} ({:#010x})",
            g.to_bits(),
            d.to_bits()
        );
    }
}

/// The scalar tier's product of `m` (weights `w`) and `x`, checked against the reference
/// on the rows `which`; returns the reference values and the scalar output.
fn scalar_checked(
    m: &WeightMat,
    w: &[u8],
    x: &[f32],
    which: &[usize],
) -> (Vec<(usize, usize, f32)>, Vec<f32>) {
    let (t, rows, cols) = (m.mat.wtype, m.mat.rows, m.mat.cols);
    let n = x.len() / cols;
    let want = reference(t, w, rows, cols, x, which);
    let mut base = vec![0f32; n * rows];
    scalar().matmul_f32(m, x, &mut base);
    check(
        &format!("{t} {rows}x{cols} n={n} scalar"),
        &base,
        rows,
        &want,
    );
    (want, base)
}

/// Every tier, both types, rows across every micro-tile and task boundary, cols from
/// one step to the real models' widths, 1..=31 tokens (tails of the 6- and 3-token
/// tiles and of the 24-token prefill tile), with and without edge values.
#[test]
fn every_tier_gives_the_reference_bits() {
    let mut rng = Rng::new(1);
    let pools = [Pool::leak(1), Pool::leak(2), Pool::leak(3)];
    let mut checked = 0;
    for t in TYPES {
        for (rows, cols) in [
            (1, 32),
            (3, 64),
            (4, 96),
            (5, 32),
            (7, 576),
            (8, 640),
            (9, 128),
            (17, 1536),
            (33, 2048),
            (65, 64),
            (130, 576),
            (576, 576),
            (1536, 576),
            (576, 1536),
            (640, 640),
            (2048, 640),
            (640, 2048),
            (1100, 160),
        ] {
            for n in [1, 2, 3, 5, 6, 7, 13, 25, 31] {
                if rows * cols * n > 6_000_000 && n > 7 {
                    continue;
                }
                let edge = rng.below(3) == 0;
                let w = weights(&mut rng, t, rows * cols, edge, false);
                let x = activations(&mut rng, n * cols, edge, false);
                let m = WeightMat::from(QMat::new_half(t, rows, cols, &w).unwrap());
                let which = checked_rows(rows, 37, 9);
                let (want, base) = scalar_checked(&m, &w, &x, &which);
                for k in all_kernels() {
                    for (threads, pool) in pools.iter().enumerate() {
                        let mut y = vec![f32::NAN; n * rows];
                        pool.install(|| k.matmul_f32(&m, &x, &mut y));
                        let at = format!(
                            "{t} {rows}x{cols} n={n} tier {} {} threads",
                            k.tier(),
                            threads + 1
                        );
                        check(&at, &y, rows, &want);
                        // Every output, against the scalar tier.
                        for (i, (&a, &b)) in y.iter().zip(&base).enumerate() {
                            assert!(same_f32(a, b), "{at}: output {i}: {a:e} vs scalar {b:e}");
                        }
                        checked += 1;
                    }
                }
            }
        }
    }
    eprintln!("{checked} products checked");
}

/// BF16 activations (`HalfActs::Bf16`, docs/kernels.md "BF16 activations"): every
/// tier's `matmul_f32` under the option, `project_each` and `matmul_bf16` on the rounded
/// input give `scalar_bf16dot::dot`'s bits at every output (`vdpbf16ps` on avx512bf16,
/// the emulations on avx512 / avx512vnni and avx2): rows across the micro-tiles
/// (8 × 1 decode, 4 × 6 prefill; 4 × 1 and 2 × 3 emulated) and task tails, 1–31 tokens (one prefetching tile up to
/// 6), 1–3 threads, a third of the cases with edge values (subnormal weights and
/// activations, products below the normal range, ±0, huge values), and the
/// vocabulary-sized and FFN shapes of the real models on sampled rows.
#[test]
fn bf16_activations_give_the_reference_bits() {
    let mut rng = Rng::new(7);
    let pools = [Pool::leak(1), Pool::leak(2), Pool::leak(3)];
    let mut checked = 0;
    let shapes = [
        (1, 32, &[1usize, 2, 6, 7][..]),
        (3, 64, &[1, 3, 5, 13][..]),
        (4, 96, &[1, 6, 7, 25][..]),
        (5, 32, &[2, 6, 12, 31][..]),
        (9, 576, &[1, 4, 6, 7, 13][..]),
        (17, 1536, &[1, 6, 19][..]),
        (33, 2048, &[1, 2, 7][..]),
        (130, 576, &[1, 6, 25][..]),
        (576, 576, &[1, 13][..]),
        (640, 2048, &[1, 7][..]),
        (8192, 2048, &[1, 7][..]),
        (49152, 576, &[1][..]),
    ];
    for (rows, cols, ns) in shapes {
        for &n in ns {
            let edge = rng.below(3) == 0;
            let w = weights(&mut rng, WType::BF16, rows * cols, edge, false);
            let x = activations(&mut rng, n * cols, edge, false);
            let xb: Vec<u16> = x.iter().map(|&v| round_bf16(v)).collect();
            let m = WeightMat::from(QMat::new_half(WType::BF16, rows, cols, &w).unwrap());
            let wb = bits16(&w);
            let which = checked_rows(rows, 211, 9);
            let mut want = Vec::new();
            for &r in &which {
                for tk in 0..n {
                    let d = scalar_bf16dot::dot(
                        &wb[r * cols..(r + 1) * cols],
                        &xb[tk * cols..(tk + 1) * cols],
                    );
                    want.push((tk, r, d));
                }
            }
            let mut base = vec![0f32; n * rows];
            scalar()
                .with_half_acts(HalfActs::Bf16)
                .matmul_f32(&m, &x, &mut base);
            check(&format!("{rows}x{cols} n={n} scalar"), &base, rows, &want);
            for k in all_kernels() {
                let k = k.with_half_acts(HalfActs::Bf16);
                for (threads, pool) in pools.iter().enumerate() {
                    let at = format!(
                        "BF16 acts {rows}x{cols} n={n} tier {} {} threads",
                        k.tier(),
                        threads + 1
                    );
                    let mut y = vec![f32::NAN; n * rows];
                    let mut y2 = vec![f32::NAN; n * rows];
                    let mut y3 = vec![f32::NAN; n * rows];
                    pool.install(|| {
                        k.matmul_f32(&m, &x, &mut y);
                        k.matmul_bf16(&m, &xb, &mut y2);
                        k.project_each(&[&m], &x, &mut QActs::new(), &mut [&mut y3]);
                    });
                    check(&at, &y, rows, &want);
                    for (i, ((&a, &b), (&c, &d))) in
                        y.iter().zip(&base).zip(y2.iter().zip(&y3)).enumerate()
                    {
                        assert!(
                            same_f32(a, b) && same_f32(c, b) && same_f32(d, b),
                            "{at}: output {i}: {a:e} / {c:e} / {d:e} vs scalar {b:e}"
                        );
                    }
                    checked += 1;
                }
            }
        }
    }
    eprintln!("{checked} products checked");
}

/// BF16 activations near the bottom of the normal range: weights and activations of
/// 2^-80 to 2^-50 with random signs, so that products and lane sums cross 2^-126 both
/// ways and flushing decides the result. Every tier (the emulations' compare-and-redo
/// path above all) against `scalar_bf16dot::dot`, decode and prefill tiles.
#[test]
fn bf16_activations_flush_as_the_reference() {
    let mut rng = Rng::new(8);
    let mut tiny = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                let e = -80 + rng.below(31) as i32;
                let s = if rng.below(2) == 0 { 1.0 } else { -1.0 };
                s * (1.0 + rng.unit().abs()) * 2f32.powi(e)
            })
            .collect()
    };
    let mut flushed = 0;
    for (rows, cols, n) in [(9, 64, 1), (9, 64, 3), (17, 96, 7), (8, 32, 13)] {
        let wf = tiny(rows * cols);
        let x = tiny(n * cols);
        let w: Vec<u8> = wf
            .iter()
            .flat_map(|&v| round_bf16(v).to_le_bytes())
            .collect();
        let xb: Vec<u16> = x.iter().map(|&v| round_bf16(v)).collect();
        let wb = bits16(&w);
        let m = WeightMat::from(QMat::new_half(WType::BF16, rows, cols, &w).unwrap());
        let mut want = Vec::new();
        for r in 0..rows {
            for tk in 0..n {
                let d = scalar_bf16dot::dot(
                    &wb[r * cols..(r + 1) * cols],
                    &xb[tk * cols..(tk + 1) * cols],
                );
                // The same order without the flush (IEEE subnormals).
                let f = |b: u16| f32::from_bits((b as u32) << 16);
                let mut acc = [0f32; HALF_LANES];
                for p in 0..cols / 2 {
                    let (wr, xr) = (&wb[r * cols + 2 * p..], &xb[tk * cols + 2 * p..]);
                    let a = f(wr[1]).mul_add(f(xr[1]), acc[p % HALF_LANES]);
                    acc[p % HALF_LANES] = f(wr[0]).mul_add(f(xr[0]), a);
                }
                flushed += usize::from(reduce_half_lanes(acc).to_bits() != d.to_bits());
                want.push((tk, r, d));
            }
        }
        for k in all_kernels() {
            let mut y = vec![f32::NAN; n * rows];
            k.with_half_acts(HalfActs::Bf16).matmul_f32(&m, &x, &mut y);
            check(
                &format!("tiny {rows}x{cols} n={n} tier {}", k.tier()),
                &y,
                rows,
                &want,
            );
        }
    }
    // The data reaches the flush: it changes some outputs.
    assert!(flushed > 0, "the flush changed no output");
    eprintln!("{flushed} outputs changed by the flush");
}

/// The rows a test checks against the reference: all of up to 130 rows, else every
/// `every`th row and the last `last`.
fn checked_rows(rows: usize, every: usize, last: usize) -> Vec<usize> {
    if rows <= 130 {
        (0..rows).collect()
    } else {
        (0..rows)
            .filter(|r| r % every == 0 || r + last >= rows)
            .collect()
    }
}

/// The vocabulary-sized classifiers (SmolLM2 49152 × 576; Gemma 3's 262144 rows, here
/// with 64 columns) and Llama 3.2 1B's FFN (8192 × 2048): decode and a short prompt,
/// every tier against the scalar tier everywhere and the reference on sampled rows.
#[test]
fn large_shapes() {
    let mut rng = Rng::new(2);
    for (t, rows, cols, ns) in [
        (WType::BF16, 49152, 576, &[1usize, 3][..]),
        (WType::F16, 262144, 64, &[1, 2][..]),
        (WType::BF16, 8192, 2048, &[1, 7][..]),
        (WType::F16, 2048, 8192, &[1][..]),
    ] {
        let w = weights(&mut rng, t, rows * cols, false, false);
        let m = WeightMat::from(QMat::new_half(t, rows, cols, &w).unwrap());
        for &n in ns {
            let x = activations(&mut rng, n * cols, false, false);
            let which = checked_rows(rows, 1009, 5);
            let (_, base) = scalar_checked(&m, &w, &x, &which);
            for k in all_kernels() {
                for pool in [Pool::leak(1), Pool::leak(3)] {
                    let mut y = vec![0f32; n * rows];
                    pool.install(|| k.matmul_f32(&m, &x, &mut y));
                    let at = format!("{t} {rows}x{cols} n={n} tier {}", k.tier());
                    assert!(
                        y.iter().zip(&base).all(|(&a, &b)| same_f32(a, b)),
                        "{at}: differs from scalar"
                    );
                }
            }
        }
    }
}

/// Infinities and NaN in weights and activations: NaN where IEEE gives NaN (inf − inf,
/// inf · 0, a NaN operand), the same infinities elsewhere, on every tier.
#[test]
fn infinities_and_nan() {
    let mut rng = Rng::new(3);
    for t in TYPES {
        for case in 0..40 {
            let (rows, cols, n) = (9, 96, 1 + case % 7);
            let w = weights(&mut rng, t, rows * cols, true, case % 2 == 0);
            let x = activations(&mut rng, n * cols, true, case % 2 == 1);
            let m = WeightMat::from(QMat::new_half(t, rows, cols, &w).unwrap());
            let want = reference(t, &w, rows, cols, &x, &(0..rows).collect::<Vec<_>>());
            assert!(
                want.iter().any(|e| !e.2.is_finite()),
                "case {case}: the data must reach a non-finite output"
            );
            for k in all_kernels() {
                let mut y = vec![0f32; n * rows];
                k.matmul_f32(&m, &x, &mut y);
                check(
                    &format!("{t} case {case} tier {}", k.tier()),
                    &y,
                    rows,
                    &want,
                );
            }
        }
    }
}

/// Hand-made columns where the lane, the order within a lane, the fused multiply-add
/// and the reduction tree each change the result: a kernel that gets any of them wrong
/// fails here (the reference is tested against the same values in `scalar_half`).
#[test]
fn lane_order_and_fma_are_the_contract() {
    let cols = 64;
    let one = |t: WType| half_float::round(t, 1.0);
    for t in TYPES {
        // Lane 0 holds columns 0, 16, 32, 48: (1e8 + 1) − 1e8 + 0.5 = 0.5 in order.
        let mut w = vec![0u16; cols];
        let mut x = vec![0f32; cols];
        for (c, v) in [(0, 1e8f32), (16, 1.0), (32, -1e8), (48, 0.5)] {
            (w[c], x[c]) = (one(t), v);
        }
        // Lanes 3 and 11 cancel before the tree: (1e8 + −1e8) then + 3.
        for (c, v) in [(3, 1e8f32), (11, -1e8), (5, 3.0)] {
            (w[c], x[c]) = (one(t), v);
        }
        // A product that a separate multiply would round: (1 + 2^-7) · (1 − 2^-7 + 2^-20).
        let (wb, xv) = (
            half_float::round(t, 1.0 + 2f32.powi(-7)),
            1.0 - 2f32.powi(-7) + 2f32.powi(-20),
        );
        (w[2], x[2]) = (wb, xv);
        (w[18], x[18]) = (one(t), -1.0);
        let bytes: Vec<u8> = w.iter().flat_map(|b| b.to_le_bytes()).collect();
        let want = dot_half(t, &w, &x);
        let m = WeightMat::from(QMat::new_half(t, 1, cols, &bytes).unwrap());
        for k in all_kernels() {
            let mut y = [0f32];
            k.matmul_f32(&m, &x, &mut y);
            assert_eq!(y[0].to_bits(), want.to_bits(), "{t} tier {}", k.tier());
        }
        let naive: f32 = w
            .iter()
            .zip(&x)
            .map(|(&b, &v)| half_float::to_f32(t, b) * v)
            .sum();
        assert_ne!(
            naive.to_bits(),
            want.to_bits(),
            "{t}: the case must tell orders apart"
        );
    }
}

/// `project` / `project_each`: f32 rows for BF16 / F16 matrices (the same bits as
/// `matmul_f32`), Q8_0 activations for the quantized ones, and in a mix each matrix as
/// it would be alone; the activations are quantized only when some matrix needs them.
#[test]
fn project_each_mixes_kinds() {
    let mut rng = Rng::new(4);
    let (cols, n) = (64, 5);
    let x = activations(&mut rng, n * cols, false, false);
    let wb = weights(&mut rng, WType::BF16, 48 * cols, false, false);
    let wf = weights(&mut rng, WType::F16, 32 * cols, false, false);
    let xs = activations(&mut rng, 16 * cols, false, false);
    let q = krafla::quant::quantize(
        WType::Q8_0,
        16,
        cols,
        &xs,
        &krafla::quant::QuantOptions::default(),
    )
    .unwrap();
    let (mb, mf, mq) = (
        WeightMat::from(QMat::new_half(WType::BF16, 48, cols, &wb).unwrap()),
        WeightMat::from(QMat::new_half(WType::F16, 32, cols, &wf).unwrap()),
        WeightMat::from(q.view()),
    );
    for k in all_kernels() {
        let (mut yb, mut yf, mut yq) = (vec![0f32; n * 48], vec![0f32; n * 32], vec![0f32; n * 16]);
        let mut qa = QActs::new();
        k.project_each(
            &[&mb, &mq, &mf],
            &x,
            &mut qa,
            &mut [&mut yb, &mut yq, &mut yf],
        );
        let mut want_b = vec![0f32; n * 48];
        k.matmul_f32(&mb, &x, &mut want_b);
        let mut want_f = vec![0f32; n * 32];
        k.matmul_f32(&mf, &x, &mut want_f);
        let mut xa = QActs::new();
        k.quantize_acts(&x, cols, &mut xa);
        let mut want_q = vec![0f32; n * 16];
        k.matmul(&mq, &xa, &mut want_q);
        assert!(
            yb == want_b && yf == want_f && yq == want_q,
            "tier {}",
            k.tier()
        );
        assert_eq!(qa.n(), n, "the quantized matrix got its activations");
        // Only 2-byte float matrices: nothing is quantized.
        let mut qa = QActs::new();
        k.project_each(&[&mb, &mf], &x, &mut qa, &mut [&mut yb, &mut yf]);
        assert_eq!(
            qa.n(),
            0,
            "tier {}: quantized an input no matrix needs",
            k.tier()
        );
        let mut y1 = vec![0f32; n * 48];
        k.project(&mb, &x, &mut qa, &mut y1);
        assert!(y1 == want_b && qa.n() == 0);
    }
}

/// Each tier's entries count under their own tier: the scalar tier runs only scalar
/// code, the SIMD tiers run SIMD code (AVX2 on the avx2 tier, AVX-512 F on both
/// AVX-512 tiers) and no scalar kernel.
#[test]
fn half_kernels_count_under_their_tier() {
    if crate::util::skip_without_counters() {
        return;
    }
    let mut rng = Rng::new(5);
    let w = weights(&mut rng, WType::BF16, 8 * 64, false, false);
    let x = activations(&mut rng, 3 * 64, false, false);
    let m = WeightMat::from(QMat::new_half(WType::BF16, 8, 64, &w).unwrap());
    for k in all_kernels() {
        counters::take();
        let mut y = vec![0f32; 3 * 8];
        Pool::leak(1).install(|| k.matmul_f32(&m, &x, &mut y));
        let c = counters::take();
        let expect = match k.tier() {
            Tier::Avx512Vnni | Tier::Avx512Bf16 => Tier::Avx512,
            t => t,
        };
        assert!(c.get(expect, Op::Half) > 0, "tier {}: {c:?}", k.tier());
        assert_eq!(c.of_tier(expect), c.get(expect, Op::Half), "{c:?}");
        for t in kernels::supported_tiers()
            .into_iter()
            .filter(|&t| t != expect)
        {
            assert_eq!(c.of_tier(t), 0, "tier {} ran {t} code: {c:?}", k.tier());
        }
    }
}

#[test]
fn new_half_checks_shapes() {
    let w = vec![0u8; 2 * 4 * 32];
    assert!(QMat::new_half(WType::BF16, 4, 32, &w).is_ok());
    assert!(QMat::new_half(WType::F16, 4, 32, &w).is_ok());
    assert!(QMat::new_half(WType::Q8_0, 4, 32, &w).is_err());
    assert!(QMat::new_half(WType::BF16, 2, 32, &w).is_err());
    assert!(QMat::new_half(WType::BF16, 4, 16, &w[..128]).is_err());
    assert!(QMat::new_half(WType::BF16, 0, 32, &[]).is_err());
}
