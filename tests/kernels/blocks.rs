//! The GGUF block types' kernels (Q4_K, Q5_K, Q6_K, Q4_1, Q5_0, Q5_1, IQ4_NL, Q6_0,
//! MXFP4, Q2_K, Q3_K, IQ4_XS, and the codebook types IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS,
//! IQ2_S, IQ1_M): every tier, row-major and packed (the codebook types have no packed
//! layout), prompt and decode, against the scalar reference (`kernels::scalar_k`) bit for
//! bit; rows read back from the packed copy; pools of 1-3 threads.

use krafla::kernels::pool::Pool;
use krafla::kernels::{self, Kernels, PackedMat, QActs, QMat, WType, WeightMat};
use krafla::quant::blocks::{has_quantizer, is_block_type};
use krafla::quant::codebook::is_codebook;
use krafla::quant::{quantize, QuantOptions, QK};

use crate::util::tiers::{all_kernels, scalar};
use crate::util::{first_diff, Rng};

/// The GGUF block types (Q4_K … IQ1_M), in `WType::ALL`'s order.
fn types() -> impl Iterator<Item = WType> {
    WType::ALL.into_iter().filter(|&t| is_block_type(t))
}

fn f16(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// Offsets of a block's f16 fields (d, and dmin or m where the type has one).
fn f16_fields(t: WType) -> &'static [usize] {
    match t {
        WType::Q4_K | WType::Q5_K | WType::Q4_1 | WType::Q5_1 => &[0, 2],
        WType::Q6_K => &[208],
        WType::Q2_K => &[80, 82],
        WType::Q3_K => &[108],
        // MXFP4's scale is an E8M0 byte, IQ1_M's f16 is spread over four nibbles
        // (`random_blocks` sets them).
        WType::MXFP4 | WType::IQ1_M => &[],
        _ => &[0],
    }
}

/// A rows × cols matrix of type `t` from random bytes, its f16 fields set to finite
/// values: ordinary ones, or with `edge` also 0, ±65504, subnormals and tiny values; with
/// `edge` some blocks have every level at its maximum or at 0.
fn random_blocks(rng: &mut Rng, t: WType, rows: usize, cols: usize, edge: bool) -> Vec<u8> {
    let mut q: Vec<u8> = (0..rows * t.row_bytes(cols))
        .map(|_| rng.next() as u8)
        .collect();
    for blk in q.chunks_exact_mut(t.block_bytes()) {
        if edge {
            match rng.below(6) {
                0 => blk.fill(0xFF),
                1 => blk.fill(0),
                _ => {}
            }
        }
        if t == WType::MXFP4 {
            // Exponents of ordinary weights (2^-28 .. 2^-1), or with `edge` also the
            // subnormal 0 and 1 and the largest, 254.
            blk[0] = if edge && rng.below(3) == 0 {
                [0, 1, 254][rng.below(3) as usize]
            } else {
                100 + rng.below(27) as u8
            };
        }
        let mut scale = || {
            if edge && rng.below(3) == 0 {
                [0.0, 65504.0, -65504.0, 6e-8, -3e-5, 1e-4][rng.below(6) as usize]
            } else {
                rng.unit() * 0.05
            }
        };
        for &at in f16_fields(t) {
            blk[at..at + 2].copy_from_slice(&f16(scale()));
        }
        if t == WType::IQ1_M {
            // d's nibble k in the top nibble of scale word k (bytes 48..56).
            let d = u16::from_le_bytes(f16(scale()));
            for k in 0..4 {
                let at = 48 + 2 * k;
                let w = u16::from_le_bytes([blk[at], blk[at + 1]]) & 0x0fff;
                let w = w | ((d >> (4 * k)) & 15) << 12;
                blk[at..at + 2].copy_from_slice(&w.to_le_bytes());
            }
        }
    }
    q
}

/// Random activations; `edge` makes blocks of special cases (as tests/kernels/tiles.rs).
fn activations(rng: &mut Rng, len: usize, edge: bool) -> Vec<f32> {
    let mut x: Vec<f32> = (0..len).map(|_| rng.unit() * 4.0).collect();
    if edge {
        for blk in x.chunks_exact_mut(QK) {
            match rng.below(10) {
                0 => blk.fill(0.0),
                1 => blk.iter_mut().for_each(|v| *v *= 1e-31),
                2 => blk.iter_mut().for_each(|v| *v *= 1e37),
                3 => blk.iter_mut().for_each(|v| *v *= 1e-39),
                4 => blk[rng.below(32) as usize] = f32::NAN,
                5 => blk[rng.below(32) as usize] = f32::INFINITY,
                6 => {
                    // Every activation at ±127: the largest integer sums.
                    blk[0] = 3.0;
                    blk.iter_mut().skip(1).for_each(|v| *v = 3.0 * v.signum());
                }
                _ => {}
            }
        }
    }
    x
}

