//! gpt-oss's harmony format: its replies read into reasoning, content and tool calls
//! ([`Reader`]), the grammars of a constrained reply (a required call,
//! [`call_grammar`]; an answer in a format, [`answer_grammar`]), and the assistant
//! messages of a conversation as its template expects them ([`adjust_message`]).
//!
//! The generation prompt ends in `<|start|>assistant`; the reply is one or more
//! messages, each a header, `<|message|>`, a body and an end:
//!
//! ```text
//! <|channel|>analysis<|message|>Reasoning...<|end|>
//! <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
//! <|start|>assistant<|channel|>final<|message|>The answer.<|return|>
//! ```
//!
//! The header names a channel (`analysis`, `commentary`, `final`) and maybe a recipient
//! (`to=functions.NAME`, before the channel or after it) and a content type. A body
//! ends at `<|end|>`, `<|call|>`, `<|return|>`, `<|start|>` or the text's end
//! (`<|call|>` and `<|return|>` are stop tokens, so a reply usually ends without one).
//!
//! As llama-server and vLLM do: the analysis channel is `reasoning_content`; final and
//! commentary without a recipient are `content`; a message to `functions.NAME` is a
//! tool call whose body is its arguments; messages to other recipients (the built-in
//! `browser`, `python`) are dropped. A reply that does not start with a header is
//! content as it is.

use serde_json::Value as Json;

use super::calls::{alternatives, find_within, partial_suffix, ToolCall, ToolEvent};
use super::conversation::Message;
use minijinja::Value;

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const CONSTRAIN: &str = "<|constrain|>";
const END: &str = "<|end|>";
const CALL: &str = "<|call|>";
const RETURN: &str = "<|return|>";
/// Where a message's body ends.
const BODY_ENDS: [&str; 4] = [END, CALL, RETURN, START];
/// A header longer than this without `<|message|>` is no header (the reply is text).
const MAX_HEADER: usize = 512;

/// Whether a template writes harmony.
pub fn is_harmony(source: &str) -> bool {
    source.contains(CHANNEL) && source.contains(MESSAGE)
}

/// What the body of the current message is.
#[derive(Debug, PartialEq)]
enum Body {
    Reasoning,
    Content,
    /// A call: its index, its arguments text given out so far (bytes of the body
    /// after leading whitespace).
    Call {
        index: usize,
        sent: usize,
    },
    /// To a recipient the reply is not read for.
    Dropped,
}

#[derive(Debug, PartialEq)]
enum State {
    /// Reading a header; `checked`: it follows `<|start|>` (else it must begin as a
    /// header does, or the reply is text).
    Header {
        checked: bool,
    },
    Body(Body),
    /// After a message's end, before the next `<|start|>`.
    Between,
    /// The reply is not harmony: all content.
    Plain,
}

/// Reads a harmony reply as it streams (module docs).
#[derive(Debug)]
pub struct Reader {
    read_calls: bool,
    state: State,
    /// Text not yet read.
    held: String,
    /// The current call's body.
    args: String,
}

impl Reader {
    /// `read_calls`: messages to `functions.NAME` are calls (else dropped).
    pub fn new(read_calls: bool) -> Reader {
        Reader {
            read_calls,
            state: State::Header { checked: false },
            held: String::new(),
            args: String::new(),
        }
    }

    pub fn push(&mut self, text: &str, calls: &mut Vec<ToolCall>, out: &mut Vec<ToolEvent>) {
        self.held.push_str(text);
        while self.step(false, calls, out) {}
    }

    /// The text has ended: an open message ends here (a call with the arguments that
    /// came); an unfinished header is dropped, or is content if nothing was read.
    pub fn finish(&mut self, calls: &mut Vec<ToolCall>, out: &mut Vec<ToolEvent>) {
        while self.step(true, calls, out) {}
        // A header cut short is dropped (text that is no header went on as Plain).
        if let State::Body(b) = std::mem::replace(&mut self.state, State::Plain) {
            self.end_body(b, calls, out);
        }
        self.held.clear();
    }

