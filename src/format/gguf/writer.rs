//! The deterministic GGUF v3 writer: metadata in the order given, tensor infos in the
//! order given with offsets computed from their sizes, every tensor's data padded to
//! the alignment (`general.alignment`, default 32), as gguf-py's `GGUFWriter` lays a
//! file out. The same input gives the same bytes. Tensor data is streamed: the header
//! is written first, then each tensor's bytes in order, in as many pieces as the
//! caller likes.

use std::collections::HashSet;
use std::io::Write;

use super::types::{GgmlType, ValueType};
use super::view::{Value, DEFAULT_ALIGNMENT, MAX_DIMS, MAX_NAME};
use crate::format::error::FormatError;
use crate::format::mlb::WriteError;

/// An owned metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    U64(u64),
    I64(i64),
    F64(f64),
    /// Elements of one type (never arrays).
    Array(ValueType, Vec<MetaValue>),
}

impl MetaValue {
    pub fn value_type(&self) -> ValueType {
        match self {
            MetaValue::U8(_) => ValueType::U8,
            MetaValue::I8(_) => ValueType::I8,
            MetaValue::U16(_) => ValueType::U16,
            MetaValue::I16(_) => ValueType::I16,
            MetaValue::U32(_) => ValueType::U32,
            MetaValue::I32(_) => ValueType::I32,
            MetaValue::F32(_) => ValueType::F32,
            MetaValue::Bool(_) => ValueType::Bool,
            MetaValue::Str(_) => ValueType::String,
            MetaValue::U64(_) => ValueType::U64,
            MetaValue::I64(_) => ValueType::I64,
            MetaValue::F64(_) => ValueType::F64,
            MetaValue::Array(..) => ValueType::Array,
        }
    }

    /// An array of strings.
    pub fn strings<S: Into<String>>(v: impl IntoIterator<Item = S>) -> MetaValue {
        MetaValue::Array(
            ValueType::String,
            v.into_iter().map(|s| MetaValue::Str(s.into())).collect(),
        )
    }

    /// An owned copy of a parsed value (strings that are not UTF-8 are replaced
    /// lossily; GGUF strings are UTF-8).
    pub fn from_value(v: &Value) -> MetaValue {
        match *v {
            Value::U8(x) => MetaValue::U8(x),
            Value::I8(x) => MetaValue::I8(x),
            Value::U16(x) => MetaValue::U16(x),
            Value::I16(x) => MetaValue::I16(x),
            Value::U32(x) => MetaValue::U32(x),
            Value::I32(x) => MetaValue::I32(x),
            Value::F32(x) => MetaValue::F32(x),
            Value::Bool(x) => MetaValue::Bool(x),
            Value::U64(x) => MetaValue::U64(x),
            Value::I64(x) => MetaValue::I64(x),
            Value::F64(x) => MetaValue::F64(x),
            Value::Str(s) => MetaValue::Str(String::from_utf8_lossy(s).into_owned()),
            Value::Array(a) => MetaValue::Array(
                a.elem,
                a.iter().map(|e| MetaValue::from_value(&e)).collect(),
            ),
        }
    }

    fn encode(&self, key: &str, out: &mut Vec<u8>) -> Result<(), FormatError> {
        match self {
            MetaValue::U8(v) => out.push(*v),
            MetaValue::I8(v) => out.push(*v as u8),
            MetaValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::Bool(v) => out.push(*v as u8),
            MetaValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::Str(s) => put_str(out, s),
            MetaValue::Array(elem, items) => {
                if *elem == ValueType::Array {
                    return Err(FormatError::format(
                        key,
                        "array of arrays",
                        "nested arrays cannot be written",
                    ));
                }
                out.extend_from_slice(&elem.to_u32().to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for (i, it) in items.iter().enumerate() {
                    if it.value_type() != *elem {
                        return Err(FormatError::format(
                            format!("{key}[{i}]"),
                            it.value_type(),
                            format!("an array of {elem} holds only {elem}"),
                        ));
                    }
                    it.encode(key, out)?;
                }
            }
        }
        Ok(())
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// A tensor to write: its name, dimensions (innermost first) and type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
}

impl TensorSpec {
    /// The spec of a parsed file's tensor, to write it again.
    pub fn of(t: &super::view::TensorInfo) -> TensorSpec {
        TensorSpec {
            name: t.name.to_string(),
            dims: t.shape().to_vec(),
            ty: t.ty,
        }
    }

    /// A `rows × cols` matrix (stored as dims `[cols, rows]`).
    pub fn matrix(name: impl Into<String>, rows: u64, cols: u64, ty: GgmlType) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dims: vec![cols, rows],
            ty,
        }
    }

    /// A vector of `len` elements.
    pub fn vector(name: impl Into<String>, len: u64, ty: GgmlType) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dims: vec![len],
            ty,
        }
    }

    /// Bytes of data, checked.
    pub fn n_bytes(&self) -> Result<u64, FormatError> {
        let name = self.name.as_str();
        if self.dims.is_empty() || self.dims.len() > MAX_DIMS || self.dims.contains(&0) {
            return Err(FormatError::shape(
                name,
                format!("{:?}", self.dims),
                format!("1 to {MAX_DIMS} non-zero dimensions"),
            ));
        }
        if !self.dims[0].is_multiple_of(self.ty.block_size()) {
            return Err(FormatError::shape(
                name,
                format!("{:?}", self.dims),
                format!("row length not a multiple of {}'s block size", self.ty),
            ));
        }
        self.dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .and_then(|n| (n / self.ty.block_size()).checked_mul(self.ty.block_bytes()))
            .ok_or_else(|| FormatError::shape(name, format!("{:?}", self.dims), "size overflows"))
    }
}

