//! Typed errors for every file format, carrying the spec's status.

use std::fmt;
use std::path::{Path, PathBuf};

/// The spec's error status of a file that cannot be loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// The file cannot be opened or read.
    Io,
    /// The bytes do not form a valid file: magic, version, enums, flags, sizes.
    Format,
    /// The dimensions are zero, over a limit or inconsistent.
    Shape,
}

impl Status {
    /// The spec's name of the status, e.g. `ML_E_SHAPE`.
    pub fn name(self) -> &'static str {
        match self {
            Status::Io => "ML_E_IO",
            Status::Format => "ML_E_FORMAT",
            Status::Shape => "ML_E_SHAPE",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A matrix or activation shape that does not fit its arrays' lengths (a view built in
/// memory: [`crate::format::mat::QMat`]'s constructors, the kernels' activations).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeError(pub String);

impl fmt::Display for ShapeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ShapeError {}

/// Why a file was refused: the status, the field (spec name) and the offending value.
#[derive(Debug, Clone, PartialEq)]
pub struct FormatError {
    pub status: Status,
    /// The spec's name of the field or array, e.g. `n_kv_heads` or `wq[3]`.
    pub field: String,
    /// The offending value as text, e.g. `7`.
    pub value: String,
    /// What rule the value breaks, e.g. `must divide n_heads (32)`.
    pub rule: String,
    /// The file, when known (added by the caller that opened it).
    pub file: Option<PathBuf>,
}

impl FormatError {
    pub fn new(
        status: Status,
        field: impl Into<String>,
        value: impl fmt::Display,
        rule: impl Into<String>,
    ) -> Self {
        FormatError {
            status,
            field: field.into(),
            value: value.to_string(),
            rule: rule.into(),
            file: None,
        }
    }

    pub fn format(
        field: impl Into<String>,
        value: impl fmt::Display,
        rule: impl Into<String>,
    ) -> Self {
        Self::new(Status::Format, field, value, rule)
    }

    pub fn shape(
        field: impl Into<String>,
        value: impl fmt::Display,
        rule: impl Into<String>,
    ) -> Self {
        Self::new(Status::Shape, field, value, rule)
    }

    /// An I/O failure on `path`.
    pub fn io(path: &Path, err: &std::io::Error) -> Self {
        let mut e = Self::new(Status::Io, "file", path.display(), err.to_string());
        e.file = Some(path.to_path_buf());
        e
    }

    /// The same error, naming the file it came from.
    pub fn in_file(mut self, path: &Path) -> Self {
        self.file = Some(path.to_path_buf());
        self
    }
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.status)?;
        if let Some(p) = &self.file {
            write!(f, "{}: ", p.display())?;
        }
        if self.status == Status::Io {
            return write!(f, "{}", self.rule);
        }
        write!(f, "{} = {}: {}", self.field, self.value, self.rule)
    }
}

impl std::error::Error for FormatError {}

pub type Result<T> = std::result::Result<T, FormatError>;
