//! `--target-bpw X` and `--preset NAME`: every matrix's type chosen to minimize the
//! model's predicted error under a budget of X bits per weight (as mlb-inspect counts
//! them: the bytes of every matrix, scales included, × 8 / the weights of every matrix).
//!
//! 1. **Measure.** For every matrix, a sample of its rows (evenly spaced, at most
//!    [`SAMPLE_ROWS`]; fewer for the slow codebook quantizers, [`sample_rows`]) is
//!    quantized to each candidate type ([`candidates`]: the IQ codebook types and the K
//!    types where the row is a multiple of 256, else the 32-weight types, and Q8_0) with
//!    the imatrix when given, and the importance-weighted relative error
//!    `r = Σ imp_c (w − ŵ)² / Σ imp_c w²` is taken (`imp_c`: the mean square of the
//!    matrix's input channel `c`, from the imatrix; 1 without one). With uncorrelated
//!    inputs, `r` is the noise-to-signal ratio of the matrix's output. With the input's
//!    covariance, the relative output error instead ([`output_rel_error`]; on the first
//!    [`FEEDBACK_COLS`] channels of a wider input).
//! 2. **Predict.** The model's KL divergence is predicted as `Σ_m w_m · r_m`: every
//!    matrix's output noise-to-signal ratio adds into the residual stream (the
//!    classifier's into the logits), so a matrix counts by its relative error, not by its
//!    size (the budget sees its size). `w = α_class · β_band / n_layers` for a layer's
//!    matrix (its output is one of n layers' in the residual stream) and `α_class` for
//!    the embedding and the classifier; α per class and β per depth band (first eighth
//!    of the layers, middle, last eighth) are [`SENSITIVITY`], calibrated against
//!    measured KL divergence by scripts/calibrate-mix.sh (docs/convert.md, "Mixes").
//! 3. **Allocate.** Every matrix starts at its cheapest candidate; upgrades along each
//!    matrix's lower convex hull of (bytes, predicted error) are taken in order of
//!    predicted error saved per byte while they fit the budget (ties by array order).
//!    The greedy alone strands a large upgrade that no longer fits behind many small
//!    ones (Gemma 3's 168M-weight tied embedding at Q8_0 missed a budget by 4 bytes and
//!    left 42 MB unspent), so exchanges follow: an upgrade that does not fit is taken
//!    when giving back other matrices' last upgrades, cheapest loss per byte first,
//!    frees its bytes for less predicted error than it saves; the best such exchange,
//!    repeatedly, until none saves anything. Every exchange lowers the predicted error,
//!    so this ends. Deterministic: the same checkpoint, imatrix and target give the same
//!    mix at any thread count.

use super::plan;
use crate::format::mlb::header::q8_class;
use crate::format::WType;
use crate::quant::feedback::{self, Feedback};
use crate::quant::{dequant_matrix, Q4Rule, QuantOptions, Quantized};

/// Rows of a matrix quantized to measure its error in each candidate type.
pub const SAMPLE_ROWS: usize = 64;

/// With covariances: the input channels (a multiple of 256) the output error is
/// measured on, the first ones of a wider input, with that window's own covariance and
/// error feedback. Error feedback's factorization is `O(n³)`: a 1B model's 8192-wide
/// down projections cost 64× a 2048-wide window's, and the mix would factor each one
/// besides the write. The relative error of a window estimates the whole row's (its
/// channels are any of the input's; a window has fewer later columns to compensate an
/// error, so it errs high, alike for every type).
pub const FEEDBACK_COLS: usize = 2048;

/// The rows of the [`SAMPLE_ROWS`] that measure type `t`. The codebook quantizers score
/// every grid entry for every group of 4 or 8 weights, 2-20x a K type's time per block
/// (IQ1_M's 4096 candidates the most): measured on every row, they made the planning of
/// a 1B model (2048-wide rows) 7.7x as long. An evenly spaced quarter of the sample
/// (IQ1_M: an eighth) keeps it at about twice; their errors are 1.3-1.9x apart from one
/// type to the next, far beyond the few percent a smaller sample moves them.
pub fn sample_rows(t: WType) -> usize {
    match t {
        WType::IQ1_M => SAMPLE_ROWS / 8,
        WType::IQ3_XXS | WType::IQ3_S | WType::IQ2_XXS | WType::IQ2_XS | WType::IQ2_S => {
            SAMPLE_ROWS / 4
        }
        _ => SAMPLE_ROWS,
    }
}

