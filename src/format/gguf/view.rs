//! `parse`: a validated, zero-copy view of a GGUF v2/v3 file.
//!
//! Layout (little-endian): magic `GGUF`, version u32, tensor count u64, metadata count
//! u64; the metadata (key string, value type u32, value); the tensor infos (name
//! string, n_dims u32, n_dims × u64 dimensions with the innermost first, ggml type u32,
//! data offset u64 relative to the data section); padding to `general.alignment`
//! (default 32); the data section. A string is a u64 length and that many bytes; an
//! array is an element type u32, a count u64 and the elements.
//!
//! Every count and length is checked against the bytes left before anything is
//! allocated, all size arithmetic is checked, and every tensor's data must lie inside
//! the file at an aligned offset. Strings and tensor data are borrowed from the input.

use std::collections::HashMap;
use std::fmt;

use super::types::{GgmlType, ValueType};
use crate::format::error::{FormatError, Result};

pub const MAGIC: &[u8; 4] = b"GGUF";
/// Data alignment when the file has no `general.alignment`.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's GGML_MAX_DIMS.
pub const MAX_DIMS: usize = 4;
/// ggml's GGML_MAX_NAME: a tensor name takes at most 63 bytes.
pub const MAX_NAME: usize = 63;
/// Fewest bytes of one metadata entry: key length, value type, one byte of value.
const MIN_KV: u64 = 8 + 4 + 1;
/// Fewest bytes of one tensor info: name length, n_dims, one dimension, type, offset.
const MIN_TENSOR_INFO: u64 = 8 + 4 + 8 + 4 + 8;

/// One metadata value, borrowed from the file.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value<'a> {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    /// The string's bytes (UTF-8 per the spec; not checked here).
    Str(&'a [u8]),
    Array(Array<'a>),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// An array of one element type (never an array of arrays).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Array<'a> {
    pub elem: ValueType,
    pub len: usize,
    /// The encoded elements (validated when the file was parsed).
    bytes: &'a [u8],
}

impl<'a> Value<'a> {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::Str(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// An integer of any width, when it is one and not negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// An integer of any width.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// A float (f32 or f64).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The string, when it is one and valid UTF-8.
    pub fn as_str(&self) -> Option<&'a str> {
        match *self {
            Value::Str(s) => std::str::from_utf8(s).ok(),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<Array<'a>> {
        match *self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl fmt::Display for Value<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::U8(v) => write!(f, "{v}"),
            Value::I8(v) => write!(f, "{v}"),
            Value::U16(v) => write!(f, "{v}"),
            Value::I16(v) => write!(f, "{v}"),
            Value::U32(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::F32(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
            Value::Str(s) => {
                let s = String::from_utf8_lossy(s);
                if s.chars().count() > 80 {
                    let head: String = s.chars().take(80).collect();
                    write!(f, "{head:?}...")
                } else {
                    write!(f, "{s:?}")
                }
            }
            Value::Array(a) => write!(f, "[{} × {}]", a.len, a.elem),
        }
    }
}

impl<'a> Array<'a> {
    /// The elements in order.
    pub fn iter(&self) -> ArrayIter<'a> {
        ArrayIter {
            elem: self.elem,
            left: self.len,
            r: Reader {
                b: self.bytes,
                pos: 0,
            },
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The elements of an [`Array`].
pub struct ArrayIter<'a> {
    elem: ValueType,
    left: usize,
    r: Reader<'a>,
}

impl<'a> Iterator for ArrayIter<'a> {
    type Item = Value<'a>;

    fn next(&mut self) -> Option<Value<'a>> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        // The bytes were validated by `parse`: this cannot fail.
        read_scalar(&mut self.r, self.elem, "").ok()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

/// One metadata entry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Kv<'a> {
    pub key: &'a str,
    pub value: Value<'a>,
}

/// One tensor: its name, shape, type and where its data lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorInfo<'a> {
    pub name: &'a str,
    /// Dimensions, innermost (contiguous) first; `dims[n_dims..]` are 1.
    pub dims: [u64; MAX_DIMS],
    pub n_dims: usize,
    pub ty: GgmlType,
    /// Absolute offset of the data in the file.
    pub offset: u64,
    /// Bytes of data.
    pub n_bytes: u64,
}

impl TensorInfo<'_> {
    /// The dimensions as stored (innermost first).
    pub fn shape(&self) -> &[u64] {
        &self.dims[..self.n_dims]
    }

    /// Elements per row (the innermost dimension).
    pub fn cols(&self) -> u64 {
        self.dims[0]
    }

    /// Rows: the product of the outer dimensions.
    pub fn rows(&self) -> u64 {
        self.dims[1..].iter().product()
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> u64 {
        self.dims[0] / self.ty.block_size() * self.ty.block_bytes()
    }

    /// `[d0, d1]` as text, e.g. `[64, 128]`.
    pub fn shape_text(&self) -> String {
        format!("{:?}", self.shape())
    }
}

/// A validated GGUF file.
#[derive(Debug, Clone)]
pub struct GgufView<'a> {
    pub version: u32,
    /// Metadata in file order.
    pub kvs: Vec<Kv<'a>>,
    /// Tensors in file order.
    pub tensors: Vec<TensorInfo<'a>>,
    pub alignment: u64,
    /// Start of the data section.
    pub data_offset: u64,
    bytes: &'a [u8],
    by_name: HashMap<&'a str, usize>,
}

impl<'a> GgufView<'a> {
    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&Value<'a>> {
        self.kvs.iter().find(|kv| kv.key == key).map(|kv| &kv.value)
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo<'a>> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The data of tensor `t` (a tensor of this file).
    pub fn data(&self, t: &TensorInfo) -> &'a [u8] {
        &self.bytes[t.offset as usize..(t.offset + t.n_bytes) as usize]
    }

    /// The whole file.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }
}

/// A bounds-checked little-endian reader.
#[derive(Debug, Clone)]
struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

fn truncated(field: &str, pos: usize, need: u64, len: usize) -> FormatError {
    FormatError::format(
        if field.is_empty() { "file" } else { field },
        format!("offset {pos}"),
        format!("truncated: needs {need} more bytes, the file has {len}"),
    )
}

impl<'a> Reader<'a> {
    fn left(&self) -> u64 {
        (self.b.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, field: &str) -> Result<&'a [u8]> {
        if n > self.left() {
            return Err(truncated(field, self.pos, n, self.b.len()));
        }
        let s = &self.b[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self, field: &str) -> Result<[u8; N]> {
        Ok(self.take(N as u64, field)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self, field: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr(field)?))
    }

    fn u64(&mut self, field: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr(field)?))
    }

    /// A string: u64 length (checked against the bytes left), then the bytes.
    fn string(&mut self, field: &str) -> Result<&'a [u8]> {
        let at = self.pos;
        let n = self.u64(field)?;
        if n > self.left() {
            return Err(FormatError::format(
                if field.is_empty() { "string" } else { field },
                format!("length {n} at offset {at}"),
                format!("longer than the {} bytes left in the file", self.left()),
            ));
        }
        self.take(n, field)
    }
}

