//! The Q8_0 / Q4_0 matrix products (`kernels/scalar/tiles.rs` and its SIMD twins): every
//! tier against the scalar reference (bit for bit), row-major and packed, f16 scales;
//! the reference against a naive f64 dot product; independence from the thread count.

use krafla::kernels::pool::Pool;
use krafla::kernels::{self, Kernels, PackedMat, QActs, QMat, Tier, WType, WeightMat};
use krafla::quant::{dequant_mat_row, QK};

use crate::util::tiers::{all_kernels, scalar};
use crate::util::{first_diff, Rng};

/// Random weights; `edge` mixes in extreme levels and scales.
pub(super) fn weights(
    rng: &mut Rng,
    wtype: WType,
    rows: usize,
    cols: usize,
    edge: bool,
) -> (Vec<u8>, Vec<f32>) {
    let q: Vec<u8> = (0..rows * wtype.row_bytes(cols))
        .map(|_| match wtype {
            WType::Q8_0 => {
                let v = if edge && rng.below(4) == 0 {
                    [127i8, -127, 0][rng.below(3) as usize]
                } else {
                    (rng.below(255) as i32 - 127) as i8
                };
                v as u8
            }
            WType::Q4_0 => rng.next() as u8,
            t => unreachable!("{t} has no quantized kernel"),
        })
        .collect();
    let d = (0..rows * cols / QK)
        .map(|_| {
            let base = rng.unit() * 0.02;
            if !edge {
                return base;
            }
            match rng.below(8) {
                0 => -base.abs() * 3.0,
                1 => 0.0,
                2 => 1e-40 * rng.unit(),
                3 => 1e30 * rng.unit(),
                _ => base,
            }
        })
        .collect();
    (q, d)
}

/// Random activations; `edge` makes blocks of special cases.
pub(super) fn activations(rng: &mut Rng, len: usize, edge: bool) -> Vec<f32> {
    let mut x: Vec<f32> = (0..len).map(|_| rng.unit() * 4.0).collect();
    if !edge {
        return x;
    }
    for blk in x.chunks_exact_mut(QK) {
        match rng.below(12) {
            0 => blk.fill(0.0),
            1 => blk.iter_mut().for_each(|v| *v *= 1e-31),
            2 => {
                // amax 127 makes id = 1: values k + 0.5 sit exactly on the rounding tie.
                blk.iter_mut().for_each(|v| *v = (*v * 20.0).trunc() + 0.5);
                blk[0] = 127.0;
                blk[1] = -126.5;
            }
            3 => blk.iter_mut().for_each(|v| *v *= 1e37),
            4 => blk.iter_mut().for_each(|v| *v *= 1e-39),
            5 => {
                blk[rng.below(32) as usize] = f32::NAN;
                blk[rng.below(32) as usize] = -f32::NAN;
            }
            6 => blk.fill(f32::NAN),
            7 => blk[rng.below(32) as usize] = f32::INFINITY,
            8 => {
                blk[0] = -3.0;
                blk.iter_mut()
                    .skip(1)
                    .for_each(|v| *v = 3.0 * (*v).signum());
            }
            9 => blk.iter_mut().for_each(|v| *v = -*v * 1e-29),
            _ => {}
        }
    }
    x
}

/// Every tier's matmul against the scalar's, bits compared.
fn check_matmul(rng: &mut Rng, wtype: WType, rows: usize, cols: usize, n: usize, edge: bool) {
    let (q, d) = weights(rng, wtype, rows, cols, edge);
    let w = WeightMat::from(QMat::new(wtype, rows, cols, &q, &d).unwrap());
    let x = activations(rng, n * cols, edge);
    let s = scalar();
    let mut xa = QActs::new();
    s.quantize_acts(&x, cols, &mut xa);
    let mut y0 = vec![0f32; n * rows];
    s.matmul(&w, &xa, &mut y0);
    for k in all_kernels() {
        let mut y = vec![f32::NAN; n * rows];
        k.matmul(&w, &xa, &mut y);
        if let Some(i) = first_diff(&y, &y0) {
            let (t, r) = (i / rows, i % rows);
            panic!(
                "tier {} {wtype:?} {rows}x{cols} n={n} edge={edge}: token {t} row {r}: {} ({:#x}) vs scalar {} ({:#x})",
                k.tier(),
                y[i],
                y[i].to_bits(),
                y0[i],
                y0[i].to_bits()
            );
        }
        check_packed(&k, &w.mat, &xa, &y0);
        if n == 1 {
            let mut yv = vec![f32::NAN; rows];
            k.matvec(&w, &xa, &mut yv);
            assert_eq!(
                first_diff(&yv, &y0),
                None,
                "tier {} matvec {rows}x{cols}",
                k.tier()
            );
        }
    }
}

