//! Error feedback's f64 product `C −= E·U` (`kernels/scalar/subproduct.rs` and its SIMD
//! twins): every tier against the contract written out, bit for bit, over shapes across
//! the tiles' edges, with strides wider than the rows, huge, tiny and subnormal values.

use krafla::kernels::scalar::subproduct::tiled;

use super::Rng;
use crate::util::tiers::all_kernels;

/// `n` values in [−scale, scale), a few of them `extreme` (large ones only in E, so that
/// no product overflows), subnormal or zero.
fn values(rng: &mut Rng, n: usize, scale: f64, extreme: f64) -> Vec<f64> {
    (0..n)
        .map(|i| match i % 97 {
            13 => extreme,
            29 => -5e-324, // subnormal
            41 => 0.0,
            _ => rng.unit() as f64 * scale + rng.unit() as f64 * scale * 1e-9,
        })
        .collect()
}

#[test]
fn sub_product_gives_the_scalar_bits() {
    let mut rng = Rng(0x5eed_f00d);
    for (m, k, n) in [
        (1, 1, 1),
        (4, 3, 16),
        (5, 7, 17),
        (64, 128, 300),
        (3, 0, 9),
        (9, 33, 8),
        (13, 64, 47),
        // Past the packed strips' depth (256), with its remainder.
        (9, 600, 21),
        // Several blocks of column tiles per strip, and a strip of one block.
        (11, 300, 420),
    ] {
        let (lde, ldu, ldc) = (k + 3, n + 5, n + 2);
        let e = values(&mut rng, m * lde, 1.0, 1e300);
        let u = values(&mut rng, k * ldu, 2.0, 1e-300);
        let c0 = values(&mut rng, m * ldc, 4.0, 1e-310);
        let mut want = c0.clone();
        // The contract written out: per element, p in increasing order.
        for i in 0..m {
            for j in 0..n {
                let mut c = want[i * ldc + j];
                for p in 0..k {
                    c = (-e[i * lde + p]).mul_add(u[p * ldu + j], c);
                }
                want[i * ldc + j] = c;
            }
        }
        let mut tiles = c0.clone();
        tiled::<3, 5>([m, k, n], (&e, lde), (&u, ldu), (&mut tiles, ldc));
        let mut got = vec![("tiles 3 x 5".to_string(), tiles)];
        for kern in all_kernels() {
            let mut c = c0.clone();
            kern.sub_product([m, k, n], (&e, lde), (&u, ldu), (&mut c, ldc));
            got.push((kern.tier().to_string(), c));
        }
        for (what, c) in got {
            let diff = (0..c.len()).find(|&i| c[i].to_bits() != want[i].to_bits());
            if let Some(i) = diff {
                panic!(
                    "{what}: m {m} k {k} n {n}: index {i} (row {}, col {}): got {:e} want {:e}",
                    i / ldc,
                    i % ldc,
                    c[i],
                    want[i]
                );
            }
        }
    }
}

/// `y −= a·x` (error feedback's update inside a window): every tier's kept pointer
/// against the contract written out (the product rounded, then the difference), over
/// lengths across the vectors' edges.
#[test]
fn sub_scaled_gives_the_scalar_bits() {
    let mut rng = Rng(0x5ca1_ab1e);
    for len in [0, 1, 3, 4, 7, 8, 15, 16, 17, 255, 256] {
        let x = values(&mut rng, len + 2, 3.0, 1e-300);
        let y0 = values(&mut rng, len, 5.0, 1e300);
        for a in [0.7, -1.3e-5, 2.5e7] {
            let want: Vec<f64> = y0.iter().zip(&x).map(|(&y, &v)| y - a * v).collect();
            for kern in all_kernels() {
                let mut y = y0.clone();
                (kern.sub_scaled())(a, &x, &mut y);
                for (i, (g, w)) in y.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{}: len {len}, a {a}, index {i}: got {g:e} want {w:e}",
                        kern.tier()
                    );
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "sub_product")]
fn sub_product_refuses_short_operands() {
    let k = &all_kernels()[0];
    let mut c = vec![0.0; 7];
    k.sub_product([2, 1, 4], (&[1.0, 2.0], 1), (&[1.0; 4], 4), (&mut c, 4));
}
