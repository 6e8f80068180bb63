//! Parsing and the zero-copy view: the same code validates a file for `mlb-inspect`
//! and loads it for `mlb-run`.

use std::borrow::Cow;
use std::fs::File;
use std::path::{Path, PathBuf};

use super::header::{wtype, Header, HEADER_SIZE};
use super::layout::{Kind, Layout};
use super::validate::{validate, validate_layer_flags, Dims};
use crate::format::error::{FormatError, Result};
use crate::format::mat::QMat;
use crate::format::WType;

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
    let table = type_table(bytes, &header, &dims, flags)?;
    let end = Layout::end_offset(&header, &dims, flags, table, limit)?;
    if end > bytes.len() as u64 {
        return Err(FormatError::format(
            "file",
            format!("{} bytes", bytes.len()),
            format!("shorter than the {end} bytes the header implies"),
        ));
    }
    let layout = Layout::with_table(&header, &dims, flags, table, limit)?;
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

/// A mixed file's type table (empty for any other `wtype`): one byte per matrix, after
/// the layer flags. Its entries are checked as the layout is placed, naming the tensor.
fn type_table<'a>(bytes: &'a [u8], h: &Header, d: &Dims, flags: &[u8]) -> Result<&'a [u8]> {
    if h.wtype != wtype::MIXED {
        return Ok(&[]);
    }
    let n = Layout::matrix_count(h, d, flags)?;
    let at = Layout::type_table_offset(h, d) as usize;
    bytes.get(at..at + n).ok_or_else(|| {
        FormatError::format(
            "type_table",
            format!("{} bytes", bytes.len()),
            format!("file too short for the {n}-entry type table at offset {at}"),
        )
    })
}

/// The x86 kernels negate weights by the activation's sign; -128 has no int8 negation.
fn check_q8_quants(bytes: &[u8], layout: &Layout) -> Result<()> {
    for t in &layout.tensors {
        if let Kind::Mat {
            wtype: WType::Q8_0, ..
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

/// A BF16 or F16 matrix: `rows × cols` 2-byte floats (their bits), row-major, borrowed
/// from the file (64-byte aligned).
#[derive(Debug, Clone, Copy)]
pub struct HalfRef<'a> {
    /// [`WType::BF16`] or [`WType::F16`].
    pub wtype: WType,
    pub rows: usize,
    pub cols: usize,
    pub w: &'a [u16],
}

impl<'a> HalfRef<'a> {
    /// Row `r`'s bits.
    pub fn row(&self, r: usize) -> &'a [u16] {
        &self.w[r * self.cols..(r + 1) * self.cols]
    }

    /// Row `r` widened to f32 (exact).
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) {
        crate::format::half_float::widen(self.wtype, self.row(r), out)
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

    /// The quantized matrix of tensor `idx`, borrowed from the file: quants and scales
    /// as stored (f32, or f16 bits in [`QMat::d16`], which the kernels convert as they
    /// read them). The layout was validated, so the lengths agree with the shape.
    ///
    /// Panics if tensor `idx` is not a matrix.
    pub fn mat(&self, idx: usize) -> QMat<'_> {
        let t = &self.parsed.layout.tensors[idx];
        let Kind::Mat {
            wtype,
            rows,
            cols,
            d_offset,
            d_bytes,
            ..
        } = t.kind
        else {
            panic!("{} is not a matrix", t.name)
        };
        let bytes = self.bytes();
        let raw = &bytes[d_offset as usize..(d_offset + d_bytes) as usize];
        let m = QMat {
            wtype,
            rows,
            cols,
            q: &bytes[t.offset as usize..(t.offset + t.bytes) as usize],
            d: &[],
            d16: &[],
        };
        if !wtype.has_scales() {
            return m;
        }
        if self.parsed.header.scale_f16 != 0 {
            // SAFETY: every bit pattern is a valid u16; align_to yields only the aligned
            // middle (arrays are 64-aligned in a page- or 8-aligned buffer, so all of it).
            let (pre, d16, post) = unsafe { raw.align_to::<u16>() };
            assert!(
                pre.is_empty() && post.is_empty(),
                "unaligned scales of {}",
                t.name
            );
            return QMat { d16, ..m };
        }
        match f32_view(raw) {
            Cow::Borrowed(d) => QMat { d, ..m },
            // Unreachable on little-endian hosts (big-endian ones are refused at load).
            Cow::Owned(_) => panic!("unaligned scales of {}", t.name),
        }
    }

    /// The storage type of tensor `idx`, or `None` when it is not a matrix.
    pub fn mat_type(&self, idx: usize) -> Option<WType> {
        match self.parsed.layout.tensors[idx].kind {
            Kind::Mat { wtype, .. } => Some(wtype),
            _ => None,
        }
    }

    /// Tensor `idx` as a BF16 or F16 matrix (zero-copy), or `None` when it is not one.
    pub fn mat_half(&self, idx: usize) -> Option<HalfRef<'_>> {
        if !self.mat_type(idx)?.is_half() {
            return None;
        }
        let m = self.mat(idx);
        // SAFETY: every bit pattern is a valid u16; align_to yields only the aligned
        // middle (arrays are 64-aligned in a page- or 8-aligned buffer, so all of it,
        // and big-endian hosts are refused at load).
        let (pre, w, post) = unsafe { m.q.align_to::<u16>() };
        assert!(
            pre.is_empty() && post.is_empty(),
            "unaligned {} matrix {}",
            m.wtype,
            self.parsed.layout.tensors[idx].name
        );
        Some(HalfRef {
            wtype: m.wtype,
            rows: m.rows,
            cols: m.cols,
            w,
        })
    }

    /// The f16 scales of matrix `idx` as stored (bits), when the file has f16 scales
    /// and the matrix's type has scales.
    pub fn mat_f16(&self, idx: usize) -> Option<&[u16]> {
        let m = self.mat(idx);
        (!m.d16.is_empty()).then_some(m.d16)
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
            if len == 0 {
                continue; // no scale array
            }
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
