//! Human and JSON reports of `.mlb`, `.mlt` and `.mli` files for `mlb-inspect`.
//!
//! Reports are built from the same validated views the tools load, so what inspect
//! calls valid is exactly what the runtime accepts.

pub mod mlb;
pub mod mli;
pub mod run;

use crate::format::error::{FormatError, Result};

/// Which format a file is, by its magic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    Mlb,
    Mlt,
    Mli,
}

/// Identifies a file by its first four bytes.
pub fn detect(bytes: &[u8]) -> Result<FileKind> {
    match bytes.get(..4) {
        Some(b"MLB1") => Ok(FileKind::Mlb),
        Some(b"MLT1") => Ok(FileKind::Mlt),
        Some(b"MLI1") => Ok(FileKind::Mli),
        Some(m) => Err(FormatError::format(
            "magic",
            format!("{:?}", String::from_utf8_lossy(m)),
            "not an .mlb (MLB1), .mlt (MLT1) or .mli (MLI1) file",
        )),
        None => Err(FormatError::format(
            "file",
            format!("{} bytes", bytes.len()),
            "too short to hold a magic number",
        )),
    }
}

/// An f32 as a JSON number with its shortest decimal form (1e-5, not 9.99e-6).
pub fn json_f32(v: f32) -> serde_json::Value {
    let s = format!("{v}");
    match s.parse::<f64>().ok().and_then(serde_json::Number::from_f64) {
        Some(n) => serde_json::Value::Number(n),
        None => serde_json::Value::String(s),
    }
}

/// Bytes as `12.3 MiB`.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}
