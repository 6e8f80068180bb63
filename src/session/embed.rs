//! Embeddings: one vector per text, pooled from the model's final hidden states (the
//! classifier's input, `h_t = rmsnorm(x_t, final_norm)`, `dim` values per position;
//! [`Session::feed_hidden`]):
//!
//! ```text
//! mean:  e = (Σ_t h_t) / n          summed in f64 in position order, then rounded to f32
//! last:  e = h_{n−1}                the last position's (a decoder's only one that saw it all)
//! cls:   e = h_0                    the first position's (sentence-transformers' CLS token)
//! then, with `dimensions` d:  e = e[..d]
//! normalized:  e_i = e_i / sqrt(Σ_j e_j²)     in f64, rounded to f32 (a zero vector stays zero)
//! ```
//!
//! A plain decoder's own choice is the last token; [`Engine::pooling`] says which the
//! model wants (the `.mlb` header's `pooling` hint, from sentence-transformers' config),
//! and a caller may override it.

use std::fmt;
use std::str::FromStr;

use super::engine::Engine;
use super::error::SessionError;
use super::sequence::Session;
use crate::format::mlb::header::pooling;

/// How the hidden states of a text's positions become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pooling {
    /// The mean over every position.
    Mean,
    /// The last position's (a causal model's only position that saw the whole text).
    #[default]
    Last,
    /// The first position's (sentence-transformers' CLS pooling).
    Cls,
}

impl Pooling {
    pub fn as_str(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Last => "last",
            Pooling::Cls => "cls",
        }
    }

    /// Whether every position's hidden state is needed (not only the last); then the
    /// text is read from its first position.
    pub fn every(self) -> bool {
        self != Pooling::Last
    }

    /// The pooling a header's `pooling` code names (none given: the last token).
    pub fn from_header(code: u32) -> Pooling {
        match code {
            pooling::MEAN => Pooling::Mean,
            pooling::CLS => Pooling::Cls,
            _ => Pooling::Last,
        }
    }
}

impl fmt::Display for Pooling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Pooling {
    type Err = String;

    fn from_str(s: &str) -> Result<Pooling, String> {
        match s {
            "mean" => Ok(Pooling::Mean),
            "last" => Ok(Pooling::Last),
            "cls" => Ok(Pooling::Cls),
            _ => Err(format!("{s:?}: give mean, last or cls")),
        }
    }
}

/// One text's pooling, fed its positions' hidden states in order.
#[derive(Debug, Clone)]
pub struct Pooler {
    pooling: Pooling,
    /// dim: the sum of the rows (mean).
    sum: Vec<f64>,
    /// dim: the latest row (last), or the first (cls).
    last: Vec<f32>,
    rows: usize,
}

impl Pooler {
    pub fn new(pooling: Pooling, dim: usize) -> Pooler {
        Pooler {
            pooling,
            sum: if pooling == Pooling::Mean {
                vec![0.0; dim]
            } else {
                Vec::new()
            },
            last: vec![0.0; dim],
            rows: 0,
        }
    }

    pub fn pooling(&self) -> Pooling {
        self.pooling
    }

    /// The hidden state of the next position.
    pub fn add(&mut self, row: &[f32]) {
        match self.pooling {
            Pooling::Mean => {
                for (s, &v) in self.sum.iter_mut().zip(row) {
                    *s += f64::from(v);
                }
            }
            Pooling::Last => self.last.copy_from_slice(row),
            Pooling::Cls if self.rows == 0 => self.last.copy_from_slice(row),
            Pooling::Cls => {}
        }
        self.rows += 1;
    }

    /// Positions seen.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The pooled vector, cut to its first `dimensions` values (all with `None`),
    /// normalized to length 1 with `normalize` (module docs).
    pub fn finish(&self, dimensions: Option<usize>, normalize: bool) -> Vec<f32> {
        let mut e: Vec<f32> = match self.pooling {
            Pooling::Mean => {
                let n = self.rows.max(1) as f64;
                self.sum.iter().map(|&s| (s / n) as f32).collect()
            }
            Pooling::Last | Pooling::Cls => self.last.clone(),
        };
        if let Some(d) = dimensions {
            e.truncate(d);
        }
        if normalize {
            l2_normalize(&mut e);
        }
        e
    }
}

/// `e / sqrt(Σ e²)` in f64, rounded to f32; a zero vector stays zero.
pub fn l2_normalize(e: &mut [f32]) {
    let norm = e
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        .sqrt();
    if norm > 0.0 {
        for v in e {
            *v = (f64::from(*v) / norm) as f32;
        }
    }
}

impl Engine {
    /// How this model pools its hidden states into an embedding: as its header's
    /// `pooling` says, else the last token (a decoder's last position is the only one
    /// that saw the whole text).
    pub fn pooling(&self) -> Pooling {
        Pooling::from_header(self.mlb().header().pooling)
    }
}

impl Session<'_> {
    /// The embedding of `ids` fed after what the session holds (to embed a text alone,
    /// [`Session::reset`] first): their final hidden states pooled with `pooling`
    /// (mean: over the ids fed here), not normalized ([`Pooler::finish`] and
    /// [`l2_normalize`] for that). Afterwards the session holds the ids and no logits.
    pub fn embed(&mut self, ids: &[u32], pooling: Pooling) -> Result<Vec<f32>, SessionError> {
        let mut p = Pooler::new(pooling, self.engine().config().dim);
        self.feed_hidden(ids, pooling.every(), &mut |_, row| p.add(row))?;
        Ok(p.finish(None, false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooling_and_normalization() {
        let mut m = Pooler::new(Pooling::Mean, 2);
        m.add(&[1.0, 2.0]);
        m.add(&[3.0, 6.0]);
        assert_eq!(m.finish(None, false), vec![2.0, 4.0]);
        assert_eq!(m.finish(Some(1), true), vec![1.0]);
        let e = m.finish(None, true);
        assert!((e[0] * e[0] + e[1] * e[1] - 1.0).abs() < 1e-6);
        let mut l = Pooler::new(Pooling::Last, 2);
        l.add(&[1.0, 2.0]);
        l.add(&[0.0, 0.0]);
        assert_eq!(l.finish(None, true), vec![0.0, 0.0], "zero stays zero");
        assert_eq!(l.rows(), 2);
        assert_eq!("mean".parse::<Pooling>(), Ok(Pooling::Mean));
        assert_eq!("cls".parse::<Pooling>(), Ok(Pooling::Cls));
        assert!("max".parse::<Pooling>().is_err());
        let mut c = Pooler::new(Pooling::Cls, 2);
        c.add(&[3.0, 4.0]);
        c.add(&[1.0, 1.0]);
        assert_eq!(c.finish(None, false), vec![3.0, 4.0]);
        assert_eq!(Pooling::from_header(pooling::MEAN), Pooling::Mean);
        assert_eq!(Pooling::from_header(pooling::NONE), Pooling::Last);
    }
}
