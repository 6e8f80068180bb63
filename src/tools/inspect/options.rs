//! [`InspectOptions`]: a checked `mlb-inspect` command line.

use std::path::PathBuf;

/// What to print about the file.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// The report of any kind of file (`--json`: one JSON object).
    Report,
    /// .mlb: statistics of one tensor.
    Tensor(String),
    /// .mlt: token ids of the UTF-8 text on the input, as one JSON array.
    Encode,
    /// .mlt: the text of the ids on the input (a JSON array or whitespace-separated).
    Decode,
    /// .mlt: the conversation in `file` rendered with the chat template: its ids, or
    /// the text when `text`.
    Chat { file: PathBuf, text: bool },
}

/// A checked `mlb-inspect` command line.
#[derive(Debug, Clone)]
pub struct InspectOptions {
    pub file: PathBuf,
    pub json: bool,
    pub action: Action,
}
