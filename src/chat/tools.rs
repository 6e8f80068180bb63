//! Tool calls: how a template's model family writes them ([`ToolFormat`]), reading them
//! out of the generated text whole or as it streams ([`ToolParser`]), the Lark grammar
//! that makes a required call always parse ([`call_grammar`]), and the assistant
//! messages of a conversation as templates expect them ([`normalize_tool_calls`]).
//!
//! Formats, by what the template writes:
//! - [`ToolFormat::Hermes`] (the template mentions `<tool_call>`: Qwen2.5, Qwen3,
//!   SmolLM3, Hermes): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
//!   any number of them, text allowed before;
//! - [`ToolFormat::Llama3Json`] (the template asks for `"parameters"`: Llama 3.1, 3.2,
//!   3.3): the reply is one JSON object `{"name": ..., "parameters": {...}}`, maybe
//!   after `<|python_tag|>`; several are separated by `;`;
//! - [`ToolFormat::MistralJson`] (the template writes `[TOOL_CALLS]`: Mistral Nemo):
//!   `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, text allowed before;
//! - [`ToolFormat::MistralArgs`] (the template writes `[TOOL_CALLS]` and `[ARGS]`:
//!   Mistral Small 3.2, Devstral, Ministral 3): `[TOOL_CALLS]NAME[ARGS]{...}` per call
//!   (a `[CALL_ID]ID` before `[ARGS]` is skipped); either Mistral form is read in both;
//! - [`ToolFormat::Harmony`] (gpt-oss): channels and recipients (`harmony`), which also
//!   split the reasoning from the content.
//!
//! A template that renders no tools gets the Hermes format (the grammar of a required
//! call writes it, the parser reads it).
//!
//! The parser streams: text before a call is content (whitespace just before a call is
//! dropped), a call's name is given once complete, then its arguments' JSON text as it
//! arrives. The concatenated argument deltas are the arguments of the whole-text parse,
//! so streaming and non-streaming answers agree.

use serde_json::{json, Value as Json};

use super::calls::{alternatives, find_within, partial_suffix};
pub use super::calls::{ToolCall, ToolEvent};
use super::conversation::Message;
use super::harmony;
use minijinja::Value;

/// How a model family writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>{"name", "arguments"}</tool_call>` (Qwen2.5/3, SmolLM3, Hermes).
    Hermes,
    /// `{"name", "parameters"}` as the whole reply (Llama 3.1/3.2/3.3).
    Llama3Json,
    /// `[TOOL_CALLS][{"name", "arguments"}, ...]` (Mistral Nemo).
    MistralJson,
    /// `[TOOL_CALLS]NAME[ARGS]{...}` (Mistral Small 3.2, Devstral, Ministral 3).
    MistralArgs,
    /// gpt-oss's channels: `<|channel|>commentary to=functions.NAME ...<|message|>{...}`.
    Harmony,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
const MISTRAL_TAG: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";
const MISTRAL_CALL_ID: &str = "[CALL_ID]";
/// Longest name (and `[CALL_ID]`) read between `[TOOL_CALLS]` and `[ARGS]`.
const MAX_MISTRAL_NAME: usize = 256;

impl ToolFormat {
    /// The format the template's source writes (Hermes when it writes none).
    pub fn detect(source: &str) -> ToolFormat {
        if harmony::is_harmony(source) {
            ToolFormat::Harmony
        } else if source.contains(MISTRAL_TAG) {
            if source.contains(MISTRAL_ARGS) {
                ToolFormat::MistralArgs
            } else {
                ToolFormat::MistralJson
            }
        } else if source.contains(HERMES_OPEN) {
            ToolFormat::Hermes
        } else if source.contains("\"parameters\"") {
            ToolFormat::Llama3Json
        } else {
            ToolFormat::Hermes
        }
    }

    /// The key of a call's arguments.
    fn arguments_key(self) -> &'static str {
        match self {
            ToolFormat::Llama3Json => "parameters",
            ToolFormat::Hermes
            | ToolFormat::MistralJson
            | ToolFormat::MistralArgs
            | ToolFormat::Harmony => "arguments",
        }
    }

    /// Whether replies are read by this format even when no tools are called: harmony's
    /// channels carry the reasoning apart from the content.
    pub fn has_channels(self) -> bool {
        self == ToolFormat::Harmony
    }

    /// A tool call's id from a random number: Mistral's templates take only 9
    /// letters and digits (vLLM's Mistral ids are the same); others `call_` and hex.
    pub fn call_id(self, n: u64) -> String {
        match self {
            ToolFormat::MistralJson | ToolFormat::MistralArgs => {
                const ALPHABET: &[u8] =
                    b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
                let mut n = n;
                (0..9)
                    .map(|_| {
                        let c = ALPHABET[(n % 62) as usize] as char;
                        n /= 62;
                        c
                    })
                    .collect()
            }
            _ => format!("call_{n:016x}"),
        }
    }
}

/// What a call's text shows so far.
#[derive(Debug, Default, PartialEq)]
struct Scan {
    name: Option<String>,
    /// Where the arguments value starts, and where it ends once complete.
    args: Option<(usize, Option<usize>)>,
    /// Where the object ends, once it does.
    end: Option<usize>,
    /// The text is not a JSON object's beginning.
    invalid: bool,
}

