//! Attention (`kernels/scalar/attention.rs`, `kv.rs` and their SIMD twins): every tier
//! over f32, f16 and Q8_0 caches against the reference over the widened f32 cache, bit
//! for bit; tiles of queries, windows, rings, edge values.

use krafla::kernels::scalar::attention::attend_one;
use krafla::kernels::{Kernels, KvData, KvType, KvView, Query, Tier};

use super::{bits, same_bits, Rng};
use crate::util::tiers::all_kernels;

/// A cache of `slots × heads × hd` f32 values stored as `t`: the stored arrays and the
/// slot stride in them, and the widened f32 cache (stride `heads × hd`) that attention
/// over the stored one must match bit for bit.
pub(super) struct Typed {
    f32s: Vec<f32>,
    f16s: Vec<u16>,
    q: Vec<i8>,
    d: Vec<f32>,
    t: KvType,
    pub(super) stride: usize,
    widened: Vec<f32>,
}

impl Typed {
    pub(super) fn new(t: KvType, x: &[f32], heads: usize, hd: usize) -> Typed {
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

    pub(super) fn data(&self) -> KvData<'_> {
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
    /// The head's sink logit (attention sinks), shifted a little per query.
    sink: Option<f32>,
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
                sink: c.sink.map(|s| s + i as f32 * 0.25),
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
                sink: c.sink.map(|s| s + i as f32 * 0.25),
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
        // Sinks below, near and far above the scores (a sink that takes all the mass).
        for (softcap, mag, sink) in [
            (0.0, 1.0, None),
            (20.0, 1.0, Some(0.5)),
            (0.0, 30.0, None),
            (5.0, 1e3, Some(-2.0)),
            (0.0, 1.0, Some(90.0)),
        ] {
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
                sink,
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
                sink: None,
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