/// Every tier, read from the map and packed, matmul and matvec, against the scalar bits.
fn check(w: &QMat, x: &[f32], what: &str) {
    let (rows, cols, n) = (w.rows, w.cols, x.len() / w.cols);
    let s = scalar();
    let mut xa = QActs::new();
    s.quantize_acts(x, cols, &mut xa);
    let mut y0 = vec![0f32; n * rows];
    let wm = WeightMat::from(*w);
    s.matmul(&wm, &xa, &mut y0);
    // The codebook types have no packed layout: their packed row is the map's.
    let p = (!is_codebook(w.wtype)).then(|| PackedMat::new(w).unwrap());
    let wp = match &p {
        Some(p) => wm.with_packed(p).unwrap(),
        None => wm,
    };
    for k in all_kernels() {
        for (m, how) in [(&wm, "map"), (&wp, "packed")] {
            let mut y = vec![f32::NAN; n * rows];
            k.matmul(m, &xa, &mut y);
            if let Some(i) = first_diff(&y, &y0) {
                panic!(
                    "{what}: tier {} {how} {}x{cols} n={n}: token {} row {}: {} ({:#x}) vs scalar {} ({:#x})",
                    k.tier(),
                    rows,
                    i / rows,
                    i % rows,
                    y[i],
                    y[i].to_bits(),
                    y0[i],
                    y0[i].to_bits()
                );
            }
            if n == 1 {
                let mut yv = vec![f32::NAN; rows];
                k.matvec(m, &xa, &mut yv);
                assert_eq!(
                    first_diff(&yv, &y0),
                    None,
                    "{what}: tier {} {how} matvec",
                    k.tier()
                );
            }
        }
    }
    // Rows read back from the packed copy (embedding lookups): the map's values.
    for r in [0, rows / 2, rows - 1] {
        let (mut a, mut b) = (vec![0f32; cols], vec![1f32; cols]);
        krafla::quant::dequant_mat_row(w, r, &mut a);
        s.dequant_row(&wp, r, &mut b);
        assert_eq!(
            first_diff(&a, &b),
            None,
            "{what}: dequant_row {r} from the packed copy"
        );
    }
}

/// The column counts of the brief's shapes that type `t` can hold.
fn widths(t: WType) -> impl Iterator<Item = usize> {
    [256usize, 576, 640, 1536, 2048]
        .into_iter()
        .filter(move |c| c.is_multiple_of(t.block_weights()))
}

/// One random matrix of type `t` ([`random_blocks`]) checked against a fresh batch of
/// activations for each token count in `ns`; `edge` as for both generators.
fn check_random(rng: &mut Rng, t: WType, rows: usize, cols: usize, ns: &[usize], edge: bool) {
    let q = random_blocks(rng, t, rows, cols, edge);
    let w = QMat::new_blocks(t, rows, cols, &q).unwrap();
    let what = if edge {
        format!("{t} edge")
    } else {
        format!("{t}")
    };
    for &n in ns {
        let x = activations(rng, n * cols, edge);
        check(&w, &x, &what);
    }
}

#[test]
fn block_tiers_agree_random_bytes() {
    assert!(types().count() >= 18, "the GGUF block types");
    let mut rng = Rng(0xB10C_5EED);
    for t in types() {
        for cols in widths(t) {
            for rows in [1, 7, 17, 33] {
                check_random(&mut rng, t, rows, cols, &[1, 2, 3, 4, 5, 8, 9], false);
            }
        }
    }
}

#[test]
fn block_tiers_agree_edge_cases() {
    let mut rng = Rng(0xED6E_CA5E);
    for t in types() {
        for cols in widths(t).take(3) {
            for rows in [3, 16, 19] {
                for n in [1, 4, 6] {
                    // Two matrices per shape, each with its own activations.
                    for _ in 0..2 {
                        check_random(&mut rng, t, rows, cols, &[n], true);
                    }
                }
            }
        }
    }
}

/// Quantized matrices (the searching quantizers' output) at the widest shape and a row
/// count that leaves a partial group and sub-block.
#[test]
fn block_tiers_agree_on_quantized_matrices() {
    let mut rng = Rng(0x0DD5_0F7E);
    for t in types().filter(|&t| has_quantizer(t)) {
        let (rows, cols) = (70, 8192);
        let v: Vec<f32> = (0..rows * cols).map(|_| rng.unit() * 0.05).collect();
        let m = quantize(t, rows, cols, &v, &QuantOptions::default()).unwrap();
        let w = QMat::new_blocks(t, rows, cols, &m.q).unwrap();
        // 20 tokens: three tiles of the packed products (8, 8, 4), over two sub-blocks
        // of groups.
        for n in [1, 7, 20] {
            check(
                &w,
                &activations(&mut rng, n * cols, false),
                &format!("{t} quantized"),
            );
        }
    }
}