/// On tiers with packed kernels: the packed form of `w` gives `y0`'s bits, and so does
/// the packed form of `w` with f16 scales against the scalar result of that matrix.
fn check_packed(k: &Kernels, w: &QMat, xa: &QActs, y0: &[f32]) {
    if !k.packs() {
        return;
    }
    let desc = format!(
        "tier {} packed {:?} {}x{} n={}",
        k.tier(),
        w.wtype,
        w.rows,
        w.cols,
        xa.n()
    );
    let p = PackedMat::new(w).unwrap();
    let wp = WeightMat::from(*w).with_packed(&p).unwrap();
    let mut y = vec![f32::NAN; y0.len()];
    k.matmul(&wp, xa, &mut y);
    if let Some(i) = first_diff(&y, y0) {
        panic!("{desc}: output {i}: {} vs scalar {}", y[i], y0[i]);
    }
    let d16: Vec<u16> =
        w.d.iter()
            .map(|&v| half::f16::from_f32(v).to_bits())
            .collect();
    let w16 = QMat::new_f16(w.wtype, w.rows, w.cols, w.q, &d16).unwrap();
    let mut r16 = vec![f32::NAN; y0.len()];
    scalar().matmul(&w16.into(), xa, &mut r16);
    let p16 = PackedMat::new(&w16).unwrap();
    let wp16 = WeightMat::from(w16).with_packed(&p16).unwrap();
    k.matmul(&wp16, xa, &mut y);
    if let Some(i) = first_diff(&y, &r16) {
        panic!(
            "{desc} f16 scales: output {i}: {} vs scalar {}",
            y[i], r16[i]
        );
    }
    assert!(
        WeightMat::from(*w).with_packed(&p16).is_err(),
        "{desc}: f16 packing taken for f32 scales"
    );
    // Rows read back from the packed copy (embeddings): the map's values.
    for (m, pm) in [(w, &wp), (&w16, &wp16)] {
        for r in [0, w.rows / 2, w.rows - 1] {
            let (mut a, mut b) = (vec![0f32; w.cols], vec![1f32; w.cols]);
            dequant_mat_row(m, r, &mut a);
            k.dequant_row(pm, r, &mut b);
            assert_eq!(first_diff(&a, &b), None, "{desc}: dequant_row {r}");
        }
    }
}

#[test]
fn matmul_tiers_agree_random() {
    let mut rng = Rng::new(3);
    for wtype in [WType::Q8_0, WType::Q4_0] {
        for &rows in &[1, 7, 8, 9, 16, 33] {
            for &cols in &[32, 64, 224, 256, 288, 512, 544, 576, 1056] {
                for n in 1..=13 {
                    check_matmul(&mut rng, wtype, rows, cols, n, false);
                }
            }
        }
    }
}