/// The rows of `x` (`k` sampled rows of `cols`) that measure `t`: evenly spaced among
/// them, [`sample_rows`] at most.
pub fn sample_for(t: WType, k: usize, cols: usize, x: &[f32]) -> (usize, Vec<f32>) {
    let n = k.min(sample_rows(t));
    let mut out = Vec::with_capacity(n * cols);
    for j in 0..n {
        let r = j * k / n;
        out.extend_from_slice(&x[r * cols..(r + 1) * cols]);
    }
    (n, out)
}

/// Named points: `--preset NAME` is `--target-bpw BPW`, by llama.cpp's names: the sizes
/// its K mixes reach on Llama-3-8B (llama-quantize's table: Q3_K_M 3.74 GiB is 4.0 bits
/// per weight), and the bits per weight its table gives its IQ types and mixes.
pub const PRESETS: [(&str, f64); 10] = [
    ("iq2_m", 2.7),
    ("iq3_xxs", 3.06),
    ("iq3_m", 3.66),
    ("q3_k_m", 4.0),
    ("iq4_xs", 4.25),
    ("q4_k_s", 4.6),
    ("q4_k_m", 4.9),
    ("q5_k_m", 5.7),
    ("q6_k", 6.6),
    ("q8_0", 8.5),
];

/// The bits per weight of preset `name`.
pub fn preset(name: &str) -> Option<f64> {
    PRESETS
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|&(_, b)| b)
}

/// The types a matrix of `cols` columns may take, smallest first, every one larger than
/// the one before: on rows of whole super-blocks the 256-weight types from 1.75 bits
/// (IQ1_M 1.75, IQ2_XXS 2.06, IQ2_XS 2.31, IQ2_S 2.56, IQ3_XXS 3.06, IQ3_S 3.44, IQ4_XS
/// 4.25, Q4_K 4.5, Q5_K 5.5, Q6_K 6.56), else the 32-weight types (IQ4_NL 4.5, Q5_0 5.5,
/// Q6_0 6.5 bits; Q6_0 left out with `gguf`, GGUF's types only); Q8_0 always. All but
/// Q6_0 are GGUF's. Left out as dominated: Q2_K (2.625 bits, more error than IQ2_S's
/// 2.56) and Q3_K (the size of IQ3_S, 1.2-2.6x its error): measured on 143 matrices of a
/// 1B model's random weights and SmolLM2's and Gemma 3's down projections, Q3_K was on
/// no matrix's lower hull and Q2_K on one. Q4_1 and Q5_1 are left out: per bit they are
/// no better than these on general weights (docs/benchmarks-quality.md), and they would
/// win only on checkpoints that were Q4_1 before (SmolLM2's here).
pub fn candidates(cols: usize, gguf: bool) -> &'static [WType] {
    use WType::*;
    match (cols.is_multiple_of(256), gguf) {
        (true, _) => &[
            IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_XS, Q4_K, Q5_K, Q6_K, Q8_0,
        ],
        (false, false) => &[IQ4_NL, Q5_0, Q6_0, Q8_0],
        (false, true) => &[IQ4_NL, Q5_0, Q8_0],
    }
}

/// Bytes of a `rows × cols` matrix of type `t` in a file with f16 scales.
pub fn matrix_bytes(t: WType, rows: usize, cols: usize) -> u64 {
    let scales = if t.has_scales() {
        rows * cols / 32 * 2
    } else {
        0
    };
    (rows * t.row_bytes(cols) + scales) as u64
}

