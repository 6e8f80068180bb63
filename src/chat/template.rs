//! Chat templates compiled with minijinja in the environment transformers renders
//! them in.
//!
//! transformers (`utils/chat_template_utils.py`, 5.24) compiles templates in a Jinja2
//! `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the
//! `loopcontrols` extension and its `{% generation %}` tag, replaces the `tojson`
//! filter (see `pyjson`), and adds the globals `raise_exception`, `strftime_now`,
//! `dict` and `namespace`. It renders with `messages`, `tools`, `documents`,
//! `add_generation_prompt`, the tokenizer's named special tokens (`bos_token`,
//! `eos_token`, ...) and the caller's keyword arguments, which override them.
//!
//! Here: the same syntax settings (and no trailing newline kept, no auto-escaping),
//! minijinja-contrib's Python methods on strings, lists and dicts (`.strip()`,
//! `.startswith()`, `.items()` ...), with `strip`/`lstrip`/`rstrip` and the `trim`
//! filter using Python's whitespace, `{% generation %}` read as a plain block, and a
//! render budget (fuel, output size, depth: `budget`) so that no template can run
//! forever, exhaust memory or overflow the stack. A template that does not compile,
//! raises, fails or runs out of its budget is a [`ChatError`] naming the template and
//! line; there is no fallback template.

use super::budget::{self, CappedOutput, RenderBudget};
use super::conversation::{Message, RenderOptions};
use super::error::ChatError;
use super::pyjson::tojson_filter;
use crate::format::mlt_chat::{ChatSection, DEFAULT_TEMPLATE};
use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State, Value};

/// The name an ad-hoc template source (given as `RenderOptions::template`) is known by.
const GIVEN: &str = "(given)";

