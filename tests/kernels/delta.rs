//! The delta rule's head step (`kernels/scalar/delta.rs` and its SIMD twin): every tier
//! against the reference, bit for bit, over two steps.

use krafla::kernels::scalar::delta::head_step;
use krafla::kernels::DeltaHead;

use super::{same_bits, Rng};
use crate::util::tiers::all_kernels;

#[test]
fn delta_head_gives_the_scalar_bits() {
    let mut rng = Rng(0xdead_beef);
    for (dk, dv) in [(16, 16), (32, 64), (24, 40), (128, 128), (8, 3)] {
        let q = rng.vec(dk, 0.3);
        let kk = rng.vec(dk, 0.3);
        let v = rng.vec(dv, 1.0);
        let z = rng.vec(dv, 2.0);
        let lnorm = rng.vec(dv, 1.0);
        let s0 = rng.vec(dk * dv, 0.5);
        let x = DeltaHead {
            q: &q,
            k: &kk,
            v: &v,
            z: &z,
            beta: 0.7,
            decay: 0.93,
            lnorm: &lnorm,
            eps: 1e-6,
        };
        let (mut s1, mut o1, mut d1) = (s0.clone(), vec![0.0; dv], vec![0.0; dv]);
        // Two steps, so the second starts from a state the first wrote.
        for _ in 0..2 {
            head_step(&x, &mut s1, &mut o1, &mut d1);
        }
        for k in all_kernels() {
            let (mut s, mut o, mut d) = (s0.clone(), vec![0.0; dv], vec![0.0; dv]);
            for _ in 0..2 {
                k.delta_head(&x, &mut s, &mut o, &mut d);
            }
            let what = format!("{} delta dk {dk} dv {dv}", k.tier());
            same_bits(&o, &o1, &what);
            same_bits(&s, &s1, &what);
        }
    }
}