fn skip_ws(s: &[u8], mut i: usize) -> usize {
    while i < s.len() && matches!(s[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

/// Where the JSON value at `s[i..]` ends: `Ok(None)` when the text stops inside it;
/// `Err` when it cannot be a value (only the shape is checked: serde_json reads it).
fn value_end(s: &[u8], i: usize) -> Result<Option<usize>, ()> {
    let Some(&c) = s.get(i) else {
        return Ok(None);
    };
    match c {
        b'"' => {
            let mut j = i + 1;
            while j < s.len() {
                match s[j] {
                    b'\\' => j += 2,
                    b'"' => return Ok(Some(j + 1)),
                    _ => j += 1,
                }
            }
            Ok(None)
        }
        b'{' | b'[' => {
            let (mut depth, mut j, mut in_str) = (0usize, i, false);
            while j < s.len() {
                match (in_str, s[j]) {
                    (true, b'\\') => j += 1,
                    (true, b'"') | (false, b'"') => in_str = !in_str,
                    (false, b'{' | b'[') => depth += 1,
                    (false, b'}' | b']') => {
                        depth -= 1;
                        if depth == 0 {
                            return Ok(Some(j + 1));
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            Ok(None)
        }
        b'-' | b'0'..=b'9' | b't' | b'f' | b'n' => {
            let j = s[i..]
                .iter()
                .position(|&b| matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
                .map(|k| i + k);
            Ok(j)
        }
        _ => Err(()),
    }
}

/// Reads as much of a call object `{"name": ..., KEY: ...}` as `s` holds.
fn scan_call(s: &str, args_key: &str) -> Scan {
    let b = s.as_bytes();
    let mut out = Scan::default();
    // The first "name" counts (as the stream gave it out), as the first arguments do.
    let mut named = false;
    let mut i = skip_ws(b, 0);
    match b.get(i) {
        None => return out,
        Some(b'{') => i += 1,
        Some(_) => {
            out.invalid = true;
            return out;
        }
    }
    loop {
        i = skip_ws(b, i);
        match b.get(i) {
            None => return out,
            Some(b'}') => {
                out.end = Some(i + 1);
                return out;
            }
            Some(b'"') => {}
            Some(_) => {
                out.invalid = true;
                return out;
            }
        }
        let Ok(Some(key_end)) = value_end(b, i) else {
            return out;
        };
        let key: Option<String> = serde_json::from_str(&s[i..key_end]).ok();
        i = skip_ws(b, key_end);
        match b.get(i) {
            None => return out,
            Some(b':') => i = skip_ws(b, i + 1),
            Some(_) => {
                out.invalid = true;
                return out;
            }
        }
        if i >= b.len() {
            return out;
        }
        let end = match value_end(b, i) {
            Err(()) => {
                out.invalid = true;
                return out;
            }
            Ok(e) => e,
        };
        match key.as_deref() {
            Some("name") if !named => {
                if let Some(e) = end {
                    named = true;
                    out.name = serde_json::from_str(&s[i..e]).ok();
                }
            }
            Some(k) if (k == args_key || k == "arguments") && out.args.is_none() => {
                out.args = Some((i, end));
            }
            _ => {}
        }
        let Some(e) = end else {
            return out;
        };
        i = skip_ws(b, e);
        match b.get(i) {
            None => return out,
            Some(b',') => i += 1,
            Some(b'}') => {
                out.end = Some(i + 1);
                return out;
            }
            Some(_) => {
                out.invalid = true;
                return out;
            }
        }
    }
}

/// The arguments of a finished call: an object's text as written; a string holding
/// JSON (some models write that) decoded.
fn final_arguments(raw: &str) -> String {
    match serde_json::from_str::<Json>(raw) {
        Ok(Json::String(s)) => s,
        _ => raw.to_string(),
    }
}

#[derive(Debug)]
enum Mode {
    /// Reading text; Llama3Json: only before the reply's first non-space.
    Text,
    /// Llama3Json: the reply is plain text (no call).
    Plain,
    /// Inside a call.
    Call(Call),
    /// Llama3Json: after a call, waiting for `;` or the end; Mistral's list: for `,`
    /// or `]`.
    After,
    /// Mistral: after `[TOOL_CALLS]` (the text before it and the tag, content again
    /// if no call follows).
    Head(String),
}

/// A call being read.
#[derive(Debug, Default)]
struct Call {
    /// The text before its JSON (whitespace, the opening tag): content again if the
    /// call turns out to be none.
    lead: String,
    /// Its text after the opening tag.
    body: String,
    /// Its name has been given out.
    started: bool,
    /// Argument bytes given out.
    sent: usize,
    /// The arguments are a JSON string (given out whole at the end).
    string_args: bool,
    /// The name, when it came before the body (Mistral's `NAME[ARGS]`): the body is
    /// the arguments' JSON.
    name: Option<String>,
}

/// Reads tool calls out of generated text, as it streams (module docs).
#[derive(Debug)]
pub struct ToolParser {
    format: ToolFormat,
    /// Llama3Json: names that make a reply's JSON a call (others are content).
    names: Vec<String>,
    mode: Mode,
    /// Text not yet given out (a possible tag, or whitespace before one).
    held: String,
    calls: Vec<ToolCall>,
    /// Harmony's reader (the format's whole reading).
    harmony: Option<harmony::Reader>,
}

impl ToolParser {
    /// A parser for `format`; `names`: the request's tools (Llama 3's JSON reply is a
    /// call only when it names one of them). `read_calls`: false reads only harmony's
    /// channels (calls dropped), for a reply with tool_choice none or no tools.
    pub fn new(format: ToolFormat, names: Vec<String>, read_calls: bool) -> ToolParser {
        ToolParser {
            format,
            names,
            mode: Mode::Text,
            held: String::new(),
            calls: Vec::new(),
            harmony: (format == ToolFormat::Harmony).then(|| harmony::Reader::new(read_calls)),
        }
    }

    /// The calls read so far.
    pub fn calls(&self) -> &[ToolCall] {
        &self.calls
    }

    /// Reads more text.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        if let Some(h) = &mut self.harmony {
            h.push(text, &mut self.calls, &mut out);
            return out;
        }
        self.held.push_str(text);
        self.advance(false, &mut out);
        out
    }

    /// The text has ended: gives out what was held. A call whose name was read stays
    /// a call (its arguments as far as they came); one whose name was not is content.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        if let Some(h) = &mut self.harmony {
            h.finish(&mut self.calls, &mut out);
            return out;
        }
        self.advance(true, &mut out);
        match std::mem::replace(&mut self.mode, Mode::Plain) {
            Mode::Call(c) if c.started => {
                self.close_call(c, None, &mut out);
            }
            Mode::Call(c) => content(&mut out, c.lead + &c.body),
            Mode::Head(lead) => content(&mut out, lead),
            _ => {}
        }
        let rest = std::mem::take(&mut self.held);
        if self.calls.is_empty() || !rest.trim().is_empty() {
            content(&mut out, rest);
        }
        out
    }

    fn advance(&mut self, end: bool, out: &mut Vec<ToolEvent>) {
        loop {
            let progressed = match self.format {
                ToolFormat::Hermes => self.step_hermes(end, out),
                ToolFormat::Llama3Json => self.step_llama(end, out),
                ToolFormat::MistralJson | ToolFormat::MistralArgs => self.step_mistral(end, out),
                // Read by its own reader.
                ToolFormat::Harmony => false,
            };
            if !progressed {
                return;
            }
        }
    }

    /// One move of the Hermes reader; whether it moved on.
    fn step_hermes(&mut self, end: bool, out: &mut Vec<ToolEvent>) -> bool {
        if let Mode::Call(c) = &mut self.mode {
            c.body.push_str(&std::mem::take(&mut self.held));
            let Some(at) = c.body.find(HERMES_CLOSE) else {
                self.stream_call(out);
                return false;
            };
            let mut c = match std::mem::replace(&mut self.mode, Mode::Text) {
                Mode::Call(c) => c,
                _ => unreachable!("in a call"),
            };
            let rest = c.body.split_off(at + HERMES_CLOSE.len());
            c.body.truncate(at);
            self.mode = Mode::Call(std::mem::take(&mut c));
            self.stream_call(out);
            let Mode::Call(c) = std::mem::replace(&mut self.mode, Mode::Text) else {
                unreachable!("in a call")
            };
            let made = self.close_call(c, Some(HERMES_CLOSE), out);
            self.held = if made {
                rest.trim_start().to_string()
            } else {
                rest
            };
            return true;
        }
        let Some((lead, body)) = self.content_until(HERMES_OPEN, end, out) else {
            return false;
        };
        self.mode = Mode::Call(Call {
            lead,
            body,
            ..Call::default()
        });
        true
    }

    /// The held text before `tag` given out as content. With the tag found: the
    /// whitespace before it (a call's lead) and the text after it, nothing held. Else
    /// `None`, and (unless at the `end`) a possible start of the tag, with the whitespace
    /// before it, still held.
    fn content_until(
        &mut self,
        tag: &str,
        end: bool,
        out: &mut Vec<ToolEvent>,
    ) -> Option<(String, String)> {
        if let Some(at) = self.held.find(tag) {
            let text_end = self.held[..at].trim_end().len();
            let after = self.held.split_off(at + tag.len());
            let lead = self.held.split_off(text_end);
            content(out, std::mem::take(&mut self.held));
            return Some((lead, after));
        }
        if !end {
            let keep = partial_suffix(&self.held, tag);
            let text_end = self.held[..keep].trim_end().len();
            let rest = self.held.split_off(text_end);
            content(out, std::mem::replace(&mut self.held, rest));
        }
        None
    }

    /// One move of the Llama 3 JSON reader; whether it moved on.
    fn step_llama(&mut self, end: bool, out: &mut Vec<ToolEvent>) -> bool {
        match &mut self.mode {
            Mode::Plain | Mode::Head(_) => {
                content(out, std::mem::take(&mut self.held));
                false
            }
            Mode::Text | Mode::After => {
                let after = matches!(self.mode, Mode::After);
                let t = self.held.trim_start();
                let t = if after {
                    match t.strip_prefix(';') {
                        Some(rest) => rest.trim_start(),
                        None if t.is_empty() => return false,
                        None => {
                            self.mode = Mode::Plain;
                            return true;
                        }
                    }
                } else {
                    t
                };
                if t.is_empty() || (!end && PYTHON_TAG.starts_with(t)) {
                    return false;
                }
                let body = t.strip_prefix(PYTHON_TAG).unwrap_or(t).trim_start();
                if body.is_empty() && !end {
                    return false;
                }
                if body.starts_with('{') {
                    let at = self.held.len() - body.len();
                    let body = self.held.split_off(at);
                    self.mode = Mode::Call(Call {
                        lead: std::mem::take(&mut self.held),
                        body,
                        ..Call::default()
                    });
                } else {
                    self.mode = Mode::Plain;
                }
                true
            }
            Mode::Call(c) => {
                c.body.push_str(&std::mem::take(&mut self.held));
                let scan = scan_call(&c.body, "parameters");
                // A reply that is JSON but no call of a known tool is content.
                let unknown = scan.name.as_ref().is_some_and(|n| !self.names.contains(n));
                // Once its name is read a call stays one (as it does streamed, where the
                // name is given out before what follows is seen).
                let not_call = !c.started
                    && (unknown || (scan.name.is_none() && (scan.invalid || scan.end.is_some())));
                if not_call {
                    self.held = std::mem::take(&mut c.lead) + &c.body;
                    self.mode = Mode::Plain;
                    return true;
                }
                self.stream_call(out);
                let Some(e) = scan.end else { return false };
                let Mode::Call(mut c) = std::mem::replace(&mut self.mode, Mode::After) else {
                    unreachable!("in a call")
                };
                self.held = c.body.split_off(e);
                self.close_call(c, None, out);
                true
            }
        }
    }

    /// One move of the Mistral reader (either form); whether it moved on.
    fn step_mistral(&mut self, end: bool, out: &mut Vec<ToolEvent>) -> bool {
        match &mut self.mode {
            Mode::Text | Mode::Plain => {
                let Some((lead, after)) = self.content_until(MISTRAL_TAG, end, out) else {
                    return false;
                };
                self.held = after;
                self.mode = Mode::Head(lead);
                true
            }
            Mode::Head(lead) => {
                let t = self.held.trim_start();
                if t.is_empty() {
                    return false;
                }
                if let Some(body) = t.strip_prefix('[') {
                    // The list form: its first call.
                    let lead = std::mem::take(lead) + &self.held[..self.held.len() - body.len()];
                    let body = body.to_string();
                    self.held.clear();
                    self.mode = Mode::Call(Call {
                        lead,
                        body,
                        ..Call::default()
                    });
                    return true;
                }
                let at = match find_within(&self.held, MISTRAL_ARGS, MAX_MISTRAL_NAME) {
                    Ok(at) => at,
                    Err(true) if !end => return false,
                    Err(_) => {
                        // No call: the tag is content, and the text goes on.
                        content(out, std::mem::take(lead));
                        self.mode = Mode::Text;
                        return true;
                    }
                };
                let head = &self.held[..at];
                let name = head
                    .split(MISTRAL_CALL_ID)
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_string();
                let valid = !name.is_empty()
                    && name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
                let body = self.held.split_off(at + MISTRAL_ARGS.len());
                if !valid {
                    let text = std::mem::take(lead) + &self.held;
                    content(out, text);
                    self.held = body;
                    self.mode = Mode::Text;
                    return true;
                }
                out.push(ToolEvent::Start {
                    index: self.calls.len(),
                    name: name.clone(),
                });
                self.held.clear();
                self.mode = Mode::Call(Call {
                    body,
                    started: true,
                    name: Some(name),
                    ..Call::default()
                });
                true
            }
            Mode::Call(c) => {
                c.body.push_str(&std::mem::take(&mut self.held));
                let (direct, at) = match &c.name {
                    Some(_) => {
                        let i = skip_ws(c.body.as_bytes(), 0);
                        match value_end(c.body.as_bytes(), i) {
                            Ok(e) => (true, e),
                            // Not JSON: the call's arguments are the text as far as it goes.
                            Err(()) => (true, None),
                        }
                    }
                    None => {
                        let scan = scan_call(&c.body, "arguments");
                        // As Llama 3's: a call whose name was read stays one.
                        if !c.started && scan.name.is_none() && (scan.invalid || scan.end.is_some())
                        {
                            // No call: the tag is content, and the text goes on (a
                            // later tag may open one).
                            content(out, std::mem::take(&mut c.lead));
                            self.held = std::mem::take(&mut c.body);
                            self.mode = Mode::Text;
                            return true;
                        }
                        (false, scan.end)
                    }
                };
                self.stream_call(out);
                let Some(e) = at else { return false };
                let Mode::Call(mut c) = std::mem::replace(
                    &mut self.mode,
                    if direct { Mode::Text } else { Mode::After },
                ) else {
                    unreachable!("in a call")
                };
                self.held = c.body.split_off(e);
                self.close_call(c, None, out);
                true
            }
            Mode::After => {
                // Inside the list: another call, or its end.
                let t = self.held.trim_start();
                if let Some(rest) = t.strip_prefix(',') {
                    let body = rest.to_string();
                    self.held.clear();
                    self.mode = Mode::Call(Call {
                        body,
                        ..Call::default()
                    });
                    return true;
                }
                if let Some(rest) = t.strip_prefix(']') {
                    self.held = rest.to_string();
                    self.mode = Mode::Text;
                    return true;
                }
                if t.is_empty() {
                    return false;
                }
                self.held = t.to_string();
                self.mode = Mode::Text;
                true
            }
        }
    }

    /// Gives out the current call's name once complete, then its arguments so far.
    fn stream_call(&mut self, out: &mut Vec<ToolEvent>) {
        let key = self.format.arguments_key();
        let index = self.calls.len();
        let Mode::Call(c) = &mut self.mode else {
            return;
        };
        if c.name.is_some() {
            // The body is the arguments' JSON.
            let b = c.body.as_bytes();
            let start = skip_ws(b, 0);
            let stop = match value_end(b, start) {
                Ok(Some(e)) => e,
                _ => c.body.trim_end().len().max(start),
            };
            if start + c.sent < stop {
                out.push(ToolEvent::Arguments {
                    index,
                    delta: c.body[start + c.sent..stop].to_string(),
                });
                c.sent = stop - start;
            }
            return;
        }
        let scan = scan_call(&c.body, key);
        if !c.started {
            let Some(name) = scan.name else { return };
            c.started = true;
            out.push(ToolEvent::Start { index, name });
        }
        if let Some((start, end)) = scan.args {
            if c.body.as_bytes().get(start) == Some(&b'"') {
                c.string_args = true;
                return;
            }
            let stop = end.unwrap_or(c.body.len());
            if start + c.sent < stop {
                out.push(ToolEvent::Arguments {
                    index,
                    delta: c.body[start + c.sent..stop].to_string(),
                });
                c.sent = stop - start;
            }
        }
    }

    /// A call's text is complete (`close`: the closing tag it had): records it and
    /// gives out what remained; a text that is no call (no name read) is content
    /// again, tags and all. Whether it was a call.
    fn close_call(&mut self, c: Call, close: Option<&str>, out: &mut Vec<ToolEvent>) -> bool {
        let key = self.format.arguments_key();
        let index = self.calls.len();
        if let Some(name) = c.name {
            let b = c.body.as_bytes();
            let start = skip_ws(b, 0);
            let stop = match value_end(b, start) {
                Ok(Some(e)) => e,
                _ => c.body.trim_end().len().max(start),
            };
            let mut arguments = c.body[start..stop].to_string();
            let mut sent = c.sent;
            if arguments.is_empty() {
                arguments = "{}".into();
                sent = 0;
            }
            if sent < arguments.len() {
                out.push(ToolEvent::Arguments {
                    index,
                    delta: arguments[sent..].to_string(),
                });
            }
            self.calls.push(ToolCall { name, arguments });
            return true;
        }
        let scan = scan_call(&c.body, key);
        let name = match (scan.name, c.started) {
            (Some(n), _) => n,
            (None, true) => unreachable!("a started call has its name"),
            (None, false) => {
                content(out, c.lead + &c.body + close.unwrap_or(""));
                return false;
            }
        };
        if !c.started {
            out.push(ToolEvent::Start {
                index,
                name: name.clone(),
            });
        }
        let raw = match scan.args {
            Some((s, e)) => &c.body[s..e.unwrap_or(c.body.len())],
            None => "",
        };
        let arguments = if c.string_args {
            final_arguments(raw)
        } else if raw.is_empty() {
            "{}".to_string()
        } else {
            raw.to_string()
        };
        let sent = if c.string_args || raw.is_empty() {
            0
        } else {
            c.sent
        };
        if sent < arguments.len() {
            out.push(ToolEvent::Arguments {
                index,
                delta: arguments[sent..].to_string(),
            });
        }
        self.calls.push(ToolCall { name, arguments });
        true
    }
}

/// Adds a content event (unless empty).
fn content(out: &mut Vec<ToolEvent>, text: String) {
    if !text.is_empty() {
        out.push(ToolEvent::Content(text));
    }
}

/// Reads the calls out of a whole text: the content (`None` when only whitespace)
/// and the calls.
pub fn parse(
    format: ToolFormat,
    names: Vec<String>,
    text: &str,
) -> (Option<String>, Vec<ToolCall>) {
    let mut p = ToolParser::new(format, names, true);
    let mut content = String::new();
    let mut evs = p.push(text);
    evs.extend(p.finish());
    for ev in evs {
        if let ToolEvent::Content(t) = ev {
            content.push_str(&t);
        }
    }
    let calls = p.calls;
    let content = (!content.trim().is_empty() || calls.is_empty()).then_some(content);
    (content, calls)
}

/// A tool of the request: its name and its parameters' JSON schema.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub parameters: Json,
    /// `function.strict`: the schema must compile strictly (a keyword the engine
    /// cannot enforce refuses it), as `json_schema` with `strict` does.
    pub strict: bool,
}

/// The Lark grammar (llguidance's) of one call of one of `tools`, or of one or more
/// calls when `parallel` (Hermes; Llama 3's template takes one call per message);
/// `json_options`: llguidance's JSON options for the calls' JSON (`x-guidance`).
/// `special(text)`: whether the tokenizer has `text` as one special token (then the
/// grammar names the token rather than spelling its text). `reasoning`: the most
/// tokens of analysis before the call (harmony; 0: none).
pub fn call_grammar(
    format: ToolFormat,
    tools: &[ToolSpec],
    parallel: bool,
    json_options: Json,
    special: impl Fn(&str) -> bool,
    reasoning: usize,
) -> String {
    let key = format.arguments_key();
    let options: Vec<Json> = tools
        .iter()
        .map(|t| {
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, key: t.parameters},
                "required": ["name", key],
                "additionalProperties": false,
            })
        })
        .collect();
    let schema = json!({"anyOf": options, "x-guidance": json_options});
    let tag = |t: &str| tag(&special, t);
    match format {
        ToolFormat::Hermes => {
            let more = if parallel { " (\"\\n\" call)*" } else { "" };
            format!(
                "start: call{more}\ncall: {} \"\\n\" args \"\\n\" {}\nargs: %json {schema}\n",
                tag(HERMES_OPEN),
                tag(HERMES_CLOSE)
            )
        }
        ToolFormat::Llama3Json => format!("start: args\nargs: %json {schema}\n"),
        ToolFormat::MistralJson => {
            let more = if parallel { " (\", \" args)*" } else { "" };
            format!(
                "start: {} \"[\" args{more} \"]\"\nargs: %json {schema}\n",
                tag(MISTRAL_TAG)
            )
        }
        ToolFormat::MistralArgs => {
            // The name comes before the arguments: one alternative per tool, each
            // with its own schema.
            let more = if parallel { "+" } else { "" };
            let mut g = format!("start: call{more}\ncall: {}\n", alternatives(tools.len()));
            for (i, (name, schema)) in own_schemas(tools, &json_options).iter().enumerate() {
                g.push_str(&format!(
                    "call{i}: {} {} {} args{i}\nargs{i}: %json {schema}\n",
                    tag(MISTRAL_TAG),
                    serde_json::to_string(name).expect("a string"),
                    tag(MISTRAL_ARGS),
                ));
            }
            g
        }
        ToolFormat::Harmony => harmony::call_grammar(
            &own_schemas(tools, &json_options),
            &harmony_frame(special, reasoning),
        ),
    }
}

