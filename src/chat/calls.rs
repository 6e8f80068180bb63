//! What the tool-call readers give out (`tools`, `harmony`), and small pieces they share.

/// One tool call read from the text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments' JSON text as the model wrote it (an object).
    pub arguments: String,
}

/// What the parser gives out as text arrives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    /// Text of the reply that is not a tool call.
    Content(String),
    /// Reasoning apart from the reply (harmony's analysis channel).
    Reasoning(String),
    /// Call `index` begins: its name.
    Start { index: usize, name: String },
    /// More of call `index`'s arguments text.
    Arguments { index: usize, delta: String },
}

/// A reply's events added up as a stream's client adds them: content, reasoning and each
/// call's (name, arguments). Panics unless the calls start in order and their argument
/// deltas add up to `calls`, the reader's own (the readers' tests and the fuzz target
/// hold every split of a text to this).
pub fn sum_events(
    evs: Vec<ToolEvent>,
    calls: &[ToolCall],
) -> (String, String, Vec<(String, String)>) {
    let (mut content, mut reasoning) = (String::new(), String::new());
    let mut streamed: Vec<ToolCall> = Vec::new();
    for ev in evs {
        match ev {
            ToolEvent::Content(t) => content.push_str(&t),
            ToolEvent::Reasoning(t) => reasoning.push_str(&t),
            ToolEvent::Start { index, name } => {
                assert_eq!(index, streamed.len(), "calls start in order");
                let arguments = String::new();
                streamed.push(ToolCall { name, arguments });
            }
            ToolEvent::Arguments { index, delta } => streamed[index].arguments.push_str(&delta),
        }
    }
    assert_eq!(streamed, calls, "the deltas add up to the calls");
    let calls = streamed.into_iter().map(|c| (c.name, c.arguments));
    (content, reasoning, calls.collect())
}

/// Where the longest suffix of `text` that begins `tag` starts (`text.len()` if none).
pub(crate) fn partial_suffix(text: &str, tag: &str) -> usize {
    text.char_indices()
        .map(|(i, _)| i)
        .find(|&i| tag.starts_with(&text[i..]))
        .unwrap_or(text.len())
}

/// Where `needle` starts in `text` if it starts within the first `limit` bytes: `Ok`;
/// `Err(true)` when it still might (the text is shorter than that could show), else
/// `Err(false)`. The same answer whether the text came whole or is growing.
pub(crate) fn find_within(text: &str, needle: &str, limit: usize) -> Result<usize, bool> {
    match text.find(needle) {
        Some(at) if at <= limit => Ok(at),
        _ => Err(text.len() < limit + needle.len()),
    }
}

/// `call0 | call1 | ...`: the rules of `n` tools' calls.
pub(crate) fn alternatives(n: usize) -> String {
    (0..n)
        .map(|i| format!("call{i}"))
        .collect::<Vec<_>>()
        .join(" | ")
}

/// A streaming reader's test: `run` on `text` whole, in two pieces split at every char
/// boundary (and, with `three`, in three: for each first cut, every `three`-th later
/// one), and one char at a time, must give the same; returns it.
#[cfg(test)]
pub(crate) fn same_at_every_split<T: PartialEq + std::fmt::Debug>(
    text: &str,
    three: Option<usize>,
    run: impl Fn(&[&str]) -> T,
) -> T {
    let whole = run(&[text]);
    let cuts: Vec<usize> = text.char_indices().map(|(i, _)| i).skip(1).collect();
    for &a in &cuts {
        assert_eq!(run(&[&text[..a], &text[a..]]), whole, "split at {a}");
        let Some(step) = three else { continue };
        for &b in cuts.iter().filter(|&&b| b > a).step_by(step) {
            assert_eq!(
                run(&[&text[..a], &text[a..b], &text[b..]]),
                whole,
                "split at {a}, {b}"
            );
        }
    }
    // One character at a time.
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(run(&pieces), whole, "char by char");
    whole
}
