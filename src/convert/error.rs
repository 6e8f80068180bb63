//! The converter's typed error: every variant renders as one line that names the
//! file, the field or tensor, and the offending value.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::format::mlb::WriteError;
use crate::format::FormatError;

/// Why a conversion failed.
#[derive(Debug)]
pub enum ConvertError {
    /// A file or folder cannot be read, created or renamed.
    Io { path: PathBuf, err: std::io::Error },
    /// config.json: a key is missing, malformed, or asks for math the format cannot express.
    Config {
        file: PathBuf,
        key: String,
        value: String,
        msg: String,
    },
    /// The checkpoint's files: a bad safetensors file, a missing shard or tensor.
    Checkpoint { file: PathBuf, msg: String },
    /// One tensor: wrong shape or dtype, NaN/Inf weights, unstorable scale.
    Tensor {
        file: PathBuf,
        tensor: String,
        msg: String,
    },
    /// The importance matrix does not fit the model.
    Imatrix {
        file: PathBuf,
        field: String,
        value: String,
        msg: String,
    },
    /// Options that contradict each other.
    Options { option: String, msg: String },
    /// The header the converter built from `file` (config.json) was refused by the
    /// format's own checks (e.g. dim not a multiple of 32).
    Format {
        file: PathBuf,
        err: Box<FormatError>,
    },
    /// Stopped on request (Ctrl-C); the temporary output was removed.
    Interrupted,
}

impl ConvertError {
    pub fn io(path: &Path, err: std::io::Error) -> Self {
        ConvertError::Io {
            path: path.to_path_buf(),
            err,
        }
    }

    pub fn config(
        file: &Path,
        key: impl Into<String>,
        value: impl fmt::Display,
        msg: impl Into<String>,
    ) -> Self {
        ConvertError::Config {
            file: file.to_path_buf(),
            key: key.into(),
            value: value.to_string(),
            msg: msg.into(),
        }
    }

    pub fn checkpoint(file: &Path, msg: impl Into<String>) -> Self {
        ConvertError::Checkpoint {
            file: file.to_path_buf(),
            msg: msg.into(),
        }
    }

    pub fn tensor(file: &Path, tensor: impl Into<String>, msg: impl Into<String>) -> Self {
        ConvertError::Tensor {
            file: file.to_path_buf(),
            tensor: tensor.into(),
            msg: msg.into(),
        }
    }

    /// A writer's failure: an I/O error on `io_path`, or the format refusing what was
    /// built from `file` (config.json for a checkpoint, else the output itself).
    pub fn write(file: &Path, io_path: &Path, e: WriteError) -> Self {
        match e {
            WriteError::Io(e) => ConvertError::io(io_path, e),
            WriteError::Format(err) => ConvertError::Format {
                file: file.to_path_buf(),
                err: Box::new(err),
            },
        }
    }

    pub fn options(option: impl Into<String>, msg: impl Into<String>) -> Self {
        ConvertError::Options {
            option: option.into(),
            msg: msg.into(),
        }
    }
}

impl fmt::Display for ConvertError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConvertError::Io { path, err } => write!(f, "{}: {err}", path.display()),
            ConvertError::Config {
                file,
                key,
                value,
                msg,
            } => write!(f, "{}: {key} = {value}: {msg}", file.display()),
            ConvertError::Checkpoint { file, msg } => write!(f, "{}: {msg}", file.display()),
            ConvertError::Tensor { file, tensor, msg } => {
                write!(f, "{}: tensor {tensor}: {msg}", file.display())
            }
            ConvertError::Imatrix {
                file,
                field,
                value,
                msg,
            } => write!(f, "{}: {field} = {value}: {msg}", file.display()),
            ConvertError::Options { option, msg } => write!(f, "{option}: {msg}"),
            ConvertError::Format { file, err } => write!(
                f,
                "{}: the model does not fit the .mlb format: {err}",
                file.display()
            ),
            ConvertError::Interrupted => write!(f, "interrupted; no output written"),
        }
    }
}

impl std::error::Error for ConvertError {}

pub type Result<T> = std::result::Result<T, ConvertError>;
