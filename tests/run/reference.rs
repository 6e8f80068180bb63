//! An independent, naive reading of the spec's forward pass in f64 (matrices
//! dequantized, matrix inputs rounded by the reference Q8_0 quantizer, as the runtime
//! does), for synthetic files. Written from the spec, sharing no code with src/model.

#![allow(clippy::needless_range_loop)]

use krafla::format::mlb::header::{layer_flag, qk_norm};
use krafla::format::mlb::layout::{Ffn, MoeIdx};
use krafla::format::mlb::{Header, Mixer, Mlb};
use krafla::kernels::QMat;
use krafla::quant::q8_0::quantize_row;
use krafla::quant::QK;

/// Rounds `x` through Q8_0 as the runtime's activation quantizer does.
pub fn q8(x: &[f64]) -> Vec<f64> {
    let xf: Vec<f32> = x.iter().map(|&v| v as f32).collect();
    let mut q = vec![0i8; xf.len()];
    let mut d = vec![0f32; xf.len() / QK];
    quantize_row(&xf, &mut q, &mut d);
    q.iter()
        .enumerate()
        .map(|(i, &v)| v as f64 * d[i / QK] as f64)
        .collect()
}

/// `W · q8(x)` in f64 (`W · x` for BF16 / F16 matrices, which take f32 activations).
pub fn mv(m: &QMat, x: &[f64]) -> Vec<f64> {
    let xq = if m.wtype.is_half() {
        x.iter().map(|&v| v as f32 as f64).collect()
    } else {
        q8(x)
    };
    let mut row = vec![0f32; m.cols];
    (0..m.rows)
        .map(|r| {
            krafla::quant::dequant_mat_row(m, r, &mut row);
            row.iter().zip(&xq).map(|(&w, &v)| w as f64 * v).sum()
        })
        .collect()
}

/// Rows `r0..r1` of `m` times `q8(x)` (or f32 `x` for BF16 / F16), in f64.
fn mv_rows(m: &QMat, r0: usize, r1: usize, x: &[f64]) -> Vec<f64> {
    let xq = if m.wtype.is_half() {
        x.iter().map(|&v| v as f32 as f64).collect()
    } else {
        q8(x)
    };
    let mut row = vec![0f32; m.cols];
    (r0..r1)
        .map(|r| {
            krafla::quant::dequant_mat_row(m, r, &mut row);
            row.iter().zip(&xq).map(|(&w, &v)| w as f64 * v).sum()
        })
        .collect()
}

/// RMSNorm in f64 with the stored (offset-included) weights.
pub fn rms(x: &[f64], w: &[f32], eps: f32) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps as f64).sqrt();
    x.iter().zip(w).map(|(&v, &w)| v * inv * w as f64).collect()
}

fn sig(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn silu(x: f64) -> f64 {
    x * sig(x)
}

fn vecs(m: &Mlb, i: Option<usize>) -> Option<Vec<f32>> {
    i.map(|i| m.f32s(i).to_vec())
}

/// Inverse frequencies of the pairs (spec: RoPE section).
fn inv_freqs(m: &Mlb, local: bool) -> Vec<f64> {
    let h = m.header();
    let d = m.dims();
    let hd = d.head_dim as f64;
    let theta = if local {
        h.rope_local_theta
    } else {
        h.rope_theta
    } as f64;
    let base: Vec<f64> = (0..d.rot_dim / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f64 / hd))
        .collect();
    if local {
        return base;
    }
    let f = h.rope_factor as f64;
    let orig = h.rope_orig_max_seq as f64;
    match h.rope_type {
        1 => {
            let (lo, hi) = (
                h.rope_low_freq_factor as f64,
                h.rope_high_freq_factor as f64,
            );
            base.iter()
                .map(|&inv| {
                    let wl = 2.0 * std::f64::consts::PI / inv;
                    if wl < orig / hi {
                        inv
                    } else if wl > orig / lo {
                        inv / f
                    } else {
                        let s = (orig / wl - lo) / (hi - lo);
                        (1.0 - s) * inv / f + s * inv
                    }
                })
                .collect()
        }
        2 => base.iter().map(|&inv| inv / f).collect(),
        3 | 4 => {
            let dd =
                |r: f64| hd * (orig / (2.0 * std::f64::consts::PI * r)).ln() / (2.0 * theta.ln());
            let (lo, hi) = (
                dd(h.rope_low_freq_factor as f64),
                dd(h.rope_high_freq_factor as f64),
            );
            // rope_type 4 keeps the range's ends where they fall.
            let (lo, hi) = match h.rope_type {
                3 => (lo.floor(), hi.ceil()),
                _ => (lo, hi),
            };
            let (lo, hi) = (lo.max(0.0), hi.min(hd - 1.0));
            base.iter()
                .enumerate()
                .map(|(i, &inv)| {
                    let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                    inv / f * ramp + inv * (1.0 - ramp)
                })
                .collect()
        }
        _ => base,
    }
}

