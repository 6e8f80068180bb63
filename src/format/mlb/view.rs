//! Parsing and the zero-copy view: the same code validates a file for `mlb-inspect`
//! and loads it for `mlb-run`.

use std::borrow::Cow;
use std::fs::File;
use std::path::{Path, PathBuf};

use super::header::{Header, HEADER_SIZE};
use super::layout::{Kind, Layout, QType};
use super::validate::{validate, validate_layer_flags, Dims};
use crate::format::error::{FormatError, Result};

/// A validated file's header, dimensions and layout.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    pub header: Header,
    pub dims: Dims,
    /// Per-layer flag bytes (all zero when the header has none).
    pub flags: Vec<u8>,
    pub layout: Layout,
}

/// Validates `bytes` as an `.mlb` file against every rule of the spec.
pub fn parse(bytes: &[u8]) -> Result<Parsed> {
    if let Some(head) = bytes.get(..HEADER_SIZE) {
        let header = Header::decode(head.try_into().expect("256 bytes"));
        if let Ok(dims) = validate(&header) {
            // Every layer holds at least one 64-byte-aligned array: a short file that claims
            // tens of thousands of layers fails here, before the per-layer size walk below
            // (which took 0.4 s for a 260-byte file claiming 16194 layers; found by fuzzing).
            let min_end = HEADER_SIZE as u64 + 64 * dims.n_layers as u64;
            if min_end > bytes.len() as u64 {
                return Err(FormatError::format(
                    "n_layers",
                    dims.n_layers,
                    format!(
                        "a {}-byte file cannot hold that many layers (each needs at least 64 bytes)",
                        bytes.len()
                    ),
                ));
            }
        }
    }
    parse_limited(bytes, usize::MAX as u64)
}

/// [`parse`] with every size capped at `limit` (models a smaller address space).
pub fn parse_limited(bytes: &[u8], limit: u64) -> Result<Parsed> {
    if bytes.is_empty() {
        return Err(FormatError::format(
            "file",
            "empty",
            "an .mlb file starts with a 256-byte header",
        ));
    }
    let head: &[u8; HEADER_SIZE] = bytes
        .get(..HEADER_SIZE)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| {
            FormatError::format(
                "file",
                format!("{} bytes", bytes.len()),
                "shorter than the 256-byte header",
            )
        })?;
    let header = Header::decode(head);
    let dims = validate(&header)?;
    let flags: &[u8] = if header.layer_flags != 0 {
        bytes
            .get(HEADER_SIZE..HEADER_SIZE + dims.n_layers)
            .ok_or_else(|| {
                FormatError::format(
                    "layer_flags",
                    format!("{} bytes", bytes.len()),
                    format!("file too short for {} layer flag bytes", dims.n_layers),
                )
            })?
    } else {
        &[]
    };
    validate_layer_flags(&header, flags)?;
    // Check the implied size before allocating anything per layer: a header that
    // claims 65536 layers of 2^24 × 65536 must fail here, cheaply.
    let end = Layout::end_offset(&header, &dims, flags, limit)?;
    if end > bytes.len() as u64 {
        return Err(FormatError::format(
            "file",
            format!("{} bytes", bytes.len()),
            format!("shorter than the {end} bytes the header implies"),
        ));
    }
    let layout = Layout::with_limit(&header, &dims, flags, limit)?;
    check_q8_quants(bytes, &layout)?;
    let flags = if flags.is_empty() {
        vec![0; dims.n_layers]
    } else {
        flags.to_vec()
    };
    Ok(Parsed {
        header,
        dims,
        flags,
        layout,
    })
}

/// The x86 kernels negate weights by the activation's sign; -128 has no int8 negation.
fn check_q8_quants(bytes: &[u8], layout: &Layout) -> Result<()> {
    for t in &layout.tensors {
        if let Kind::Mat {
            qtype: QType::Q8_0, ..
        } = t.kind
        {
            let q = &bytes[t.offset as usize..(t.offset + t.bytes) as usize];
            if let Some(i) = memchr::memchr(0x80, q) {
                return Err(FormatError::format(
                    t.name.to_string(),
                    -128,
                    format!(
                        "Q8_0 quant at file offset {} is -128 (quants must be in [-127, 127])",
                        t.offset as usize + i
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// A quantized matrix view: quants and f32 scales.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    pub qtype: QType,
    pub rows: usize,
    pub cols: usize,
    /// Q8_0: rows × cols int8 (as bytes); Q4_0: rows × cols / 2 bytes.
    pub q: &'a [u8],
    /// rows × cols / 32 scales.
    pub d: &'a [f32],
}

impl MatRef<'_> {
    /// Dequantizes row `r` into `out` (cols floats): w = q × d.
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) {
        crate::quant::dequant_row(self.qtype, self.q, self.d, self.cols, r, out)
    }
}

/// Bytes behind a file: a read-only map, or an owned aligned buffer.
enum Backing {
    /// The map and the file it maps (kept to re-check the file's size).
    Map(memmap2::Mmap, File),
    /// u64 storage keeps the bytes 8-aligned, so f32 arrays can be borrowed.
    Owned(Vec<u64>, usize),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Map(m, _) => m,
            Backing::Owned(v, len) => {
                // SAFETY: a Vec<u64> of ⌈len/8⌉ words holds at least len initialized bytes.
                unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, *len) }
            }
        }
    }
}

