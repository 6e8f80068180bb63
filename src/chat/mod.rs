//! Chat: templates that turn a conversation into the model's prompt, and the stop
//! set that ends a generated turn.
//!
//! The `.mlt` carries the model's chat templates, the special-token strings they read
//! and the stop set (`crate::format::mlt_chat`). This module renders them as
//! transformers' `apply_chat_template` does (`template`, `pyjson`), and tokenizes the
//! text as `apply_chat_template(tokenize=True)` does: the special tokens in the text
//! are matched as added tokens, and **no BOS is added** (transformers encodes with
//! `add_special_tokens=False`; templates that want BOS write `{{ bos_token }}`).
//!
//! ```no_run
//! use krafla::chat::{Chat, Message, RenderOptions};
//! use krafla::format::mlt::Mlt;
//! use krafla::tokenizer::Tokenizer;
//! let mlt = Mlt::load("smollm2.mlt".as_ref())?;
//! let tok = Tokenizer::from_mlt(&mlt)?;
//! let chat = Chat::from_mlt(&mlt)?.expect("the tokenizer has a chat template");
//! let opts = RenderOptions { add_generation_prompt: true, ..Default::default() };
//! let ids = chat.encode(&tok, &[Message::new("user", "Hi!")], &opts)?;
//! // generate until chat.stop().is_stop(id) ...
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod budget;
pub mod calls;
pub mod capture;
pub mod conversation;
pub mod error;
pub mod harmony;
pub mod pyjson;
pub mod stop;
pub mod template;
pub mod tools;

pub use budget::RenderBudget;
pub use conversation::{Conversation, Message, RenderOptions};
pub use error::ChatError;
pub use minijinja::Value;
pub use stop::StopSet;
pub use template::ChatTemplate;

use crate::format::mlt::Mlt;
use crate::tokenizer::Tokenizer;

/// A tokenizer's chat templates with its stop set: what a chat front end needs.
#[derive(Debug)]
pub struct Chat {
    template: ChatTemplate,
    stop: StopSet,
}

impl Chat {
    /// The file's chat, if it has a chat section; its templates compiled.
    pub fn from_mlt(m: &Mlt) -> Result<Option<Chat>, ChatError> {
        let Some(section) = &m.chat else {
            return Ok(None);
        };
        Ok(Some(Chat {
            template: ChatTemplate::new(section)?,
            stop: StopSet::from_mlt(m),
        }))
    }

    /// A chat from parts (e.g. a template given on the command line).
    pub fn new(template: ChatTemplate, stop: StopSet) -> Chat {
        Chat { template, stop }
    }

    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    pub fn stop(&self) -> &StopSet {
        &self.stop
    }

    pub fn stop_mut(&mut self) -> &mut StopSet {
        &mut self.stop
    }

    /// What one rendering may cost.
    pub fn set_budget(&mut self, budget: RenderBudget) {
        self.template.set_budget(budget);
    }

    /// The prompt text of a conversation.
    pub fn render(&self, messages: &[Message], opts: &RenderOptions) -> Result<String, ChatError> {
        self.template.render(messages, opts)
    }

    /// The prompt ids of a conversation: rendered, then encoded without adding BOS.
    pub fn encode(
        &self,
        tok: &Tokenizer,
        messages: &[Message],
        opts: &RenderOptions,
    ) -> Result<Vec<u32>, ChatError> {
        Ok(encode_rendered(tok, &self.render(messages, opts)?))
    }
}

/// Encodes rendered chat text as transformers' `apply_chat_template(tokenize=True)`:
/// added tokens matched in the text, no BOS prepended.
pub fn encode_rendered(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.encode_with(text, false)
}