/// Reads a value that is not an array.
fn read_scalar<'a>(r: &mut Reader<'a>, ty: ValueType, key: &str) -> Result<Value<'a>> {
    Ok(match ty {
        ValueType::U8 => Value::U8(r.arr::<1>(key)?[0]),
        ValueType::I8 => Value::I8(r.arr::<1>(key)?[0] as i8),
        ValueType::U16 => Value::U16(u16::from_le_bytes(r.arr(key)?)),
        ValueType::I16 => Value::I16(i16::from_le_bytes(r.arr(key)?)),
        ValueType::U32 => Value::U32(u32::from_le_bytes(r.arr(key)?)),
        ValueType::I32 => Value::I32(i32::from_le_bytes(r.arr(key)?)),
        ValueType::F32 => Value::F32(f32::from_le_bytes(r.arr(key)?)),
        ValueType::U64 => Value::U64(u64::from_le_bytes(r.arr(key)?)),
        ValueType::I64 => Value::I64(i64::from_le_bytes(r.arr(key)?)),
        ValueType::F64 => Value::F64(f64::from_le_bytes(r.arr(key)?)),
        ValueType::Bool => match r.arr::<1>(key)?[0] {
            0 => Value::Bool(false),
            1 => Value::Bool(true),
            b => return Err(FormatError::format(key, b, "a bool must be 0 or 1")),
        },
        ValueType::String => Value::Str(r.string(key)?),
        ValueType::Array => {
            return Err(FormatError::format(
                key,
                "array of arrays",
                "nested arrays are not supported",
            ))
        }
    })
}

