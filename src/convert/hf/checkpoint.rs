//! A Hugging Face checkpoint's tensors: `model.safetensors`, or the shards listed in
//! `model.safetensors.index.json`, memory-mapped and read tensor by tensor.
//!
//! Every shard's header is parsed (and checked against the file's length) by the
//! safetensors crate when the checkpoint is opened, so a truncated shard fails before
//! any output is written. Rows are upcast from bf16, f16 or f32 to f32 on demand;
//! after a tensor is read its pages are released (`MADV_DONTNEED`), so the process's
//! resident memory stays near one tensor, not the checkpoint's size.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::convert::error::{ConvertError, Result};

/// Element types the converter reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    BF16,
    F16,
    F32,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }
}

/// Where one tensor lies.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub shard: usize,
    /// The dtype as the file names it (e.g. `BF16`, `I64`).
    pub dtype_name: String,
    pub dtype: Option<DType>,
    pub shape: Vec<usize>,
    /// Byte range in the shard file (absolute, past the header).
    pub start: usize,
    pub end: usize,
}

struct Shard {
    path: PathBuf,
    map: Mmap,
}

/// An opened checkpoint.
pub struct Checkpoint {
    /// `model.safetensors.index.json`, when the checkpoint is sharded.
    index: Option<PathBuf>,
    shards: Vec<Shard>,
    tensors: HashMap<String, TensorInfo>,
}

fn dtype_of(d: Dtype) -> Option<DType> {
    match d {
        Dtype::BF16 => Some(DType::BF16),
        Dtype::F16 => Some(DType::F16),
        Dtype::F32 => Some(DType::F32),
        _ => None,
    }
}