/// A grammar's name for the marker `t`: the special token, or its text quoted.
fn tag(special: &impl Fn(&str) -> bool, t: &str) -> String {
    if special(t) {
        t.to_string()
    } else {
        serde_json::to_string(t).expect("a string")
    }
}

/// How a constrained harmony reply names its markers and may reason first.
fn harmony_frame(
    special: impl Fn(&str) -> bool,
    reasoning: usize,
) -> harmony::Frame<impl Fn(&str) -> String> {
    harmony::Frame {
        special: special("<|channel|>") && special("<|end|>"),
        tag: move |t: &str| tag(&special, t),
        reasoning,
    }
}

/// The Lark grammar of a reply whose answer is the grammar `@body` names (`json`: a
/// JSON format), for a format whose replies carry the answer apart from the rest:
/// harmony's final channel, after at most `reasoning` tokens of analysis, or (`calls`
/// not empty) one call of one of them instead ([`harmony::answer_grammar`]; the calls'
/// JSON under `json_options`). `None` for the other formats: their answer is the whole
/// reply.
pub fn answer_grammar(
    format: ToolFormat,
    body: &str,
    json: bool,
    calls: &[ToolSpec],
    json_options: Json,
    special: impl Fn(&str) -> bool,
    reasoning: usize,
) -> Option<String> {
    format.has_channels().then(|| {
        harmony::answer_grammar(
            body,
            json,
            &own_schemas(calls, &json_options),
            &harmony_frame(special, reasoning),
        )
    })
}