fn rotate(x: &mut [f64], hd: usize, inv: &[f64], pos: usize, mscale: f64) {
    for head in x.chunks_mut(hd) {
        for (i, &f) in inv.iter().enumerate() {
            let a = pos as f64 * f;
            let (c, s) = (a.cos() * mscale, a.sin() * mscale);
            let (x0, x1) = (head[2 * i], head[2 * i + 1]);
            head[2 * i] = x0 * c - x1 * s;
            head[2 * i + 1] = x0 * s + x1 * c;
        }
    }
}

/// The FFN's `act(g) · u` (GELU tanh with act 1, else SiLU).
fn act(h: &Header, g: f64, u: f64) -> f64 {
    let a = if h.act == 1 {
        0.5 * g * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g)).tanh())
    } else {
        silu(g)
    };
    a * u
}

/// The experts a token's router logits `l` choose and their weights (spec: "Mixture of
/// experts", moe_gating): by value, largest first, the lower index on a tie.
pub fn route(gating: u32, k: usize, l: &[f64]) -> Vec<(usize, f64)> {
    let soft = |v: &[f64]| {
        let mx = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = v.iter().map(|x| (x - mx).exp()).collect();
        let z: f64 = e.iter().sum();
        e.iter().map(|x| x / z).collect::<Vec<f64>>()
    };
    let top = |v: &[f64]| {
        let mut idx: Vec<usize> = (0..v.len()).collect();
        idx.sort_by(|&a, &b| v[b].partial_cmp(&v[a]).unwrap().then(a.cmp(&b)));
        idx.truncate(k);
        idx
    };
    match gating {
        0 | 1 => {
            let p = soft(l);
            let ids = top(&p);
            let s: f64 = ids.iter().map(|&e| p[e]).sum();
            let norm = if gating == 1 { s } else { 1.0 };
            ids.iter().map(|&e| (e, p[e] / norm)).collect()
        }
        _ => {
            let ids = top(l);
            let w = soft(&ids.iter().map(|&e| l[e]).collect::<Vec<_>>());
            ids.into_iter().zip(w).collect()
        }
    }
}

