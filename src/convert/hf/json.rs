//! Reading config.json keys with errors that name the file, the key (under
//! `text_config.` for a multimodal wrapper) and the value.

use std::path::Path;

use serde_json::{Map, Value};

use crate::convert::error::{ConvertError, Result};

/// Reads config.json keys with errors that name the file, key and value.
pub struct Cfg<'a> {
    pub file: &'a Path,
    /// Prefix of key names in messages (`text_config.` for wrappers).
    pub prefix: &'a str,
    pub m: &'a Map<String, Value>,
}

impl<'a> Cfg<'a> {
    pub fn key(&self, k: &str) -> String {
        format!("{}{k}", self.prefix)
    }

    pub fn err(&self, k: &str, v: impl std::fmt::Display, msg: impl Into<String>) -> ConvertError {
        ConvertError::config(self.file, self.key(k), v, msg)
    }

    pub fn get(&self, k: &str) -> Option<&'a Value> {
        match self.m.get(k) {
            Some(Value::Null) | None => None,
            v => v,
        }
    }

    pub fn usize_opt(&self, k: &str) -> Result<Option<usize>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|x| Some(x as usize))
                .ok_or_else(|| self.err(k, v, "must be a non-negative integer")),
        }
    }

    pub fn usize_req(&self, k: &str) -> Result<usize> {
        self.usize_opt(k)?
            .ok_or_else(|| self.err(k, "missing", "required key"))
    }

    pub fn f64_opt(&self, k: &str) -> Result<Option<f64>> {
        f64_in(self, self.m, k)
    }

    pub fn bool_opt(&self, k: &str) -> Result<Option<bool>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.err(k, v, "must be true or false")),
        }
    }

    /// The value `v` of key `k` as a list of one entry per layer (`n`).
    pub fn layer_list(&self, k: &str, v: &'a Value, n: usize) -> Result<&'a Vec<Value>> {
        let a = v
            .as_array()
            .ok_or_else(|| self.err(k, v, "must be a list"))?;
        if a.len() != n {
            return Err(self.err(
                k,
                format!("{} entries", a.len()),
                format!("must have num_hidden_layers ({n}) entries"),
            ));
        }
        Ok(a)
    }

    pub fn str_opt(&self, k: &str) -> Result<Option<&'a str>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.err(k, v, "must be a string")),
        }
    }
}

fn f64_in(c: &Cfg, m: &Map<String, Value>, k: &str) -> Result<Option<f64>> {
    match m.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| c.err(k, v, "must be a number")),
    }
}