fn value_type(v: u32, key: &str) -> Result<ValueType> {
    ValueType::from_u32(v).ok_or_else(|| FormatError::format(key, v, "unknown value type (0..=12)"))
}

/// Reads one value of type `ty` for `key`.
fn read_value<'a>(r: &mut Reader<'a>, ty: ValueType, key: &str) -> Result<Value<'a>> {
    if ty != ValueType::Array {
        return read_scalar(r, ty, key);
    }
    let elem = value_type(r.u32(key)?, key)?;
    if elem == ValueType::Array {
        return Err(FormatError::format(
            key,
            "array of arrays",
            "nested arrays are not supported",
        ));
    }
    let n = r.u64(key)?;
    // Cap the count before walking: every element takes at least min_size bytes.
    let min = n.checked_mul(elem.min_size() as u64);
    if min.is_none_or(|m| m > r.left()) {
        return Err(FormatError::format(
            key,
            format!("{n} × {elem}"),
            format!("array longer than the {} bytes left in the file", r.left()),
        ));
    }
    let start = r.pos;
    match elem.fixed_size() {
        Some(size) => {
            r.take(n * size as u64, key)?;
            if elem == ValueType::Bool {
                if let Some(b) = r.b[start..r.pos].iter().find(|&&b| b > 1) {
                    return Err(FormatError::format(key, b, "a bool must be 0 or 1"));
                }
            }
        }
        None => {
            for _ in 0..n {
                r.string(key)?;
            }
        }
    }
    Ok(Value::Array(Array {
        elem,
        len: n as usize,
        bytes: &r.b[start..r.pos],
    }))
}

fn align_up(v: u64, a: u64) -> Option<u64> {
    v.checked_add(a - 1).map(|x| x / a * a)
}