/// A mixture-of-experts FFN of one token's normalized input `x` (spec: "Mixture of
/// experts"); also returns the chosen experts.
fn moe(m: &Mlb, x: &MoeIdx, hn: &[f64]) -> (Vec<f64>, Vec<usize>) {
    let (h, d) = (*m.header(), *m.dims());
    let (dim, eh, ne) = (d.dim, d.expert_hidden, d.n_experts);
    let router = m.f32s(x.router);
    let rb = vecs(m, x.router_b);
    let l: Vec<f64> = (0..ne)
        .map(|e| {
            let r = &router[e * dim..(e + 1) * dim];
            let v: f64 = r.iter().zip(hn).map(|(&w, &v)| w as f64 * v).sum();
            v + rb.as_ref().map_or(0.0, |b| b[e] as f64)
        })
        .collect();
    let chosen = route(h.moe_gating, d.n_experts_used, &l);
    let (eb1, eb2, eb3) = (vecs(m, x.eb1), vecs(m, x.eb2), vecs(m, x.eb3));
    let mut y = vec![0f64; dim];
    for &(e, w) in &chosen {
        let (hr, or) = (e * eh..(e + 1) * eh, e * dim..(e + 1) * dim);
        let mut g = mv_rows(&m.mat(x.ew1), hr.start, hr.end, hn);
        let mut u = mv_rows(&m.mat(x.ew3), hr.start, hr.end, hn);
        for (v, b) in [(&mut g, &eb1), (&mut u, &eb3)] {
            if let Some(b) = b {
                v.iter_mut()
                    .zip(&b[hr.clone()])
                    .for_each(|(v, &b)| *v += b as f64);
            }
        }
        let hid: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| {
                if h.swiglu_limit > 0.0 {
                    let (lim, a) = (h.swiglu_limit as f64, h.swiglu_alpha as f64);
                    let g = g.min(lim);
                    let u = u.clamp(-lim, lim);
                    (u + 1.0) * g * sig(a * g)
                } else {
                    act(&h, g, u)
                }
            })
            .collect();
        let mut ye = mv_rows(&m.mat(x.ew2), or.start, or.end, &hid);
        if let Some(b) = &eb2 {
            ye.iter_mut().zip(&b[or]).for_each(|(v, &b)| *v += b as f64);
        }
        y.iter_mut().zip(&ye).for_each(|(y, v)| *y += w * v);
    }
    if let Some([s1, s2, s3]) = x.shared {
        let g = mv(&m.mat(s1), hn);
        let u = mv(&m.mat(s3), hn);
        let hid: Vec<f64> = g.iter().zip(&u).map(|(&g, &u)| act(&h, g, u)).collect();
        let s = mv(&m.mat(s2), &hid);
        let gate = match x.sgate {
            Some(i) => sig(m.f32s(i).iter().zip(hn).map(|(&w, &v)| w as f64 * v).sum()),
            None => 1.0,
        };
        y.iter_mut().zip(&s).for_each(|(y, v)| *y += gate * v);
    }
    (y, chosen.into_iter().map(|(e, _)| e).collect())
}

/// Logits of every position (T × vocab, f32).
pub fn logits(m: &Mlb, toks: &[u32]) -> Vec<f32> {
    logits_routed(m, toks).0
}