    /// One move; whether it moved on.
    fn step(&mut self, end: bool, calls: &mut Vec<ToolCall>, out: &mut Vec<ToolEvent>) -> bool {
        match &mut self.state {
            State::Plain => {
                push(out, ToolEvent::Content, std::mem::take(&mut self.held));
                false
            }
            State::Between => {
                let t = self.held.trim_start();
                if t.is_empty() {
                    return false;
                }
                if let Some(rest) = t.strip_prefix(START) {
                    self.held = rest.to_string();
                    self.state = State::Header { checked: true };
                    return true;
                }
                if t.starts_with(CHANNEL) || t.starts_with(" to=") {
                    self.held = t.to_string();
                    self.state = State::Header { checked: true };
                    return true;
                }
                if !end && (START.starts_with(t) || CHANNEL.starts_with(t)) {
                    return false;
                }
                // Text after a message's end that begins none: content.
                self.held = t.to_string();
                self.state = State::Plain;
                true
            }
            State::Header { checked } => {
                if !*checked {
                    let t = self.held.as_str();
                    let marks = [CHANNEL, START, " to="];
                    if t.is_empty() {
                        return false;
                    }
                    if !marks.iter().any(|m| t.starts_with(m)) {
                        // Maybe the start of one: wait; else the reply is text.
                        if !end && marks.iter().any(|m| m.starts_with(t)) {
                            return false;
                        }
                        self.state = State::Plain;
                        return true;
                    }
                    if let Some(rest) = t.strip_prefix(START) {
                        self.held = rest.to_string();
                    }
                    *checked = true;
                }
                let at = match find_within(&self.held, MESSAGE, MAX_HEADER) {
                    Ok(at) => at,
                    // It may still come; at the end, `finish` drops the header.
                    Err(true) => return false,
                    Err(false) => {
                        self.state = State::Plain;
                        return true;
                    }
                };
                let body = self.held.split_off(at + MESSAGE.len());
                let header = std::mem::replace(&mut self.held, body);
                let kind = self.body_kind(&header[..at], calls, out);
                self.args.clear();
                self.state = State::Body(kind);
                true
            }
            State::Body(_) => {
                let found = BODY_ENDS
                    .iter()
                    .filter_map(|m| self.held.find(m).map(|at| (at, *m)))
                    .min();
                let (text_end, rest) = match found {
                    Some((at, m)) => (at, Some(at + if m == START { 0 } else { m.len() })),
                    None if end => (self.held.len(), None),
                    None => {
                        let keep = BODY_ENDS
                            .iter()
                            .map(|m| partial_suffix(&self.held, m))
                            .min()
                            .unwrap_or(self.held.len());
                        (keep, None)
                    }
                };
                let rest_text = match rest {
                    Some(r) => self.held.split_off(r),
                    None => self.held.split_off(text_end),
                };
                self.held.truncate(text_end);
                let text = std::mem::replace(&mut self.held, rest_text);
                self.body_text(text, out);
                if rest.is_some() {
                    let State::Body(b) = std::mem::replace(&mut self.state, State::Between) else {
                        unreachable!("in a body")
                    };
                    self.end_body(b, calls, out);
                    return true;
                }
                false
            }
        }
    }

    /// The body a header opens (a call's start given out).
    fn body_kind(&self, header: &str, calls: &mut Vec<ToolCall>, out: &mut Vec<ToolEvent>) -> Body {
        let word = |after: &str| -> Option<String> {
            let at = header.find(after)? + after.len();
            let w: String = header[at..]
                .chars()
                .take_while(|c| !c.is_whitespace() && *c != '<')
                .collect();
            Some(w)
        };
        let channel = word(CHANNEL);
        match word("to=") {
            Some(r) => match r.strip_prefix("functions.") {
                Some(name) if self.read_calls && !name.is_empty() => {
                    let index = calls.len();
                    calls.push(ToolCall {
                        name: name.to_string(),
                        arguments: String::new(),
                    });
                    out.push(ToolEvent::Start {
                        index,
                        name: name.to_string(),
                    });
                    Body::Call { index, sent: 0 }
                }
                _ => Body::Dropped,
            },
            None => match channel.as_deref() {
                Some("analysis") => Body::Reasoning,
                _ => Body::Content,
            },
        }
    }