/// Streams one GGUF file to `W`.
pub struct GgufWriter<W: Write> {
    out: W,
    specs: Vec<TensorSpec>,
    sizes: Vec<u64>,
    alignment: u64,
    /// Index of the tensor being written, and its bytes so far.
    next: usize,
    done: u64,
    pos: u64,
}

const ZEROS: [u8; 256] = [0; 256];

impl<W: Write> GgufWriter<W> {
    /// Checks the metadata and tensor list and writes everything before the data.
    pub fn new(
        out: W,
        kvs: &[(String, MetaValue)],
        specs: Vec<TensorSpec>,
    ) -> Result<GgufWriter<W>, WriteError> {
        let mut keys = HashSet::new();
        let mut alignment = DEFAULT_ALIGNMENT;
        for (k, v) in kvs {
            if k.is_empty() || !keys.insert(k.as_str()) {
                return Err(FormatError::format(k, "", "empty or duplicate key").into());
            }
            if k == "general.alignment" {
                match v {
                    MetaValue::U32(a) if *a > 0 && a.is_power_of_two() && *a <= 256 => {
                        alignment = *a as u64
                    }
                    _ => {
                        return Err(FormatError::format(
                            k,
                            format!("{v:?}"),
                            "must be a u32 power of two, at most 256",
                        )
                        .into())
                    }
                }
            }
        }
        let mut names = HashSet::new();
        let mut sizes = Vec::with_capacity(specs.len());
        for s in &specs {
            if s.name.len() > MAX_NAME || !names.insert(s.name.as_str()) {
                return Err(FormatError::format(
                    &s.name,
                    s.name.len(),
                    format!("tensor names are unique and at most {MAX_NAME} bytes"),
                )
                .into());
            }
            sizes.push(s.n_bytes()?);
        }
        let mut head = Vec::new();
        head.extend_from_slice(super::view::MAGIC);
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(specs.len() as u64).to_le_bytes());
        head.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
        for (k, v) in kvs {
            put_str(&mut head, k);
            head.extend_from_slice(&v.value_type().to_u32().to_le_bytes());
            v.encode(k, &mut head)?;
        }
        let mut offset = 0u64;
        for (s, &size) in specs.iter().zip(&sizes) {
            put_str(&mut head, &s.name);
            head.extend_from_slice(&(s.dims.len() as u32).to_le_bytes());
            for d in &s.dims {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&s.ty.to_u32().to_le_bytes());
            head.extend_from_slice(&offset.to_le_bytes());
            offset = offset
                .checked_add(size)
                .and_then(|o| o.checked_next_multiple_of(alignment))
                .ok_or_else(|| FormatError::shape(&s.name, size, "file size overflows"))?;
        }
        let mut w = GgufWriter {
            out,
            specs,
            sizes,
            alignment,
            next: 0,
            done: 0,
            pos: 0,
        };
        w.raw(&head)?;
        w.pad()?;
        Ok(w)
    }

    fn raw(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.out.write_all(b)?;
        self.pos += b.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> std::io::Result<()> {
        let pad = (self.alignment - self.pos % self.alignment) % self.alignment;
        self.raw(&ZEROS[..pad as usize])
    }

    /// The tensor whose data comes next, if any.
    pub fn next_tensor(&self) -> Option<&TensorSpec> {
        self.specs.get(self.next)
    }

    /// Appends `bytes` to the data of the current tensor; a tensor is complete when
    /// its size is reached, and the next call starts the next one.
    pub fn write_data(&mut self, bytes: &[u8]) -> Result<(), WriteError> {
        let Some(s) = self.specs.get(self.next) else {
            return Err(FormatError::shape("tensor", self.next, "more data than tensors").into());
        };
        let size = self.sizes[self.next];
        if self.done + bytes.len() as u64 > size {
            return Err(FormatError::shape(
                &s.name,
                self.done + bytes.len() as u64,
                format!("more than its {size} bytes"),
            )
            .into());
        }
        self.raw(bytes)?;
        self.done += bytes.len() as u64;
        if self.done == size {
            self.pad()?;
            self.next += 1;
            self.done = 0;
        }
        Ok(())
    }

    /// Checks that every tensor was written in full and returns the output.
    pub fn finish(mut self) -> Result<W, WriteError> {
        if let Some(s) = self.specs.get(self.next) {
            return Err(FormatError::shape(
                &s.name,
                self.done,
                format!("bytes written of {}", self.sizes[self.next]),
            )
            .into());
        }
        self.out.flush()?;
        Ok(self.out)
    }
}

/// A whole file in memory (tests, small files).
pub fn to_bytes(
    kvs: &[(String, MetaValue)],
    tensors: &[(TensorSpec, &[u8])],
) -> Result<Vec<u8>, WriteError> {
    let specs = tensors.iter().map(|(s, _)| s.clone()).collect();
    let mut w = GgufWriter::new(Vec::new(), kvs, specs)?;
    for (_, d) in tensors {
        w.write_data(d)?;
    }
    w.finish()
}