/// transformers' marker for `continue_final_message`.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// Python's `str.isspace`: Unicode White_Space plus the separators U+001C..U+001F.
pub fn py_is_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.strip()` (no argument).
pub fn py_strip(s: &str) -> &str {
    s.trim_matches(py_is_space)
}

/// The error `raise_exception` raises, told apart from others by its source.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raise_exception(message: Rest<Value>) -> Result<Value, Error> {
    let text = message.first().map(|m| m.to_string()).unwrap_or_default();
    Err(Error::new(ErrorKind::InvalidOperation, text.clone()).with_source(Raised(text)))
}

/// Jinja's `trim` filter: Python's `str.strip(chars)`.
fn trim_filter(value: Value, chars: Option<String>) -> String {
    let s = value.to_string();
    match chars {
        Some(c) => s.trim_matches(|x| c.contains(x)).to_string(),
        None => py_strip(&s).to_string(),
    }
}

/// minijinja-contrib's Python methods, with `strip`, `lstrip` and `rstrip` (no
/// argument) using Python's whitespace.
fn py_methods(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let (Some(s), "format") = (value.as_str(), method) {
        // Widths and precisions can ask for any length: pay before formatting.
        let padding = budget::str_format_padding(s);
        budget::pay_bytes(state, padding.saturating_add(s.len() as u64), "str.format")?;
    }
    if let (Some(s), true) = (
        value.as_str(),
        args.is_empty() || (args.len() == 1 && args[0].is_none()),
    ) {
        match method {
            "strip" => return Ok(Value::from(py_strip(s))),
            "lstrip" => return Ok(Value::from(s.trim_start_matches(py_is_space))),
            "rstrip" => return Ok(Value::from(s.trim_end_matches(py_is_space))),
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Rewrites `{% generation %}` / `{% endgeneration %}` (transformers' tag marking the
/// assistant's text) into `{% if true %}` / `{% endif %}`, keeping the `-`/`+`
/// whitespace markers, so they render their body as transformers does.
fn rewrite_generation_tags(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find("{%") {
        out.push_str(&rest[..i]);
        let tag = &rest[i..];
        // From after the `{%`: in `{%}` the `%}` overlaps it.
        let Some(end) = tag[2..].find("%}").map(|e| e + 2) else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (pre, body) = match inner.chars().next() {
            Some(c @ ('-' | '+')) => (c.to_string(), &inner[1..]),
            _ => (String::new(), inner),
        };
        let (body, post) = match body.chars().last() {
            Some(c @ ('-' | '+')) => (&body[..body.len() - 1], c.to_string()),
            _ => (body, String::new()),
        };
        match body.trim() {
            "generation" => out.push_str(&format!("{{%{pre} if true {post}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{pre} endif {post}%}}")),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

fn strftime(now: chrono::NaiveDateTime, fmt: &str) -> Result<String, Error> {
    use std::fmt::Write;
    let items: Vec<chrono::format::Item> = chrono::format::StrftimeItems::new(fmt).collect();
    if items.contains(&chrono::format::Item::Error) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: bad format {fmt:?}"),
        ));
    }
    let mut s = String::new();
    write!(s, "{}", now.format_with_items(items.iter())).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: cannot format {fmt:?}"),
        )
    })?;
    Ok(s)
}

/// transformers' `tojson` ([`tojson_filter`]), refused before it writes when its
/// output (with the given separators and indent) could exceed the bytes the render
/// budget has left.
fn tojson_budgeted(
    state: &State,
    value: Value,
    args: Rest<Value>,
    kwargs: Kwargs,
) -> Result<String, Error> {
    let arg = |i: usize, name: &str| -> Option<Value> {
        args.get(i)
            .cloned()
            .or_else(|| kwargs.peek::<Option<Value>>(name).ok().flatten())
            .filter(|v| !v.is_none())
    };
    let indent = arg(1, "indent").map(|v| match v.as_str() {
        Some(s) => s.len(),
        None => v.as_i64().unwrap_or(1).clamp(0, 64) as usize,
    });
    let (mut item, mut key) = (if indent.is_some() { 1 } else { 2 }, 2);
    if let Some(seps) = arg(2, "separators") {
        let parts: Vec<Value> = seps.try_iter().map(|i| i.collect()).unwrap_or_default();
        if let [a, b] = parts.as_slice() {
            item = a.as_str().map_or(0, str::len);
            key = b.as_str().map_or(0, str::len);
        }
    }
    let left = budget::bytes_left(state).unwrap_or(u64::MAX);
    if budget::tojson_size(&value, item, key, indent, left).is_none() {
        return Err(Error::new(
            ErrorKind::OutOfFuel,
            "tojson: the output would exceed what the render budget has left",
        ));
    }
    tojson_filter(value, args, kwargs)
}

/// The environment templates are compiled in, with the fuel of `budget`.
fn environment(budget: &RenderBudget) -> Environment<'static> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .expect("default delimiters are valid"),
    );
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_fuel(Some(budget.fuel));
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(py_methods);
    env.add_filter("tojson", tojson_budgeted);
    env.add_filter("trim", trim_filter);
    env.add_function("raise_exception", raise_exception);
    env.add_function(budget::NAMESPACE_GUARD, budget::namespace_value);
    env
}

/// The source minijinja compiles: `{% generation %}` tags read as plain blocks, and
/// namespace assignments guarded (`budget::guard_namespace_sets`).
fn prepare(source: &str) -> String {
    budget::guard_namespace_sets(&rewrite_generation_tags(source))
}

fn error(template: &str, e: &Error, compiling: bool) -> ChatError {
    use std::error::Error as _;
    let line = e.line();
    let template = template.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        if let Some(r) = s.downcast_ref::<Raised>() {
            return ChatError::Raised {
                template,
                line,
                message: r.0.clone(),
            };
        }
        src = s.source();
    }
    let message = match e.detail() {
        Some(d) => format!("{}: {d}", e.kind()),
        None => e.kind().to_string(),
    };
    if e.kind() == ErrorKind::OutOfFuel {
        return budget::budget_error(&template, line, message);
    }
    if compiling {
        ChatError::Syntax {
            template,
            line,
            message,
        }
    } else {
        ChatError::Render {
            template,
            line,
            message,
        }
    }
}

/// A file's chat templates, compiled, with the special-token strings they read.
pub struct ChatTemplate {
    env: Environment<'static>,
    budget: RenderBudget,
    names: Vec<String>,
    sources: Vec<String>,
    specials: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("names", &self.names)
            .field("budget", &self.budget)
            .field("specials", &self.specials)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles every template of a chat section.
    pub fn new(section: &ChatSection) -> Result<ChatTemplate, ChatError> {
        let budget = RenderBudget::default();
        let mut t = ChatTemplate {
            env: environment(&budget),
            budget,
            names: Vec::new(),
            sources: Vec::new(),
            specials: section.specials.clone(),
        };
        for nt in &section.templates {
            t.add(&nt.name, &nt.source)?;
        }
        Ok(t)
    }

    /// One template (named `default`) and the special-token strings it reads.
    pub fn from_source(
        source: &str,
        specials: &[(String, String)],
    ) -> Result<ChatTemplate, ChatError> {
        ChatTemplate::new(&ChatSection {
            templates: vec![crate::format::mlt_chat::NamedTemplate {
                name: DEFAULT_TEMPLATE.into(),
                source: source.into(),
            }],
            specials: specials.to_vec(),
            stop: Vec::new(),
        })
    }

    fn add(&mut self, name: &str, source: &str) -> Result<(), ChatError> {
        self.env
            .add_template_owned(name.to_string(), prepare(source))
            .map_err(|e| error(name, &e, true))?;
        self.names.push(name.to_string());
        self.sources.push(source.to_string());
        Ok(())
    }

    /// What one rendering may cost (default: [`RenderBudget::default`]).
    pub fn set_budget(&mut self, budget: RenderBudget) {
        self.env.set_fuel(Some(budget.fuel));
        self.budget = budget;
    }

    pub fn budget(&self) -> &RenderBudget {
        &self.budget
    }

    /// The template names, in file order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The source of the template `name`, if the file has it.
    pub fn source(&self, name: &str) -> Option<&str> {
        let i = self.names.iter().position(|n| n == name)?;
        Some(&self.sources[i])
    }

    /// The source transformers renders a conversation with tools by: `tool_use` when
    /// the file has it, else `default`.
    pub fn tools_source(&self) -> Option<&str> {
        self.source("tool_use")
            .or_else(|| self.source(DEFAULT_TEMPLATE))
    }

    /// The special-token strings passed to every rendering.
    pub fn specials(&self) -> &[(String, String)] {
        &self.specials
    }

    /// The template transformers' `get_chat_template` picks: the named one (or a given
    /// source), else `tool_use` when tools are given and present, else `default`.
    fn pick(&self, opts: &RenderOptions) -> Result<(String, String), ChatError> {
        let find = |n: &str| {
            self.names
                .iter()
                .position(|x| x == n)
                .map(|i| (n.to_string(), self.sources[i].clone()))
        };
        if let Some(t) = &opts.template {
            return Ok(find(t).unwrap_or_else(|| (GIVEN.to_string(), t.clone())));
        }
        if opts.tools.is_some() {
            if let Some(p) = find("tool_use") {
                return Ok(p);
            }
        }
        find(DEFAULT_TEMPLATE).ok_or_else(|| ChatError::NoTemplate {
            name: DEFAULT_TEMPLATE.into(),
            available: self.names.clone(),
        })
    }

    /// Renders a conversation to text, as transformers' `apply_chat_template(...,
    /// tokenize=False)` does.
    pub fn render(&self, messages: &[Message], opts: &RenderOptions) -> Result<String, ChatError> {
        if messages.is_empty() {
            return Err(ChatError::input(
                "messages",
                "[]",
                "cannot apply a chat template to an empty conversation",
            ));
        }
        if opts.continue_final_message && opts.add_generation_prompt {
            return Err(ChatError::input(
                "continue_final_message",
                true,
                "cannot be used together with add_generation_prompt",
            ));
        }
        for (k, _) in &opts.kwargs {
            if ["messages", "tools", "documents", "add_generation_prompt"].contains(&k.as_str()) {
                return Err(ChatError::input(
                    format!("kwargs.{k}"),
                    k,
                    "is set by its own option, not as a template variable",
                ));
            }
        }
        let (name, source) = self.pick(opts)?;
        let mut chat: Vec<Message> = messages.iter().map(Message::normalized).collect();
        let mut final_text = None;
        if opts.continue_final_message {
            final_text = Some(mark_final(&mut chat, &source)?);
        }
        let now = opts.now;
        let strftime_now = Value::from_function(move |fmt: String| -> Result<String, Error> {
            strftime(
                now.unwrap_or_else(|| chrono::Local::now().naive_local()),
                &fmt,
            )
        });
        let mut ctx: Vec<(String, Value)> = vec![
            (
                "messages".into(),
                chat.iter().map(Message::to_value).collect::<Value>(),
            ),
            (
                "tools".into(),
                opts.tools.clone().unwrap_or(Value::from(())),
            ),
            (
                "documents".into(),
                opts.documents.clone().unwrap_or(Value::from(())),
            ),
            (
                "add_generation_prompt".into(),
                Value::from(opts.add_generation_prompt),
            ),
            ("strftime_now".into(), strftime_now),
        ];
        for (k, v) in &self.specials {
            ctx.push((k.clone(), Value::from(v.as_str())));
        }
        ctx.extend(opts.kwargs.iter().cloned());
        let ctx = Value::from_pairs(ctx.iter().map(|(k, v)| (k.as_str(), v.clone())));
        let rendered = if name == GIVEN {
            let mut env = environment(&self.budget);
            env.add_template_owned(GIVEN, prepare(&source))
                .map_err(|e| error(&name, &e, true))?;
            render_in(&env, &name, ctx, self.budget.max_output)?
        } else {
            render_in(&self.env, &name, ctx, self.budget.max_output)?
        };
        match final_text {
            Some(text) => cut_at_tag(&name, rendered, &text),
            None => Ok(rendered),
        }
    }
}

