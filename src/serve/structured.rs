//! Structured output and tool calls at the HTTP edge: the request fields
//! (`response_format`, `grammar`, `regex`, `tools`, `tool_choice`,
//! `parallel_tool_calls`) read and checked into a [`Structured`], the grammar a
//! generation is constrained by ([`Structured::grammar`]), the engine that compiles it
//! (made at the first request that needs it), and tool calls in OpenAI's shapes (the
//! message of a whole answer, the deltas of a stream).

use std::sync::{Arc, OnceLock};

use serde_json::{json, Value as Json};

use crate::chat::tools::{self, ToolCall, ToolFormat, ToolParser, ToolSpec};
use crate::chat::{harmony, Chat};
use crate::session::constraint::{call_json_options, BODY};
use crate::session::{Constraint, ConstraintError, Engine, Grammar, Grammars};

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The reply is text; calls are not read out of it.
    None,
    /// The model may call tools; calls are read out of its text.
    Auto,
    /// At least one call (constrained by a grammar, so it parses).
    Required,
    /// One call of this function (constrained).
    Named(String),
}

/// The tools of a chat request.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    pub specs: Vec<ToolSpec>,
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true): a required call may be several.
    pub parallel: bool,
}

impl Tools {
    pub fn names(&self) -> Vec<String> {
        self.specs.iter().map(|t| t.name.clone()).collect()
    }

    /// The tools a required or named call is one of, and whether it may be several;
    /// `None` when the reply need not be a call.
    fn required(&self) -> Option<(Vec<ToolSpec>, bool)> {
        match &self.choice {
            ToolChoice::None | ToolChoice::Auto => None,
            ToolChoice::Required => Some((self.specs.clone(), self.parallel)),
            ToolChoice::Named(n) => Some((
                self.specs
                    .iter()
                    .filter(|s| &s.name == n)
                    .cloned()
                    .collect(),
                false,
            )),
        }
    }
}

/// What a request asks of its output's shape.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Structured {
    /// `response_format` (json_object, json_schema), `grammar` or `regex`, and the
    /// field that gave it (errors name it).
    pub format: Option<(Grammar, &'static str)>,
    /// `tools` (chat), when the list is not empty.
    pub tools: Option<Tools>,
    /// A chat request (its reply may carry channels, whose answer alone is in the
    /// format).
    pub chat: bool,
    /// The reasoning effort ([`reasoning_effort`]) is not `none`: a constrained harmony
    /// reply may reason first.
    pub reasoning: bool,
}

/// A refusal of the request (the edge turns it into its error body): a field's value
/// (400 naming it), or the grammar engine failing (500).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StructuredError {
    /// A field is refused: the field, the message, OpenAI's error code.
    Field {
        param: String,
        message: String,
        code: &'static str,
    },
    /// The grammar engine could not be made.
    Engine(String),
}

impl StructuredError {
    /// The field it names, if any.
    pub fn param(&self) -> Option<&str> {
        match self {
            StructuredError::Field { param, .. } => Some(param),
            StructuredError::Engine(_) => None,
        }
    }

    fn missing(param: &str) -> StructuredError {
        StructuredError::Field {
            param: param.to_string(),
            message: format!("Missing required parameter: '{param}'."),
            code: "missing_required_parameter",
        }
    }
}

impl std::fmt::Display for StructuredError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StructuredError::Field { message, .. } | StructuredError::Engine(message) => {
                f.write_str(message)
            }
        }
    }
}

fn invalid(param: &str, message: impl Into<String>) -> StructuredError {
    StructuredError::Field {
        param: param.to_string(),
        message: message.into(),
        code: "invalid_value",
    }
}