/// Sensitivity of the predicted KL divergence to a matrix's relative error: α per class,
/// β per depth band (first eighth, middle, last eighth of the layers). Only the ratios
/// matter (the allocation is the same for any common factor).
#[derive(Debug, Clone, Copy)]
pub struct Sensitivity {
    pub tok_emb: f64,
    /// The classifier (and a shared tok_emb, which is the classifier).
    pub wcls: f64,
    pub wqk: f64,
    pub wv: f64,
    pub wo: f64,
    pub w13: f64,
    pub w2: f64,
    /// lb, la (Qwen3.5's gates; they stay Q8_0, so this only weighs nothing).
    pub other: f64,
    pub bands: [f64; 3],
    /// A factor on the routed experts' w13/w2 α: each expert sees only the tokens
    /// routed to it and its output is weighed by the router, so its noise reaches the
    /// residual stream scaled down.
    pub experts: f64,
}

/// The sensitivities, fitted to the mean KL divergence against BF16 of files with one
/// class (or band) quantized, on SmolLM2-135M and Gemma 3 270M (scripts/calibrate-mix.sh;
/// docs/convert.md, "Mixes: calibration", has the measurements). The layer classes are
/// scaled to a geometric mean of 1; each is the geometric mean of the two models'.
pub const SENSITIVITY: Sensitivity = Sensitivity {
    // Not measured: both models tie it to the classifier. An untied embedding's noise is
    // one more input to the residual stream, weighed as a layer matrix of a 24-layer
    // model (between these two's 30 and 18).
    tok_emb: 1.0 / 24.0,
    wcls: 20.25,
    wqk: 0.50,
    wv: 1.03,
    wo: 0.81,
    w13: 1.35,
    w2: 1.78,
    // lb, la: pinned to Q8_0, never chosen.
    other: 1.0,
    bands: [0.84, 1.0, 0.90],
    // Not calibrated yet (no MoE model in scripts/calibrate-mix.sh): the field's finding
    // that routed experts take fewer bits than attention and shared experts, as a
    // factor of one half.
    experts: 0.5,
};

impl Sensitivity {
    /// α of a matrix of class bits `class` (a shared tok_emb has the wcls bit too).
    pub fn class(&self, class: u32) -> f64 {
        // The first bit set wins: WCLS before TOK_EMB.
        [
            (q8_class::WCLS, self.wcls),
            (q8_class::TOK_EMB, self.tok_emb),
            (q8_class::WQK, self.wqk),
            (q8_class::WV, self.wv),
            (q8_class::WO, self.wo),
            (q8_class::W13, self.w13),
            (q8_class::W2, self.w2),
        ]
        .into_iter()
        .find(|&(bit, _)| class & bit != 0)
        .map_or(self.other, |(_, alpha)| alpha)
    }

    /// The factor of array `name` beyond its class: [`Self::experts`] for a routed
    /// expert's matrix (ew1, ew2, ew3), 1 otherwise.
    pub fn group(&self, name: &str) -> f64 {
        match plan::group_of(name) {
            Some("experts") => self.experts,
            _ => 1.0,
        }
    }

    /// β of layer `l` of `n` over `n` (a layer's output is one of n in the residual
    /// stream); tok_emb and the classifier: 1.
    pub fn band(&self, layer: Option<u32>, n: usize) -> f64 {
        match layer {
            Some(_) => self.bands[band(layer, n)] / n.max(1) as f64,
            None => 1.0,
        }
    }
}

/// The depth band of layer `l` of `n`: 0 for the first eighth (at least one layer), 2 for
/// the last eighth, 1 otherwise and for matrices outside the layers.
pub fn band(layer: Option<u32>, n: usize) -> usize {
    let Some(l) = layer.map(|l| l as usize) else {
        return 1;
    };
    let e = n.div_ceil(8).max(1);
    if l < e {
        0
    } else if l + e >= n {
        2
    } else {
        1
    }
}

