//! RoPE as llama.cpp stores it: `rope.scaling.*` read into the description, and Llama 3
//! scaling as per-frequency factors (`rope_freqs.weight`) both ways.

use super::meta::{usize_of, Meta};
use crate::convert::desc::{Dims, Rope, RopeScaling, Yarn};
use crate::convert::error::{ConvertError, Result};
use crate::format::gguf::dequant;

/// The `rope` section: the base (llama.cpp's default 10000), the rotated dimensions
/// (default the head size), the scaling, or Llama 3's per-frequency factors
/// (`rope_freqs.weight`, whose name is returned: the description consumed it). The
/// sliding layers' base is the window's ([`super::desc`]).
pub fn rope(m: &Meta, dims: &Dims) -> Result<(Rope, Option<String>)> {
    let head_dim = dims.head_dim;
    let rot_dim = match m.u64_opt("rope.dimension_count")? {
        Some(r) => usize_of(m, "rope.dimension_count", r)?,
        None => head_dim,
    };
    let theta = m.f64_opt("rope.freq_base")?.unwrap_or(10_000.0);
    if theta <= 0.0 {
        return Err(m.err("rope.freq_base", theta, "must be > 0"));
    }
    let mut scaling = rope_scaling(m, m.u64_req("context_length")?)?;
    let mut consumed = None;
    if let Some(t) = m.v.tensor("rope_freqs.weight") {
        if scaling != RopeScaling::None {
            return Err(ConvertError::tensor(
                m.file,
                t.name,
                "per-frequency factors together with a RoPE scaling type cannot be expressed",
            ));
        }
        let mut factors = vec![0f32; t.cols() as usize];
        if t.rows() != 1
            || t.cols() as usize != head_dim / 2
            || !dequant::dequantize_row(t.ty, m.v.data(t), &mut factors)
        {
            return Err(ConvertError::tensor(
                m.file,
                t.name,
                format!(
                    "{} {}: expected {} F32 frequency factors",
                    t.ty,
                    t.shape_text(),
                    head_dim / 2
                ),
            ));
        }
        let orig = m
            .u64_opt("rope.scaling.original_context_length")?
            .unwrap_or(8192)
            .clamp(1, u32::MAX as u64) as u32;
        scaling = llama3_from_factors(theta, head_dim, &factors, orig)
            .map_err(|msg| ConvertError::tensor(m.file, t.name, msg))?;
        consumed = Some(t.name.to_string());
    }
    let _ = m.get("rope.scaling.finetuned"); // no effect on the math
    let rope = Rope {
        theta,
        scaling,
        local_theta: None,
        rot_dim,
    };
    Ok((rope, consumed))
}

/// `rope.scaling.*` as llama.cpp reads it: type default "linear", factor 0 means none;
/// yarn's attention factor is get_mscale(f) times `rope.scaling.attn_factor`, its betas
/// 32 and 1 (llama.cpp reads no yarn_* key for these architectures: such keys are
/// refused rather than guessed at, except the betas at those very values, which
/// llama.cpp's converter writes for gpt-oss).
fn rope_scaling(m: &Meta, ctx: u64) -> Result<RopeScaling> {
    let ty = m.str_opt("rope.scaling.type")?.unwrap_or("linear");
    let factor = match m.f64_opt("rope.scaling.factor")? {
        Some(f) => Some(f),
        None => m.f64_opt("rope.scale_linear")?,
    }
    .unwrap_or(0.0);
    let attn = m.f64_opt("rope.scaling.attn_factor")?;
    for (k, used) in [
        ("rope.scaling.yarn_beta_fast", 32.0),
        ("rope.scaling.yarn_beta_slow", 1.0),
    ] {
        if m.v.get(&m.full(k)).and_then(|v| v.as_f64()) == Some(used) {
            let _ = m.get(k);
        }
    }
    for k in [
        "rope.scaling.yarn_beta_fast",
        "rope.scaling.yarn_beta_slow",
        "rope.scaling.yarn_attn_factor",
        "rope.scaling.yarn_log_multiplier",
        "rope.scaling.yarn_ext_factor",
    ] {
        if let Some(v) = m.v.get(&m.full(k)).filter(|_| !m.was_read(k)) {
            return Err(m.err(
                k,
                v,
                format!(
                    "llama.cpp ignores this key for {}; refusing rather than guessing which RoPE the model needs",
                    m.arch
                ),
            ));
        }
    }
    if factor < 0.0 {
        return Err(m.err("rope.scaling.factor", factor, "must be ≥ 0"));
    }
    let scaling = match ty {
        "none" => RopeScaling::None,
        "linear" if factor == 0.0 || factor == 1.0 => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor },
        "yarn" => {
            if factor == 0.0 {
                return Err(m.err("rope.scaling.factor", "missing", "yarn needs a factor"));
            }
            let orig = m
                .u64_opt("rope.scaling.original_context_length")?
                .unwrap_or(ctx);
            if orig == 0 || orig > u32::MAX as u64 {
                return Err(m.err("rope.scaling.original_context_length", orig, "must be > 0"));
            }
            let mscale = if factor <= 1.0 {
                1.0
            } else {
                0.1 * factor.ln() + 1.0
            };
            RopeScaling::Yarn(Yarn {
                factor,
                beta_fast: 32.0,
                beta_slow: 1.0,
                orig: orig as u32,
                attn_factor: mscale * attn.unwrap_or(1.0),
                truncate: true,
            })
        }
        other => {
            return Err(m.err(
                "rope.scaling.type",
                format!("{other:?}"),
                "unsupported RoPE scaling (none, linear or yarn)",
            ))
        }
    };
    if attn.is_some() && !matches!(scaling, RopeScaling::Yarn(_)) && attn != Some(1.0) {
        return Err(m.err(
            "rope.scaling.attn_factor",
            attn.unwrap_or(0.0),
            "a RoPE attention factor without yarn cannot be expressed",
        ));
    }
    Ok(scaling)
}

