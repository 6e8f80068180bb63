//! The f32 kernels of every tier (attention, exp, the maximum, SiLU / GELU, the delta
//! rule's head step) against their scalar references (which are checked against f64), bit for bit, on random data and
//! edge cases; and the call counters that show which tier's code ran.

use krafla::kernels::counters::{self, Op};
use krafla::kernels::scalar::attention::attend_one;
use krafla::kernels::scalar::delta::head_step;
use krafla::kernels::scalar::math::{self as sm, HI, LO};
use krafla::kernels::{DeltaHead, Kernels, KvData, KvType, KvView, Query, Tier};

use crate::util::nan_bits;
use crate::util::tiers::all_kernels;

/// xorshift32 values in [-scale, scale).
struct Rng(u32);

impl Rng {
    fn unit(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 17;
        self.0 ^= self.0 << 5;
        (self.0 as f32 / u32::MAX as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
}

/// The bits, every NaN as one value ([`nan_bits`]).
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|&x| nan_bits(x)).collect()
}

/// Panics with the first differing index and both bit patterns.
fn same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = got
        .iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        panic!(
            "{what}: index {i}: got {} ({:#010x}), want {} ({:#010x})",
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

/// Inputs of `exp` and the activations: a sweep through the range, the cut-offs,
/// subnormals, zeros of both signs, infinities, NaN, the largest values.
fn sweep() -> Vec<f32> {
    let mut v: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.05).collect();
    v.extend((0..4000).map(|i| -87.5 + i as f32 * 0.044));
    v.extend([
        0.0,
        -0.0,
        1e-30,
        -1e-30,
        1e-40,
        -1e-40,
        HI,
        HI + 0.01,
        LO,
        LO - 0.01,
        88.0,
        -87.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
    ]);
    v
}

#[test]
fn exp_is_accurate() {
    for x in sweep() {
        let got = sm::exp(x);
        if x.is_nan() {
            assert!(got.is_nan());
            continue;
        }
        let want = (x as f64).exp();
        if x > HI {
            assert_eq!(got, f32::INFINITY, "{x}");
        } else if x < LO {
            assert_eq!(got.to_bits(), 0, "{x}");
        } else {
            let rel = ((got as f64 - want) / want).abs();
            assert!(
                rel < 2.0 * f32::EPSILON as f64,
                "exp({x}) = {got}, want {want}: {rel:e}"
            );
        }
    }
    assert_eq!(sm::exp(0.0), 1.0);
}

#[test]
fn gelu_matches_the_tanh_formula() {
    for x in sweep()
        .into_iter()
        .filter(|x| x.is_finite() && x.abs() < 30.0)
    {
        let xd = x as f64;
        let u = (2.0 / std::f64::consts::PI).sqrt() * (xd + 0.044715 * xd * xd * xd);
        let want = 0.5 * xd * (1.0 + u.tanh());
        let got = sm::gelu_tanh(x) as f64;
        // Relative to |x|: GELU is x times a factor in [0, 1].
        let err = (got - want).abs() / xd.abs().max(1e-30);
        assert!(err < 1e-6, "gelu({x}) = {got}, want {want}");
    }
    assert_eq!(sm::gelu_tanh(0.0), 0.0);
    assert!(sm::gelu_tanh(f32::NAN).is_nan());
}

