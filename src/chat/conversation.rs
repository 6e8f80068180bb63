//! Conversations: messages and the options of one rendering, as transformers'
//! `apply_chat_template` takes them.
//!
//! A message is a JSON object with a string `role`; every key is passed to the template
//! as given and in the given order (`content` as a string or a list of parts,
//! `tool_calls`, `reasoning_content`, ...). Before rendering, transformers drops the keys
//! whose value is null and copies a message's reasoning (`reasoning_content`,
//! `thinking` or `reasoning`, the first non-null) to both `thinking` and
//! `reasoning_content`; [`Message::normalized`] does the same.

use super::error::ChatError;
use minijinja::value::ValueKind;
use minijinja::Value;

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    fields: Vec<(String, Value)>,
}

const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

impl Message {
    /// A message with a role and text content.
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            fields: vec![
                ("role".into(), Value::from(role)),
                ("content".into(), Value::from(content)),
            ],
        }
    }

    /// A message from a template value (a map with a string `role`).
    pub fn from_value(v: &Value, field: &str) -> Result<Message, ChatError> {
        if v.kind() != ValueKind::Map {
            return Err(ChatError::input(
                field,
                v,
                "a message must be a JSON object",
            ));
        }
        let mut fields = Vec::new();
        for key in v
            .try_iter()
            .map_err(|e| ChatError::input(field, v, e.to_string()))?
        {
            let Some(k) = key.as_str() else {
                return Err(ChatError::input(field, &key, "keys must be strings"));
            };
            let val = v.get_item(&key).unwrap_or_default();
            fields.push((k.to_string(), val));
        }
        let m = Message { fields };
        if m.get("role").and_then(|r| r.as_str().map(|_| ())).is_none() {
            return Err(ChatError::input(
                format!("{field}.role"),
                m.get("role").cloned().unwrap_or_default(),
                "every message needs a string role",
            ));
        }
        Ok(m)
    }

    /// The value of a key, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.fields.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Sets a key (replacing its value in place, or appending it).
    pub fn set(&mut self, key: &str, value: Value) {
        match self.fields.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.fields.push((key.to_string(), value)),
        }
    }

    pub fn role(&self) -> &str {
        self.get("role").and_then(Value::as_str).unwrap_or("")
    }

    /// The content when it is a string.
    pub fn content(&self) -> Option<&str> {
        self.get("content").and_then(Value::as_str)
    }

    /// The message as transformers hands it to the template: null keys dropped, the
    /// reasoning aliased (`{"thinking": r, **message, "reasoning_content": r}`).
    pub fn normalized(&self) -> Message {
        let mut fields: Vec<(String, Value)> = self
            .fields
            .iter()
            .filter(|(_, v)| !v.is_none())
            .cloned()
            .collect();
        let reasoning = REASONING_FIELDS.iter().find_map(|name| {
            fields
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        });
        if let Some(r) = reasoning {
            // "thinking" comes first, keeping the message's own value if it has one.
            let thinking = match fields.iter().position(|(k, _)| k == "thinking") {
                Some(i) => fields.remove(i).1,
                None => r.clone(),
            };
            fields.insert(0, ("thinking".into(), thinking));
            let mut m = Message { fields };
            m.set("reasoning_content", r);
            return m;
        }
        Message { fields }
    }

    /// The message as a template value (a map in key order).
    pub fn to_value(&self) -> Value {
        Value::from_pairs(self.fields.iter().map(|(k, v)| (k.as_str(), v.clone())))
    }
}

/// How one conversation is rendered (transformers' `apply_chat_template` arguments).
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    /// Append the header of an assistant turn for the model to fill.
    pub add_generation_prompt: bool,
    /// Leave the final message open (no end-of-turn after it) so the model continues
    /// it; cannot be used with `add_generation_prompt`.
    pub continue_final_message: bool,
    /// A template name of the file, or a whole template source (as transformers'
    /// `chat_template` argument); `None`: `tool_use` when tools are given and the file
    /// has it, else `default`.
    pub template: Option<String>,
    /// Tool schemas (`tools`); the template sees none when absent.
    pub tools: Option<Value>,
    /// Documents for retrieval templates (`documents`).
    pub documents: Option<Value>,
    /// Other template variables (`enable_thinking`, `date_string`, ...), in order;
    /// they override the file's special-token strings of the same name.
    pub kwargs: Vec<(String, Value)>,
    /// The time `strftime_now` formats; `None`: the local clock.
    pub now: Option<chrono::NaiveDateTime>,
}

impl RenderOptions {
    /// Sets a template variable (replacing an earlier value of the same name).
    pub fn set(&mut self, name: &str, value: impl Into<Value>) {
        let value = value.into();
        match self.kwargs.iter_mut().find(|(k, _)| k == name) {
            Some(slot) => slot.1 = value,
            None => self.kwargs.push((name.to_string(), value)),
        }
    }
}

/// A conversation and its options, e.g. read from the JSON of `mlb-inspect --chat`.
#[derive(Debug, Clone, Default)]
pub struct Conversation {
    pub messages: Vec<Message>,
    pub options: RenderOptions,
}

