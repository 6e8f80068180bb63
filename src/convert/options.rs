//! What a conversion is asked to do: [`ConvertOptions`] (the CLI fills it in) and the
//! defaults the library owns.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use super::pipeline::plan::TypePlan;
use crate::format::mlb::header::q8_class;
use crate::format::WType;
use crate::quant::Q4Rule;

/// The default `--q8` of a Q4_0 model: the classifier stays Q8_0, as llama.cpp keeps
/// its output matrix at higher precision; with a shared classifier this makes tok_emb
/// Q8_0 too (the spec's rule).
pub const DEFAULT_Q4_Q8_MASK: u32 = q8_class::WCLS;

/// `--wtype`'s default: Q8_0, nearly lossless at 8.5 bits per weight.
pub const DEFAULT_WTYPE: WType = WType::Q8_0;

/// What to convert and how.
#[derive(Debug, Clone)]
pub struct ConvertOptions {
    /// The checkpoint folder.
    pub input: PathBuf,
    /// The output file; `None`: [`default_output`].
    pub output: Option<PathBuf>,
    /// The type of every matrix (Q4_0: except the `q8_mask` classes and lb/la, Q8_0);
    /// `None`: [`DEFAULT_WTYPE`]. A GGUF's matrices keep their own types: it refuses one.
    pub wtype: Option<WType>,
    /// q8_mask for Q4_0 (`None`: [`DEFAULT_Q4_Q8_MASK`]); must be 0 or `None` otherwise.
    pub q8_mask: Option<u32>,
    /// Per-class or per-tensor types over `wtype`'s (`--types`); when the result is not
    /// what `wtype` and `q8_mask` alone give, the file is mixed (`wtype` 128). On a GGUF
    /// the matrices they name are requantized, the others copied.
    pub types: TypePlan,
    pub scale_f16: bool,
    /// `None`: the architecture's default (`Arch::default_q4_rule`: round for
    /// Gemma 3, search otherwise).
    pub q4_rule: Option<Q4Rule>,
    pub imatrix: Option<PathBuf>,
    /// Error feedback where the imatrix has the input's covariance (`--no-error-feedback`
    /// turns it off).
    pub error_feedback: bool,
    /// How error feedback regularizes H: `λ · mean(diag H)` added to its diagonal
    /// (`--feedback-damp`), its off-diagonal shrunk by `(1 − α)` (`--feedback-shrink`).
    pub feedback: crate::quant::feedback::Prior,
    /// Rayon threads (`None`: rayon's default, one per core).
    pub threads: Option<usize>,
    /// GGUF input: the type of the matrices Krafla cannot store as they are
    /// (dequantized, then quantized again); `None` refuses them.
    pub requantize: Option<WType>,
    /// When set to true (e.g. by a Ctrl-C handler), the conversion stops at the next
    /// row chunk with [`ConvertError::Interrupted`](super::error::ConvertError::Interrupted) and removes its temporary file.
    pub cancel: Option<&'static AtomicBool>,
    /// `--target-bpw` (or a `--preset`'s): every matrix's type chosen by measured error
    /// under this many bits per weight ([`mix`](super::pipeline::mix)); `wtype` and `q8_mask` are not used,
    /// `types` pins the matrices its rules pick. Checkpoint folders only.
    pub target_bpw: Option<f64>,
    /// `--gguf-types`: only types GGUF has, so that mlb-export takes the file: a mix
    /// chooses among them, rows that are not whole 256-weight super-blocks fall back to
    /// GGUF types (Q6_K to Q8_0 rather than Q6_0), scales are f16, and a type GGUF
    /// lacks (`--wtype q6_0`) is refused.
    pub gguf_types: bool,
}

impl ConvertOptions {
    /// The matrices' type of a checkpoint's conversion (`--wtype`, else [`DEFAULT_WTYPE`]).
    pub fn wtype(&self) -> WType {
        self.wtype.unwrap_or(DEFAULT_WTYPE)
    }

    /// `input` converted to `wtype` with the library's other defaults (a GGUF input
    /// refuses a `wtype`: set it to `None` for one).
    pub fn new(input: impl Into<PathBuf>, wtype: WType) -> ConvertOptions {
        ConvertOptions {
            input: input.into(),
            output: None,
            wtype: Some(wtype),
            q8_mask: None,
            types: TypePlan::default(),
            scale_f16: false,
            q4_rule: None,
            imatrix: None,
            error_feedback: true,
            feedback: Default::default(),
            threads: None,
            requantize: None,
            cancel: None,
            target_bpw: None,
            gguf_types: false,
        }
    }
}

/// `<folder>-<wtype>.mlb` beside the folder, e.g. `models/gemma-3-270m-q4_0.mlb`.
pub fn default_output(input: &Path, wtype: WType) -> PathBuf {
    let abs = std::path::absolute(input).unwrap_or_else(|_| input.to_path_buf());
    let name = abs
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let parent = abs.parent().map(Path::to_path_buf).unwrap_or_default();
    parent.join(format!("{name}-{}.mlb", wtype.cli_name()))
}