/// Each tool's name and its parameters' schema with llguidance's options.
fn own_schemas(tools: &[ToolSpec], json_options: &Json) -> Vec<(String, Json)> {
    tools
        .iter()
        .map(|t| {
            let mut schema = t.parameters.clone();
            if let Some(o) = schema.as_object_mut() {
                o.insert("x-guidance".into(), json_options.clone());
            }
            (t.name.clone(), schema)
        })
        .collect()
}

/// Assistant messages' `tool_calls` as templates expect them (vLLM does the same):
/// OpenAI clients send each call's `function.arguments` as a JSON string, templates
/// (transformers' documented form) read an object; a string holding a JSON object
/// becomes that object (its key order kept), other values are left as given. A null or
/// missing `content` beside the calls becomes `""` (Qwen3's and SmolLM2's templates
/// fail on a message without one).
pub fn normalize_tool_calls(m: &mut Message) {
    let Some(calls) = m.get("tool_calls").cloned().filter(|c| !c.is_none()) else {
        return;
    };
    if m.role() == "assistant"
        && m.get("content")
            .is_none_or(|c| c.is_none() || c.is_undefined())
    {
        m.set("content", Value::from(""));
    }
    let Ok(iter) = calls.try_iter() else { return };
    let mut changed = false;
    let mut out = Vec::new();
    for call in iter {
        let f = call.get_attr("function").ok().filter(|f| !f.is_undefined());
        let args = f
            .as_ref()
            .and_then(|f| f.get_attr("arguments").ok())
            .and_then(|a| a.as_str().map(str::to_string));
        let parsed = args.and_then(|a| serde_json::from_str::<Value>(&a).ok());
        match (f, parsed) {
            (Some(f), Some(p)) if p.kind() == minijinja::value::ValueKind::Map => {
                changed = true;
                let f2 = replace_key(&f, "arguments", p);
                out.push(replace_key(&call, "function", f2));
            }
            _ => out.push(call),
        }
    }
    if changed {
        m.set("tool_calls", Value::from(out));
    }
}