/// [`logits`], and per mixture-of-experts layer and position the chosen experts (in
/// the order chosen).
pub fn logits_routed(m: &Mlb, toks: &[u32]) -> (Vec<f32>, Vec<Vec<Vec<usize>>>) {
    let h = *m.header();
    let d = *m.dims();
    let lay = m.layout().clone();
    let t_len = toks.len();
    let eps = h.norm_eps;
    let hd = d.head_dim;
    let es = if h.embed_scale > 0.0 {
        h.embed_scale as f64
    } else {
        1.0
    };
    let mut xs: Vec<Vec<f64>> = toks
        .iter()
        .map(|&t| {
            let mut row = vec![0f32; d.dim];
            krafla::quant::dequant_mat_row(&m.mat(lay.tok_emb), t as usize, &mut row);
            row.iter().map(|&v| v as f64 * es).collect()
        })
        .collect();
    let mut routed: Vec<Vec<Vec<usize>>> = Vec::new();
    for (l, li) in lay.layers.iter().enumerate() {
        let f = m.layer_flags(l);
        let xn: Vec<Vec<f64>> = xs
            .iter()
            .map(|x| rms(x, m.f32s(li.attn_norm), eps))
            .collect();
        let outs: Vec<Vec<f64>> = match &li.mixer {
            Mixer::Attention(a) => {
                let sliding =
                    h.sliding_window > 0 && (h.layer_flags == 0 || f & layer_flag::SLIDING != 0);
                let inv = inv_freqs(m, f & layer_flag::LOCAL_ROPE != 0);
                let mscale = if (h.rope_type == 3 || h.rope_type == 4)
                    && h.rope_attn_factor > 0.0
                    && f & layer_flag::LOCAL_ROPE == 0
                {
                    h.rope_attn_factor as f64
                } else {
                    1.0
                };
                let (bq, bk, bv) = (vecs(m, a.bq), vecs(m, a.bk), vecs(m, a.bv));
                let (qn, kn) = (vecs(m, a.q_norm), vecs(m, a.k_norm));
                let (bo, sinks) = (vecs(m, a.bo), vecs(m, a.sinks));
                let mut qs = Vec::new();
                let mut ks = Vec::new();
                let mut vs = Vec::new();
                let mut gs = Vec::new();
                for (t, x) in xn.iter().enumerate() {
                    let mut q = mv(&m.mat(a.wq), x);
                    let mut k = mv(&m.mat(a.wk), x);
                    let mut v = mv(&m.mat(a.wv), x);
                    for (y, b) in [(&mut q, &bq), (&mut k, &bk), (&mut v, &bv)] {
                        if let Some(b) = b {
                            y.iter_mut().zip(b).for_each(|(y, &b)| *y += b as f64);
                        }
                    }
                    // Per head, or over the whole projection (qk_norm 2).
                    let span = |y: &[f64]| match h.qk_norm {
                        qk_norm::WHOLE => y.len(),
                        _ => hd,
                    };
                    for (y, w) in [(&mut q, &qn), (&mut k, &kn)] {
                        if let Some(w) = w {
                            let n: Vec<f64> =
                                y.chunks(span(y)).flat_map(|hh| rms(hh, w, eps)).collect();
                            *y = n;
                        }
                    }
                    if f & layer_flag::NO_ROPE == 0 {
                        rotate(&mut q, hd, &inv, t, mscale);
                        rotate(&mut k, hd, &inv, t, mscale);
                    }
                    if let Some(g) = a.wg {
                        gs.push(mv(&m.mat(g), x));
                    }
                    qs.push(q);
                    ks.push(k);
                    vs.push(v);
                }
                let scale = if h.attn_scale > 0.0 {
                    h.attn_scale as f64
                } else {
                    1.0 / (hd as f64).sqrt()
                };
                let group = d.n_heads / d.n_kv_heads;
                (0..t_len)
                    .map(|t| {
                        let mut o = vec![0f64; d.q_dim];
                        for hh in 0..d.n_heads {
                            let kvh = hh / group;
                            let q = &qs[t][hh * hd..(hh + 1) * hd];
                            let vis: Vec<usize> = (0..=t)
                                .filter(|&s| !sliding || t - s < h.sliding_window as usize)
                                .collect();
                            let sc: Vec<f64> = vis
                                .iter()
                                .map(|&s| {
                                    let k = &ks[s][kvh * hd..(kvh + 1) * hd];
                                    let mut v =
                                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() * scale;
                                    if h.attn_softcap > 0.0 {
                                        let c = h.attn_softcap as f64;
                                        v = c * (v / c).tanh();
                                    }
                                    v
                                })
                                .collect();
                            // A sink logit: a term of the denominator with no value.
                            let sink = sinks.as_ref().map(|s| s[hh] as f64);
                            let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                            let mx = sink.map_or(mx, |s| mx.max(s));
                            let e: Vec<f64> = sc.iter().map(|v| (v - mx).exp()).collect();
                            let z: f64 =
                                e.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - mx).exp());
                            for (p, &s) in e.iter().zip(&vis) {
                                for j in 0..hd {
                                    o[hh * hd + j] += p / z * vs[s][kvh * hd + j];
                                }
                            }
                        }
                        if !gs.is_empty() {
                            o.iter_mut().zip(&gs[t]).for_each(|(o, &g)| *o *= sig(g));
                        }
                        let mut y = mv(&m.mat(a.wo), &o);
                        if let Some(b) = &bo {
                            y.iter_mut().zip(b).for_each(|(y, &b)| *y += b as f64);
                        }
                        y
                    })
                    .collect()
            }
            Mixer::Linear(li2) => {
                let (kh, vh) = (h.lin_k_heads as usize, h.lin_v_heads as usize);
                let (dk, dv, taps) = (
                    h.lin_k_dim as usize,
                    h.lin_v_dim as usize,
                    h.lin_conv as usize,
                );
                let conv = m.f32s(li2.lconv);
                let (dtb, alog, ln) = (m.f32s(li2.dt_bias), m.f32s(li2.a_log), m.f32s(li2.lnorm));
                let raw: Vec<Vec<f64>> = xn.iter().map(|x| mv(&m.mat(li2.lqkv), x)).collect();
                let mut st = vec![vec![0f64; dk * dv]; vh];
                let mut res = Vec::new();
                for t in 0..t_len {
                    let z = mv(&m.mat(li2.lz), &xn[t]);
                    let b = mv(&m.mat(li2.lb), &xn[t]);
                    let a = mv(&m.mat(li2.la), &xn[t]);
                    let ch = raw[t].len();
                    let mut u: Vec<f64> = (0..ch)
                        .map(|c| {
                            let mut acc = 0.0;
                            for j in 0..taps {
                                // tap j × input of position t − (taps − 1) + j
                                if let Some(p) = (t + j).checked_sub(taps - 1) {
                                    acc += conv[c * taps + j] as f64 * raw[p][c];
                                }
                            }
                            silu(acc)
                        })
                        .collect();
                    for hh in 0..2 * kh {
                        let s = &mut u[hh * dk..(hh + 1) * dk];
                        let n = (s.iter().map(|v| v * v).sum::<f64>() + 1e-6).sqrt();
                        let extra = if hh < kh {
                            1.0 / (dk as f64).sqrt()
                        } else {
                            1.0
                        };
                        s.iter_mut().for_each(|v| *v = *v / n * extra);
                    }
                    let mut out = vec![0f64; vh * dv];
                    for hv in 0..vh {
                        let kk = hv / (vh / kh);
                        let q = &u[kk * dk..(kk + 1) * dk];
                        let k = &u[kh * dk + kk * dk..kh * dk + (kk + 1) * dk];
                        let v = &u[2 * kh * dk + hv * dv..2 * kh * dk + (hv + 1) * dv];
                        let beta = sig(b[hv]);
                        let x = a[hv] + dtb[hv] as f64;
                        let sp = if x > 20.0 { x } else { x.exp().ln_1p() };
                        let g = -(alog[hv] as f64).exp() * sp;
                        let s = &mut st[hv];
                        s.iter_mut().for_each(|v| *v *= g.exp());
                        // Sᵀk
                        let stk: Vec<f64> = (0..dv)
                            .map(|j| (0..dk).map(|i| s[i * dv + j] * k[i]).sum())
                            .collect();
                        for i in 0..dk {
                            for j in 0..dv {
                                s[i * dv + j] += k[i] * beta * (v[j] - stk[j]);
                            }
                        }
                        let o: Vec<f64> = (0..dv)
                            .map(|j| (0..dk).map(|i| s[i * dv + j] * q[i]).sum())
                            .collect();
                        let o = rms(&o, ln, eps);
                        for j in 0..dv {
                            out[hv * dv + j] = o[j] * silu(z[hv * dv + j]);
                        }
                    }
                    res.push(mv(&m.mat(li2.lout), &out));
                }
                res
            }
        };
        if matches!(li.ffn, Ffn::Moe(_)) {
            routed.push(Vec::new());
        }
        for (x, o) in xs.iter_mut().zip(outs) {
            let o = match li.post_attn_norm {
                Some(p) => rms(&o, m.f32s(p), eps),
                None => o,
            };
            x.iter_mut().zip(o).for_each(|(x, o)| *x += o);
            let hn = rms(x, m.f32s(li.ffn_norm), eps);
            let y = match &li.ffn {
                Ffn::Dense { w1, w2, w3 } => {
                    let g = mv(&m.mat(*w1), &hn);
                    let u = mv(&m.mat(*w3), &hn);
                    let hid: Vec<f64> = g.iter().zip(&u).map(|(&g, &u)| act(&h, g, u)).collect();
                    mv(&m.mat(*w2), &hid)
                }
                Ffn::Moe(e) => {
                    let (y, ids) = moe(m, e, &hn);
                    routed.last_mut().expect("a layer's list").push(ids);
                    y
                }
            };
            let y = match li.post_ffn_norm {
                Some(p) => rms(&y, m.f32s(p), eps),
                None => y,
            };
            x.iter_mut().zip(y).for_each(|(x, y)| *x += y);
        }
    }
    let mut out = Vec::with_capacity(t_len * d.vocab);
    for x in &xs {
        let xn = rms(x, m.f32s(lay.final_norm), eps);
        for l in mv(&m.mat(lay.wcls), &xn) {
            let l = if h.final_softcap > 0.0 {
                let c = h.final_softcap as f64;
                c * (l / c).tanh()
            } else {
                l
            };
            out.push(l as f32);
        }
    }
    (out, routed)
}