/// One matrix of the mix: what was measured and what was chosen.
#[derive(Debug, Clone)]
pub struct MixRow {
    /// Index among the file's matrices (array order).
    pub index: usize,
    pub name: String,
    pub class: u32,
    pub layer: Option<u32>,
    pub rows: usize,
    pub cols: usize,
    /// Candidate types with their bytes and measured relative error, smallest first.
    pub cands: Vec<(WType, u64, f64)>,
    /// α · β of the matrix.
    pub weight: f64,
    /// `None`: the matrix's type is fixed (lb, la: Q8_0; or a `--types` tensor rule).
    pub fixed: Option<WType>,
    pub chosen: WType,
}

impl MixRow {
    /// Bytes of the chosen type.
    pub fn bytes(&self) -> u64 {
        match self.cands.iter().find(|c| c.0 == self.chosen) {
            Some(c) => c.1,
            None => matrix_bytes(self.chosen, self.rows, self.cols),
        }
    }
}

/// The importance-weighted relative error of `x` (`rows × cols`, sampled rows) stored
/// as `t`: `Σ imp_c (x − x̂)² / Σ imp_c x²` in f64 (0 for an all-zero sample).
pub fn rel_error(t: WType, rows: usize, cols: usize, x: &[f32], imp: Option<&[f32]>) -> f64 {
    let Some(xq) = round_trip(t, rows, cols, x, imp, None) else {
        return f64::INFINITY; // a scale beyond f16: never chosen
    };
    let (mut e, mut s) = (0f64, 0f64);
    for (xr, qr) in x.chunks_exact(cols).zip(xq.chunks_exact(cols)) {
        for (c, (&a, &b)) in xr.iter().zip(qr).enumerate() {
            let w = imp.map_or(1.0, |i| i[c] as f64);
            e += w * (a as f64 - b as f64).powi(2);
            s += w * (a as f64).powi(2);
        }
    }
    if s > 0.0 {
        e / s
    } else {
        0.0
    }
}

/// With the input's covariance `h` (cols × cols): the relative output error
/// `tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)` of the sampled rows `x` stored as `t`, quantized as the
/// file is (with error feedback `fb` when given). With uncorrelated inputs it is
/// [`rel_error`].
pub fn output_rel_error(
    t: WType,
    rows: usize,
    cols: usize,
    x: &[f32],
    imp: Option<&[f32]>,
    h: &[f64],
    fb: Option<&Feedback>,
) -> f64 {
    match round_trip(t, rows, cols, x, imp, fb) {
        Some(xq) => feedback::output_error(rows, cols, x, &xq, h, crate::kernels::sub_product),
        None => f64::INFINITY,
    }
}

/// `x` quantized to `t` (f16 scales, as in a mixed file) and dequantized; `None` when
/// a scale does not fit.
fn round_trip(
    t: WType,
    rows: usize,
    cols: usize,
    x: &[f32],
    imp: Option<&[f32]>,
    fb: Option<&Feedback>,
) -> Option<Vec<f32>> {
    let opts = QuantOptions {
        scale_f16: true,
        q4_rule: Q4Rule::Search,
        imatrix: imp,
    };
    let q: Quantized = feedback::quantize(t, rows, cols, x, &opts, fb).ok()?;
    Some(dequant_matrix(&q.view()))
}

/// The lower convex hull of a matrix's candidates in (bytes, predicted error): indices
/// into `cands`, bytes increasing, error strictly decreasing, slopes increasing.
fn hull(cands: &[(WType, u64, f64)], weight: f64) -> Vec<usize> {
    let mut h: Vec<usize> = Vec::new();
    for (i, c) in cands.iter().enumerate() {
        let err = weight * c.2;
        if let Some(&last) = h.last() {
            if err >= weight * cands[last].2 || c.1 <= cands[last].1 {
                continue; // no better for more bytes
            }
        }
        while h.len() >= 2 {
            let (a, b) = (&cands[h[h.len() - 2]], &cands[h[h.len() - 1]]);
            let s_ab = (weight * (b.2 - a.2)) / (b.1 - a.1) as f64;
            let s_bc = (err - weight * b.2) / (c.1 - b.1) as f64;
            if s_bc <= s_ab {
                h.pop(); // b lies above the segment a–c
            } else {
                break;
            }
        }
        h.push(i);
    }
    h
}