/// `response_format`: null, text, json_object (llama-server's `schema` beside it
/// allowed), or json_schema with its `json_schema.schema` and `strict`.
fn response_format(rf: &Json) -> Result<Option<Grammar>, StructuredError> {
    let p = "response_format";
    if rf.is_null() {
        return Ok(None);
    }
    let Some(o) = rf.as_object() else {
        return Err(invalid(p, "'response_format' must be an object."));
    };
    match o.get("type").and_then(Json::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(match o.get("schema") {
            Some(s) if !s.is_null() => Grammar::JsonSchema {
                schema: s.clone(),
                strict: false,
            },
            _ => Grammar::JsonObject,
        })),
        Some("json_schema") => {
            let Some(js) = o.get("json_schema").and_then(Json::as_object) else {
                return Err(StructuredError::missing("response_format.json_schema"));
            };
            let strict = match js.get("strict") {
                None | Some(Json::Null) => false,
                Some(Json::Bool(b)) => *b,
                Some(other) => {
                    return Err(invalid(
                        "response_format.json_schema.strict",
                        format!("'response_format.json_schema.strict' = {other}: must be true or false."),
                    ))
                }
            };
            Ok(Some(match js.get("schema") {
                None | Some(Json::Null) => Grammar::JsonObject,
                Some(s) => Grammar::JsonSchema {
                    schema: s.clone(),
                    strict,
                },
            }))
        }
        other => Err(invalid(
            "response_format.type",
            format!(
                "'response_format.type' = {}: must be 'text', 'json_object' or 'json_schema' (other grammars: the 'grammar' or 'regex' field).",
                other.map_or_else(|| "(none)".to_string(), |t| format!("'{t}'"))
            ),
        )),
    }
}

/// A string field holding a grammar (`grammar`, `regex`), if given.
fn text_field(v: Option<&Json>, p: &str) -> Result<Option<String>, StructuredError> {
    match v {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) if s.trim().is_empty() => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(invalid(p, format!("'{p}' = {other}: must be a string."))),
    }
}

/// `tools`: a list of `{"type": "function", "function": {"name", "description"?,
/// "parameters"?, "strict"?}}`.
fn tool_specs(v: &Json) -> Result<Vec<ToolSpec>, StructuredError> {
    let Some(list) = v.as_array() else {
        return Err(invalid("tools", "'tools' must be a list of tool objects."));
    };
    let mut out = Vec::new();
    for (i, t) in list.iter().enumerate() {
        let p = format!("tools[{i}]");
        if t.get("type").and_then(Json::as_str) != Some("function") {
            return Err(invalid(
                &format!("{p}.type"),
                format!("'{p}.type' must be 'function' (the only tool type this server calls)."),
            ));
        }
        let Some(f) = t.get("function").filter(|f| f.is_object()) else {
            return Err(StructuredError::missing(&format!("{p}.function")));
        };
        let name = match f.get("name") {
            Some(Json::String(n))
                if !n.is_empty()
                    && n.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.') =>
            {
                n.clone()
            }
            Some(Json::String(n)) => {
                return Err(invalid(
                    &format!("{p}.function.name"),
                    format!(
                        "'{p}.function.name' = '{n}': must be letters, digits, '_', '-' or '.'."
                    ),
                ))
            }
            _ => return Err(StructuredError::missing(&format!("{p}.function.name"))),
        };
        let parameters = match f.get("parameters") {
            None | Some(Json::Null) => json!({"type": "object", "properties": {}}),
            Some(s) if s.is_object() => s.clone(),
            Some(other) => {
                return Err(invalid(
                    &format!("{p}.function.parameters"),
                    format!("'{p}.function.parameters' = {other}: must be a JSON schema object."),
                ))
            }
        };
        let strict = match f.get("strict") {
            None | Some(Json::Null) => false,
            Some(Json::Bool(b)) => *b,
            Some(other) => {
                return Err(invalid(
                    &format!("{p}.function.strict"),
                    format!("'{p}.function.strict' = {other}: must be true or false."),
                ))
            }
        };
        out.push(ToolSpec {
            name,
            parameters,
            strict,
        });
    }
    Ok(out)
}