/// An opened, validated `.mlb` file with typed, zero-copy access to its arrays.
pub struct Mlb {
    backing: Backing,
    pub path: Option<PathBuf>,
    pub parsed: Parsed,
    /// Scales converted from f16 on the first [`Mlb::mat`] of each tensor (empty with f32
    /// scales). The runtime reads f16 scales directly ([`Mlb::mat_f16`]) and never
    /// converts them here.
    f16_scales: Vec<std::sync::OnceLock<Vec<f32>>>,
}

/// `bytes` as f32s without copying when aligned on a little-endian host.
fn f32_view(bytes: &[u8]) -> Cow<'_, [f32]> {
    if cfg!(target_endian = "little") {
        // SAFETY: every bit pattern is a valid f32; align_to only yields the aligned middle.
        let (pre, mid, post) = unsafe { bytes.align_to::<f32>() };
        if pre.is_empty() && post.is_empty() {
            return Cow::Borrowed(mid);
        }
    }
    Cow::Owned(
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    )
}

impl Mlb {
    /// Maps and validates the file at `path`.
    pub fn open(path: &Path) -> Result<Mlb> {
        // A regular file only: a FIFO would block and a device never end.
        let file = crate::input::open(path).map_err(|e| FormatError::io(path, &e))?;
        let len = file
            .metadata()
            .map_err(|e| FormatError::io(path, &e))?
            .len();
        if len == 0 {
            return Err(FormatError::format(
                "file",
                "empty",
                "an .mlb file starts with a 256-byte header",
            )
            .in_file(path));
        }
        // SAFETY: the map is read-only. If another process truncates or rewrites the
        // file while it is mapped, reads may fault or see new bytes; the runtime checks
        // the size again before use (see docs/reliability.md). That is the mmap caveat.
        let map = unsafe { memmap2::MmapOptions::new().map(&file) }
            .map_err(|e| FormatError::io(path, &e))?;
        let mut m = Self::from_backing(Backing::Map(map, file)).map_err(|e| e.in_file(path))?;
        m.path = Some(path.to_path_buf());
        Ok(m)
    }