    /// Text of the current body.
    fn body_text(&mut self, text: String, out: &mut Vec<ToolEvent>) {
        let State::Body(b) = &mut self.state else {
            return;
        };
        match b {
            Body::Reasoning => push(out, ToolEvent::Reasoning, text),
            Body::Content => push(out, ToolEvent::Content, text),
            Body::Dropped => {}
            Body::Call { index, sent } => {
                self.args.push_str(&text);
                // Whitespace around the arguments is not theirs: give out what lies
                // between the first and the last non-space so far.
                let a = self.args.trim_start();
                let a = a.trim_end();
                if a.len() > *sent {
                    out.push(ToolEvent::Arguments {
                        index: *index,
                        delta: a[*sent..].to_string(),
                    });
                    *sent = a.len();
                }
            }
        }
    }

    /// A body ended: a call gets its arguments (`{}` when none came).
    fn end_body(&mut self, b: Body, calls: &mut [ToolCall], out: &mut Vec<ToolEvent>) {
        if let Body::Call { index, sent } = b {
            let mut args = self.args.trim().to_string();
            if args.is_empty() {
                args = "{}".into();
                out.push(ToolEvent::Arguments {
                    index,
                    delta: args.clone(),
                });
            } else if sent < args.len() {
                out.push(ToolEvent::Arguments {
                    index,
                    delta: args[sent..].to_string(),
                });
            }
            calls[index].arguments = args;
            self.args.clear();
        }
    }
}

/// Adds an event of text (unless empty).
fn push(out: &mut Vec<ToolEvent>, make: fn(String) -> ToolEvent, text: String) {
    if !text.is_empty() {
        out.push(make(text));
    }
}

/// How a constrained reply may reason first, and how its grammar names the markers.
pub struct Frame<T: Fn(&str) -> String> {
    /// The grammar's name for a marker (the special token, or its text quoted).
    pub tag: T,
    /// Whether the markers are special tokens (the analysis can only be delimited by
    /// the special `<|end|>`: free text could spell a marker that is only text).
    pub special: bool,
    /// The most tokens of analysis (0: none; the request's `reasoning_effort` none).
    pub reasoning: usize,
}

impl<T: Fn(&str) -> String> Frame<T> {
    /// The start of a constrained reply, then `then` (a rule expression): at most one
    /// analysis message of at most [`Frame::reasoning`] tokens, then `<|start|>assistant`
    /// (the generation prompt holds the first one only). Without special markers or
    /// reasoning, `then` comes first.
    fn start(&self, then: &str) -> String {
        if !self.special || self.reasoning == 0 {
            return format!("start: {then}\n");
        }
        let tag = &self.tag;
        format!(
            "start: analysis? {then}\nanalysis: {} \"analysis\" {} thought {} {} \"assistant\"\nthought[max_tokens={}]: /(.|\\n)*/\n",
            tag(CHANNEL),
            tag(MESSAGE),
            tag(END),
            tag(START),
            self.reasoning,
        )
    }

    /// Rule `call`: one call of one of the tools, each given as its name and its
    /// arguments' `%json` schema, on the commentary channel as gpt-oss writes it.
    fn call_rules(&self, tools: &[(String, Json)]) -> String {
        let tag = &self.tag;
        let mut g = format!("call: {}\n", alternatives(tools.len()));
        for (i, (name, schema)) in tools.iter().enumerate() {
            let head = serde_json::to_string(&format!("commentary to=functions.{name} "))
                .expect("a string");
            g.push_str(&format!(
                "call{i}: {} {head} {} \"json\" {} args{i}\nargs{i}: %json {schema}\n",
                tag(CHANNEL),
                tag(CONSTRAIN),
                tag(MESSAGE),
            ));
        }
        g
    }
}

/// The Lark grammar (llguidance's) of one call of one of the tools, each given as its
/// name and its arguments' `%json` schema: the call on the commentary channel as
/// gpt-oss writes it, after at most one analysis message ([`Frame`]).
pub fn call_grammar<T: Fn(&str) -> String>(tools: &[(String, Json)], frame: &Frame<T>) -> String {
    let mut g = frame.start("call");
    g.push_str(&frame.call_rules(tools));
    g
}