/// Keys of the conversation JSON that are options, not template variables.
const OPTION_KEYS: [&str; 6] = [
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "tools",
    "documents",
    "chat_template",
];

impl Conversation {
    /// Parses `{"messages": [...], "add_generation_prompt": true, "tools": [...],
    /// "chat_template": NAME, ...}`; every other key is a template variable (e.g.
    /// `"enable_thinking": false`). Key order is kept, as Python's dicts keep it.
    pub fn from_json(text: &str) -> Result<Conversation, ChatError> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| ChatError::input("conversation", "", format!("not JSON: {e}")))?;
        Conversation::from_value(&v)
    }

    /// The same from a template value (a map, e.g. one element of a JSON list read as
    /// a [`Value`], which keeps key order).
    pub fn from_value(v: &Value) -> Result<Conversation, ChatError> {
        if v.kind() != ValueKind::Map {
            return Err(ChatError::input(
                "conversation",
                v.kind(),
                "must be a JSON object with a \"messages\" list",
            ));
        }
        let item = |k: &str| v.get_item(&Value::from(k)).unwrap_or_default();
        let msgs = item("messages");
        if msgs.kind() != ValueKind::Seq {
            return Err(ChatError::input(
                "messages",
                msgs.kind(),
                "must be a list of message objects",
            ));
        }
        let mut messages = Vec::new();
        for (i, m) in msgs
            .try_iter()
            .map_err(|e| ChatError::input("messages", "", e.to_string()))?
            .enumerate()
        {
            messages.push(Message::from_value(&m, &format!("messages[{i}]"))?);
        }
        let flag = |k: &str| -> Result<bool, ChatError> {
            let x = item(k);
            match x.kind() {
                ValueKind::Undefined | ValueKind::None => Ok(false),
                ValueKind::Bool => Ok(x.is_true()),
                _ => Err(ChatError::input(k, &x, "must be true or false")),
            }
        };
        let some = |k: &str| Some(item(k)).filter(|x| !x.is_undefined() && !x.is_none());
        let mut options = RenderOptions {
            add_generation_prompt: flag("add_generation_prompt")?,
            continue_final_message: flag("continue_final_message")?,
            tools: some("tools"),
            documents: some("documents"),
            ..RenderOptions::default()
        };
        if let Some(t) = some("chat_template") {
            match t.as_str() {
                Some(s) => options.template = Some(s.to_string()),
                None => return Err(ChatError::input("chat_template", &t, "must be a string")),
            }
        }
        for key in v
            .try_iter()
            .map_err(|e| ChatError::input("conversation", "", e.to_string()))?
        {
            let Some(k) = key.as_str() else { continue };
            if !OPTION_KEYS.contains(&k) {
                options.kwargs.push((k.to_string(), item(k)));
            }
        }
        Ok(Conversation { messages, options })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(m: &Message) -> Vec<&str> {
        m.fields.iter().map(|(k, _)| k.as_str()).collect()
    }

    #[test]
    fn parse_keeps_order_and_kwargs() {
        let c = Conversation::from_json(
            r#"{"messages": [{"role": "user", "z": 1, "content": "hi", "a": null}],
                "add_generation_prompt": true, "enable_thinking": false, "tools": null}"#,
        )
        .unwrap();
        assert!(c.options.add_generation_prompt);
        assert!(c.options.tools.is_none());
        assert_eq!(c.options.kwargs.len(), 1);
        assert_eq!(c.options.kwargs[0].0, "enable_thinking");
        assert_eq!(keys(&c.messages[0]), ["role", "z", "content", "a"]);
        assert_eq!(keys(&c.messages[0].normalized()), ["role", "z", "content"]);
    }

    #[test]
    fn refusals_name_the_field() {
        for (json, field) in [
            ("[]", "conversation"),
            (r#"{"messages": {}}"#, "messages"),
            (r#"{"messages": [1]}"#, "messages[0]"),
            (r#"{"messages": [{"content": "x"}]}"#, "messages[0].role"),
            (
                r#"{"messages": [], "add_generation_prompt": 1}"#,
                "add_generation_prompt",
            ),
            (r#"{"messages": [], "chat_template": 3}"#, "chat_template"),
        ] {
            match Conversation::from_json(json) {
                Err(ChatError::Input { field: f, .. }) => assert_eq!(f, field, "{json}"),
                other => panic!("{json}: {other:?}"),
            }
        }
    }

    #[test]
    fn reasoning_is_aliased_as_transformers_does() {
        let c = Conversation::from_json(
            r#"{"messages": [{"role": "assistant", "content": "x", "reasoning": "r"}]}"#,
        )
        .unwrap();
        let n = c.messages[0].normalized();
        assert_eq!(
            keys(&n),
            [
                "thinking",
                "role",
                "content",
                "reasoning",
                "reasoning_content"
            ]
        );
        assert_eq!(n.get("thinking").unwrap().as_str(), Some("r"));
        assert_eq!(n.get("reasoning_content").unwrap().as_str(), Some("r"));
    }
}