/// Chooses every free matrix's type so that the bytes of all matrices fit in `budget`,
/// minimizing `Σ weight · r` (the module docs' greedy, then exchanges). `Err` with the
/// smallest mix's bits per weight when even that does not fit.
pub fn allocate(rows: &mut [MixRow], budget: u64) -> Result<(), f64> {
    let weights: u64 = rows.iter().map(|r| (r.rows * r.cols) as u64).sum();
    let mut hulls: Vec<Vec<usize>> = rows.iter().map(|r| hull(&r.cands, r.weight)).collect();
    for (r, h) in rows.iter().zip(hulls.iter_mut()) {
        if r.fixed.is_some() {
            h.truncate(1); // never moves: its bytes are r.bytes() whatever the hull says
        }
    }
    let mut used = 0u64;
    for (r, h) in rows.iter_mut().zip(&hulls) {
        if r.fixed.is_none() {
            r.chosen = r.cands[h[0]].0;
        }
        used += r.bytes();
    }
    if used > budget {
        return Err(used as f64 * 8.0 / weights as f64);
    }
    let mut mix = Mix {
        at: vec![0; rows.len()],
        rows,
        hulls: &hulls,
        used,
    };
    // Greedy by error saved per byte; a skipped upgrade retires its matrix.
    let mut done = vec![false; mix.rows.len()];
    loop {
        let mut best: Option<(f64, usize)> = None;
        for (i, _) in done.iter().enumerate().filter(|(_, &d)| !d) {
            if let Some((bytes, gain)) = mix.step(i, 1) {
                let per_byte = gain / bytes as f64;
                if best.is_none_or(|(g, _)| per_byte > g) {
                    best = Some((per_byte, i));
                }
            }
        }
        let Some((_, i)) = best else { break };
        let (bytes, _) = mix.step(i, 1).expect("a step was found");
        if mix.used + bytes <= budget {
            mix.moved(i, 1);
        } else {
            done[i] = true;
        }
    }
    // Exchanges: the best upgrade that fits once other matrices give back their last step.
    // Each one lowers Σ weight · r, so the loop ends; the cap only guards against float
    // ties that the strict comparison already excludes.
    for _ in 0..mix.rows.len() * 16 {
        let Some((i, give)) = mix.best_exchange(budget) else {
            break;
        };
        for j in give {
            mix.moved(j, -1);
        }
        mix.moved(i, 1);
    }
    debug_assert!(mix.used <= budget);
    Ok(())
}

/// The allocator's state: each matrix's position on its hull and the bytes used.
struct Mix<'a> {
    rows: &'a mut [MixRow],
    hulls: &'a [Vec<usize>],
    at: Vec<usize>,
    used: u64,
}

impl Mix<'_> {
    /// Matrix `i`'s step up (`dir` 1) or down (−1) its hull: (bytes it adds or frees,
    /// predicted error it saves or costs); `None` at the hull's end.
    fn step(&self, i: usize, dir: isize) -> Option<(u64, f64)> {
        let (h, at) = (&self.hulls[i], self.at[i]);
        let to = at.checked_add_signed(dir).filter(|&t| t < h.len())?;
        let (a, b) = (&self.rows[i].cands[h[at]], &self.rows[i].cands[h[to]]);
        Some((a.1.abs_diff(b.1), self.rows[i].weight * (a.2 - b.2).abs()))
    }

    fn moved(&mut self, i: usize, dir: isize) {
        let (bytes, _) = self.step(i, dir).expect("a step on the hull");
        self.at[i] = self.at[i].checked_add_signed(dir).expect("on the hull");
        let r = &mut self.rows[i];
        r.chosen = r.cands[self.hulls[i][self.at[i]]].0;
        if dir > 0 {
            self.used += bytes;
        } else {
            self.used -= bytes;
        }
    }

    /// The upgrade with the largest net saving once the matrices it names give back
    /// their last step (cheapest loss per byte first, until the upgrade fits).
    fn best_exchange(&self, budget: u64) -> Option<(usize, Vec<usize>)> {
        let mut downs: Vec<(f64, usize, u64, f64)> = (0..self.rows.len())
            .filter_map(|j| {
                let (bytes, loss) = self.step(j, -1)?;
                Some((loss / bytes as f64, j, bytes, loss))
            })
            .collect();
        downs.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let free = budget - self.used;
        let mut best: Option<(f64, usize, Vec<usize>)> = None;
        for i in 0..self.rows.len() {
            let Some((bytes, gain)) = self.step(i, 1) else {
                continue;
            };
            let (mut freed, mut loss, mut give) = (free, 0.0, Vec::new());
            for &(_, j, b, l) in &downs {
                if freed >= bytes || loss >= gain {
                    break;
                }
                if j != i {
                    freed += b;
                    loss += l;
                    give.push(j);
                }
            }
            let net = gain - loss;
            // Strictly better, by more than rounding: no exchange undoes another.
            if freed >= bytes && net > gain * 1e-9 && best.as_ref().is_none_or(|b| net > b.0) {
                best = Some((net, i, give));
            }
        }
        best.map(|(_, i, give)| (i, give))
    }
}