/// `tool_choice`: none, auto, required, or `{"type": "function", "function": {"name"}}`.
fn tool_choice(v: Option<&Json>, specs: &[ToolSpec]) -> Result<ToolChoice, StructuredError> {
    let p = "tool_choice";
    let choice = match v {
        None | Some(Json::Null) => ToolChoice::Auto,
        Some(Json::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => {
                return Err(invalid(
                    p,
                    format!("'tool_choice' = '{s}': must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}."),
                ))
            }
        },
        Some(o) => match o.pointer("/function/name").and_then(Json::as_str) {
            Some(n) if o.get("type").and_then(Json::as_str) == Some("function") => {
                ToolChoice::Named(n.to_string())
            }
            _ => {
                return Err(invalid(
                    p,
                    format!("'tool_choice' = {o}: a named choice is {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}."),
                ))
            }
        },
    };
    if let ToolChoice::Named(n) = &choice {
        if !specs.iter().any(|t| &t.name == n) {
            return Err(invalid(
                "tool_choice.function.name",
                format!("'tool_choice' names '{n}', which is not among 'tools'."),
            ));
        }
    }
    Ok(choice)
}

/// The fields of a request that shape its output.
#[derive(Debug, Default)]
pub struct Fields<'a> {
    pub response_format: Option<&'a Json>,
    pub grammar: Option<&'a Json>,
    pub regex: Option<&'a Json>,
    pub tools: Option<&'a Json>,
    pub tool_choice: Option<&'a Json>,
    pub parallel_tool_calls: Option<bool>,
    pub reasoning_effort: Option<&'a Json>,
    pub chat_template_kwargs: Option<&'a serde_json::Map<String, Json>>,
}

/// The request's reasoning effort: the top-level `reasoning_effort` (OpenAI's field),
/// else `chat_template_kwargs.reasoning_effort` (as transformers and vLLM clients pass
/// it); a null is no value. The template gets the same value (`api::parse` sets the
/// top-level field after the kwargs), so the grammar and the template agree.
pub fn reasoning_effort<'a>(f: &Fields<'a>) -> Option<&'a Json> {
    f.reasoning_effort
        .filter(|v| !v.is_null())
        .or_else(|| f.chat_template_kwargs?.get("reasoning_effort"))
}

/// Reads and checks the fields (module docs); tools only for chat.
pub fn parse(f: &Fields, chat: bool) -> Result<Structured, StructuredError> {
    let mut formats = Vec::new();
    if let Some(g) = f
        .response_format
        .map(response_format)
        .transpose()?
        .flatten()
    {
        formats.push((g, "response_format"));
    }
    if let Some(t) = text_field(f.grammar, "grammar")? {
        formats.push((Grammar::from_text(&t), "grammar"));
    }
    if let Some(t) = text_field(f.regex, "regex")? {
        formats.push((Grammar::Regex(t), "regex"));
    }
    if formats.len() > 1 {
        return Err(invalid(
            formats[1].1,
            format!(
                "'{}' and '{}' cannot both shape the output: give one.",
                formats[0].1, formats[1].1
            ),
        ));
    }
    let format = formats.pop();
    let reasoning = reasoning_effort(f).and_then(Json::as_str) != Some("none");
    let specs = match f.tools {
        None | Some(Json::Null) => Vec::new(),
        Some(t) => tool_specs(t)?,
    };
    if specs.is_empty() {
        let choice = tool_choice(f.tool_choice, &specs)?;
        if matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
            return Err(invalid(
                "tool_choice",
                "'tool_choice' requires a tool call, but 'tools' lists none.",
            ));
        }
        return Ok(Structured {
            format,
            tools: None,
            chat,
            reasoning,
        });
    }
    if !chat {
        return Err(invalid(
            "tools",
            "'tools' is for /v1/chat/completions (the chat template renders them).",
        ));
    }
    let choice = tool_choice(f.tool_choice, &specs)?;
    Ok(Structured {
        format,
        tools: Some(Tools {
            specs,
            choice,
            parallel: f.parallel_tool_calls.unwrap_or(true),
        }),
        chat,
        reasoning,
    })
}

