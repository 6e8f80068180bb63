//! [`ChatSession`]: a conversation over one [`Session`], turn after turn, prefilling
//! only what is new.
//!
//! Each turn renders the whole conversation with the tokenizer's chat template (as
//! transformers' `apply_chat_template(tokenize=True)` does: [`crate::chat::Chat::encode`])
//! and syncs the session to those ids:
//!
//! 1. `p = session.common_prefix(ids)` (at most `len − 1`: the last id is fed again when
//!    everything is held, for its logits);
//! 2. [`Session::rewind`] to `p`: free for attention layers, else through the latest
//!    snapshot at or before `p` (linear-attention state and wrapped rings cannot be
//!    rewound in place), else from the start;
//! 3. feed `ids[p..]`, taking snapshots on the way at the end of the system prompt, at
//!    the end of the conversation without the generation prompt, and at the end.
//!
//! So the logits are bit for bit those of a fresh prefill of the rendered conversation,
//! however the template renders earlier turns again (a reply's text may tokenize to
//! other ids than those sampled; Qwen3 drops earlier turns' thinking, and with
//! `enable_thinking=false` the empty think block of the generation prompt: the common
//! prefix then ends at the previous turn's generation prompt, where a snapshot was taken).
//! The reply's last sampled id (its end-of-turn token) is not fed; the next rendering
//! brings it with the new turn.
//!
//! Context: a rendered conversation must leave room in the context (one position, or
//! with `context_shift` a quarter of the context or `max_tokens`, whichever is smaller).
//! If it does not, without `context_shift` the turn is refused
//! ([`ChatSessionError::ContextFull`]); with it the oldest turns after the system
//! messages are dropped (a turn: a user message and what follows it up to the next user
//! message) until it fits, and the rest is prefilled again. A reply that fills the
//! context is cut there (`StopReason::ContextFull`), or with `context_shift` continued
//! after dropping the oldest turns: the partial reply is rendered as the final message
//! with `continue_final_message` and the generation goes on from it.

use std::ops::ControlFlow;

use super::engine::Engine;
use super::error::{ChatSessionError, SessionError};
use super::generate::{GenerateOptions, Generator, Step, StopReason};
use super::sequence::{Session, Snapshot};
use crate::chat::{Chat, ChatError, Message, RenderOptions};
use crate::model::StateOptions;
use crate::tokenizer::Tokenizer;

/// Most snapshots kept besides the one at the end of the system prompt.
const TURN_SNAPSHOTS: usize = 2;

/// How a [`ChatSession`] renders and generates.
#[derive(Debug, Clone)]
pub struct ChatSessionOptions {
    /// Each reply's generation: `max_tokens` per reply, sampling, stop strings. The
    /// engine's stop set (end-of-turn tokens) ends a reply unless `ignore_eos`.
    pub generate: GenerateOptions,
    /// Template name and variables (`enable_thinking`, `tools`, ...).
    /// `add_generation_prompt` and `continue_final_message` are set per rendering.
    pub render: RenderOptions,
    /// Drop the oldest turns when the context is full instead of refusing.
    pub context_shift: bool,
}

impl Default for ChatSessionOptions {
    fn default() -> Self {
        ChatSessionOptions {
            generate: GenerateOptions {
                max_tokens: DEFAULT_CHAT_MAX_TOKENS,
                ..GenerateOptions::default()
            },
            render: RenderOptions::default(),
            context_shift: false,
        }
    }
}

/// The default most tokens of one reply.
pub const DEFAULT_CHAT_MAX_TOKENS: usize = 1024;

/// How a turn's prompt went into the session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptInfo {
    /// Ids of the rendered conversation.
    pub tokens: usize,
    /// Leading ids the session already held and kept.
    pub reused: usize,
    /// Ids run through the model for it (those after `reused`, and any fed again
    /// from a snapshot to reach `reused`).
    pub fed: usize,
    /// Messages the context shift dropped for it.
    pub dropped: usize,
    /// It continues a reply cut by the context (rendered with
    /// `continue_final_message`).
    pub continued: bool,
}