    /// Validates an in-memory file (copied into an aligned buffer).
    pub fn from_bytes(bytes: &[u8]) -> Result<Mlb> {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        // SAFETY: words has room for bytes.len() bytes; the regions do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                words.as_mut_ptr() as *mut u8,
                bytes.len(),
            )
        };
        Self::from_backing(Backing::Owned(words, bytes.len()))
    }

    fn from_backing(backing: Backing) -> Result<Mlb> {
        let parsed = parse(backing.bytes())?;
        let f16_scales = if parsed.header.scale_f16 != 0 {
            (0..parsed.layout.tensors.len())
                .map(|_| std::sync::OnceLock::new())
                .collect()
        } else {
            Vec::new()
        };
        // Borrowing f32 arrays needs aligned, little-endian bytes; copy otherwise.
        if cfg!(target_endian = "big") {
            return Err(FormatError::format(
                "host",
                "big-endian",
                "this build reads .mlb files on little-endian hosts only",
            ));
        }
        Ok(Mlb {
            backing,
            path: None,
            parsed,
            f16_scales,
        })
    }

    /// For a mapped file: refuses it if the file no longer has the size it had when
    /// mapped (another process truncated or rewrote it in place). Reading a mapped page
    /// past a file's new end raises SIGBUS, so the runtime calls this before each use
    /// of the arrays; it narrows the window, it cannot close it (see
    /// docs/reliability.md). In-memory files always pass.
    pub fn check_unchanged(&self) -> Result<()> {
        let Backing::Map(map, file) = &self.backing else {
            return Ok(());
        };
        let path = self.path.as_deref().unwrap_or(Path::new("model"));
        let len = file
            .metadata()
            .map_err(|e| FormatError::io(path, &e))?
            .len();
        if len != map.len() as u64 {
            return Err(FormatError::format(
                "file",
                format!("{len} bytes"),
                format!("changed size while in use (was {} bytes)", map.len()),
            )
            .in_file(path));
        }
        Ok(())
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.backing.bytes()
    }

    pub fn header(&self) -> &Header {
        &self.parsed.header
    }

    pub fn dims(&self) -> &Dims {
        &self.parsed.dims
    }

    pub fn layout(&self) -> &Layout {
        &self.parsed.layout
    }

    /// The float array of tensor `idx` (norms, biases, conv taps).
    pub fn f32s(&self, idx: usize) -> &[f32] {
        let t = &self.parsed.layout.tensors[idx];
        let b = &self.bytes()[t.offset as usize..(t.offset + t.bytes) as usize];
        match f32_view(b) {
            Cow::Borrowed(s) => s,
            // Unreachable on little-endian hosts: offsets are 64-aligned and the backing
            // is page- or 8-aligned (big-endian hosts are refused at load).
            Cow::Owned(_) => panic!("unaligned f32 array {}", t.name),
        }
    }

    /// The quantized matrix of tensor `idx`.
    pub fn mat(&self, idx: usize) -> MatRef<'_> {
        let (qtype, rows, cols, q) = self.mat_quants(idx);
        let raw = self.scale_bytes(idx);
        let d: &[f32] = match self.f16_scales.get(idx) {
            Some(cell) => cell.get_or_init(|| {
                raw.chunks_exact(2)
                    .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect()
            }),
            None => match f32_view(raw) {
                Cow::Borrowed(s) => s,
                Cow::Owned(_) => panic!(
                    "unaligned scales of {}",
                    self.parsed.layout.tensors[idx].name
                ),
            },
        };
        MatRef {
            qtype,
            rows,
            cols,
            q,
            d,
        }
    }

    /// Type, rows, cols and quants of matrix `idx`, without touching its scales.
    pub fn mat_quants(&self, idx: usize) -> (QType, usize, usize, &[u8]) {
        let t = &self.parsed.layout.tensors[idx];
        let Kind::Mat {
            qtype, rows, cols, ..
        } = t.kind
        else {
            panic!("{} is not a matrix", t.name)
        };
        (
            qtype,
            rows,
            cols,
            &self.bytes()[t.offset as usize..(t.offset + t.bytes) as usize],
        )
    }

    /// The stored bytes of matrix `idx`'s scales (f32 or f16 per the header).
    fn scale_bytes(&self, idx: usize) -> &[u8] {
        let t = &self.parsed.layout.tensors[idx];
        let Kind::Mat {
            d_offset, d_bytes, ..
        } = t.kind
        else {
            panic!("{} is not a matrix", t.name)
        };
        &self.bytes()[d_offset as usize..(d_offset + d_bytes) as usize]
    }

    /// The f16 scales of matrix `idx` as stored (bits), when the file has f16 scales.
    pub fn mat_f16(&self, idx: usize) -> Option<&[u16]> {
        if self.f16_scales.is_empty() {
            return None;
        }
        let raw = self.scale_bytes(idx);
        // SAFETY: every bit pattern is a valid u16; align_to yields only the aligned
        // middle (arrays are 64-aligned in a page- or 8-aligned buffer, so all of it).
        let (pre, mid, post) = unsafe { raw.align_to::<u16>() };
        (cfg!(target_endian = "little") && pre.is_empty() && post.is_empty()).then_some(mid)
    }

    /// Drops the mapped pages of rows `r0..r1` of matrix `idx` (quants and scales) from
    /// this process's memory, for a caller that copied them elsewhere (the packed
    /// kernels' layout): the pages stay in the page cache and a later read maps them
    /// again. Nothing for an in-memory file.
    ///
    /// The range released starts up to 4 MiB before the rows: the kernel maps pages
    /// around each fault (fault-around, large folios), so reading one range maps parts
    /// of its neighbours again; releasing in file order with that margin leaves none
    /// behind. Vectors in the margin are mapped again when read (a few pages).
    pub fn release_rows(&self, idx: usize, r0: usize, r1: usize) {
        let Backing::Map(map, _) = &self.backing else {
            return;
        };
        let t = &self.parsed.layout.tensors[idx];
        let Kind::Mat {
            rows,
            d_offset,
            d_bytes,
            ..
        } = t.kind
        else {
            return;
        };
        let (r0, r1) = (r0.min(rows) as u64, r1.min(rows) as u64);
        let (qrow, drow) = (t.bytes / rows as u64, d_bytes / rows as u64);
        const MARGIN: u64 = 4 << 20;
        for (off, len) in [
            (t.offset + r0 * qrow, (r1 - r0) * qrow),
            (d_offset + r0 * drow, (r1 - r0) * drow),
        ] {
            let (off, len) = (off.saturating_sub(MARGIN), len + off.min(MARGIN));
            // SAFETY: a read-only shared file map: MADV_DONTNEED only drops page-table
            // entries, and the next access reads the same bytes from the page cache.
            // A failure only means the pages stay resident.
            let _ = unsafe {
                map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    off as usize,
                    len as usize,
                )
            };
        }
    }

    /// The layer flag byte of layer `l` (0 without layer flags).
    pub fn layer_flags(&self, l: usize) -> u8 {
        self.parsed.flags[l]
    }
}