/// Renders into a writer that refuses more than `max_output` bytes.
fn render_in(
    env: &Environment,
    name: &str,
    ctx: Value,
    max_output: usize,
) -> Result<String, ChatError> {
    let t = env.get_template(name).map_err(|e| error(name, &e, true))?;
    let mut out = CappedOutput {
        buf: Vec::new(),
        max: max_output,
        over: false,
    };
    match t.render_captured_to(ctx, &mut out) {
        Ok(_) => {}
        Err(_) if out.over => {
            return Err(ChatError::TooLong {
                template: name.to_string(),
                limit: max_output,
            })
        }
        Err(e) => return Err(error(name, &e, false)),
    }
    // minijinja writes whole UTF-8 strings, so the bytes are text.
    String::from_utf8(out.buf).map_err(|e| ChatError::Render {
        template: name.to_string(),
        line: None,
        message: e.to_string(),
    })
}

/// transformers' `continue_final_message`: tags the final message's content (its last
/// text part, for a list) and returns the content, to cut the rendering there.
fn mark_final(chat: &mut [Message], source: &str) -> Result<String, ChatError> {
    let last = chat.last_mut().expect("checked non-empty");
    let content = last.get("content").cloned().unwrap_or_default();
    if content.is_undefined() {
        return Err(ChatError::input(
            "continue_final_message",
            true,
            "the final message has no \"content\" to continue",
        ));
    }
    if !source.contains("content") {
        return Err(ChatError::input(
            "continue_final_message",
            true,
            "the chat template does not read \"content\"",
        ));
    }
    if let Some(s) = content.as_str() {
        last.set("content", Value::from(format!("{s}{CONTINUE_TAG}")));
        return Ok(s.to_string());
    }
    if content.kind() == ValueKind::Seq {
        let mut parts: Vec<Value> = content.try_iter().map(|i| i.collect()).unwrap_or_default();
        for part in parts.iter_mut().rev() {
            let text = part.get_item(&Value::from("text")).unwrap_or_default();
            if let Some(t) = text.as_str() {
                let original = t.to_string();
                *part = with_key(
                    part,
                    "text",
                    Value::from(format!("{original}{CONTINUE_TAG}")),
                );
                last.set("content", parts.into_iter().collect());
                return Ok(original);
            }
        }
    }
    Err(ChatError::input(
        "continue_final_message",
        true,
        "found no text to continue in the final message",
    ))
}