#[test]
fn exp_max_and_activations_give_the_scalar_bits() {
    let xs = sweep();
    let u: Vec<f32> = (0..xs.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
    for k in all_kernels() {
        let t = k.tier();
        // Every length around the vector widths, and starts off alignment.
        for len in (0..70).chain([xs.len() - 3]) {
            for start in [0, 3] {
                let x = &xs[start..start + len];
                let mut e = x.to_vec();
                k.exp(&mut e);
                let want: Vec<f32> = x.iter().map(|&v| sm::exp(v)).collect();
                same_bits(&e, &want, &format!("{t} exp, len {len}"));
                let m = k.max(x);
                assert_eq!(m.to_bits(), sm::max(x).to_bits(), "{t} max, len {len}");
                let uu = &u[..len];
                let mut g = x.to_vec();
                k.silu_mul(&mut g, uu);
                let want: Vec<f32> = x.iter().zip(uu).map(|(&a, &b)| sm::silu(a) * b).collect();
                same_bits(&g, &want, &format!("{t} silu, len {len}"));
                let mut g = x.to_vec();
                k.gelu_mul(&mut g, uu);
                let want: Vec<f32> = x
                    .iter()
                    .zip(uu)
                    .map(|(&a, &b)| sm::gelu_tanh(a) * b)
                    .collect();
                same_bits(&g, &want, &format!("{t} gelu, len {len}"));
            }
        }
        // NaN is skipped by the maximum; all NaN gives −inf.
        assert_eq!(k.max(&[f32::NAN; 40]), f32::NEG_INFINITY, "{t}");
        let mut mixed = [f32::NAN; 40];
        mixed[37] = -3.0;
        mixed[5] = -7.0;
        assert_eq!(k.max(&mixed), -3.0, "{t}");
    }
}

/// A cache of `slots × heads × hd` f32 values stored as `t`: the stored arrays and the
/// slot stride in them, and the widened f32 cache (stride `heads × hd`) that attention
/// over the stored one must match bit for bit.
struct Typed {
    f32s: Vec<f32>,
    f16s: Vec<u16>,
    q: Vec<i8>,
    d: Vec<f32>,
    t: KvType,
    stride: usize,
    widened: Vec<f32>,
}

impl Typed {
    fn new(t: KvType, x: &[f32], heads: usize, hd: usize) -> Typed {
        let slots = x.len() / (heads * hd);
        let hs = t.head_stride(hd);
        let stride = heads * hs;
        let mut c = Typed {
            f32s: Vec::new(),
            f16s: Vec::new(),
            q: Vec::new(),
            d: Vec::new(),
            t,
            stride,
            widened: Vec::new(),
        };
        match t {
            KvType::F32 => c.f32s = x.to_vec(),
            KvType::F16 => {
                c.f16s = vec![0; x.len()];
                Kernels::for_tier(Tier::Scalar)
                    .unwrap()
                    .store_kv_f16(x, &mut c.f16s);
            }
            KvType::Q8_0 => {
                let s = Kernels::for_tier(Tier::Scalar).unwrap();
                c.q = vec![0; slots * stride];
                c.d = vec![0.0; slots * stride / 32];
                let mut pad = vec![0.0; hs];
                for (i, row) in x.chunks_exact(heads * hd).enumerate() {
                    let (q, d) = (&mut c.q[i * stride..], &mut c.d[i * stride / 32..]);
                    s.store_kv_q8_0(row, hd, &mut pad, &mut q[..stride], &mut d[..stride / 32]);
                }
            }
        }
        let mut buf = vec![0.0; hd];
        for slot in 0..slots {
            for g in 0..heads {
                let r = c.data().row(slot * stride + g * hs, hd, &mut buf).to_vec();
                c.widened.extend_from_slice(&r);
            }
        }
        c
    }

    fn data(&self) -> KvData<'_> {
        match self.t {
            KvType::F32 => KvData::F32(&self.f32s),
            KvType::F16 => KvData::F16(&self.f16s),
            KvType::Q8_0 => KvData::Q8_0 {
                q: &self.q,
                d: &self.d,
            },
        }
    }
}

/// One attention case: head size, kv heads, cache slots, window, positions of the
/// queries (a tile: consecutive tokens × the query heads of one kv head).
struct AttnCase {
    hd: usize,
    kv_heads: usize,
    cap: usize,
    window: Option<usize>,
    /// First position, tokens, query heads per kv head.
    p0: usize,
    tokens: usize,
    group: usize,
    softcap: f32,
    /// Scale of the keys and queries (large: scores near the exp cut-offs).
    mag: f32,
}

/// Every tier's attention over the cache stored as `t` against the reference over the
/// widened f32 cache: the same bits (only the rounding at storage differs from f32).
fn check_attention(k: &Kernels, c: &AttnCase, t: KvType, rng: &mut Rng) {
    let stride = c.hd * c.kv_heads;
    let (kc, vc) = (
        Typed::new(t, &rng.vec(c.cap * stride, c.mag), c.kv_heads, c.hd),
        Typed::new(t, &rng.vec(c.cap * stride, 1.0), c.kv_heads, c.hd),
    );
    let n = c.tokens * c.group;
    let qv = rng.vec(n * c.hd, c.mag);
    let al = c.cap.max(1);
    let hs = t.head_stride(c.hd);
    for g in 0..c.kv_heads {
        let kv = KvView {
            k: kc.data(),
            v: vc.data(),
            cap: c.cap,
            stride: kc.stride,
            off: g * hs,
            window: c.window,
        };
        let wide = KvView {
            k: KvData::F32(&kc.widened),
            v: KvData::F32(&vc.widened),
            cap: c.cap,
            stride,
            off: g * c.hd,
            window: c.window,
        };
        let (mut att, mut out) = (vec![0.0; n * al], vec![0.0; n * c.hd]);
        let mut qs: Vec<Query> = att
            .chunks_exact_mut(al)
            .zip(out.chunks_exact_mut(c.hd))
            .enumerate()
            .map(|(i, (a, o))| Query {
                q: &qv[i * c.hd..(i + 1) * c.hd],
                pos: c.p0 + i / c.group,
                att: a,
                out: o,
            })
            .collect();
        k.attend(&mut qs, &kv, 0.3, c.softcap);
        for i in 0..n {
            let (mut a1, mut o1) = (vec![0.0; al], vec![0.0; c.hd]);
            let mut one = Query {
                q: &qv[i * c.hd..(i + 1) * c.hd],
                pos: c.p0 + i / c.group,
                att: &mut a1,
                out: &mut o1,
            };
            attend_one(&mut one, &wide, 0.3, c.softcap);
            same_bits(
                &out[i * c.hd..(i + 1) * c.hd],
                &o1,
                &format!(
                    "{} attention, {t} cache: hd {} cap {} window {:?} pos {} query {i} kv head {g}",
                    k.tier(),
                    c.hd,
                    c.cap,
                    c.window,
                    c.p0
                ),
            );
        }
    }
}

