//! Typed errors of chat templates and conversations.

use std::fmt;

/// Why a conversation could not be rendered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatError {
    /// The template does not compile (a syntax minijinja does not accept).
    Syntax {
        template: String,
        line: Option<usize>,
        message: String,
    },
    /// The template called `raise_exception(message)`.
    Raised {
        template: String,
        line: Option<usize>,
        message: String,
    },
    /// Rendering failed (an undefined attribute, a type error, a bad strftime format ...).
    Render {
        template: String,
        line: Option<usize>,
        message: String,
    },
    /// Rendering ran out of its budget (fuel, output size, depth: `chat::budget`).
    Budget {
        template: String,
        line: Option<usize>,
        message: String,
    },
    /// The rendered text would exceed the render budget's output size.
    TooLong { template: String, limit: usize },
    /// No template of that name (or none at all).
    NoTemplate {
        name: String,
        available: Vec<String>,
    },
    /// The conversation or an option is not what a template can take.
    Input {
        field: String,
        value: String,
        rule: String,
    },
}

impl ChatError {
    pub(crate) fn input(
        field: impl Into<String>,
        value: impl fmt::Display,
        rule: impl Into<String>,
    ) -> ChatError {
        let mut value = value.to_string();
        if value.len() > 120 {
            let mut end = 117;
            while !value.is_char_boundary(end) {
                end -= 1;
            }
            value.truncate(end);
            value.push_str("...");
        }
        ChatError::Input {
            field: field.into(),
            value,
            rule: rule.into(),
        }
    }
}

fn at(f: &mut fmt::Formatter<'_>, template: &str, line: &Option<usize>) -> fmt::Result {
    write!(f, "chat template '{template}'")?;
    if let Some(l) = line {
        write!(f, " line {l}")?;
    }
    Ok(())
}

impl fmt::Display for ChatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChatError::Syntax {
                template,
                line,
                message,
            } => {
                at(f, template, line)?;
                write!(f, ": does not compile: {message}")
            }
            ChatError::Raised {
                template,
                line,
                message,
            } => {
                at(f, template, line)?;
                write!(f, ": raise_exception: {message}")
            }
            ChatError::Render {
                template,
                line,
                message,
            } => {
                at(f, template, line)?;
                write!(f, ": {message}")
            }
            ChatError::Budget {
                template,
                line,
                message,
            } => {
                at(f, template, line)?;
                write!(f, ": over its render budget: {message}")
            }
            ChatError::TooLong { template, limit } => write!(
                f,
                "chat template '{template}': the rendered text exceeds {limit} bytes (the render budget's output size)"
            ),
            ChatError::NoTemplate { name, available } if available.is_empty() => {
                write!(f, "no chat template '{name}': the tokenizer has none")
            }
            ChatError::NoTemplate { name, available } => write!(
                f,
                "no chat template '{name}' (available: {})",
                available.join(", ")
            ),
            ChatError::Input { field, value, rule } => write!(f, "{field} = {value}: {rule}"),
        }
    }
}

impl std::error::Error for ChatError {}
