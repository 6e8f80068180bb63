//! Reading a GGUF file's metadata keys of one architecture (`{arch}.key`), with errors
//! that name the key and value, remembering which keys were read so that any other key
//! under the architecture's prefix can be refused.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::path::Path;

use super::arch::GgufArch;
use crate::convert::error::{ConvertError, Result};
use crate::format::gguf::{Array, GgufView, Value};

/// Reads metadata keys of one architecture, remembering which were read.
pub struct Meta<'v, 'a> {
    pub v: &'v GgufView<'a>,
    pub file: &'v Path,
    pub arch: &'static str,
    used: RefCell<BTreeSet<String>>,
}

impl<'v, 'a> Meta<'v, 'a> {
    pub fn new(v: &'v GgufView<'a>, file: &'v Path, arch: &'static str) -> Self {
        Meta {
            v,
            file,
            arch,
            used: RefCell::new(BTreeSet::new()),
        }
    }

    pub fn full(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch)
    }

    pub fn err(
        &self,
        suffix: &str,
        v: impl std::fmt::Display,
        msg: impl Into<String>,
    ) -> ConvertError {
        ConvertError::config(self.file, self.full(suffix), v, msg)
    }

    pub fn get(&self, suffix: &str) -> Option<Value<'a>> {
        let k = self.full(suffix);
        let v = self.v.get(&k).copied();
        self.used.borrow_mut().insert(k);
        v
    }

    /// The value of `suffix` as `read` reads it; one it cannot read is refused with `rule`.
    fn typed<T>(
        &self,
        suffix: &str,
        read: impl FnOnce(Value<'a>) -> Option<T>,
        rule: &str,
    ) -> Result<Option<T>> {
        self.get(suffix)
            .map(|v| read(v).ok_or_else(|| self.err(suffix, v, rule)))
            .transpose()
    }

    pub fn u64_opt(&self, suffix: &str) -> Result<Option<u64>> {
        self.typed(suffix, |v| v.as_u64(), "must be a non-negative integer")
    }

    /// Refuses an integer key that is set to anything but `want` (what the file's
    /// other facts give): `rule` says why.
    pub fn u64_eq(&self, suffix: &str, want: usize, rule: String) -> Result<()> {
        match self.u64_opt(suffix)? {
            Some(x) if x as usize != want => Err(self.err(suffix, x, rule)),
            _ => Ok(()),
        }
    }

    pub fn u64_req(&self, suffix: &str) -> Result<u64> {
        self.u64_opt(suffix)?
            .ok_or_else(|| self.err(suffix, "missing", "required key"))
    }

    pub fn f64_opt(&self, suffix: &str) -> Result<Option<f64>> {
        let finite = |v: Value<'a>| {
            v.as_f64()
                .or_else(|| v.as_i64().map(|i| i as f64))
                .filter(|x| x.is_finite())
        };
        self.typed(suffix, finite, "must be a finite number")
    }

    pub fn str_opt(&self, suffix: &str) -> Result<Option<&'a str>> {
        self.typed(suffix, |v| v.as_str(), "must be a string")
    }

    /// Refuses the array `a` under `suffix` unless it has one entry per layer (`n`);
    /// `what` starts the message.
    pub fn check_layers(&self, suffix: &str, a: Array<'a>, n: usize, what: &str) -> Result<()> {
        if a.len != n {
            return Err(self.err(
                suffix,
                Value::Array(a),
                format!("{what}must have block_count ({n}) entries"),
            ));
        }
        Ok(())
    }

    /// A per-layer integer: one value, or an array of `n` values that must all agree.
    pub fn uniform(&self, suffix: &str, n: usize) -> Result<Option<u64>> {
        match self.get(suffix) {
            None => Ok(None),
            Some(Value::Array(a)) => {
                self.check_layers(suffix, a, n, "a per-layer array ")?;
                let vals: Option<Vec<u64>> = a.iter().map(|x| x.as_u64()).collect();
                match vals.as_deref() {
                    Some([first, rest @ ..]) if rest.iter().all(|x| x == first) => Ok(Some(*first)),
                    Some(_) => Err(self.err(
                        suffix,
                        Value::Array(a),
                        "differs between layers: the .mlb format has one value for every layer",
                    )),
                    None => Err(self.err(suffix, Value::Array(a), "must hold integers")),
                }
            }
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.err(suffix, v, "must be a non-negative integer")),
        }
    }

    /// Whether `suffix` was read (and so is not refused as unknown).
    pub fn was_read(&self, suffix: &str) -> bool {
        self.used.borrow().contains(&self.full(suffix))
    }

    /// Keys under the architecture's prefix that nothing read and the table does not
    /// know: the first one, if any.
    pub fn unknown_key(&self, ga: &GgufArch) -> Option<(String, String)> {
        let prefix = format!("{}.", self.arch);
        let used = self.used.borrow();
        self.v.kvs.iter().find_map(|kv| {
            let suffix = kv.key.strip_prefix(&prefix)?;
            (!used.contains(kv.key) && !ga.knows_key(suffix))
                .then(|| (kv.key.to_string(), kv.value.to_string()))
        })
    }
}

pub fn usize_of(m: &Meta, suffix: &str, v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| m.err(suffix, v, "too large"))
}
