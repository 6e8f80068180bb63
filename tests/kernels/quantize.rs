//! The activation quantizer (`kernels/scalar/quantize.rs` and its SIMD twins): every tier
//! against the scalar reference and `quant::q8_0::quantize_block`, per block, bit for
//! bit; the same blocks on a pool of any size.

use krafla::kernels::pool::Pool;
use krafla::kernels::{self, QActs};
use krafla::quant::QK;

use super::tiles::activations;
use crate::util::tiers::{all_kernels, scalar};
use crate::util::{first_diff, Rng};

fn check_quantize(x: &[f32]) {
    let s = scalar();
    let (mut q0, mut d0) = (vec![0i8; x.len()], vec![0f32; x.len() / QK]);
    s.quantize_act(x, &mut q0, &mut d0);
    for k in all_kernels() {
        let (mut q, mut d) = (vec![1i8; x.len()], vec![1f32; x.len() / QK]);
        k.quantize_act(x, &mut q, &mut d);
        for b in 0..d.len() {
            let r = b * QK..(b + 1) * QK;
            assert!(
                d[b].to_bits() == d0[b].to_bits() && q[r.clone()] == q0[r.clone()],
                "tier {}: block {b} differs: x {:?}\n d {} vs {}\n q {:?}\n vs {:?}",
                k.tier(),
                &x[r.clone()],
                d[b],
                d0[b],
                &q[r.clone()],
                &q0[r]
            );
        }
    }
}

#[test]
fn quantize_act_tiers_agree() {
    let mut rng = Rng::new(1);
    for len in [32, 64, 96, 576, 1024, 2048 + 32] {
        check_quantize(&activations(&mut rng, len, false));
        for _ in 0..20 {
            check_quantize(&activations(&mut rng, len, true));
        }
    }
}

#[test]
fn quantize_act_matches_q8_0_reference() {
    let mut rng = Rng::new(2);
    let x = activations(&mut rng, 4096, true);
    let (mut q, mut d) = (vec![0i8; x.len()], vec![0f32; x.len() / QK]);
    kernels::quantize_act(&x, &mut q, &mut d);
    for (b, xb) in x.chunks_exact(QK).enumerate() {
        let mut qb = [0i8; QK];
        let db = krafla::quant::q8_0::quantize_block(xb, &mut qb);
        assert_eq!(db.to_bits(), d[b].to_bits(), "block {b}");
        assert_eq!(&qb[..], &q[b * QK..(b + 1) * QK], "block {b}");
    }
}

/// A prompt-sized input (more than one pool task of values) is quantized in parallel:
/// the same quants and scales as one thread, per block as the reference.
#[test]
fn parallel_quantization_gives_the_same_blocks() {
    let mut rng = Rng::new(11);
    let (n, cols) = (300, 320);
    let x = activations(&mut rng, n * cols, true);
    let one = Pool::leak(1).install(|| {
        let mut a = QActs::new();
        kernels::quantize_acts(&x, cols, &mut a);
        a
    });
    for threads in [2, 3] {
        let many = Pool::leak(threads).install(|| {
            let mut a = QActs::new();
            kernels::quantize_acts(&x, cols, &mut a);
            a
        });
        assert_eq!(many.q(), one.q(), "{threads} threads");
        assert_eq!(first_diff(many.d(), one.d()), None, "{threads} threads");
    }
    let mut qb = [0i8; QK];
    for (b, xb) in x.chunks_exact(QK).enumerate().step_by(97) {
        let db = krafla::quant::q8_0::quantize_block(xb, &mut qb);
        assert_eq!(db.to_bits(), one.d()[b].to_bits(), "block {b}");
        assert_eq!(&qb[..], &one.q()[b * QK..(b + 1) * QK], "block {b}");
    }
}
