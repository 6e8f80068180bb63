//! A mixture-of-experts FFN for a step's rows, as work is scheduled: route every row
//! (`model::routing`), group the rows by expert, and run every chosen expert's matrices
//! on its own rows as two pool steps for the whole step, whatever the number of rows
//! (decode, a prompt chunk, a batched step of several sequences):
//!
//! 1. the rows are gathered by expert (a counting sort: experts ascending, rows in
//!    step order within an expert), one segment per expert with tokens;
//! 2. one step: each such expert's ew1 and ew3 rows on its segment (the gathered rows
//!    quantized once, by segments: `Kernels::project_groups`), and the shared expert's
//!    sw1 and sw3 on every row;
//! 3. biases and the activation (SiLU / GELU, or the clamped SwiGLU) on every
//!    gathered row;
//! 4. one step: each expert's ew2 rows on its hidden rows, and the shared expert's sw2;
//! 5. per row, `y = Σ w_e · y_e` over its experts in ascending expert index (f32
//!    multiply, then add; from +0), then `y = y + g · s` for the shared expert's output
//!    `s` with `g = sigmoid(sgate · x)` (1 without the gate).
//!
//! An expert's weights are read once per step, only when some row chose it (a decode
//! step reads its k experts). Every output of a row depends on that row alone (the
//! kernels' products do not depend on the other rows of a segment, nor a segment's
//! quantization on the others), and the combination order is fixed by expert index,
//! so a row gets the same bits in any grouping: prefill, decode and batched steps agree.

use super::{Model, Scratch, Seg};
use crate::kernels::{pool, GroupInput, GroupProduct, Kernels};
use crate::model::config::Act;
use crate::model::observer::{tap, Input};
use crate::model::ops::{add, for_rows, PAR_MIN};
use crate::model::routing;
use crate::model::weights::MoeWeights;

/// `buf` (rows of `width`) cut at the row bounds `bounds`: one slice per segment.
fn cut<'a>(mut buf: &'a mut [f32], bounds: &[usize], width: usize) -> Vec<&'a mut [f32]> {
    let mut v = Vec::with_capacity(bounds.len().saturating_sub(1));
    for b in bounds.windows(2) {
        let (a, rest) = std::mem::take(&mut buf).split_at_mut((b[1] - b[0]) * width);
        v.push(a);
        buf = rest;
    }
    v
}

/// Shows the observers the gathered rows `data` (rows of `width`) of one expert's
/// segment, whose step rows are `rows` (ascending): each sequence's observer its own.
fn tap_gathered(segs: &mut [Seg], layer: usize, input: Input, rows: &[u32], data: &[f32]) {
    let width = data.len() / rows.len().max(1);
    for s in segs.iter_mut().filter(|s| s.seq.observer.is_some()) {
        let a = rows.partition_point(|&r| (r as usize) < s.r0);
        let b = rows.partition_point(|&r| (r as usize) < s.r0 + s.n);
        if a < b {
            tap(
                &mut s.seq.observer,
                layer,
                input,
                &data[a * width..b * width],
            );
        }
    }
}

/// `g = act(g, u)` over rows of `width`: the clamped SwiGLU, or the model's activation.
fn activate(
    k: &Kernels,
    act: Act,
    swiglu: Option<(f32, f32)>,
    g: &mut [f32],
    u: &[f32],
    width: usize,
) {
    for_rows(g, width, |i, r| {
        let u = &u[i * width..(i + 1) * width];
        match (swiglu, act) {
            (Some((limit, alpha)), _) => k.swiglu_mul(r, u, limit, alpha),
            (None, Act::Silu) => k.silu_mul(r, u),
            (None, Act::GeluTanh) => k.gelu_mul(r, u),
        }
    });
}

