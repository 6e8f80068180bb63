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

/// A rule of the model description broken
/// ([`ModelDesc::check`](super::desc::ModelDesc::check)): the field, its value and why.
/// Each reader names the field by its own key ([`DescError::at`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescError {
    pub field: DescField,
    pub value: String,
    pub msg: String,
}

/// The description's fields that its rules speak of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DescField {
    /// Rotated dimensions per head.
    RotDim,
    /// The RoPE scaling type.
    RopeScaling,
    /// The FFN activation.
    Act,
    SlidingWindow,
    /// The per-layer flags.
    Layers,
    /// The number of routed experts.
    Experts,
    /// Experts per token.
    ExpertsUsed,
    /// One routed expert's FFN width.
    ExpertHidden,
    /// The shared expert's FFN width.
    SharedHidden,
}

impl DescError {
    /// The error in `file` under the reader's `key` for the field, with the value as
    /// the reader stores it (`None`: the description's).
    pub fn at(self, file: &Path, key: impl Into<String>, value: Option<String>) -> ConvertError {
        ConvertError::config(file, key, value.unwrap_or(self.value), self.msg)
    }
}

pub type Result<T> = std::result::Result<T, ConvertError>;