impl Checkpoint {
    /// Opens `dir/model.safetensors`, or every shard `dir/model.safetensors.index.json`
    /// names (each must exist, and hold the tensors the index assigns to it).
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let mut ck = Checkpoint {
            index: None,
            shards: Vec::new(),
            tensors: HashMap::new(),
        };
        if index.exists() {
            ck.index = Some(index.clone());
            let text =
                crate::input::read_to_string(&index).map_err(|e| ConvertError::io(&index, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ConvertError::checkpoint(&index, format!("not valid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| ConvertError::checkpoint(&index, "has no \"weight_map\" object"))?;
            // Shard file → the tensors the index places there (sorted: deterministic).
            let mut by_shard: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for (name, file) in map {
                let file = file.as_str().ok_or_else(|| {
                    ConvertError::checkpoint(
                        &index,
                        format!("weight_map[{name:?}] is not a file name"),
                    )
                })?;
                by_shard
                    .entry(file.to_string())
                    .or_default()
                    .push(name.clone());
            }
            let missing: Vec<&String> = by_shard.keys().filter(|f| !dir.join(f).exists()).collect();
            if !missing.is_empty() {
                let list: Vec<&str> = missing.iter().map(|s| s.as_str()).collect();
                return Err(ConvertError::checkpoint(
                    &index,
                    format!(
                        "shard(s) named in the index are missing: {}",
                        list.join(", ")
                    ),
                ));
            }
            for (file, names) in &by_shard {
                let path = dir.join(file);
                let s = ck.add_shard(&path)?;
                let mut absent: Vec<&str> = names
                    .iter()
                    .filter(|n| ck.tensors.get(*n).map(|t| t.shard) != Some(s))
                    .map(|n| n.as_str())
                    .collect();
                if !absent.is_empty() {
                    absent.sort_unstable();
                    return Err(ConvertError::checkpoint(
                        &path,
                        format!(
                            "tensor(s) the index places in this shard are not in it: {}",
                            absent.join(", ")
                        ),
                    ));
                }
            }
        } else if single.exists() {
            ck.add_shard(&single)?;
        } else {
            return Err(ConvertError::checkpoint(
                dir,
                "no model.safetensors or model.safetensors.index.json in the folder",
            ));
        }
        Ok(ck)
    }

    fn add_shard(&mut self, path: &Path) -> Result<usize> {
        // A regular file only: a FIFO would block the open.
        let f = crate::input::open(path).map_err(|e| ConvertError::io(path, e))?;
        // SAFETY: the map is read-only; the checkpoint files are not expected to change
        // during the conversion (as for every mmap-based loader).
        let map = unsafe { Mmap::map(&f) }.map_err(|e| ConvertError::io(path, e))?;
        let (n, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
            ConvertError::checkpoint(
                path,
                format!("not a valid safetensors file ({e}); truncated or damaged download?"),
            )
        })?;
        let base = 8 + n;
        let idx = self.shards.len();
        for (name, info) in meta.tensors() {
            let t = TensorInfo {
                shard: idx,
                dtype_name: format!("{:?}", info.dtype),
                dtype: dtype_of(info.dtype),
                shape: info.shape.clone(),
                start: base + info.data_offsets.0,
                end: base + info.data_offsets.1,
            };
            if let Some(prev) = self.tensors.get(&name) {
                return Err(ConvertError::checkpoint(
                    path,
                    format!(
                        "tensor {name} is also in {}",
                        self.shards[prev.shard].path.display()
                    ),
                ));
            }
            self.tensors.insert(name, t);
        }
        self.shards.push(Shard {
            path: path.to_path_buf(),
            map,
        });
        Ok(idx)
    }

    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.tensors.keys().map(|s| s.as_str()).collect();
        v.sort_unstable();
        v
    }

    /// The file holding `t`.
    pub fn path_of(&self, t: &TensorInfo) -> &Path {
        &self.shards[t.shard].path
    }

    /// Every file of the checkpoint this reads: the index, if any, and the shards.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        let shards = self.shards.iter().map(|s| s.path.as_path());
        self.index.as_deref().into_iter().chain(shards)
    }

    /// The first shard (the file errors name when no tensor is involved).
    pub fn first_path(&self) -> &Path {
        &self.shards[0].path
    }

    /// Appends rows `rows` (of `row_len` elements each) of tensor `t` as f32 to `out`.
    /// The caller has checked the tensor's shape, so the rows lie inside it.
    pub fn read_rows(
        &self,
        t: &TensorInfo,
        dtype: DType,
        row_len: usize,
        rows: std::ops::Range<usize>,
        out: &mut Vec<f32>,
    ) {
        let es = dtype.size();
        let a = t.start + rows.start * row_len * es;
        let b = t.start + rows.end * row_len * es;
        debug_assert!(b <= t.end);
        upcast(dtype, &self.shards[t.shard].map[a..b], out);
    }

    /// The stored bytes of tensor `t`.
    pub fn raw_bytes(&self, t: &TensorInfo) -> &[u8] {
        &self.shards[t.shard].map[t.start..t.end]
    }

    /// Drops all of `t`'s pages from this process's resident set (see [`Self::release`]).
    pub fn release_all(&self, t: &TensorInfo) {
        #[cfg(unix)]
        if t.end > t.start {
            // SAFETY: as in `release`: a private read-only file mapping.
            let _ = unsafe {
                self.shards[t.shard].map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    t.start,
                    t.end - t.start,
                )
            };
        }
    }

    /// Drops the pages of bytes `bytes` (relative to the tensor's start) of `t` from
    /// this process's resident set (see [`Self::release`]).
    pub fn release_bytes(&self, t: &TensorInfo, bytes: std::ops::Range<usize>) {
        #[cfg(unix)]
        {
            let map = &self.shards[t.shard].map;
            let a = t.start + bytes.start;
            let len = bytes.end.saturating_sub(bytes.start);
            if len > 0 && a + len <= t.end {
                // SAFETY: as in `release`: a private read-only file mapping.
                let _ = unsafe {
                    map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, a, len)
                };
            }
        }
        #[cfg(not(unix))]
        let _ = (t, bytes);
    }

    /// Asks the kernel to start reading `t`'s rows `rows` (`MADV_WILLNEED`), so that the
    /// next chunk's pages come from the disk while this one is quantized. Only a hint:
    /// the pages enter the page cache, not this process's resident set.
    pub fn prefetch(&self, t: &TensorInfo, row_len: usize, rows: std::ops::Range<usize>) {
        let Some((a, len)) = row_span(t, row_len, rows) else {
            return;
        };
        let map = &self.shards[t.shard].map;
        #[cfg(unix)]
        if len > 0 && a + len <= t.end.min(map.len()) {
            let _ = map.advise_range(memmap2::Advice::WillNeed, a, len);
        }
        #[cfg(not(unix))]
        let _ = (map, a, len);
    }

    /// Drops the pages of `t`'s rows `rows` from this process's resident set (the data
    /// stays in the page cache; a later read maps it again).
    pub fn release(&self, t: &TensorInfo, row_len: usize, rows: std::ops::Range<usize>) {
        let Some((a, len)) = row_span(t, row_len, rows) else {
            return;
        };
        #[cfg(unix)]
        {
            let map = &self.shards[t.shard].map;
            if len > 0 && a + len <= map.len() {
                // SAFETY: a private read-only file mapping: after MADV_DONTNEED the pages
                // read back the same file contents, so no borrowed data changes.
                let _ = unsafe {
                    map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, a, len)
                };
            }
        }
        #[cfg(not(unix))]
        let _ = (a, len);
    }
}

/// The bytes of `t`'s rows `rows` (`row_len` elements each) in its shard's map: the
/// offset and length, `None` for a tensor without a float type.
fn row_span(
    t: &TensorInfo,
    row_len: usize,
    rows: std::ops::Range<usize>,
) -> Option<(usize, usize)> {
    let es = t.dtype?.size();
    let len = rows.end.saturating_sub(rows.start) * row_len * es;
    Some((t.start + rows.start * row_len * es, len))
}

/// Little-endian bf16 / f16 / f32 bytes → f32, appended to `out`.
pub fn upcast(dtype: DType, bytes: &[u8], out: &mut Vec<f32>) {
    match dtype {
        DType::BF16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16)),
        ),
        DType::F16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()),
        ),
        DType::F32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
    }
}