/// The tool-call format of the chat's template (the one transformers renders tools
/// with).
pub fn tool_format(chat: Option<&Chat>) -> ToolFormat {
    ToolFormat::detect(chat.and_then(|c| c.template().tools_source()).unwrap_or(""))
}

impl Structured {
    /// The grammar the generation is constrained by, and the field errors name: a
    /// required or named call's grammar, else the output format (`special`: whether
    /// the tokenizer has a text as one special token). `max_tokens`: the reply's
    /// length, of which a constrained harmony reply may reason half before its answer
    /// or call.
    ///
    /// For a chat template that writes channels (harmony), the format constrains the
    /// final channel's content, not the whole reply ([`tools::answer_grammar`]); beside
    /// `tools` the model may call (`tool_choice` auto), a `response_format` answer may
    /// be a call instead, as OpenAI's is. A `grammar` that writes the channel headers
    /// itself is the whole reply's.
    ///
    /// A required or named call is the whole reply in every family (the call grammars
    /// leave no room for content: no text before, between or after the calls; under
    /// harmony at most an analysis, which is reasoning), so a format beside it shapes
    /// nothing here ([`Structured::unused_format`]): it is for the turns after the
    /// call, as OpenAI's is.
    pub fn grammar(
        &self,
        format: ToolFormat,
        special: impl Fn(&str) -> bool,
        max_tokens: usize,
    ) -> Option<(Grammar, &'static str)> {
        let reasoning = if self.reasoning { max_tokens / 2 } else { 0 };
        if let Some((specs, parallel)) = self.tools.as_ref().and_then(Tools::required) {
            let lark = tools::call_grammar(
                format,
                &specs,
                parallel,
                call_json_options(),
                special,
                reasoning,
            );
            return Some((Grammar::Lark(lark), "tools"));
        }
        let (body, field) = self.format.as_ref()?;
        let own_headers =
            matches!(body, Grammar::Lark(t) | Grammar::Gbnf(t) if harmony::writes_headers(t));
        if !self.chat || own_headers {
            return Some((body.clone(), field));
        }
        let calls = match &self.tools {
            Some(t) if t.choice == ToolChoice::Auto && *field == "response_format" => {
                t.specs.as_slice()
            }
            _ => &[],
        };
        let json = matches!(body, Grammar::JsonObject | Grammar::JsonSchema { .. });
        Some(
            match tools::answer_grammar(
                format,
                BODY,
                json,
                calls,
                call_json_options(),
                special,
                reasoning,
            ) {
                Some(frame) => (
                    Grammar::Framed {
                        frame,
                        body: Box::new(body.clone()),
                    },
                    field,
                ),
                None => (body.clone(), field),
            },
        )
    }

    /// The format beside a required or named call, which the reply (the call) has no
    /// content for ([`Structured::grammar`]): it is compiled only to refuse a bad one.
    pub fn unused_format(&self) -> Option<&(Grammar, &'static str)> {
        self.tools
            .as_ref()
            .and_then(Tools::required)
            .and(self.format.as_ref())
    }

    /// The reply's reader: tool calls read out of it (tools given, tool_choice not
    /// none), or for harmony its channels in any case.
    pub fn reader(&self, format: ToolFormat) -> Option<ToolParser> {
        let names = self.tools.as_ref().map(Tools::names).unwrap_or_default();
        if self.reads_calls() {
            Some(ToolParser::new(format, names, true))
        } else if format.has_channels() {
            Some(ToolParser::new(format, names, false))
        } else {
            None
        }
    }

    /// Whether tool calls are read out of the reply.
    pub fn reads_calls(&self) -> bool {
        self.tools
            .as_ref()
            .is_some_and(|t| t.choice != ToolChoice::None)
    }
}