/// The mix as JSON (`mlb-convert --mix-report`): the achieved bits per weight and, per
/// matrix, its class, band weight, candidates (type, bytes, relative error) and choice.
pub fn report_json(rows: &[MixRow], bpw: f64) -> String {
    let mats: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "name": r.name,
                "class": q8_class::names(r.class).first().copied().unwrap_or("other"),
                "layer": r.layer,
                "rows": r.rows,
                "cols": r.cols,
                "weight": r.weight,
                "fixed": r.fixed.is_some(),
                "chosen": r.chosen.cli_name(),
                "candidates": r.cands.iter().map(|c| serde_json::json!({
                    "type": c.0.cli_name(), "bytes": c.1, "rel_error": c.2,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    let v = serde_json::json!({ "bits_per_weight": bpw, "matrices": mats });
    serde_json::to_string_pretty(&v).expect("plain JSON") + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The types chosen for two matrices, `a` weighing 1 and `b` `b_weight`, in `budget`.
    fn pair(
        a: &[(WType, u64, f64)],
        b: &[(WType, u64, f64)],
        b_weight: f64,
        budget: u64,
    ) -> (WType, WType) {
        let mut rows = vec![row(0, a.to_vec(), 1.0), row(1, b.to_vec(), b_weight)];
        allocate(&mut rows, budget).unwrap();
        (rows[0].chosen, rows[1].chosen)
    }

    fn row(index: usize, cands: Vec<(WType, u64, f64)>, weight: f64) -> MixRow {
        MixRow {
            index,
            name: format!("m{index}"),
            class: q8_class::W13,
            layer: Some(0),
            rows: 1,
            cols: 100,
            chosen: cands[0].0,
            cands,
            weight,
            fixed: None,
        }
    }

    #[test]
    fn hull_drops_dominated_and_concave_points() {
        use WType::*;
        // Q5_K is above the segment Q4_K–Q6_K: skipped; Q8_0 saves nothing: skipped.
        let c = vec![
            (Q4_K, 100, 1.0),
            (Q5_K, 150, 0.8),
            (Q6_K, 200, 0.2),
            (Q8_0, 300, 0.2),
        ];
        assert_eq!(hull(&c, 2.0), vec![0, 2]);
        let c = vec![
            (Q4_K, 100, 1.0),
            (Q5_K, 150, 0.4),
            (Q6_K, 200, 0.2),
            (Q8_0, 300, 0.1),
        ];
        assert_eq!(hull(&c, 1.0), vec![0, 1, 2, 3]);
    }

    #[test]
    fn greedy_spends_the_budget_where_it_saves_most() {
        use WType::*;
        let a = vec![(IQ4_NL, 100, 1.0), (Q5_0, 120, 0.5), (Q8_0, 200, 0.01)];
        let b = vec![(IQ4_NL, 100, 1.0), (Q5_0, 120, 0.9), (Q8_0, 200, 0.8)];
        // 240 bytes: both can take Q5_0, but a's saving per byte is larger.
        assert_eq!(pair(&a, &b, 1.0, 240), (Q5_0, Q5_0));
        assert_eq!(pair(&a, &b, 1.0, 300), (Q8_0, IQ4_NL));
        // A sensitivity weight reverses it.
        assert_eq!(pair(&a, &b, 100.0, 300).1, Q8_0);
        let mut rows = vec![row(0, a, 1.0)];
        assert_eq!(allocate(&mut rows, 99), Err(8.0));
    }

    #[test]
    fn exchanges_give_back_small_upgrades_for_a_large_one() {
        use WType::*;
        // The greedy takes b first (0.02 saved per byte against a's 0.01), and then a's
        // 100 bytes no longer fit; giving b's back (0.2 lost) affords a (1.0 saved).
        let a = vec![(IQ4_NL, 100, 1.0), (Q8_0, 200, 0.0)];
        let b = vec![(IQ4_NL, 10, 1.0), (Q5_0, 20, 0.8)];
        assert_eq!(pair(&a, &b, 1.0, 210), (Q8_0, IQ4_NL));
        // Not when the give-back costs more than the upgrade saves.
        assert_eq!(pair(&a, &b, 10.0, 210), (IQ4_NL, Q5_0));
        // Nor when everything given back still does not make room.
        assert_eq!(pair(&a, &b, 1.0, 199), (IQ4_NL, Q5_0));
        // Several small ones, cheapest loss per byte first; the others stay.
        let c = vec![(IQ4_NL, 10, 1.0), (Q5_0, 20, 0.5)];
        let mut rows = vec![
            row(0, a, 1.0),
            row(1, b.clone(), 1.0),
            row(2, b, 1.0),
            row(3, c, 1.0),
        ];
        allocate(&mut rows, 240).unwrap();
        let chosen: Vec<WType> = rows.iter().map(|r| r.chosen).collect();
        assert_eq!(chosen, vec![Q8_0, IQ4_NL, IQ4_NL, Q5_0]);
        assert!(rows.iter().map(MixRow::bytes).sum::<u64>() <= 240);
    }

    #[test]
    fn bands_and_presets() {
        assert_eq!(
            (band(Some(0), 30), band(Some(3), 30), band(Some(4), 30)),
            (0, 0, 1)
        );
        assert_eq!(
            (band(Some(26), 30), band(Some(25), 30), band(None, 30)),
            (2, 1, 1)
        );
        assert_eq!((band(Some(0), 2), band(Some(1), 2)), (0, 2));
        assert_eq!(preset("Q4_K_M"), Some(4.9));
        assert_eq!(preset("q3"), None);
    }

    #[test]
    fn layer_weights_are_shared_over_the_layers() {
        let s = SENSITIVITY;
        let mid = |n: usize| s.class(q8_class::W13) * s.band(Some(n as u32 / 2), n);
        // A layer matrix's output is one of n in the residual stream.
        assert!((mid(30) * 30.0 - mid(18) * 18.0).abs() < 1e-12);
        assert_eq!(s.band(None, 30), 1.0);
        // Measured: the classifier's relative error costs hundreds of times a layer
        // matrix's (the KL divergence is its logits' noise).
        let cls = s.class(q8_class::WCLS | q8_class::TOK_EMB);
        assert!(cls > 100.0 * mid(18), "{cls} {}", mid(18));
    }

    /// Bell-shaped values, as trained weights are (the sum of three uniforms).
    fn bell(seed: u64, n: usize) -> Vec<f32> {
        let mut r = crate::rng::Rng(seed);
        (0..n)
            .map(|_| r.next_f32() + r.next_f32() + r.next_f32())
            .collect()
    }

    #[test]
    fn relative_error_orders_the_types() {
        let x = bell(1, 8 * 512);
        let cands = candidates(512, false);
        let e: Vec<f64> = cands
            .iter()
            .map(|&t| rel_error(t, 8, 512, &x, None))
            .collect();
        assert!(e.windows(2).all(|w| w[0] > w[1]), "{e:?}");
        // Q4_K: about 1/(12·15²)·12 of the signal, ~0.5%.
        let q4k = cands.iter().position(|&t| t == WType::Q4_K).unwrap();
        assert!(e[q4k] > 1e-3 && e[q4k] < 2e-2, "{e:?}");
    }

    #[test]
    fn candidates_grow() {
        // (That they are GGUF's types: convert::gguf::types' tests, which may import
        // this module, not the other way round.)
        for (cols, gguf) in [(512, false), (512, true), (576, false), (576, true)] {
            let c = candidates(cols, gguf);
            // The hull needs strictly growing sizes: a same-size type would be dropped
            // whatever its error.
            let bytes: Vec<u64> = c.iter().map(|&t| matrix_bytes(t, 4, cols)).collect();
            assert!(bytes.windows(2).all(|w| w[0] < w[1]), "{cols}: {c:?}");
        }
        // Down to IQ1_M's 1.75 bits on whole super-blocks; IQ4_NL's 4.5 otherwise.
        assert_eq!(candidates(2048, true)[0], WType::IQ1_M);
        assert_eq!(candidates(576, true)[0], WType::IQ4_NL);
    }

    #[test]
    fn slow_types_measure_an_even_subset() {
        let cols = 4;
        let x: Vec<f32> = (0..64 * cols).map(|i| (i / cols) as f32).collect();
        let first = |v: &[f32]| v.chunks(cols).map(|r| r[0]).collect::<Vec<f32>>();
        let (n, s) = sample_for(WType::IQ1_M, 64, cols, &x);
        assert_eq!(
            (n, first(&s)),
            (8, vec![0., 8., 16., 24., 32., 40., 48., 56.])
        );
        let (n, s) = sample_for(WType::IQ3_S, 64, cols, &x);
        assert_eq!((n, first(&s)[..3].to_vec()), (16, vec![0., 4., 8.]));
        let (n, s) = sample_for(WType::Q4_K, 64, cols, &x);
        assert_eq!((n, s), (64, x.clone()));
        // A matrix of fewer rows than the sample: all of them.
        let (n, s) = sample_for(WType::IQ2_S, 5, cols, &x[..5 * cols]);
        assert_eq!((n, s.len()), (5, 5 * cols));
    }

    /// Measured errors, then a low budget: the mix takes codebook types, stays within the
    /// bytes, and spends them (no type a bit larger would still fit).
    #[test]
    fn low_targets_take_codebook_types() {
        let (rows, cols) = (4, 512);
        let mats: Vec<Vec<f32>> = (0..6).map(|s| bell(s + 1, rows * cols)).collect();
        let weights = (6 * rows * cols) as f64;
        for bpw in [1.8, 2.0, 2.5, 3.0] {
            let mut mix: Vec<MixRow> = mats
                .iter()
                .enumerate()
                .map(|(i, x)| {
                    let cands = candidates(cols, true)
                        .iter()
                        .map(|&t| {
                            let e = rel_error(t, rows, cols, x, None);
                            (t, matrix_bytes(t, rows, cols), e)
                        })
                        .collect();
                    row(i, cands, 1.0 + i as f64)
                })
                .collect();
            for r in &mut mix {
                (r.rows, r.cols) = (rows, cols);
            }
            let budget = (bpw * weights / 8.0) as u64;
            allocate(&mut mix, budget).unwrap();
            let used: u64 = mix.iter().map(MixRow::bytes).sum();
            assert!(used <= budget, "{bpw}: {used} > {budget}");
            assert!(used as f64 * 8.0 / weights > bpw - 0.25, "{bpw}: {used}");
            let chosen: Vec<WType> = mix.iter().map(|r| r.chosen).collect();
            assert!(
                chosen.iter().all(|t| WType::CODEBOOKS.contains(t)),
                "{bpw}: {chosen:?}"
            );
        }
        let mut one = vec![row(0, vec![(WType::IQ1_M, 56, 0.2)], 1.0)];
        one[0].cols = 256;
        assert_eq!(allocate(&mut one, 55), Err(1.75));
    }
}