#[test]
fn block_thread_count_does_not_change_bits() {
    let mut rng = Rng(0x7EAD_5000);
    for t in types() {
        let (rows, cols) = (300, 512);
        let q = random_blocks(&mut rng, t, rows, cols, false);
        let w = QMat::new_blocks(t, rows, cols, &q).unwrap();
        let p = (!is_codebook(t)).then(|| PackedMat::new(&w).unwrap());
        let w = WeightMat::from(w);
        let wp = match &p {
            Some(p) => w.with_packed(p).unwrap(),
            None => w,
        };
        for n in [1, 6, 19] {
            let x = activations(&mut rng, n * cols, false);
            let mut xa = QActs::new();
            kernels::quantize_acts(&x, cols, &mut xa);
            for k in all_kernels() {
                for m in [&w, &wp] {
                    let ys: Vec<Vec<f32>> = [1, 2, 3]
                        .iter()
                        .map(|&threads| {
                            let mut y = vec![0f32; n * rows];
                            Pool::leak(threads).install(|| k.matmul(m, &xa, &mut y));
                            y
                        })
                        .collect();
                    assert_eq!(
                        first_diff(&ys[0], &ys[1]),
                        None,
                        "{t} tier {} n {n}",
                        k.tier()
                    );
                    assert_eq!(
                        first_diff(&ys[0], &ys[2]),
                        None,
                        "{t} tier {} n {n}",
                        k.tier()
                    );
                }
            }
        }
    }
}

/// A codebook matrix times several tokens takes the decoded path on the x86 tiers
/// (levels decoded once per sub-block of rows, then the packed-style kernel: no
/// row-major tile), one token the row-major kernel; the bits are checked above.
#[test]
fn codebook_prompts_decode_once_on_x86_tiers() {
    use krafla::kernels::counters::{self, Op};
    use krafla::kernels::Tier;
    if crate::util::skip_without_counters() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    let has_vbmi = std::is_x86_feature_detected!("avx512vbmi");
    #[cfg(not(target_arch = "x86_64"))]
    let has_vbmi = false;
    let mut rng = Rng(0xDEC0_DE01);
    let (rows, cols) = (40, 512);
    for t in types().filter(|&t| is_codebook(t)) {
        let q = random_blocks(&mut rng, t, rows, cols, false);
        let w = WeightMat::from(QMat::new_blocks(t, rows, cols, &q).unwrap());
        for k in all_kernels() {
            let x86 = !matches!(k.tier(), Tier::Scalar | Tier::Neon);
            for n in [1, 9] {
                let x = activations(&mut rng, n * cols, false);
                let mut xa = QActs::new();
                k.quantize_acts(&x, cols, &mut xa);
                let mut y = vec![0f32; n * rows];
                counters::take();
                Pool::leak(1).install(|| k.matmul(&w, &xa, &mut y));
                let calls = counters::take();
                // The BF16 tier runs the VNNI tier's kernel, as AVX-512 runs AVX2's.
                let vbmi_tiles = calls.get(Tier::Avx512Vnni, Op::Tile);
                let (tiles, packed) = (
                    calls.get(k.tier(), Op::Tile)
                        + calls.get(Tier::Avx2, Op::Tile)
                        + if k.tier() == Tier::Avx512Bf16 {
                            vbmi_tiles
                        } else {
                            0
                        },
                    calls.get(Tier::Avx512Vnni, Op::Packed) + calls.get(Tier::Avx2, Op::Packed),
                );
                if x86 && n > 1 {
                    assert!(
                        tiles == 0 && packed > 0,
                        "{t} {} n {n}: {calls:?}",
                        k.tier()
                    );
                } else {
                    assert!(
                        tiles > 0 && packed == 0,
                        "{t} {} n {n}: {calls:?}",
                        k.tier()
                    );
                }
                // One token on a VNNI tier with VBMI: the byte-table lookups, which the
                // tests above check bit for bit.
                let vbmi = matches!(k.tier(), Tier::Avx512Vnni | Tier::Avx512Bf16) && has_vbmi;
                if n == 1 {
                    assert_eq!(vbmi_tiles > 0, vbmi, "{t} {}: {calls:?}", k.tier());
                }
            }
        }
    }
}

#[test]
fn block_views_are_checked() {
    let q = vec![0u8; 2 * 144];
    assert!(QMat::new_blocks(WType::Q4_K, 2, 256, &q).is_ok());
    assert!(
        QMat::new_blocks(WType::Q4_K, 1, 256, &q).is_err(),
        "q too long"
    );
    let e = QMat::new_blocks(WType::Q4_K, 1, 576, &q[..144]).unwrap_err();
    assert!(e.0.contains("multiple of 256"), "{e}");
    assert!(QMat::new_blocks(WType::Q8_0, 1, 32, &q[..32]).is_err());
    // A tier forced by `with_tier` multiplies the block types too.
    let w = WeightMat::from(QMat::new_blocks(WType::Q4_K, 2, 256, &q).unwrap());
    for t in kernels::supported_tiers() {
        assert!(Kernels::for_tier(t).unwrap().supports(WType::Q6_0));
        let y = kernels::with_tier(t, || {
            let mut xa = QActs::new();
            kernels::quantize_acts(&[1.0; 256], 256, &mut xa);
            let mut y = vec![f32::NAN; 2];
            kernels::matmul(&w, &xa, &mut y);
            y
        })
        .unwrap();
        assert_eq!(y, [0.0, 0.0], "tier {t}");
    }
}