/// A copy of the map `map` with `key` set (in place, or appended).
fn with_key(map: &Value, key: &str, value: Value) -> Value {
    let mut pairs: Vec<(Value, Value)> = match map.try_iter() {
        Ok(keys) => keys
            .map(|k| {
                let v = map.get_item(&k).unwrap_or_default();
                (k, v)
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    match pairs.iter_mut().find(|(k, _)| k.as_str() == Some(key)) {
        Some(p) => p.1 = value,
        None => pairs.push((Value::from(key), value)),
    }
    Value::from_pairs(pairs)
}

fn cut_at_tag(name: &str, rendered: String, final_text: &str) -> Result<String, ChatError> {
    let tag = py_strip(CONTINUE_TAG);
    if !rendered.contains(py_strip(final_text)) || !rendered.contains(tag) {
        return Err(ChatError::Render {
            template: name.to_string(),
            line: None,
            message:
                "continue_final_message: the final message does not appear in the rendered chat"
                    .into(),
        });
    }
    let at = rendered.rfind(tag).expect("contains the tag");
    if rendered[at..].starts_with(CONTINUE_TAG) {
        Ok(rendered[..at].to_string())
    } else {
        Ok(rendered[..at].trim_end_matches(py_is_space).to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(src: &str) -> ChatTemplate {
        ChatTemplate::from_source(src, &[("bos_token".into(), "<s>".into())]).unwrap()
    }

    fn conv(pairs: &[(&str, &str)]) -> Vec<Message> {
        pairs.iter().map(|(r, c)| Message::new(r, c)).collect()
    }

    /// `src` rendered over `pairs` with the default options.
    fn render(src: &str, pairs: &[(&str, &str)]) -> Result<String, ChatError> {
        t(src).render(&conv(pairs), &RenderOptions::default())
    }

    #[test]
    fn trim_and_lstrip_blocks_as_transformers() {
        let src = "{{ bos_token }}\n{% for m in messages %}\n    {% if m.role == 'user' %}\nU:{{ m.content }}\n    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}A:{% endif %}\n";
        let r = t(src)
            .render(
                &conv(&[("user", "hi")]),
                &RenderOptions {
                    add_generation_prompt: true,
                    ..Default::default()
                },
            )
            .unwrap();
        // Jinja2 with trim_blocks + lstrip_blocks, no trailing newline kept.
        assert_eq!(r, "<s>\nU:hi\nA:");
    }

    #[test]
    fn python_methods_and_whitespace() {
        let r = render("{{ messages[0].content.strip() }}|{{ messages[0].content | trim }}|{{ messages[0].content.split('b')[-1].lstrip('x') }}|{{ messages[0].content.startswith('\\x1f') }}", &[("user", "\u{1f} axbxxc \u{85}")])
            .unwrap();
        assert_eq!(r, "axbxxc|axbxxc|c \u{85}|True");
    }

    #[test]
    fn values_print_as_python_prints_them() {
        // Jinja2 prints str(x): None, True, ['a', 1], {'k': 1.5}; `~` and |string too.
        let r = render("{{ none }}|{{ true }}|{{ ['a', 1] }}|{{ {'k': 1.5} }}|{{ 'x' ~ none }}|{{ false|string }}|{{ 2.0 }}", &[("user", "x")])
            .unwrap();
        assert_eq!(r, "None|True|['a', 1]|{'k': 1.5}|xNone|False|2.0");
    }

    #[test]
    fn raise_exception_names_the_line() {
        let e = render("line one\n{% if messages|length > 1 %}\n{{ raise_exception('Roles must alternate') }}\n{% endif %}", &[("user", "a"), ("user", "b")])
            .unwrap_err();
        assert_eq!(
            e,
            ChatError::Raised {
                template: "default".into(),
                line: Some(3),
                message: "Roles must alternate".into()
            }
        );
        assert_eq!(
            e.to_string(),
            "chat template 'default' line 3: raise_exception: Roles must alternate"
        );
    }

    #[test]
    fn syntax_and_render_errors_name_the_line() {
        let e = ChatTemplate::from_source("ok\n{% for %}", &[]).unwrap_err();
        assert!(
            matches!(&e, ChatError::Syntax { line: Some(2), .. }),
            "{e:?}"
        );
        let e = render("a\nb\n{{ messages[0].missing.deeper }}", &[("user", "x")]).unwrap_err();
        assert!(
            matches!(&e, ChatError::Render { line: Some(3), .. }),
            "{e:?}"
        );
    }

    #[test]
    fn endless_templates_run_out_of_fuel() {
        let e = render(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            &[("user", "x")],
        )
        .unwrap_err();
        assert!(e.to_string().contains("fuel"), "{e}");
    }

    #[test]
    fn hostile_templates_are_clean_errors_within_the_budget() {
        // Issue 42's probes: before, aborts on 4 GB allocations, stack overflows, 2.5 GiB.
        for (src, want) in [
            ("{% set l = range(100000)|list %}{{ l|tojson(separators=(' ' * 1000000, ':')) }}", "render budget"),
            ("{% set l = range(100000)|list %}{{ l|tojson(indent=' ' * 1000000) }}", "render budget"),
            ("{% set ns = namespace(a=1) %}{% set ns.me = ns %}{{ ns }}", "namespace cannot hold a namespace"),
            ("{% set ns = namespace(a=1) %}{% set ns.l = [ns] %}{{ ns }}", "namespace cannot hold a namespace"),
            ("{% set ns = namespace(a=[]) %}{% for i in range(1000) %}{% set ns.a = [ns.a] %}{% endfor %}{{ ns.a }}", "nest at most"),
            ("{{ '%999999999s'|format('x') }}", "render budget"),
            ("{{ '{:>999999999}'.format('x') }}", "render budget"),
            ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}", "render budget"),
            ("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l|length }}", "render budget"),
            ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "render budget"),
        ] {
            let t0 = std::time::Instant::now();
            let e = render(src, &[("user", "x")]).expect_err(src);
            assert!(e.to_string().contains(want), "{src}: {e}");
            assert!(t0.elapsed().as_secs() < 20, "{src}: {:?}", t0.elapsed());
        }
        // The output bound, on a small budget.
        let mut small = t("{% for i in range(1000) %}0123456789{% endfor %}");
        small.set_budget(RenderBudget {
            max_output: 5000,
            ..RenderBudget::default()
        });
        let e = small
            .render(&conv(&[("user", "x")]), &RenderOptions::default())
            .unwrap_err();
        assert!(matches!(e, ChatError::TooLong { limit: 5000, .. }), "{e}");
        // Namespaces still work as templates use them.
        let r = render("{% set ns = namespace(n=0, l=[], d={}) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% set ns.l = ns.l + [m.role] %}{% endfor %}{% set ns.d, x = {'k': messages}, 1 %}{{ ns.n }}{{ ns.l }}{{ ns.d.k[0].content }}", &[("user", "a"), ("assistant", "b")]).unwrap();
        assert_eq!(r, "2['user', 'assistant']a");
    }

    #[test]
    fn generation_tags_render_their_body() {
        assert_eq!(
            rewrite_generation_tags("a{%- generation %}b{% endgeneration -%} c{% if x %}"),
            "a{%- if true %}b{% endif -%} c{% if x %}"
        );
        // A `%}` overlapping the `{%` (found by the chat_render fuzz target: it panicked).
        for src in ["{%}", "x{%}{% generation %}", "{%-}", "{%"] {
            let _ = rewrite_generation_tags(src);
        }
        assert_eq!(rewrite_generation_tags("{%}"), "{%}");
        let r = render("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}", &[("assistant", "x")])
            .unwrap();
        assert_eq!(r, "[x]");
    }

    #[test]
    fn kwargs_override_specials_and_strftime_uses_the_given_clock() {
        let mut o = RenderOptions {
            now: chrono::NaiveDate::from_ymd_opt(2024, 7, 26).and_then(|d| d.and_hms_opt(9, 5, 0)),
            ..Default::default()
        };
        o.set("bos_token", "<B>");
        let r = t("{{ bos_token }} {{ strftime_now('%d %b %Y %H:%M') }} {{ tools is none }} {{ enable_thinking is defined }}")
            .render(&conv(&[("user", "x")]), &o)
            .unwrap();
        assert_eq!(r, "<B> 26 Jul 2024 09:05 True False");
        let e = t("{{ strftime_now('%Q') }}")
            .render(&conv(&[("user", "x")]), &o)
            .unwrap_err();
        assert!(e.to_string().contains("strftime_now"), "{e}");
    }

    #[test]
    fn named_templates_are_picked_as_transformers_does() {
        let sec = ChatSection {
            templates: vec![
                crate::format::mlt_chat::NamedTemplate {
                    name: "default".into(),
                    source: "D".into(),
                },
                crate::format::mlt_chat::NamedTemplate {
                    name: "tool_use".into(),
                    source: "T{{ tools is none }}".into(),
                },
            ],
            ..Default::default()
        };
        let ct = ChatTemplate::new(&sec).unwrap();
        let m = conv(&[("user", "x")]);
        assert_eq!(ct.render(&m, &RenderOptions::default()).unwrap(), "D");
        let with_tools = RenderOptions {
            tools: Some(Value::from(vec![Value::from(1)])),
            ..Default::default()
        };
        assert_eq!(ct.render(&m, &with_tools).unwrap(), "TFalse");
        let named = RenderOptions {
            template: Some("tool_use".into()),
            ..Default::default()
        };
        assert_eq!(ct.render(&m, &named).unwrap(), "TTrue");
        let given = RenderOptions {
            template: Some("G{{ messages | length }}".into()),
            ..Default::default()
        };
        assert_eq!(ct.render(&m, &given).unwrap(), "G1");
        let only_rag = ChatTemplate::new(&ChatSection {
            templates: vec![crate::format::mlt_chat::NamedTemplate {
                name: "rag".into(),
                source: "R".into(),
            }],
            ..Default::default()
        })
        .unwrap();
        assert!(matches!(
            only_rag.render(&m, &RenderOptions::default()),
            Err(ChatError::NoTemplate { .. })
        ));
    }

    #[test]
    fn continue_final_message_cuts_after_the_content() {
        let ct = t("{% for m in messages %}<{{ m.role }}>{{ m.content }}</end>\n{% endfor %}");
        let o = RenderOptions {
            continue_final_message: true,
            ..Default::default()
        };
        let r = ct
            .render(&conv(&[("user", "q"), ("assistant", "The answer is")]), &o)
            .unwrap();
        assert_eq!(r, "<user>q</end>\n<assistant>The answer is");
        assert!(ct.render(&[], &RenderOptions::default()).is_err());
        // A list of parts: the last text part is continued.
        let parts = crate::chat::conversation::Conversation::from_json(
            r#"{"messages": [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b c"}]}]}"#,
        )
        .unwrap();
        let r = t("{% for p in messages[0].content %}{{ p.text }}|{% endfor %}")
            .render(&parts.messages, &o)
            .unwrap();
        assert_eq!(r, "a||b c");
    }
}