/// The Lark grammar of a reply whose answer is constrained: after at most one
/// analysis message ([`Frame`]), the final channel's content is the grammar that
/// `@body` names (`json`: a JSON format, which the header may announce as gpt-oss
/// does, `<|constrain|>json`), or, when tools are given, the reply may instead be one
/// call of one of them ([`call_grammar`]). The reply ends at a stop token
/// (`<|return|>`, the template's end of turn).
pub fn answer_grammar<T: Fn(&str) -> String>(
    body: &str,
    json: bool,
    tools: &[(String, Json)],
    frame: &Frame<T>,
) -> String {
    let tag = &frame.tag;
    let mut g = frame.start(if tools.is_empty() {
        "answer"
    } else {
        "(answer | call)"
    });
    let constrain = if json && frame.special {
        format!(" (\" \" {} \"json\")?", tag(CONSTRAIN))
    } else {
        String::new()
    };
    g.push_str(&format!(
        "answer: {} \"final\"{constrain} {} @{body}\n",
        tag(CHANNEL),
        tag(MESSAGE)
    ));
    if !tools.is_empty() {
        g.push_str(&frame.call_rules(tools));
    }
    g
}

/// Whether a grammar's text writes harmony's headers itself (then it is the whole
/// reply's grammar, as llama-server takes every grammar).
pub fn writes_headers(grammar: &str) -> bool {
    grammar.contains(CHANNEL)
}