/// The grammar engine of the server's tokenizer, made at the first request that needs
/// one (its trie takes a moment for a large vocabulary; a server that is never asked
/// for structured output never pays it).
pub struct GrammarEngine {
    engine: Arc<Engine>,
    stop_ids: Vec<u32>,
    grammars: OnceLock<Result<Grammars, ConstraintError>>,
}

impl GrammarEngine {
    pub fn new(engine: Arc<Engine>, stop_ids: Vec<u32>) -> GrammarEngine {
        GrammarEngine {
            engine,
            stop_ids,
            grammars: OnceLock::new(),
        }
    }

    /// The compiler (made now if not yet; blocking work).
    pub fn grammars(&self) -> Result<&Grammars, StructuredError> {
        self.grammars
            .get_or_init(|| {
                let mut stops = self.stop_ids.clone();
                stops.extend(self.engine.stop_ids());
                Grammars::new(self.engine.clone(), &stops)
            })
            .as_ref()
            .map_err(|e| StructuredError::Engine(e.to_string()))
    }

    /// The request's constraint, compiled (blocking work), and the field that gave it:
    /// `None` when it has no grammar; a grammar that does not compile is a 400 naming
    /// its field.
    pub fn constraint(
        &self,
        s: &Structured,
        format: ToolFormat,
        max_tokens: usize,
    ) -> Result<Option<(Constraint, &'static str)>, StructuredError> {
        self.check_strict_tools(s)?;
        if s.format.is_none() && s.grammar(format, |_| false, max_tokens).is_none() {
            return Ok(None);
        }
        let g = self.grammars()?;
        let Some((grammar, field)) = s.grammar(format, |t| g.has_special(t), max_tokens) else {
            return Ok(None);
        };
        if let Some((unused, unused_field)) = s.unused_format() {
            self.compile(unused, unused_field)?;
        }
        self.compile(&grammar, field).map(|c| Some((c, field)))
    }

    /// `grammar` compiled; one the engine refuses is a 400 naming `field`.
    fn compile(&self, grammar: &Grammar, field: &str) -> Result<Constraint, StructuredError> {
        match self.grammars()?.compile(grammar) {
            Ok(c) => Ok(c),
            Err(e @ ConstraintError::Grammar { .. }) => Err(StructuredError::Field {
                param: field.to_string(),
                message: format!("'{field}': {e}"),
                code: "invalid_grammar",
            }),
            Err(e) => Err(StructuredError::Engine(e.to_string())),
        }
    }
}

impl GrammarEngine {
    /// Each strict tool's parameters compiled on their own, strictly: a schema the
    /// engine cannot enforce is a 400 naming the tool (a call's grammar holds them
    /// leniently beside the other tools', which then changes nothing: strict
    /// compiling only refuses, never approximates).
    fn check_strict_tools(&self, s: &Structured) -> Result<(), StructuredError> {
        let Some(t) = s.tools.as_ref().filter(|_| s.reads_calls()) else {
            return Ok(());
        };
        for (i, spec) in t.specs.iter().enumerate().filter(|(_, t)| t.strict) {
            let g = self.grammars()?;
            let grammar = Grammar::JsonSchema {
                schema: spec.parameters.clone(),
                strict: true,
            };
            match g.compile(&grammar) {
                Ok(_) => {}
                Err(e @ ConstraintError::Grammar { .. }) => {
                    let param = format!("tools[{i}].function.parameters");
                    return Err(StructuredError::Field {
                        message: format!(
                            "'{param}' of the strict function '{}' cannot be enforced: {e}. Leave out 'strict' to have what cannot be enforced ignored.",
                            spec.name
                        ),
                        param,
                        code: "invalid_schema",
                    });
                }
                Err(e) => return Err(StructuredError::Engine(e.to_string())),
            }
        }
        Ok(())
    }
}