#[test]
fn matmul_tiers_agree_edge_cases() {
    let mut rng = Rng::new(4);
    for wtype in [WType::Q8_0, WType::Q4_0] {
        for &rows in &[1, 9, 33] {
            for &cols in &[32, 96, 256, 320, 1024] {
                for n in [1, 2, 4, 5, 13] {
                    for _ in 0..3 {
                        check_matmul(&mut rng, wtype, rows, cols, n, true);
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_larger_shapes_agree() {
    let mut rng = Rng::new(5);
    for wtype in [WType::Q8_0, WType::Q4_0] {
        check_matmul(&mut rng, wtype, 200, 576, 1, false);
        check_matmul(&mut rng, wtype, 130, 1536, 7, false);
        check_matmul(&mut rng, wtype, 1100, 64, 3, true);
    }
}

/// Wide rows make a packed task run its groups in several sub-blocks (as many 16-row
/// groups as 256 KiB holds: 4 of Q8_0 at 4096 columns, 6 or 7 of Q4_0), each against two
/// token tiles; on 1 and 2 threads, so that a task holds more groups than a sub-block.
#[test]
fn packed_sub_blocks_agree() {
    let mut rng = Rng::new(15);
    for threads in [1, 2] {
        Pool::leak(threads).install(|| {
            for wtype in [WType::Q8_0, WType::Q4_0] {
                check_matmul(&mut rng, wtype, 1040, 4096, 10, false);
            }
        });
    }
}

/// The contract's result is close to an f64 dot of the dequantized values.
#[test]
fn reference_matches_naive_f64() {
    let mut rng = Rng::new(6);
    for wtype in [WType::Q8_0, WType::Q4_0] {
        let (rows, cols, n) = (17, 800, 3);
        let (q, d) = weights(&mut rng, wtype, rows, cols, false);
        let w = QMat::new(wtype, rows, cols, &q, &d).unwrap();
        let x = activations(&mut rng, n * cols, false);
        let mut xa = QActs::new();
        kernels::quantize_acts(&x, cols, &mut xa);
        let mut y = vec![0f32; n * rows];
        scalar().matmul(&w.into(), &xa, &mut y);
        let mut wr = vec![0f32; cols];
        for r in 0..rows {
            dequant_mat_row(&w, r, &mut wr);
            for t in 0..n {
                let (mut sum, mut mag) = (0f64, 0f64);
                for (c, &wv) in wr.iter().enumerate() {
                    let xv = xa.q()[t * cols + c] as f64 * xa.d()[(t * cols + c) / QK] as f64;
                    sum += wv as f64 * xv;
                    mag += (wv as f64 * xv).abs();
                }
                let got = y[t * rows + r] as f64;
                assert!(
                    (got - sum).abs() <= 1e-6 * mag + 1e-30,
                    "{wtype:?} row {r} token {t}: {got} vs {sum} (mag {mag})"
                );
            }
        }
    }
}

#[test]
fn dequant_row_values() {
    let q8: Vec<u8> = (0..64).map(|i| (i as i8 - 32) as u8).collect();
    let d = [0.5f32, -2.0];
    let w = QMat::new(WType::Q8_0, 1, 64, &q8, &d).unwrap();
    let mut out = vec![0f32; 64];
    dequant_mat_row(&w, 0, &mut out);
    for (c, &o) in out.iter().enumerate() {
        assert_eq!(o, (c as i8 - 32) as f32 * d[c / 32]);
    }
    let q4: Vec<u8> = (0..32).map(|i| (i * 37) as u8).collect();
    let w = QMat::new(WType::Q4_0, 1, 64, &q4, &d).unwrap();
    dequant_mat_row(&w, 0, &mut out);
    for (c, &o) in out.iter().enumerate() {
        let byte = q4[(c / 32) * 16 + c % 16];
        let nib = if c % 32 < 16 { byte & 15 } else { byte >> 4 };
        assert_eq!(o, (nib as i32 - 8) as f32 * d[c / 32]);
    }
}

#[test]
fn thread_count_does_not_change_bits() {
    let mut rng = Rng::new(7);
    for wtype in [WType::Q8_0, WType::Q4_0] {
        let (rows, cols) = (1000, 320);
        let (q, d) = weights(&mut rng, wtype, rows, cols, false);
        let w = WeightMat::from(QMat::new(wtype, rows, cols, &q, &d).unwrap());
        for n in [1, 6] {
            let x = activations(&mut rng, n * cols, false);
            let mut xa = QActs::new();
            kernels::quantize_acts(&x, cols, &mut xa);
            for k in all_kernels() {
                let mut ys = Vec::new();
                for threads in [1, 2, 3] {
                    let mut y = vec![0f32; n * rows];
                    Pool::leak(threads).install(|| k.matmul(&w, &xa, &mut y));
                    ys.push(y);
                }
                assert_eq!(first_diff(&ys[0], &ys[1]), None, "tier {} n {n}", k.tier());
                assert_eq!(first_diff(&ys[0], &ys[2]), None, "tier {} n {n}", k.tier());
            }
        }
    }
}

#[test]
fn with_tier_forces_each_tier() {
    let mut rng = Rng::new(8);
    let (q, d) = weights(&mut rng, WType::Q8_0, 9, 96, false);
    let w = WeightMat::from(QMat::new(WType::Q8_0, 9, 96, &q, &d).unwrap());
    let x = activations(&mut rng, 2 * 96, false);
    for t in kernels::supported_tiers() {
        let y = kernels::with_tier(t, || {
            assert_eq!(kernels::tier(), t);
            let mut xa = QActs::new();
            kernels::quantize_acts(&x, 96, &mut xa);
            let mut y = vec![0f32; 18];
            kernels::matmul(&w, &xa, &mut y);
            y
        })
        .unwrap();
        let mut xa = QActs::new();
        scalar().quantize_acts(&x, 96, &mut xa);
        let mut y0 = vec![0f32; 18];
        scalar().matmul(&w, &xa, &mut y0);
        assert_eq!(first_diff(&y, &y0), None, "tier {t}");
    }
    assert!(kernels::supported_tiers().contains(&kernels::tier()));
}

#[test]
fn views_are_checked() {
    let q = vec![0u8; 64];
    let d = vec![0f32; 2];
    assert!(QMat::new(WType::Q8_0, 1, 64, &q, &d).is_ok());
    assert!(QMat::new(WType::Q8_0, 2, 32, &q, &d).is_ok());
    assert!(QMat::new(WType::Q4_0, 1, 64, &q[..32], &d).is_ok());
    assert!(QMat::new(WType::Q4_0, 1, 64, &q, &d).is_err());
    assert!(QMat::new(WType::Q8_0, 1, 48, &q[..48], &d[..1]).is_err());
    assert!(QMat::new(WType::Q8_0, 0, 64, &[], &[]).is_err());
    assert!(QActs::from_parts(2, 32, vec![0; 64], vec![0.0; 2]).is_ok());
    assert!(QActs::from_parts(2, 32, vec![0; 64], vec![0.0; 3]).is_err());
    assert_eq!(Tier::from_name("AVX2"), Some(Tier::Avx2));
    assert_eq!(Tier::from_name("nope"), None);
}

/// f16 block scales (read as stored, converted per block of rows by the kernels) give
/// the bits of the same scales passed as f32, for matvec, matmul and dequant_row, every
/// tier, row counts that are not multiples of the kernels' sub-blocks; and the f16 view
/// is checked like the f32 one.
#[test]
fn f16_scales_give_the_bits_of_f32_scales() {
    let mut rng = Rng(0x000F_165C_A1E5);
    for (wtype, rows, cols, n) in [
        (WType::Q8_0, 200, 96, 1),
        (WType::Q4_0, 131, 320, 1),
        (WType::Q8_0, 70, 64, 5),
        (WType::Q4_0, 257, 96, 9),
    ] {
        let (q, d) = weights(&mut rng, wtype, rows, cols, false);
        let d16: Vec<u16> = d
            .iter()
            .map(|&v| half::f16::from_f32(v).to_bits())
            .collect();
        let d32: Vec<f32> = d16
            .iter()
            .map(|&b| half::f16::from_bits(b).to_f32())
            .collect();
        let w32 = QMat::new(wtype, rows, cols, &q, &d32).unwrap();
        let w16 = QMat::new_f16(wtype, rows, cols, &q, &d16).unwrap();
        let x = activations(&mut rng, n * cols, false);
        let mut xa = QActs::new();
        kernels::quantize_acts(&x, cols, &mut xa);
        for k in all_kernels() {
            let product = |w: &QMat| {
                let mut y = vec![0f32; n * rows];
                k.matmul(&(*w).into(), &xa, &mut y);
                y
            };
            let (a, b) = (product(&w32), product(&w16));
            assert_eq!(
                first_diff(&a, &b),
                None,
                "tier {} {wtype:?} n={n}",
                k.tier()
            );
        }
        for k in all_kernels() {
            let last_row = |w: &QMat| {
                let mut r = vec![0f32; cols];
                k.dequant_row(&(*w).into(), rows - 1, &mut r);
                r
            };
            assert_eq!(first_diff(&last_row(&w32), &last_row(&w16)), None);
        }
        let mut r = vec![0f32; cols];
        dequant_mat_row(&w16, rows - 1, &mut r);
        let mut r32 = vec![0f32; cols];
        dequant_mat_row(&w32, rows - 1, &mut r32);
        assert_eq!(first_diff(&r32, &r), None);
        assert!(QMat::new_f16(wtype, rows, cols, &q, &d16[1..]).is_err());
    }
}
