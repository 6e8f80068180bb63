//! File formats: `.mlb` (model), `.mlt` (tokenizer), `.mli` (importance matrix), and
//! GGUF (llama.cpp's model file, read and written by the converters).
//!
//! Each format has a pure `parse(&[u8])` that validates every rule of the spec and a
//! deterministic writer; the same code validates for `mlb-inspect` and loads for
//! `mlb-run`.

/// Named bit flags of a header field: a `pub const` per bit, `$names` (every bit with
/// its name, in the order given) and `$known` (their union).
macro_rules! named_bits {
    ($names:ident, $known:ident; $($(#[$doc:meta])* $bit:ident = $v:literal, $name:literal;)*) => {
        $($(#[$doc])* pub const $bit: u32 = $v;)*
        /// Every bit with its name, in bit order.
        pub const $names: &[(u32, &str)] = &[$(($bit, $name)),*];
        const $known: u32 = {
            let mut known = 0;
            $(known |= $bit;)*
            known
        };
    };
}

/// The names of the bits of `bits` set, in `table` order.
fn bit_names(table: &[(u32, &'static str)], bits: u32) -> Vec<&'static str> {
    table
        .iter()
        .filter(|(b, _)| bits & b != 0)
        .map(|&(_, n)| n)
        .collect()
}

pub mod error;
pub mod gguf;
pub mod half_float;
#[rustfmt::skip] // generated (scripts/gen-iq-grids.py): one line per 4 or 8 entries
pub mod iq_grids;
pub mod mat;
pub mod mlb;
pub mod mli;
pub mod mlt;
pub mod mlt_chat;
mod reader;
pub mod wtype;

pub use error::{FormatError, Result, ShapeError, Status};
pub use mat::{QMat, Quantized, Scales};
pub use wtype::WType;