impl Model<'_> {
    /// The mixture-of-experts FFN of layer `l` for the step's `n` rows (input in
    /// `st.xb`, output in `st.xb2`); see the module docs.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe(
        &self,
        k: &Kernels,
        st: &mut Scratch,
        segs: &mut [Seg],
        l: usize,
        w: &MoeWeights,
        n: usize,
    ) {
        let c = &self.cfg;
        let moe = c.moe.expect("a mixture-of-experts layer has experts");
        let (d, ne, kk, eh, sh) = (
            c.dim,
            moe.n_experts,
            moe.k,
            moe.expert_hidden,
            moe.shared_hidden,
        );
        let m = n * kk;
        let x = &st.xb[..n * d];
        let ms = &mut st.moe;

        // 1. Route every row.
        pool::parallel_if(n * ne * d >= PAR_MIN).for_chunks3(
            (&mut ms.logits[..n * ne], ne),
            (&mut ms.ids[..m], kk),
            (&mut ms.w[..m], kk),
            |t, lg, ids, wt| {
                routing::logits(k, w.router, w.router_b, &x[t * d..(t + 1) * d], lg);
                routing::route(k, &moe, lg, ids, wt);
            },
        );
        for s in segs.iter_mut() {
            if let Some(o) = s.seq.observer.as_mut() {
                o.routed(l, s.p0, kk, &ms.ids[s.r0 * kk..(s.r0 + s.n) * kk]);
            }
        }

        // 2. Group the rows by expert.
        ms.next.clear();
        ms.next.resize(ne, 0);
        for &e in &ms.ids[..m] {
            ms.next[e as usize] += 1;
        }
        ms.active.clear();
        ms.bounds.clear();
        ms.bounds.push(0);
        let mut at = 0;
        for (e, cnt) in ms.next.iter_mut().enumerate() {
            if *cnt > 0 {
                ms.active.push(e as u32);
                let first = at;
                at += *cnt;
                ms.bounds.push(at);
                *cnt = first;
            }
        }
        for (i, &e) in ms.ids[..m].iter().enumerate() {
            let g = &mut ms.next[e as usize];
            ms.row[*g] = (i / kk) as u32;
            ms.slot[i] = *g as u32;
            *g += 1;
        }
        let row = &ms.row[..m];
        pool::parallel_if(m * d >= PAR_MIN).for_chunks(&mut ms.gx[..m * d], d, |g, o| {
            let r = row[g] as usize;
            o.copy_from_slice(&x[r * d..(r + 1) * d]);
        });

        // 3. Gate and up of every chosen expert on its rows (and the shared expert's).
        {
            let mut gh = cut(&mut ms.gh[..m * eh], &ms.bounds, eh).into_iter();
            let mut gu = cut(&mut ms.gu[..m * eh], &ms.bounds, eh).into_iter();
            let mut prods = Vec::with_capacity(2 * ms.active.len() + 2);
            for (i, &e) in ms.active.iter().enumerate() {
                let ew = w.expert(e as usize);
                let (yg, yu) = (gh.next().expect("a segment"), gu.next().expect("a segment"));
                prods.push(GroupProduct {
                    w: &ew.w1,
                    input: 0,
                    seg: i,
                    y: yg,
                });
                prods.push(GroupProduct {
                    w: &ew.w3,
                    input: 0,
                    seg: i,
                    y: yu,
                });
            }
            let mut inputs = vec![GroupInput {
                x: &ms.gx[..m * d],
                cols: d,
                bounds: &ms.bounds,
                qa: &mut st.qa,
            }];
            if let Some(s) = &w.shared {
                inputs.push(GroupInput {
                    x,
                    cols: d,
                    bounds: &[],
                    qa: &mut ms.qa,
                });
                prods.push(GroupProduct {
                    w: &s.w1,
                    input: 1,
                    seg: 0,
                    y: &mut ms.sh[..n * sh],
                });
                prods.push(GroupProduct {
                    w: &s.w3,
                    input: 1,
                    seg: 0,
                    y: &mut ms.su[..n * sh],
                });
            }
            k.project_groups(&mut inputs, &mut prods);
        }
        if moe.expert_bias {
            for (i, &e) in ms.active.iter().enumerate() {
                let ew = w.expert(e as usize);
                let rows = ms.bounds[i] * eh..ms.bounds[i + 1] * eh;
                for (b, buf) in [(ew.b1, &mut ms.gh), (ew.b3, &mut ms.gu)] {
                    if let Some(b) = b {
                        buf[rows.clone()]
                            .chunks_exact_mut(eh)
                            .for_each(|r| add(r, b));
                    }
                }
            }
        }
        activate(
            k,
            c.act,
            moe.swiglu,
            &mut ms.gh[..m * eh],
            &ms.gu[..m * eh],
            eh,
        );
        if w.shared.is_some() {
            activate(k, c.act, None, &mut ms.sh[..n * sh], &ms.su[..n * sh], sh);
        }
        if segs.iter().any(|s| s.seq.observer.is_some()) {
            for (i, &e) in ms.active.iter().enumerate() {
                let (a, b) = (ms.bounds[i], ms.bounds[i + 1]);
                let rows = &ms.row[a..b];
                tap_gathered(segs, l, Input::ExpertIn(e), rows, &ms.gx[a * d..b * d]);
                let hid = &ms.gh[a * eh..b * eh];
                tap_gathered(segs, l, Input::ExpertHidden(e), rows, hid);
            }
            if w.shared.is_some() {
                super::tap_rows(segs, l, Input::SharedHidden, &ms.sh[..n * sh]);
            }
        }

        // 4. Down of every chosen expert on its hidden rows (into gx), and the shared
        // expert's.
        {
            let mut gy = cut(&mut ms.gx[..m * d], &ms.bounds, d).into_iter();
            let mut prods = Vec::with_capacity(ms.active.len() + 1);
            for (i, &e) in ms.active.iter().enumerate() {
                prods.push(GroupProduct {
                    w: &w.expert(e as usize).w2,
                    input: 0,
                    seg: i,
                    y: gy.next().expect("a segment"),
                });
            }
            let mut inputs = vec![GroupInput {
                x: &ms.gh[..m * eh],
                cols: eh,
                bounds: &ms.bounds,
                qa: &mut st.qa,
            }];
            if let Some(s) = &w.shared {
                inputs.push(GroupInput {
                    x: &ms.sh[..n * sh],
                    cols: sh,
                    bounds: &[],
                    qa: &mut ms.qa,
                });
                prods.push(GroupProduct {
                    w: &s.w2,
                    input: 1,
                    seg: 0,
                    y: &mut ms.sy[..n * d],
                });
            }
            k.project_groups(&mut inputs, &mut prods);
        }
        if moe.expert_bias {
            for (i, &e) in ms.active.iter().enumerate() {
                if let Some(b) = w.expert(e as usize).b2 {
                    let rows = ms.bounds[i] * d..ms.bounds[i + 1] * d;
                    ms.gx[rows].chunks_exact_mut(d).for_each(|r| add(r, b));
                }
            }
        }

        // 5. Combine, in ascending expert index, then the shared expert.
        let ms = &st.moe;
        let (ids, wt, slot, gy) = (&ms.ids, &ms.w, &ms.slot, &ms.gx);
        let shared = w.shared.as_ref().map(|_| &ms.sy);
        let x = &st.xb;
        for_rows(&mut st.xb2[..n * d], d, |t, y| {
            y.fill(0.0);
            let choices = &ids[t * kk..(t + 1) * kk];
            let mut prev = None;
            for _ in 0..kk {
                // The smallest expert id above the previous one.
                let j = (0..kk)
                    .filter(|&j| prev.is_none_or(|p| choices[j] > p))
                    .min_by_key(|&j| choices[j])
                    .expect("k distinct experts");
                prev = Some(choices[j]);
                let (we, g) = (wt[t * kk + j], slot[t * kk + j] as usize);
                for (o, &v) in y.iter_mut().zip(&gy[g * d..(g + 1) * d]) {
                    *o += we * v;
                }
            }
            if let Some(sy) = shared {
                let gate = match w.sgate {
                    Some(sg) => k.sigmoid(k.dot(sg, &x[t * d..(t + 1) * d])),
                    None => 1.0,
                };
                for (o, &v) in y.iter_mut().zip(&sy[t * d..(t + 1) * d]) {
                    *o += gate * v;
                }
            }
        });
    }
}