/// Validates `bytes` as a GGUF file and returns the view.
pub fn parse(bytes: &[u8]) -> Result<GgufView<'_>> {
    if bytes.is_empty() {
        return Err(FormatError::format(
            "file",
            "empty",
            "a GGUF file starts with the magic \"GGUF\"",
        ));
    }
    let mut r = Reader { b: bytes, pos: 0 };
    let magic = r.take(4, "magic")?;
    if magic != MAGIC {
        return Err(FormatError::format(
            "magic",
            format!("{:?}", String::from_utf8_lossy(magic)),
            "must be \"GGUF\"",
        ));
    }
    let version = r.u32("version")?;
    match version {
        2 | 3 => {}
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
            return Err(FormatError::format(
                "version",
                v,
                "a big-endian GGUF file (only little-endian files are read)",
            ))
        }
        v => return Err(FormatError::format("version", v, "must be 2 or 3")),
    }
    let n_tensors = r.u64("n_tensors")?;
    let n_kv = r.u64("n_kv")?;
    // Caps before allocating: every entry takes a minimum number of bytes.
    if n_kv.checked_mul(MIN_KV).is_none_or(|b| b > r.left()) {
        return Err(FormatError::format(
            "n_kv",
            n_kv,
            format!(
                "{n_kv} metadata entries cannot fit in the {} bytes left",
                r.left()
            ),
        ));
    }
    if n_tensors
        .checked_mul(MIN_TENSOR_INFO)
        .is_none_or(|b| b > r.left())
    {
        return Err(FormatError::format(
            "n_tensors",
            n_tensors,
            format!(
                "{n_tensors} tensor infos cannot fit in the {} bytes left",
                r.left()
            ),
        ));
    }
    let mut kvs: Vec<Kv> = Vec::with_capacity(n_kv as usize);
    let mut seen: HashMap<&str, ()> = HashMap::with_capacity(n_kv as usize);
    for i in 0..n_kv {
        let at = r.pos;
        let key_bytes = r.string(&format!("metadata entry {i}"))?;
        let key = std::str::from_utf8(key_bytes).map_err(|_| {
            FormatError::format(
                format!("metadata entry {i}"),
                format!("{:?}", String::from_utf8_lossy(key_bytes)),
                format!("key at offset {at} is not UTF-8"),
            )
        })?;
        if key.is_empty() {
            return Err(FormatError::format(
                format!("metadata entry {i}"),
                "\"\"",
                "empty key",
            ));
        }
        let ty = value_type(r.u32(key)?, key)?;
        let value = read_value(&mut r, ty, key)?;
        if seen.insert(key, ()).is_some() {
            return Err(FormatError::format(key, value, "duplicate key"));
        }
        kvs.push(Kv { key, value });
    }
    let alignment = match kvs.iter().find(|kv| kv.key == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(kv) => match kv.value {
            Value::U32(a) if a > 0 && a.is_power_of_two() => a as u64,
            v => {
                return Err(FormatError::format(
                    "general.alignment",
                    format!("{v} ({})", v.value_type()),
                    "must be a u32 power of two",
                ))
            }
        },
    };

    let mut infos = Vec::with_capacity(n_tensors as usize);
    let mut by_name: HashMap<&str, usize> = HashMap::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let at = r.pos;
        let field = format!("tensor {i}");
        let name_bytes = r.string(&field)?;
        let name = std::str::from_utf8(name_bytes).map_err(|_| {
            FormatError::format(
                &field,
                format!("{:?}", String::from_utf8_lossy(name_bytes)),
                format!("name at offset {at} is not UTF-8"),
            )
        })?;
        if name.len() > MAX_NAME {
            return Err(FormatError::format(
                &field,
                format!("{name:?}"),
                format!("name longer than {MAX_NAME} bytes"),
            ));
        }
        let n_dims = r.u32(name)?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            return Err(FormatError::shape(
                name,
                format!("n_dims {n_dims}"),
                format!("must be 1 to {MAX_DIMS}"),
            ));
        }
        let mut dims = [1u64; MAX_DIMS];
        for d in dims.iter_mut().take(n_dims as usize) {
            *d = r.u64(name)?;
        }
        let shape = &dims[..n_dims as usize];
        if shape.contains(&0) {
            return Err(FormatError::shape(
                name,
                format!("{shape:?}"),
                "a dimension is zero",
            ));
        }
        let n_el = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| {
                FormatError::shape(name, format!("{shape:?}"), "element count overflows")
            })?;
        let ty_id = r.u32(name)?;
        let ty = GgmlType::from_u32(ty_id).ok_or_else(|| {
            FormatError::format(name, format!("type {ty_id}"), "unknown ggml type")
        })?;
        if dims[0] % ty.block_size() != 0 {
            return Err(FormatError::shape(
                name,
                format!("{shape:?}"),
                format!(
                    "the row length {} is not a multiple of {}'s block size {}",
                    dims[0],
                    ty,
                    ty.block_size()
                ),
            ));
        }
        let n_bytes = (n_el / ty.block_size())
            .checked_mul(ty.block_bytes())
            .ok_or_else(|| FormatError::shape(name, format!("{shape:?}"), "size overflows"))?;
        let offset = r.u64(name)?;
        if offset % alignment != 0 {
            return Err(FormatError::format(
                name,
                format!("offset {offset}"),
                format!("data offset is not a multiple of the alignment {alignment}"),
            ));
        }
        if by_name.insert(name, i as usize).is_some() {
            return Err(FormatError::format(
                name,
                format!("tensor {i}"),
                "duplicate tensor name",
            ));
        }
        infos.push((name, dims, n_dims as usize, ty, offset, n_bytes));
    }

    let data_offset = align_up(r.pos as u64, alignment)
        .ok_or_else(|| FormatError::format("data", r.pos, "data offset overflows"))?;
    let file_len = bytes.len() as u64;
    if !infos.is_empty() && data_offset > file_len {
        return Err(FormatError::format(
            "data",
            format!("{file_len} bytes"),
            format!("the file ends before its data section (offset {data_offset})"),
        ));
    }
    let mut tensors = Vec::with_capacity(infos.len());
    for (name, dims, n_dims, ty, rel, n_bytes) in infos {
        let end = data_offset
            .checked_add(rel)
            .and_then(|o| o.checked_add(n_bytes).map(|e| (o, e)));
        let (offset, _) = match end {
            Some((o, e)) if e <= file_len => (o, e),
            _ => {
                return Err(FormatError::format(
                    name,
                    format!("offset {rel} + {n_bytes} bytes"),
                    format!(
                        "data runs past the end of the file ({} bytes of data)",
                        file_len.saturating_sub(data_offset)
                    ),
                ))
            }
        };
        tensors.push(TensorInfo {
            name,
            dims,
            n_dims,
            ty,
            offset,
            n_bytes,
        });
    }
    Ok(GgufView {
        version,
        kvs,
        tensors,
        alignment,
        data_offset,
        bytes,
        by_name,
    })
}