/// A map value with one key's value replaced (key order kept).
fn replace_key(map: &Value, key: &str, v: Value) -> Value {
    let Ok(keys) = map.try_iter() else {
        return map.clone();
    };
    let pairs: Vec<(Value, Value)> = keys
        .map(|k| {
            let val = if k.as_str() == Some(key) {
                v.clone()
            } else {
                map.get_item(&k).unwrap_or_default()
            };
            (k, val)
        })
        .collect();
    Value::from_pairs(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::calls::{same_at_every_split, sum_events};

    /// Everything the parser gives out for `chunks`, and the calls.
    fn run(format: ToolFormat, chunks: &[&str]) -> (String, Vec<(usize, String, String)>) {
        let mut p = ToolParser::new(format, vec!["get_weather".into(), "f".into()], true);
        let mut evs: Vec<ToolEvent> = chunks.iter().flat_map(|c| p.push(c)).collect();
        evs.extend(p.finish());
        let (content, reasoning, calls) = sum_events(evs, p.calls());
        assert!(reasoning.is_empty(), "reasoning {reasoning:?}");
        let calls = calls.into_iter().enumerate();
        (content, calls.map(|(i, (n, a))| (i, n, a)).collect())
    }

    /// Every split of `text` into two or three pieces (at char boundaries) parses as
    /// the whole text does.
    fn every_split(format: ToolFormat, text: &str) -> (String, Vec<(usize, String, String)>) {
        same_at_every_split(text, Some(7), |pieces| run(format, pieces))
    }

    #[test]
    fn hermes_calls_with_text_before_and_between() {
        let text = "Let me look.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Reykjavík\", \"n\": [1, {\"a\": \"}\"}]}}\n</tool_call>\n<tool_call>\n{\"arguments\": {}, \"name\": \"f\"}\n</tool_call>";
        let (content, calls) = every_split(ToolFormat::Hermes, text);
        assert_eq!(content, "Let me look.");
        assert_eq!(
            calls,
            vec![
                (
                    0,
                    "get_weather".into(),
                    "{\"location\": \"Reykjavík\", \"n\": [1, {\"a\": \"}\"}]}".into()
                ),
                (1, "f".into(), "{}".into())
            ]
        );
        let (c, calls) = parse(ToolFormat::Hermes, vec![], text);
        assert_eq!(c.as_deref(), Some("Let me look."));
        assert_eq!(calls.len(), 2);
        assert_eq!(
            parse(
                ToolFormat::Hermes,
                vec![],
                "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>"
            )
            .0,
            None
        );
    }

    #[test]
    fn hermes_text_without_calls_is_kept_whole() {
        for text in [
            "plain <tool text> and < and <tool_cal",
            "ends in space  \n",
            "a <tool_call> never closed {\"x\": 1",
        ] {
            let (content, calls) = every_split(ToolFormat::Hermes, text);
            assert_eq!(content, text);
            assert!(calls.is_empty());
        }
        // A block that is no call is content, tags and all.
        let text = "x \n<tool_call>\nnot json\n</tool_call> after";
        assert_eq!(every_split(ToolFormat::Hermes, text).0, text);
        // Arguments written as a JSON string are decoded.
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>";
        assert_eq!(
            every_split(ToolFormat::Hermes, text).1,
            vec![(0, "f".into(), "{\"a\": 1}".into())]
        );
        // An unclosed call whose name was read stays a call (max_tokens hit).
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": ";
        assert_eq!(
            every_split(ToolFormat::Hermes, text).1,
            vec![(0, "f".into(), "{\"a\": ".into())]
        );
    }

    #[test]
    fn llama3_json_calls_and_plain_replies() {
        let text = "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"location\": \"Paris\"}}; {\"name\": \"f\", \"parameters\": {}}";
        let (content, calls) = every_split(ToolFormat::Llama3Json, text);
        assert_eq!(content, "");
        assert_eq!(
            calls,
            vec![
                (0, "get_weather".into(), "{\"location\": \"Paris\"}".into()),
                (1, "f".into(), "{}".into())
            ]
        );
        // JSON that names no tool, or is no call, is the reply's content.
        for text in [
            "{\"name\": \"Bob\", \"parameters\": {}}",
            "{\"answer\": 4}",
            "The answer is {\"x\": 1}",
            "  <|pyth",
            "[1, 2]",
        ] {
            let (content, calls) = every_split(ToolFormat::Llama3Json, text);
            assert!(calls.is_empty(), "{text}");
            assert_eq!(content, text);
        }
    }

    #[test]
    fn mistral_calls_in_either_form() {
        let list = "Let me check. [TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Reykjavík\", \"n\": [1, {\"a\": \"]\"}]}}, {\"arguments\": {}, \"name\": \"f\"}]";
        let named = "Let me check.[TOOL_CALLS]get_weather[ARGS]{\"location\": \"Reykjavík\", \"n\": [1, {\"a\": \"]\"}]}[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS] {}";
        let want = vec![
            (
                0,
                "get_weather".to_string(),
                "{\"location\": \"Reykjavík\", \"n\": [1, {\"a\": \"]\"}]}".to_string(),
            ),
            (1, "f".to_string(), "{}".to_string()),
        ];
        for format in [ToolFormat::MistralJson, ToolFormat::MistralArgs] {
            for text in [list, named] {
                let (content, calls) = every_split(format, text);
                assert_eq!(content, "Let me check.", "{text}");
                assert_eq!(calls, want, "{text}");
            }
        }
        // Text that is no call stays content, tags and all.
        for text in [
            "no calls [TOOL_CALL here",
            "[TOOL_CALLS]",
            "[TOOL_CALLS] not a list",
            "[TOOL_CALLS]two words[ARGS]{}",
            "[TOOL_CALLS][1, 2]",
        ] {
            let (content, calls) = every_split(ToolFormat::MistralArgs, text);
            assert_eq!(content, text);
            assert!(calls.is_empty(), "{text}");
        }
        // Cut short: the call keeps what came.
        assert_eq!(
            every_split(ToolFormat::MistralArgs, "[TOOL_CALLS]f[ARGS]{\"a\": ").1,
            vec![(0, "f".into(), "{\"a\":".into())]
        );
        // A call whose JSON breaks after its name stays a call, whole and streamed
        // (tool_parse fuzz finding, 2026-12-06: whole it was content, streamed a call).
        let text = "[TOOL_CALLS][{\"name\": \"f\", \"a\": {\"b\": \"]\"}_w]e {\"}";
        assert_eq!(
            every_split(ToolFormat::MistralArgs, text),
            (String::new(), vec![(0, "f".into(), "{}".into())])
        );
        // (and: a list that is no call, then a call; a call named twice, 2026-12-06)
        assert_eq!(
            every_split(
                ToolFormat::MistralJson,
                "[TOOL_CALLS][{\"name\": \"f\", \"name\": \"\"}]"
            )
            .1,
            vec![(0, "f".into(), "{}".into())]
        );
        let text = "[TOOL_CALLS][CALL_ID]a1b2c3d4e[ARGS]{\"cit[ARGS]{\"city\":LS]get_we}[TOOL_CALLS]f[ARGS]";
        assert_eq!(
            every_split(ToolFormat::MistralArgs, text),
            (
                "[TOOL_CALLS][CALL_ID]a1b2c3d4e[ARGS]{\"cit[ARGS]{\"city\":LS]get_we}".into(),
                vec![(0, "f".into(), "{}".into())]
            )
        );
        let far = format!("[TOOL_CALLS]{}[ARGS]{{}}", "x".repeat(300));
        assert_eq!(every_split(ToolFormat::MistralArgs, &far).0, far);
        let text = "{\"name\": \"f\", \"x\": [1]_w";
        assert_eq!(
            every_split(ToolFormat::Llama3Json, text),
            (String::new(), vec![(0, "f".into(), "{}".into())])
        );
    }

    #[test]
    fn call_ids_fit_the_format() {
        let id = ToolFormat::MistralArgs.call_id(u64::MAX);
        assert!(
            id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()),
            "{id}"
        );
        assert_ne!(id, ToolFormat::MistralJson.call_id(7));
        assert_eq!(ToolFormat::Hermes.call_id(255), "call_00000000000000ff");
    }

    #[test]
    fn formats_are_detected_from_templates() {
        assert_eq!(ToolFormat::detect("x <tool_call> y"), ToolFormat::Hermes);
        assert_eq!(
            ToolFormat::detect("{{- '\"parameters\": ' }}"),
            ToolFormat::Llama3Json
        );
        assert_eq!(ToolFormat::detect("{{ messages }}"), ToolFormat::Hermes);
        assert_eq!(
            ToolFormat::detect("{{- \"[TOOL_CALLS][\" }}"),
            ToolFormat::MistralJson
        );
        assert_eq!(
            ToolFormat::detect("'[TOOL_CALLS]' + name + '[ARGS]'"),
            ToolFormat::MistralArgs
        );
        assert_eq!(
            ToolFormat::detect("<|start|>assistant<|channel|>final<|message|>"),
            ToolFormat::Harmony
        );
    }

    #[test]
    fn call_grammars_name_special_tokens() {
        let tools = [ToolSpec {
            name: "f".into(),
            parameters: json!({"type": "object"}),
            strict: false,
        }];
        let g = call_grammar(
            ToolFormat::Hermes,
            &tools,
            true,
            json!({}),
            |t| t == "<tool_call>",
            0,
        );
        assert!(g.starts_with("start: call (\"\\n\" call)*\ncall: <tool_call> \"\\n\" args \"\\n\" \"</tool_call>\"\n"), "{g}");
        assert!(g.contains("\"const\":\"f\""), "{g}");
        let g = call_grammar(
            ToolFormat::Llama3Json,
            &tools,
            true,
            json!({}),
            |_| false,
            0,
        );
        assert!(
            g.starts_with("start: args\n") && g.contains("\"parameters\""),
            "{g}"
        );
        let g = call_grammar(
            ToolFormat::MistralArgs,
            &tools,
            true,
            json!({"k": 1}),
            |t| t.starts_with('['),
            0,
        );
        assert!(
            g.starts_with(
                "start: call+\ncall: call0\ncall0: [TOOL_CALLS] \"f\" [ARGS] args0\nargs0: %json {"
            ) && g.contains("\"x-guidance\":{\"k\":1}"),
            "{g}"
        );
        let g = call_grammar(
            ToolFormat::MistralJson,
            &tools,
            false,
            json!({}),
            |_| false,
            0,
        );
        assert!(
            g.starts_with("start: \"[TOOL_CALLS]\" \"[\" args \"]\"\n"),
            "{g}"
        );
        // An answer apart from the rest: harmony's final channel only.
        let answer = |format, special: bool| {
            answer_grammar(format, "body", true, &tools, json!({}), |_| special, 9)
        };
        assert_eq!(answer(ToolFormat::Hermes, true), None);
        let g = answer(ToolFormat::Harmony, true).unwrap();
        assert!(
            g.starts_with("start: analysis? (answer | call)\n")
                && g.contains("thought[max_tokens=9]")
                && g.contains("@body"),
            "{g}"
        );
        let g = answer(ToolFormat::Harmony, false).unwrap();
        assert!(g.starts_with("start: (answer | call)\n"), "{g}");
    }

    #[test]
    fn string_arguments_become_objects() {
        let v: Value = serde_json::from_str(
            r#"{"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": [2.0]}"}}, {"function": {"name": "g", "arguments": "not json"}}]}"#,
        )
        .unwrap();
        let mut m = Message::from_value(&v, "m").unwrap();
        normalize_tool_calls(&mut m);
        let calls = m.get("tool_calls").unwrap();
        let args = calls
            .get_item(&Value::from(0))
            .unwrap()
            .get_attr("function")
            .unwrap()
            .get_attr("arguments")
            .unwrap();
        assert_eq!(args.kind(), minijinja::value::ValueKind::Map);
        let keys: Vec<String> = args.try_iter().unwrap().map(|k| k.to_string()).collect();
        assert_eq!(keys, ["b", "a"]);
        let id = calls
            .get_item(&Value::from(0))
            .unwrap()
            .get_attr("id")
            .unwrap();
        assert_eq!(id.as_str(), Some("c1"));
        let other = calls
            .get_item(&Value::from(1))
            .unwrap()
            .get_attr("function")
            .unwrap()
            .get_attr("arguments")
            .unwrap();
        assert_eq!(other.as_str(), Some("not json"));
    }
}
