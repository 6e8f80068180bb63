//! The call counters (`kernels/counters.rs`): the table's f32 entries run under their
//! own tier's code.

use krafla::kernels::counters::{self, Op};
use krafla::kernels::{DeltaHead, KvType, KvView, Query, Tier};

use super::attention::Typed;
use crate::util::tiers::all_kernels;

/// The table's f32 entries count under their own tier: the scalar tier's run scalar
/// code only; on x86 every SIMD tier runs SIMD code for each of them.
#[test]
fn f32_kernels_count_under_their_tier() {
    if crate::util::skip_without_counters() {
        return;
    }
    let (hd, cap) = (16, 8);
    let caches: Vec<Typed> = KvType::ALL
        .into_iter()
        .map(|t| Typed::new(t, &vec![0.5; cap * hd], 1, hd))
        .collect();
    let q = vec![0.25; hd];
    for k in all_kernels() {
        counters::take();
        // Attention over an f32, an f16 and a Q8_0 cache.
        for c in &caches {
            let kv = KvView {
                k: c.data(),
                v: c.data(),
                cap,
                stride: c.stride,
                off: 0,
                window: None,
            };
            let (mut att, mut out) = (vec![0.0; cap], vec![0.0; hd]);
            let mut qs = [Query {
                q: &q,
                pos: 3,
                att: &mut att,
                out: &mut out,
                sink: None,
            }];
            k.attend(&mut qs, &kv, 0.25, 0.0);
        }
        let mut g = vec![0.5; 20];
        k.silu_mul(&mut g, &[1.0; 20]);
        k.gelu_mul(&mut g, &[1.0; 20]);
        k.exp(&mut g);
        k.max(&g);
        let x = DeltaHead {
            q: &q,
            k: &q,
            v: &q,
            z: &q,
            beta: 0.5,
            decay: 0.5,
            lnorm: &q,
            eps: 1e-6,
        };
        let (mut s, mut o, mut d) = (vec![0.0; hd * hd], vec![0.0; hd], vec![0.0; hd]);
        k.delta_head(&x, &mut s, &mut o, &mut d);
        let c = counters::take();
        let ops = [Op::Attend, Op::Act, Op::Exp, Op::Max, Op::Delta];
        match k.tier() {
            Tier::Scalar | Tier::Neon => {
                for op in ops {
                    assert_eq!(c.simd(op), 0, "{} {op:?}", k.tier());
                    assert!(c.get(Tier::Scalar, op) > 0, "{} {op:?}", k.tier());
                }
            }
            t => {
                for op in ops {
                    assert_eq!(c.get(Tier::Scalar, op), 0, "{t} {op:?}: scalar code ran");
                    assert!(c.simd(op) > 0, "{t} {op:?}: no SIMD code ran");
                }
                assert!(c.get(Tier::Avx2, Op::Act) == 2, "{t}: two activations");
                assert_eq!(c.simd(Op::Attend), 3, "{t}: three cache types");
            }
        }
    }
}
