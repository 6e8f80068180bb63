//! mlb-convert: Hugging Face checkpoint folder → one `.mlb` file.
//!
//! Thin: parses the options, calls `krafla::convert::convert`, shows a progress bar
//! on a terminal, prints a one-line summary. Exit 0 on success, 1 on a conversion
//! error (one line on stderr), 2 on bad usage, 130 when interrupted (Ctrl-C or
//! SIGTERM: the conversion stops at the next row chunk and removes its temporary file).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;

use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use krafla::convert::{self, ConvertOptions, Progress, TypePlan, WType};
use krafla::format::mlb::header::q8_class;
use krafla::quant::Q4Rule;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum WTypeArg {
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
    #[value(name = "bf16")]
    Bf16,
    #[value(name = "f16")]
    F16,
    #[value(name = "q4_k")]
    Q4K,
    #[value(name = "q5_k")]
    Q5K,
    #[value(name = "q6_k")]
    Q6K,
    #[value(name = "q4_1")]
    Q4_1,
    #[value(name = "q5_0")]
    Q5_0,
    #[value(name = "q5_1")]
    Q5_1,
    #[value(name = "iq4_nl")]
    Iq4Nl,
    #[value(name = "q6_0")]
    Q6_0,
    #[value(name = "mxfp4")]
    Mxfp4,
    #[value(name = "q2_k")]
    Q2K,
    #[value(name = "q3_k")]
    Q3K,
    #[value(name = "iq4_xs")]
    Iq4Xs,
    #[value(name = "iq3_xxs")]
    Iq3Xxs,
    #[value(name = "iq3_s")]
    Iq3S,
    #[value(name = "iq2_xxs")]
    Iq2Xxs,
    #[value(name = "iq2_xs")]
    Iq2Xs,
    #[value(name = "iq2_s")]
    Iq2S,
    #[value(name = "iq1_m")]
    Iq1M,
}