/// What a reply shows as it is made.
#[derive(Debug)]
pub enum ChatEvent<'a> {
    /// The prompt is in the session; sampling starts (again after a context shift).
    Prompt(&'a PromptInfo),
    /// A sampled token and the text it completes.
    Token(&'a Step),
    /// Text no token gave out when a generation ends ([`Generation::tail`](super::Generation::tail)).
    Tail(&'a str),
}

/// A finished reply (also appended to the conversation as an assistant message).
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// Its text (after any `continue_final_message` prefix of the conversation).
    pub text: String,
    /// Every sampled id, a stop id included.
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    /// Its prompts: one, and one more for each context shift during the reply.
    pub prompts: Vec<PromptInfo>,
}

/// Whether a message is part of the system prompt that the context shift keeps.
fn is_system(m: &Message) -> bool {
    matches!(m.role(), "system" | "developer")
}

/// A conversation with a model: its messages, the session holding their prompt, the
/// snapshots that make going back cheap.
pub struct ChatSession<'e> {
    session: Session<'e>,
    chat: &'e Chat,
    tok: &'e Tokenizer,
    opts: ChatSessionOptions,
    messages: Vec<Message>,
    /// Snapshots: at the end of the system prompt first (when `has_sys`), then those at
    /// the ends of recent prompts, oldest first.
    snaps: Vec<Snapshot>,
    has_sys: bool,
}