/// One call in OpenAI's shape.
pub fn call_json(id: &str, c: &ToolCall) -> Json {
    json!({"id": id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
}

/// A whole chat answer's message as its reader read it: the content (null when the
/// reply was only calls), the reasoning (`reasoning_content`, when there was some),
/// the calls (with them, the finish reason `tool_calls` unless the length ran out).
pub fn read_message(
    resp: &mut Json,
    content: String,
    reasoning: String,
    calls: &[(String, ToolCall)],
) {
    let choice = &mut resp["choices"][0];
    let mut m = json!({"role": "assistant", "content": content, "refusal": null});
    if !reasoning.is_empty() {
        m["reasoning_content"] = json!(reasoning);
    }
    if !calls.is_empty() {
        if content.trim().is_empty() {
            m["content"] = Json::Null;
        }
        m["tool_calls"] = json!(calls
            .iter()
            .map(|(id, c)| call_json(id, c))
            .collect::<Vec<_>>());
        if choice["finish_reason"] != "length" {
            choice["finish_reason"] = json!("tool_calls");
        }
    }
    choice["message"] = m;
}

/// The `delta.tool_calls` of a call's first chunk (id, type, name, empty arguments).
pub fn start_delta(index: usize, id: &str, name: &str) -> Json {
    json!([{"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}])
}

/// The `delta.tool_calls` of more arguments text of call `index`.
pub fn arguments_delta(index: usize, delta: &str) -> Json {
    json!([{"index": index, "function": {"arguments": delta}}])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(body: Json, chat: bool) -> Result<Structured, StructuredError> {
        let f = Fields {
            response_format: body.get("response_format"),
            grammar: body.get("grammar"),
            regex: body.get("regex"),
            tools: body.get("tools"),
            tool_choice: body.get("tool_choice"),
            parallel_tool_calls: body.get("parallel_tool_calls").and_then(Json::as_bool),
            reasoning_effort: body.get("reasoning_effort"),
            chat_template_kwargs: body.get("chat_template_kwargs").and_then(Json::as_object),
        };
        parse(&f, chat)
    }

    fn tool(name: &str) -> Json {
        json!({"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}})
    }

    #[test]
    fn strict_is_read() {
        let mut t = tool("f");
        t["function"]["strict"] = json!(true);
        let s = read(json!({"tools": [t, tool("g")]}), true).unwrap();
        let specs = &s.tools.unwrap().specs;
        assert!(specs[0].strict && !specs[1].strict);
    }

    #[test]
    fn formats_are_read() {
        let chat = |b| read(b, true).unwrap().format;
        assert_eq!(chat(json!({"response_format": {"type": "text"}})), None);
        assert_eq!(
            chat(json!({"response_format": {"type": "json_object"}})),
            Some((Grammar::JsonObject, "response_format"))
        );
        assert_eq!(
            chat(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": true, "schema": {"type": "integer"}}}})
            ),
            Some((
                Grammar::JsonSchema {
                    schema: json!({"type": "integer"}),
                    strict: true
                },
                "response_format"
            ))
        );
        assert_eq!(
            chat(json!({"grammar": "root ::= \"a\""})),
            Some((Grammar::Gbnf("root ::= \"a\"".into()), "grammar"))
        );
        assert_eq!(
            chat(json!({"grammar": "start: \"a\""})),
            Some((Grammar::Lark("start: \"a\"".into()), "grammar"))
        );
        assert_eq!(
            chat(json!({"regex": "[0-9]+"})),
            Some((Grammar::Regex("[0-9]+".into()), "regex"))
        );
        let s = read(json!({"tools": [tool("f"), tool("g")], "tool_choice": {"type": "function", "function": {"name": "g"}}}), true).unwrap();
        let t = s.tools.as_ref().unwrap();
        assert_eq!(
            (t.choice.clone(), t.parallel),
            (ToolChoice::Named("g".into()), true)
        );
        let (Grammar::Lark(g), "tools") = s.grammar(ToolFormat::Hermes, |_| false, 100).unwrap()
        else {
            panic!()
        };
        assert!(
            g.contains("\"const\":\"g\"") && !g.contains("\"const\":\"f\""),
            "{g}"
        );
        assert!(
            read(json!({"tools": [tool("f")], "tool_choice": "auto"}), true)
                .unwrap()
                .grammar(ToolFormat::Hermes, |_| false, 100)
                .is_none()
        );
        assert!(read(json!({"tools": [], "tool_choice": "none"}), true)
            .unwrap()
            .tools
            .is_none());
    }

    /// Under a harmony template a chat's format is the final channel's content, after
    /// at most half the reply's tokens of analysis (none with reasoning_effort none);
    /// beside auto tools a response_format answer may be a call instead.
    #[test]
    fn formats_are_framed_for_harmony() {
        let frame = |body: Json, chat: bool| -> Option<(Grammar, &'static str)> {
            read(body, chat)
                .unwrap()
                .grammar(ToolFormat::Harmony, |_| true, 100)
        };
        let rf = json!({"type": "json_object"});
        let Some((Grammar::Framed { frame: f, body }, "response_format")) =
            frame(json!({"response_format": rf}), true)
        else {
            panic!()
        };
        assert_eq!(*body, Grammar::JsonObject);
        assert!(
            f.starts_with("start: analysis? answer\n") && f.contains("thought[max_tokens=50]"),
            "{f}"
        );
        let Some((Grammar::Framed { frame: f, .. }, _)) = frame(
            json!({"response_format": rf, "reasoning_effort": "none"}),
            true,
        ) else {
            panic!()
        };
        assert!(f.starts_with("start: answer\n"), "{f}");
        let Some((Grammar::Framed { frame: f, body }, "regex")) = frame(
            json!({"regex": "[0-9]+", "tools": [tool("f")], "reasoning_effort": "low"}),
            true,
        ) else {
            panic!()
        };
        assert_eq!(*body, Grammar::Regex("[0-9]+".into()));
        assert!(f.starts_with("start: analysis? answer\n"), "{f}");
        let Some((Grammar::Framed { frame: f, .. }, _)) =
            frame(json!({"response_format": rf, "tools": [tool("f")]}), true)
        else {
            panic!()
        };
        assert!(
            f.starts_with("start: analysis? (answer | call)\n") && f.contains("functions.f"),
            "{f}"
        );
        // Whole replies: a completion's, a grammar that writes the headers, other families.
        assert_eq!(
            frame(json!({"response_format": rf}), false),
            Some((Grammar::JsonObject, "response_format"))
        );
        let own = "start: \"<|channel|>final<|message|>x\"";
        assert_eq!(
            frame(json!({"grammar": own}), true),
            Some((Grammar::Lark(own.into()), "grammar"))
        );
        assert_eq!(
            read(json!({"response_format": rf}), true).unwrap().grammar(
                ToolFormat::Hermes,
                |_| true,
                100
            ),
            Some((Grammar::JsonObject, "response_format"))
        );
        // A required call reasons within the same bound.
        let Some((Grammar::Lark(g), "tools")) = frame(
            json!({"tools": [tool("f")], "tool_choice": "required"}),
            true,
        ) else {
            panic!()
        };
        assert!(g.contains("thought[max_tokens=50]"), "{g}");
    }

    /// A required or named call beside a format (OpenAI takes both): the reply is the
    /// call under its grammar in every family, harmony's too; the format is kept aside
    /// (compiled only to refuse a bad one). Beside auto tools nothing is aside.
    #[test]
    fn required_calls_beside_a_format() {
        let named = json!({"type": "function", "function": {"name": "g"}});
        for (format, special) in [(ToolFormat::Hermes, false), (ToolFormat::Harmony, true)] {
            for (choice, extra) in [
                (
                    json!("required"),
                    json!({"response_format": {"type": "json_object"}}),
                ),
                (named.clone(), json!({"regex": "[0-9]+"})),
                (named.clone(), json!({"grammar": "start: \"<|channel|>x\""})),
            ] {
                let mut body = json!({"tools": [tool("f"), tool("g")], "tool_choice": choice});
                body.as_object_mut()
                    .unwrap()
                    .extend(extra.as_object().unwrap().clone());
                let s = read(body.clone(), true).expect("accepted");
                let Some((Grammar::Lark(g), "tools")) = s.grammar(format, |_| special, 100) else {
                    panic!("{format:?} {body}")
                };
                assert!(
                    g.contains("\"const\":\"g\"") || g.contains("functions.g"),
                    "{g}"
                );
                assert_eq!(
                    choice.is_object(),
                    !g.contains("\"const\":\"f\"") && !g.contains("functions.f"),
                    "{g}"
                );
                if format == ToolFormat::Harmony {
                    assert!(g.starts_with("start: analysis? call\n"), "{g}");
                }
                assert_eq!(s.unused_format(), s.format.as_ref(), "{body}");
                assert!(s.unused_format().is_some());
            }
        }
        let auto = read(
            json!({"tools": [tool("f")], "response_format": {"type": "json_object"}}),
            true,
        )
        .unwrap();
        assert_eq!(auto.unused_format(), None);
    }

    /// `reasoning_effort` inside `chat_template_kwargs` frames a harmony reply as the
    /// top-level field does; the top-level field wins, a null one is no value.
    #[test]
    fn reasoning_effort_from_template_kwargs() {
        let reasoning = |extra: Json| {
            let mut body = json!({"response_format": {"type": "json_object"}});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let s = read(body, true).unwrap();
            let Some((Grammar::Framed { frame, .. }, _)) =
                s.grammar(ToolFormat::Harmony, |_| true, 100)
            else {
                panic!()
            };
            assert_eq!(
                s.reasoning,
                frame.starts_with("start: analysis?"),
                "{frame}"
            );
            s.reasoning
        };
        let none = json!({"reasoning_effort": "none"});
        assert!(reasoning(json!({})));
        assert!(!reasoning(json!({"chat_template_kwargs": none})));
        assert!(!reasoning(
            json!({"reasoning_effort": null, "chat_template_kwargs": none})
        ));
        assert!(reasoning(
            json!({"reasoning_effort": "low", "chat_template_kwargs": none})
        ));
        assert!(!reasoning(
            json!({"reasoning_effort": "none", "chat_template_kwargs": {"reasoning_effort": "high"}})
        ));
    }

    #[test]
    fn refusals_name_the_field() {
        for (body, chat, want) in [
            (
                json!({"response_format": {"type": "xml"}}),
                true,
                "response_format.type",
            ),
            (json!({"response_format": "json"}), true, "response_format"),
            (
                json!({"response_format": {"type": "json_schema"}}),
                true,
                "response_format.json_schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"strict": 1}}}),
                true,
                "response_format.json_schema.strict",
            ),
            (
                json!({"response_format": {"type": "json_object"}, "grammar": "root ::= \"a\""}),
                true,
                "grammar",
            ),
            (json!({"grammar": 3}), true, "grammar"),
            (json!({"tools": {}}), true, "tools"),
            (json!({"tools": [{"type": "code"}]}), true, "tools[0].type"),
            (
                json!({"tools": [{"type": "function"}]}),
                true,
                "tools[0].function",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
                true,
                "tools[0].function.name",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a", "parameters": 3}}]}),
                true,
                "tools[0].function.parameters",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a", "strict": "yes"}}]}),
                true,
                "tools[0].function.strict",
            ),
            (
                json!({"tools": [tool("f")], "tool_choice": "always"}),
                true,
                "tool_choice",
            ),
            (
                json!({"tools": [tool("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
                true,
                "tool_choice.function.name",
            ),
            (json!({"tool_choice": "required"}), true, "tool_choice"),
            (json!({"tools": [tool("f")]}), false, "tools"),
        ] {
            let e = read(body.clone(), chat).expect_err("refused");
            assert_eq!(e.param(), Some(want), "{body}: {e}");
        }
    }
}