/// llama.cpp's per-frequency factors for Llama 3 RoPE (`rope_freqs.weight`, the divisor
/// of each pair's frequency, as its converter's generate_extra_tensors makes them): the
/// inverse of [`llama3_from_factors`].
pub(crate) fn llama3_factors(
    theta: f64,
    head_dim: usize,
    factor: f64,
    low: f64,
    high: f64,
    orig: f64,
) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| {
            let inv = theta.powf(-2.0 * i as f64 / head_dim as f64);
            let wl = 2.0 * std::f64::consts::PI / inv;
            if wl < orig / high {
                1.0
            } else if wl > orig / low {
                factor as f32
            } else {
                let s = (orig / wl - low) / (high - low);
                (1.0 / ((1.0 - s) / factor + s)) as f32
            }
        })
        .collect()
}

/// Llama 3 RoPE parameters that reproduce llama.cpp's per-frequency factors
/// (`rope_freqs.weight`, the divisor of each pair's frequency).
///
/// With wavelength λ_i = 2π / θ^(−2i/d), the factors are 1 (λ < orig/high), f
/// (λ > orig/low), and 1 / ((1 − s)/f + s) between, s = (orig/λ − low)/(high − low):
/// s is a line in 1/λ. The line is fitted through the interpolated factors (and the
/// band edges when fewer than two lie between); `orig` is free (any scale of
/// orig, low, high gives the same factors) and taken from the file or 8192. The fit is
/// accepted only when the spec's formula reproduces every factor to 1e-5.
pub(crate) fn llama3_from_factors(
    theta: f64,
    head_dim: usize,
    factors: &[f32],
    orig: u32,
) -> std::result::Result<RopeScaling, String> {
    let n = factors.len();
    let u: Vec<f64> = (0..n)
        .map(|i| theta.powf(-2.0 * i as f64 / head_dim as f64) / (2.0 * std::f64::consts::PI))
        .collect();
    let fs: Vec<f64> = factors.iter().map(|&x| x as f64).collect();
    if fs.iter().any(|&x| !(x.is_finite() && x > 0.0)) {
        return Err("a frequency factor is not finite and positive".into());
    }
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1.0);
    if fs.iter().all(|&x| close(x, 1.0)) {
        return Ok(RopeScaling::None);
    }
    let f = fs.iter().cloned().fold(0.0f64, f64::max);
    if f <= 1.0 {
        return Err(format!(
            "largest factor {f} is not above 1: not Llama 3 scaling"
        ));
    }
    // Dims are in order of falling frequency: unscaled, interpolated, scaled.
    let unscaled: Vec<usize> = (0..n).filter(|&i| close(fs[i], 1.0)).collect();
    let scaled: Vec<usize> = (0..n).filter(|&i| close(fs[i], f)).collect();
    let mid: Vec<usize> = (0..n)
        .filter(|&i| !close(fs[i], 1.0) && !close(fs[i], f))
        .collect();
    if scaled.is_empty() {
        return Err("no frequency is fully scaled: the factor cannot be determined".into());
    }
    let s_of = |x: f64| (1.0 / x - 1.0 / f) / (1.0 - 1.0 / f);
    let mut pts: Vec<(f64, f64)> = mid.iter().map(|&i| (u[i], s_of(fs[i]))).collect();
    let edge_scaled = (u[*scaled.first().expect("non-empty")], 0.0);
    let edge_unscaled = unscaled.last().map(|&i| (u[i], 1.0));
    let line = |a: (f64, f64), b: (f64, f64)| {
        let alpha = (a.1 - b.1) / (a.0 - b.0);
        (alpha, alpha * a.0 - a.1)
    };
    let (alpha, beta) = match pts.len() {
        0 => match edge_unscaled {
            Some(e) => line(e, edge_scaled),
            None => return Err("only fully scaled frequencies: not Llama 3 scaling".into()),
        },
        1 => {
            let p = pts.remove(0);
            let (a1, b1) = line(p, edge_scaled);
            match edge_unscaled {
                Some(e) if a1 * e.0 - b1 < 1.0 => line(e, p),
                _ => (a1, b1),
            }
        }
        _ => line(pts[0], pts[pts.len() - 1]),
    };
    if !(alpha.is_finite() && alpha > 0.0 && beta.is_finite() && beta > 0.0) {
        return Err("the factors do not follow Llama 3's scaling".into());
    }
    let orig_f = orig as f64;
    let fits = |low: f64, high: f64| -> std::result::Result<(), String> {
        for i in 0..n {
            let wavelen = 1.0 / u[i];
            let want = if wavelen < orig_f / high {
                1.0
            } else if wavelen > orig_f / low {
                f
            } else {
                let s = (orig_f / wavelen - low) / (high - low);
                1.0 / ((1.0 - s) / f + s)
            };
            if (want - fs[i]).abs() > 1e-5 * fs[i] {
                return Err(format!(
                    "factor {i} is {}, Llama 3 scaling with factor {f}, low {low}, high {high}, original context {orig} gives {want}",
                    fs[i]
                ));
            }
        }
        Ok(())
    };
    let mut low = beta * orig_f / alpha;
    let mut high = low + orig_f / alpha;
    fits(low, high)?;
    // The shortest decimals that give the same factors (Llama 3.1's 1 and 4, not
    // 0.99999...): the fit is exact only to float rounding.
    let sig = |x: f64, k: i32| {
        let e = 10f64.powi(k - 1 - x.abs().log10().floor() as i32);
        (x * e).round() / e
    };
    if let Some((l, h)) = (1..=9)
        .map(|k| (sig(low, k), sig(high, k)))
        .find(|&(l, h)| l > 0.0 && h > l && fits(l, h).is_ok())
    {
        (low, high) = (l, h);
    }
    Ok(RopeScaling::Llama3 {
        factor: f,
        low,
        high,
        orig,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_parameters_are_recovered() {
        // Llama 3.1 (head_dim 128): many interpolated frequencies.
        let fs = llama3_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192.0);
        let RopeScaling::Llama3 {
            factor,
            low,
            high,
            orig,
        } = llama3_from_factors(500000.0, 128, &fs, 8192).unwrap()
        else {
            panic!()
        };
        assert_eq!((factor, orig), (8.0, 8192));
        assert!(
            (low - 1.0).abs() < 1e-4 && (high - 4.0).abs() < 1e-3,
            "{low} {high}"
        );
        // The fixture: one interpolated frequency only; any equivalent parameters do.
        let fs = llama3_factors(10000.0, 16, 8.0, 1.0, 4.0, 32.0);
        assert!(llama3_from_factors(10000.0, 16, &fs, 8192).is_ok());
        // All ones: no scaling. Nonsense: refused.
        assert_eq!(
            llama3_from_factors(1e4, 16, &[1.0; 8], 8192).unwrap(),
            RopeScaling::None
        );
        assert!(
            llama3_from_factors(1e4, 16, &[2.0, 1.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0], 8192).is_err()
        );
    }
}