impl<'e> ChatSession<'e> {
    /// A new conversation over `engine` (which needs a tokenizer with a chat section),
    /// its session sized by `model`.
    pub fn new(
        engine: &'e Engine,
        model: &StateOptions,
        opts: ChatSessionOptions,
    ) -> Result<ChatSession<'e>, ChatSessionError> {
        let tok = engine.tokenizer().ok_or(SessionError::NoTokenizer)?;
        let chat = engine.chat().ok_or(ChatSessionError::NoTemplate)?;
        Generator::new(engine, opts.generate.clone())?;
        Ok(ChatSession {
            session: engine.session(model)?,
            chat,
            tok,
            opts,
            messages: Vec::new(),
            snaps: Vec::new(),
            has_sys: false,
        })
    }

    /// The session holding the conversation's prompt.
    pub fn session(&self) -> &Session<'e> {
        &self.session
    }

    pub fn options(&self) -> &ChatSessionOptions {
        &self.opts
    }

    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// Adds a message (a user's turn, a system prompt, a whole conversation read from a
    /// file); the next [`ChatSession::respond`] renders it.
    pub fn push(&mut self, m: Message) {
        self.messages.push(m);
    }

    /// Sets the system prompt: replaces the leading system messages with this one (none
    /// with `None`), keeping the rest of the conversation.
    pub fn set_system(&mut self, text: Option<&str>) {
        let n = self.messages.iter().take_while(|m| is_system(m)).count();
        self.messages
            .splice(..n, text.map(|t| Message::new("system", t)));
    }

    /// Forgets the conversation after the system messages (the session keeps its
    /// state: the next turn reuses the system prompt's ids).
    pub fn reset(&mut self) {
        let n = self.messages.iter().take_while(|m| is_system(m)).count();
        self.messages.truncate(n);
    }

    /// Removes the last user message and everything after it; returns how many
    /// messages went.
    pub fn undo(&mut self) -> usize {
        let n = self.messages.len();
        match self.messages.iter().rposition(|m| m.role() == "user") {
            Some(i) => {
                self.messages.truncate(i);
                n - i
            }
            None => 0,
        }
    }

    /// Adds a user message and generates the reply ([`ChatSession::respond`]).
    pub fn say(
        &mut self,
        text: &str,
        on: impl FnMut(ChatEvent<'_>) -> ControlFlow<()>,
    ) -> Result<Reply, ChatSessionError> {
        self.push(Message::new("user", text));
        let r = self.respond(on);
        if r.is_err() && self.messages.last().is_some_and(|m| m.role() == "user") {
            // The turn did not happen: the conversation stays as it was.
            self.messages.pop();
        }
        r
    }

    /// The conversation's ids: with the generation prompt, or, after `open` (an
    /// assistant message being written), with that message left open for the model to
    /// continue (`continue_final_message`).
    pub fn render(&self, open: Option<&Message>) -> Result<Vec<u32>, ChatSessionError> {
        let mut msgs = self.messages.clone();
        let mut ro = self.opts.render.clone();
        ro.add_generation_prompt = open.is_none();
        ro.continue_final_message = open.is_some();
        msgs.extend(open.cloned());
        Ok(self.chat.encode(self.tok, &msgs, &ro)?)
    }

    /// The ids of `msgs` rendered without a generation prompt, if the template can.
    fn render_plain(&self, msgs: &[Message]) -> Option<Vec<u32>> {
        let ro = RenderOptions {
            add_generation_prompt: false,
            continue_final_message: false,
            ..self.opts.render.clone()
        };
        self.chat.encode(self.tok, msgs, &ro).ok()
    }

    /// Positions worth a snapshot in `ids`: the end of the system prompt and the end of
    /// the conversation before what the generation prompt or an open final message
    /// adds. Each is the common prefix of `ids` with a rendering of fewer messages (a
    /// template that cannot render those gives none).
    fn marks(&self, ids: &[u32]) -> (Option<usize>, Option<usize>) {
        let common = |other: Vec<u32>| ids.iter().zip(&other).take_while(|(a, b)| a == b).count();
        let n_sys = self.messages.iter().take_while(|m| is_system(m)).count();
        let sys = (n_sys > 0)
            .then(|| self.render_plain(&self.messages[..n_sys]))
            .flatten()
            .map(common)
            .filter(|&p| p > 0);
        let stable = self
            .render_plain(&self.messages)
            .map(common)
            .filter(|&p| p > 0);
        (sys, stable)
    }

    /// Positions to keep free for a reply of at most `left` tokens: one, or with the
    /// context shift a quarter of the context at most.
    fn room(&self, left: usize) -> usize {
        match self.opts.context_shift {
            true => left.min(self.session.ctx() / 4).max(1),
            false => 1,
        }
    }

    /// The final assistant message to continue, when `continue_final_message` is set.
    fn continues(&self) -> bool {
        self.opts.render.continue_final_message
            && self
                .messages
                .last()
                .is_some_and(|m| m.role() == "assistant")
    }

    /// Puts the next reply's prompt into the session: renders the conversation (with the
    /// generation prompt, or with its final assistant message open when
    /// `continue_final_message` is set), makes room with the context shift, and syncs
    /// the session to it, prefilling only what it does not hold. The session's logits
    /// are then those of a fresh prefill of the rendered ids. [`ChatSession::respond`]
    /// does this first (for free when nothing changed since).
    pub fn prefill(&mut self) -> Result<PromptInfo, ChatSessionError> {
        let room = self.room(self.opts.generate.max_tokens);
        if !self.continues() {
            return self.prompt(None, room);
        }
        let open = self.messages.pop();
        let r = self.prompt(open.as_ref(), room);
        self.messages.extend(open);
        r
    }

    /// Renders the conversation (with `open` after it, if given), drops the oldest turns
    /// while it does not leave `room` positions (with the context shift), and syncs the
    /// session to it.
    fn prompt(
        &mut self,
        open: Option<&Message>,
        room: usize,
    ) -> Result<PromptInfo, ChatSessionError> {
        let ctx = self.session.ctx();
        let mut dropped = 0;
        let ids = loop {
            let ids = self.render(open)?;
            if ids.len() + room <= ctx {
                break ids;
            }
            let full = ChatSessionError::ContextFull {
                tokens: ids.len(),
                room,
                ctx,
                shift: self.opts.context_shift,
            };
            if !self.opts.context_shift {
                return Err(full);
            }
            match self.drop_oldest_turn() {
                0 => return Err(full),
                n => dropped += n,
            }
        };
        if ids.is_empty() {
            return Err(
                ChatError::input("messages", "", "the chat template rendered no tokens").into(),
            );
        }
        let (sys, stable) = self.marks(&ids);
        let (reused, fed) = self.sync(&ids, sys, stable)?;
        Ok(PromptInfo {
            tokens: ids.len(),
            reused,
            fed,
            dropped,
            continued: open.is_some(),
        })
    }

    /// Drops the first turn after the system messages: the messages up to the next
    /// user message. Keeps the last user message and what follows it. Returns how many
    /// messages went (0: nothing left to drop).
    fn drop_oldest_turn(&mut self) -> usize {
        let a = self.messages.iter().take_while(|m| is_system(m)).count();
        let Some(last_user) = self.messages.iter().rposition(|m| m.role() == "user") else {
            return 0;
        };
        if last_user <= a {
            return 0;
        }
        let b = (a + 1..=last_user)
            .find(|&i| self.messages[i].role() == "user")
            .unwrap_or(last_user);
        self.messages.drain(a..b);
        b - a
    }

    /// Brings the session to `ids` (see the module docs); returns (reused, fed).
    fn sync(
        &mut self,
        ids: &[u32],
        sys: Option<usize>,
        stable: Option<usize>,
    ) -> Result<(usize, usize), ChatSessionError> {
        let n = ids.len();
        let held = self.session.common_prefix(ids);
        if held == n && self.session.pos() == n && self.session.logits().is_some() {
            return Ok((n, 0));
        }
        let p = held.min(n - 1);
        let refed = self.session.rewind(p, &self.snaps)?;
        let mut at = p;
        let mut cuts: Vec<(usize, bool)> = [sys.map(|s| (s, true)), stable.map(|s| (s, false))]
            .into_iter()
            .flatten()
            .filter(|&(m, _)| m > p && m < n)
            .collect();
        cuts.sort_unstable();
        cuts.push((n, false));
        for (m, is_sys) in cuts {
            if m <= at {
                continue;
            }
            self.session.feed(&ids[at..m])?;
            at = m;
            self.keep(self.session.snapshot(), is_sys);
        }
        Ok((p, refed + (n - p)))
    }

    /// Keeps a snapshot: the one at the end of the system prompt replaces the last such,
    /// others push out the oldest beyond [`TURN_SNAPSHOTS`].
    fn keep(&mut self, snap: Snapshot, is_sys: bool) {
        let first = usize::from(self.has_sys);
        if is_sys {
            match self.has_sys {
                true => self.snaps[0] = snap,
                false => self.snaps.insert(0, snap),
            }
            self.has_sys = true;
            return;
        }
        self.snaps.push(snap);
        if self.snaps.len() - first > TURN_SNAPSHOTS {
            self.snaps.remove(first);
        }
    }

    /// Bytes held by the snapshots.
    pub fn snapshot_bytes(&self) -> usize {
        self.snaps.iter().map(Snapshot::bytes).sum()
    }

    /// Generates the assistant's reply to the conversation and appends it. With
    /// `render.continue_final_message` and a final assistant message, continues that
    /// message instead (the reply's text is what follows it). `on` sees the prompt, each
    /// token and the tail as they come, and may end the reply (`StopReason::Cancelled`).
    pub fn respond(
        &mut self,
        mut on: impl FnMut(ChatEvent<'_>) -> ControlFlow<()>,
    ) -> Result<Reply, ChatSessionError> {
        let info = self.prefill()?;
        let _ = on(ChatEvent::Prompt(&info));
        // The message being written: the final one continued, or a new one.
        let existing = self.continues();
        let mut open = match existing {
            true => self
                .messages
                .pop()
                .unwrap_or_else(|| Message::new("assistant", "")),
            false => Message::new("assistant", ""),
        };
        let start = open.content().unwrap_or("").to_string();
        let mut reply = Reply {
            text: String::new(),
            tokens: Vec::new(),
            stop: StopReason::Length,
            prompts: vec![info],
        };
        let go = self.opts.generate.clone();
        let mut left = go.max_tokens;
        let result = loop {
            let opts = GenerateOptions {
                max_tokens: left,
                ..go.clone()
            };
            let g = match self
                .session
                .generate(&opts, |step| on(ChatEvent::Token(step)))
            {
                Ok(g) => g,
                Err(e) => break Err(e.into()),
            };
            if !g.tail.is_empty() {
                let _ = on(ChatEvent::Tail(&g.tail));
            }
            reply.text.push_str(&g.text);
            reply.tokens.extend_from_slice(&g.tokens);
            reply.stop = g.stop;
            left -= g.tokens.len();
            if g.stop != StopReason::ContextFull || !self.opts.context_shift || left == 0 {
                break Ok(());
            }
            // Cut by the context: drop the oldest turns and go on from the partial reply.
            open.set("content", format!("{start}{}", reply.text).into());
            let room = self.room(left);
            match self.prompt(Some(&open), room) {
                Ok(info) => {
                    let _ = on(ChatEvent::Prompt(&info));
                    reply.prompts.push(info);
                }
                Err(ChatSessionError::ContextFull { .. }) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        match result {
            Ok(()) => {
                open.set("content", format!("{start}{}", reply.text).into());
                self.messages.push(open);
                Ok(reply)
            }
            Err(e) => {
                if existing {
                    open.set("content", start.into());
                    self.messages.push(open);
                }
                Err(e)
            }
        }
    }
}