/// `--requantize`: any type Krafla writes.
fn requant_type(s: &str) -> Result<WType, String> {
    krafla::quant::quantizable_type(s)
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum RuleArg {
    Search,
    Round,
}

/// Convert a Hugging Face checkpoint folder (config.json + safetensors) or a GGUF file to an .mlb file.
#[derive(Debug, Parser)]
#[command(name = "mlb-convert", version)]
struct Cli {
    /// Checkpoint folder (config.json and model.safetensors or model.safetensors.index.json with its shards), or a GGUF file
    checkpoint: PathBuf,
    /// Output file [default: <folder>-<wtype>.mlb beside the folder]
    #[arg(short, long, value_name = "OUT.mlb")]
    output: Option<PathBuf>,
    /// Weight type of the matrices (the 256-weight types on rows that are not a multiple of 256 fall back to a 32-weight type, with a note); a GGUF's matrices keep their own types (--types, --requantize) [default: q8_0]
    #[arg(long, value_enum)]
    wtype: Option<WTypeArg>,
    /// Choose every matrix's type by measured error under this many bits per weight (all matrices, scales included, as mlb-inspect counts them): from 1.75 (IQ1_M) to 8.5 (Q8_0) on rows of whole 256-weight super-blocks, from 4.5 (IQ4_NL) on others; checkpoint folders only
    #[arg(long, value_name = "BPW", conflicts_with_all = ["wtype", "preset"])]
    target_bpw: Option<f64>,
    /// A named --target-bpw: iq2_m (2.7), iq3_xxs (3.06), iq3_m (3.66), q3_k_m (4.0), iq4_xs (4.25), q4_k_s (4.6), q4_k_m (4.9), q5_k_m (5.7), q6_k (6.6), q8_0 (8.5)
    #[arg(long, value_name = "NAME", value_parser = parse_preset, conflicts_with = "wtype")]
    preset: Option<f64>,
    /// With --target-bpw or --preset: write every matrix's measured errors and chosen type as JSON
    #[arg(long, value_name = "FILE.json")]
    mix_report: Option<PathBuf>,
    /// Q4_0 only: matrix classes stored as Q8_0 instead, comma-separated from tok_emb, wcls, wqk, wv, wo, w13, w2, or none [default: wcls]
    #[arg(long, value_name = "CLASSES", value_parser = parse_q8)]
    q8: Option<u32>,
    /// Other types for some matrices (a mixed file), comma-separated TARGET=TYPE: a class (tok_emb, wcls, wqk, wv, wo, w13, w2), a group (experts, shared_expert) or a tensor (layers.3.w2), e.g. tok_emb=q8_0; on GGUF input the matrices it names are dequantized and quantized again, the others copied
    #[arg(long, value_name = "RULES", value_parser = TypePlan::parse)]
    types: Option<TypePlan>,
    /// Store every quantization scale as f16 instead of f32
    #[arg(long)]
    f16_scales: bool,
    /// Only types GGUF has, so that mlb-export takes the file: mixes choose among them, rows that are not whole 256-weight super-blocks fall back to GGUF types (Q6_K to Q8_0), scales are f16
    #[arg(long)]
    gguf_types: bool,
    /// Q4_0 rounding: least-squares search, or llama.cpp's round [default: round for Gemma 3, search otherwise]
    #[arg(long, value_enum)]
    q4_rule: Option<RuleArg>,
    /// Importance matrix (MLI1, from mlb-run --imatrix) weighting the searching quantizers (Q4_0 search, the block types) and the --target-bpw error measure
    #[arg(long, value_name = "FILE.mli")]
    imatrix: Option<PathBuf>,
    /// With an --imatrix that has covariances (mlb-run --imatrix F --covariance): quantize without error feedback (for comparisons)
    #[arg(long, requires = "imatrix")]
    no_error_feedback: bool,
    /// Error feedback's damping λ: λ · mean(diag H) is added to the covariance's diagonal (more: closer to the plain quantizer, less fitted to the calibration text)
    #[arg(long, value_name = "λ", default_value_t = krafla::quant::feedback::DAMP, requires = "imatrix")]
    feedback_damp: f64,
    /// Error feedback's shrinkage α: the covariance's off-diagonal is multiplied by 1 − α before it is factored (0: as measured; 1: no feedback between columns, only the importance)
    #[arg(long, value_name = "α", default_value_t = krafla::quant::feedback::SHRINK, requires = "imatrix")]
    feedback_shrink: f64,
    /// GGUF input: quantize the F32/F16/BF16 matrices, and dequantize and quantize again those of types Krafla lacks (IQ1_S, TQ1_0, ...), to this type (q8_0, q4_0, bf16, f16, q4_k, q5_k, q6_k, q4_1, q5_0, q5_1, iq4_nl, q6_0, mxfp4, q2_k, q3_k, iq4_xs, iq3_xxs, iq3_s, iq2_xxs, iq2_xs, iq2_s, iq1_m); without it F16/BF16 are kept and the others refused
    #[arg(long, value_name = "TYPE", value_parser = requant_type)]
    requantize: Option<WType>,
    /// Worker threads [default: one per core]; the output does not depend on it
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    threads: Option<usize>,
}

fn wtype(w: WTypeArg) -> WType {
    match w {
        WTypeArg::Q8_0 => WType::Q8_0,
        WTypeArg::Q4_0 => WType::Q4_0,
        WTypeArg::Bf16 => WType::BF16,
        WTypeArg::F16 => WType::F16,
        WTypeArg::Q4K => WType::Q4_K,
        WTypeArg::Q5K => WType::Q5_K,
        WTypeArg::Q6K => WType::Q6_K,
        WTypeArg::Q4_1 => WType::Q4_1,
        WTypeArg::Q5_0 => WType::Q5_0,
        WTypeArg::Q5_1 => WType::Q5_1,
        WTypeArg::Iq4Nl => WType::IQ4_NL,
        WTypeArg::Q6_0 => WType::Q6_0,
        WTypeArg::Mxfp4 => WType::MXFP4,
        WTypeArg::Q2K => WType::Q2_K,
        WTypeArg::Q3K => WType::Q3_K,
        WTypeArg::Iq4Xs => WType::IQ4_XS,
        WTypeArg::Iq3Xxs => WType::IQ3_XXS,
        WTypeArg::Iq3S => WType::IQ3_S,
        WTypeArg::Iq2Xxs => WType::IQ2_XXS,
        WTypeArg::Iq2Xs => WType::IQ2_XS,
        WTypeArg::Iq2S => WType::IQ2_S,
        WTypeArg::Iq1M => WType::IQ1_M,
    }
}

fn parse_q8(s: &str) -> Result<u32, String> {
    q8_class::parse(s)
}

fn parse_preset(s: &str) -> Result<f64, String> {
    convert::pipeline::mix::preset(s).ok_or_else(|| {
        let names: Vec<&str> = convert::pipeline::mix::PRESETS
            .iter()
            .map(|p| p.0)
            .collect();
        format!("unknown preset '{s}' (known: {})", names.join(", "))
    })
}

/// Set by SIGINT / SIGTERM; polled by the converter between row chunks.
static STOP: AtomicBool = AtomicBool::new(false);

fn main() -> ExitCode {
    krafla::cli::default_sigpipe();
    let cli = krafla::cli::parse_args::<Cli>();
    krafla::signals::stop_on_interrupt(&STOP);

    let opts = ConvertOptions {
        input: cli.checkpoint,
        output: cli.output,
        wtype: cli.wtype.map(wtype),
        q8_mask: cli.q8,
        types: cli.types.unwrap_or_default(),
        scale_f16: cli.f16_scales,
        q4_rule: cli.q4_rule.map(|r| match r {
            RuleArg::Search => Q4Rule::Search,
            RuleArg::Round => Q4Rule::Round,
        }),
        imatrix: cli.imatrix,
        error_feedback: !cli.no_error_feedback,
        feedback: krafla::quant::feedback::Prior {
            damp: cli.feedback_damp,
            shrink: cli.feedback_shrink,
        },
        threads: cli.threads,
        requantize: cli.requantize,
        cancel: Some(&STOP),
        target_bpw: cli.target_bpw.or(cli.preset),
        gguf_types: cli.gguf_types,
    };
    if cli.mix_report.is_some() && opts.target_bpw.is_none() {
        eprintln!("mlb-convert: --mix-report needs --target-bpw or --preset");
        return ExitCode::from(2);
    }
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = ProgressBar::new(0);
        b.set_style(
            ProgressStyle::with_template(
                "{bar:32} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta} {msg}",
            )
            .expect("valid template"),
        );
        b
    });
    let mut tensors = 0;
    let mut on_progress = |p: Progress| match p {
        Progress::Start { tensors: n, bytes } => {
            tensors = n;
            if let Some(b) = &bar {
                b.set_length(bytes);
            }
        }
        Progress::Note(n) => match &bar {
            Some(b) => b.println(format!("note: {n}")),
            None => eprintln!("note: {n}"),
        },
        Progress::Warning(w) => match &bar {
            Some(b) => b.println(format!("warning: {w}")),
            None => eprintln!("warning: {w}"),
        },
        Progress::Tensor {
            index,
            name,
            bytes_done,
        } => {
            if let Some(b) = &bar {
                b.set_position(bytes_done);
                b.set_message(format!("tensor {}/{tensors} {name}", index + 1));
            }
        }
    };
    let res = convert::convert(&opts, &mut on_progress);
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    match res {
        Ok(s) => {
            let rule = match s.q4_rule {
                Some(Q4Rule::Search) => ", q4 search",
                Some(Q4Rule::Round) => ", q4 round",
                None => "",
            };
            krafla::outln!(
                "{}: {} {}, {:.1}M parameters, {:.1} MB, {:.2} bits/weight{rule}, {:.1} s",
                s.output.display(),
                s.arch,
                s.type_text(),
                s.params as f64 / 1e6,
                s.file_bytes as f64 / 1e6,
                s.bits_per_weight(),
                s.seconds
            );
            if let Some(p) = &cli.mix_report {
                let json = convert::pipeline::mix::report_json(&s.mix, s.matrix_bpw);
                if let Err(e) = krafla::atomic::write(p, json.as_bytes()) {
                    eprintln!("mlb-convert: {}: {e}", p.display());
                    return ExitCode::from(1);
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("mlb-convert: {e}");
            if matches!(e, convert::ConvertError::Interrupted) {
                ExitCode::from(130)
            } else {
                ExitCode::from(1)
            }
        }
    }
}