#[test]
fn attention_gives_the_scalar_bits() {
    let mut cases = Vec::new();
    // Head sizes with and without tails of 8, 16, 32, 64 and 128; prompt tiles that
    // span several blocks of 64 keys; query pairs of one position (group ≥ 2); a tile
    // longer than TILE_QUERIES; windows; a ring whose positions wrap (pos ≥ cap); groups
    // of one position summing their values together (hd a multiple of 64, group ≥ 2).
    for (hd, kv_heads, cap, window, p0, tokens, group) in [
        (64, 2, 200, None, 0, 10, 3),
        (64, 1, 200, None, 100, 7, 3),
        (256, 1, 200, Some(70), 130, 8, 4),
        (40, 2, 20, Some(5), 3, 9, 2),
        (16, 1, 60, None, 0, 40, 1),
        (128, 1, 150, None, 120, 3, 2),
        (12, 2, 7, Some(7), 30, 1, 2),
        (96, 2, 16, Some(16), 100, 2, 2),
        (24, 1, 9, None, 8, 1, 1),
        (8, 1, 70, None, 65, 4, 5),
        (264, 1, 33, None, 20, 2, 2),
        // Groups of one position larger than the value sums' four (4 + 2, 4 + 3).
        (64, 1, 100, None, 10, 3, 6),
        (128, 1, 80, Some(30), 50, 2, 7),
    ] {
        for (softcap, mag) in [(0.0, 1.0), (20.0, 1.0), (0.0, 30.0), (5.0, 1e3)] {
            cases.push(AttnCase {
                hd,
                kv_heads,
                cap,
                window,
                p0,
                tokens,
                group,
                softcap,
                mag,
            });
        }
    }
    for k in all_kernels() {
        for t in KvType::ALL {
            let mut rng = Rng(0x1234_5678);
            for c in &cases {
                check_attention(&k, c, t, &mut rng);
            }
        }
    }
}

#[test]
fn attention_edge_values_give_the_scalar_bits() {
    // Keys with ±0, subnormals, infinities and NaN in some rows: NaN and inf outputs
    // where the reference has them, on every tier.
    let (hd, cap) = (32, 40);
    let mut rng = Rng(99);
    let mut kc = rng.vec(cap * hd, 1.0);
    let vc = rng.vec(cap * hd, 1.0);
    for (i, v) in [0.0, -0.0, 1e-40, -1e-40, f32::INFINITY, f32::NAN, 7e4, -1e5]
        .into_iter()
        .enumerate()
    {
        kc[(5 * i + 3) * hd + i] = v;
    }
    let q = rng.vec(hd, 1.0);
    for t in KvType::ALL {
        let (kt, vt) = (Typed::new(t, &kc, 1, hd), Typed::new(t, &vc, 1, hd));
        let kv = KvView {
            k: kt.data(),
            v: vt.data(),
            cap,
            stride: kt.stride,
            off: 0,
            window: None,
        };
        let run = |k: &Kernels, pos: usize| {
            let (mut att, mut out) = (vec![0.0; cap], vec![0.0; hd]);
            let mut qs = [Query {
                q: &q,
                pos,
                att: &mut att,
                out: &mut out,
            }];
            k.attend(&mut qs, &kv, 0.125, 0.0);
            out
        };
        let s = Kernels::for_tier(Tier::Scalar).unwrap();
        for pos in [0, 2, 3, 8, 13, 17, 29, 39] {
            let want = run(&s, pos);
            for k in all_kernels() {
                let at = format!("{} {t} cache, pos {pos}", k.tier());
                assert_eq!(bits(&run(&k, pos)), bits(&want), "{at}");
            }
        }
    }
}

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