/// An assistant message as gpt-oss's template expects it (llama-server does the same):
/// its `reasoning_content` (what this server answers with) is the template's
/// `thinking`; beside tool calls, the template takes thinking or content, not both,
/// so the content goes.
pub fn adjust_message(m: &mut Message) {
    if m.role() != "assistant" {
        return;
    }
    let Some(r) = m
        .get("reasoning_content")
        .filter(|r| r.as_str().is_some())
        .cloned()
    else {
        return;
    };
    m.set("thinking", r);
    let calls = m
        .get("tool_calls")
        .is_some_and(|c| c.len().is_some_and(|n| n > 0));
    if calls {
        m.set("content", Value::from(""));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::calls::{same_at_every_split, sum_events};

    /// Content, reasoning and calls read from `chunks`, checking that the deltas add up
    /// to the calls.
    fn run(read_calls: bool, chunks: &[&str]) -> (String, String, Vec<(String, String)>) {
        let mut r = Reader::new(read_calls);
        let mut calls = Vec::new();
        let mut evs = Vec::new();
        for c in chunks {
            r.push(c, &mut calls, &mut evs);
        }
        r.finish(&mut calls, &mut evs);
        sum_events(evs, &calls)
    }

    /// Every split of `text` at each byte (char boundary) into two pieces, one at a time,
    /// and char by char, reads as the whole does.
    fn every_split(read_calls: bool, text: &str) -> (String, String, Vec<(String, String)>) {
        same_at_every_split(text, None, |pieces| run(read_calls, pieces))
    }

    #[test]
    fn analysis_then_final() {
        let text = "<|channel|>analysis<|message|>User greets. Reply <b>kindly</b>.<|end|><|start|>assistant<|channel|>final<|message|>Hello — hi! 🙂";
        let (content, reasoning, calls) = every_split(true, text);
        assert_eq!(content, "Hello — hi! 🙂");
        assert_eq!(reasoning, "User greets. Reply <b>kindly</b>.");
        assert!(calls.is_empty());
        // With the stop token written out, the same.
        let (c, _, _) = every_split(true, &format!("{text}<|return|>"));
        assert_eq!(c, "Hello — hi! 🙂");
    }

    #[test]
    fn calls_in_either_header_form() {
        for text in [
            "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\", \"n\": [1, {\"a\": \"}\"}]}<|call|>",
            "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|> {\"city\": \"Oslo\", \"n\": [1, {\"a\": \"}\"}]} \n",
        ] {
            let (content, reasoning, calls) = every_split(true, text);
            assert_eq!(content, "", "{text}");
            assert_eq!(reasoning, "Need weather.");
            assert_eq!(
                calls,
                [(
                    "get_weather".to_string(),
                    "{\"city\": \"Oslo\", \"n\": [1, {\"a\": \"}\"}]}".to_string()
                )]
            );
        }
        // A preamble on the commentary channel is content; a call straight after the
        // generation prompt; a call with no arguments.
        let text = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.now<|message|><|call|><|start|>assistant<|channel|>commentary to=functions.f json<|message|>{}";
        let (content, _, calls) = every_split(true, text);
        assert_eq!(content, "Checking.");
        assert_eq!(
            calls,
            [
                ("now".to_string(), "{}".to_string()),
                ("f".to_string(), "{}".to_string())
            ]
        );
        // Not reading calls (tool_choice none): dropped, as are built-in tools.
        let text = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": 1}<|call|><|start|>assistant<|channel|>analysis to=browser.search<|message|>{\"q\": 1}<|end|><|start|>assistant<|channel|>final<|message|>Done.";
        assert_eq!(
            every_split(false, text),
            ("Done.".into(), String::new(), vec![])
        );
        let (content, _, calls) = every_split(true, text);
        assert_eq!(content, "Done.");
        assert_eq!(calls, [("f".to_string(), "{\"a\": 1}".to_string())]);
    }

    #[test]
    fn text_that_is_no_harmony_is_content() {
        for text in [
            "It is sunny.",
            "<|chan but not",
            "  leading space <|channel|>final<|message|>x",
            "",
        ] {
            let (content, reasoning, calls) = every_split(true, text);
            assert_eq!((content.as_str(), reasoning.as_str()), (text, ""), "{text}");
            assert!(calls.is_empty());
        }
        // Cut short (max_tokens): a partial header is dropped, a call keeps what came.
        let (content, reasoning, calls) = every_split(
            true,
            "<|channel|>analysis<|message|>Thinking<|end|><|start|>assistant<|chan",
        );
        assert_eq!((content.as_str(), reasoning.as_str()), ("", "Thinking"));
        assert!(calls.is_empty());
        let (_, _, calls) = every_split(
            true,
            "<|channel|>commentary to=functions.f<|message|>{\"a\": ",
        );
        assert_eq!(calls, [("f".to_string(), "{\"a\":".to_string())]);
    }

    #[test]
    fn grammars_name_the_markers() {
        let tools = [("f".to_string(), serde_json::json!({"type": "object"}))];
        let quote = |t: &str| serde_json::to_string(t).unwrap();
        let special = Frame {
            tag: |t: &str| t.to_string(),
            special: true,
            reasoning: 40,
        };
        let g = call_grammar(&tools, &special);
        assert!(g.starts_with("start: analysis? call\nanalysis: <|channel|> \"analysis\" <|message|> thought <|end|> <|start|> \"assistant\"\nthought[max_tokens=40]: "), "{g}");
        assert!(g.contains("call0: <|channel|> \"commentary to=functions.f \" <|constrain|> \"json\" <|message|> args0\n"), "{g}");
        let text = Frame {
            tag: quote,
            special: false,
            reasoning: 40,
        };
        let g = call_grammar(&tools, &text);
        assert!(
            g.starts_with("start: call\n") && !g.contains("analysis"),
            "{g}"
        );
        // The answer: the final channel around `@body`, or a call beside it.
        let g = answer_grammar("body", true, &[], &special);
        assert!(g.starts_with("start: analysis? answer\n"), "{g}");
        assert!(
            g.contains(
                "answer: <|channel|> \"final\" (\" \" <|constrain|> \"json\")? <|message|> @body\n"
            ),
            "{g}"
        );
        let g = answer_grammar("body", false, &tools, &special);
        assert!(g.starts_with("start: analysis? (answer | call)\n"), "{g}");
        assert!(
            g.contains("answer: <|channel|> \"final\" <|message|> @body\n")
                && g.contains("call0: "),
            "{g}"
        );
        // reasoning_effort none: no analysis.
        let none = Frame {
            reasoning: 0,
            ..special
        };
        let g = answer_grammar("body", true, &[], &none);
        assert!(
            g.starts_with("start: answer\n") && !g.contains("analysis"),
            "{g}"
        );
        let g = answer_grammar("body", true, &[], &text);
        assert!(
            g.starts_with(
                "start: answer\nanswer: \"<|channel|>\" \"final\" \"<|message|>\" @body\n"
            ),
            "{g}"
        );
        assert!(
            writes_headers("start: \"<|channel|>final<|message|>x\"")
                && !writes_headers("start: \"x\"")
        );
    }

    #[test]
    fn reasoning_content_becomes_thinking() {
        let v: Value = serde_json::from_str(
            r#"{"role": "assistant", "content": "x", "reasoning_content": "r", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}"#,
        )
        .unwrap();
        let mut m = Message::from_value(&v, "m").unwrap();
        adjust_message(&mut m);
        assert_eq!(m.get("thinking").and_then(|t| t.as_str()), Some("r"));
        assert_eq!(m.content(), Some(""));
        let mut u = Message::new("user", "hi");
        adjust_message(&mut u);
        assert!(u.get("thinking").is_none());
    }
}
