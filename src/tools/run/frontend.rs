//! [`RunFrontend`]: what `mlb-run` shows as it happens, implemented by the binary.

/// What the command shows, as it happens: generated text to stdout, `--verbose` lines
/// and progress to stderr, and the interactive chat's lines read back.
pub trait RunFrontend {
    /// Generated text (stdout), as it is made; an error ends the run.
    fn text(&mut self, s: &str) -> std::io::Result<()>;
    /// A `--verbose` line or a note (stderr).
    fn info(&mut self, _line: &str) {}
    /// A measurement starts over `total` chunks.
    fn chunks_start(&mut self, _total: usize) {}
    /// `done` chunks measured; `figure` is the running result ("PPL 12.3456"), when
    /// there is one.
    fn chunks_done(&mut self, _done: usize, _figure: Option<&str>) {}
    /// The measurement is over (before its report is shown).
    fn chunks_end(&mut self) {}
    /// The interactive chat's next line, `prompt` shown before it; `None` at the end of
    /// the input (Ctrl-D).
    fn read_line(&mut self, _prompt: &str) -> std::io::Result<Option<String>> {
        Ok(None)
    }
    /// Whether the user asked to stop the reply being generated (Ctrl-C) since the
    /// last call.
    fn interrupted(&mut self) -> bool {
        false
    }
}
