//! `mlb-run --chat`: a [`ChatSession`] driven from the command line.
//!
//! - Interactive ([`ChatRunOptions::interactive`]: a terminal, or `--interactive`): turns are
//!   read line by line through the [`RunFrontend`] (the binary edits them with rustyline
//!   and keeps a history, [`default_history_file`]); a line ending in `\` continues on
//!   the next; the [`COMMANDS`] start with `/`. Errors of a turn (a full context, a
//!   template that raises) are one line and the chat goes on.
//! - One turn (`--prompt TEXT`): the system prompt (`--system`) and one user message.
//! - A conversation (`--file FILE` or a pipe on stdin): the JSON of `mlb-inspect --chat`,
//!   `{"messages": [...], ...}` (its other keys are template variables; with
//!   `"continue_final_message": true` the final assistant message is continued). The
//!   generation prompt is always added otherwise.
//!
//! The reply streams to stdout and ends with a newline; notes (a context shift, a reply
//! cut by the context) and `--logprobs` lines go to stderr.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::Instant;

use super::error::RunError;
use super::frontend::RunFrontend;
use super::input::read_text;
use super::options::{ChatRunOptions, PromptSource, RunOptions};
use super::report::{logprobs_json, note_verbose, peak_rss_kib, GenerationSummary, Outcome};
use crate::chat::{Conversation, Message, RenderOptions};
use crate::session::{
    ChatEvent, ChatSession, ChatSessionError, ChatSessionOptions, Engine, GenerateOptions, Reply,
    StopReason, DEFAULT_CHAT_MAX_TOKENS,
};

/// The interactive chat's commands and what they do.
pub const COMMANDS: &[(&str, &str)] = &[
    ("/help", "list these commands"),
    (
        "/reset",
        "start the conversation over (the system prompt stays)",
    ),
    (
        "/undo",
        "take back the last turn (your message and the reply)",
    ),
    (
        "/system [TEXT]",
        "set the system prompt (none without TEXT); the conversation stays",
    ),
    ("/exit", "end the chat (also /quit, or Ctrl-D)"),
];

/// Where the interactive chat keeps its history: `$XDG_STATE_HOME/krafla/chat_history`,
/// else `$HOME/.local/state/krafla/chat_history` (`None` without either).
pub fn default_history_file() -> Option<PathBuf> {
    let var = |k| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let state = var("XDG_STATE_HOME")
        .filter(|p| p.is_absolute())
        .or_else(|| var("HOME").map(|h| h.join(".local/state")))?;
    Some(state.join("krafla").join("chat_history"))
}

/// Running totals for the summary.
#[derive(Default)]
struct Totals {
    prompt_tokens: usize,
    prompt_secs: f64,
    generated: usize,
    gen_secs: f64,
    stop: Option<StopReason>,
}

/// Runs the chat mode of mlb-run (`o.chat` is set); called by [`super::run`] with the
/// loaded engine.
pub(super) fn run(
    o: &RunOptions,
    c: &ChatRunOptions,
    engine: &Engine,
    fe: &mut dyn RunFrontend,
    load_secs: f64,
) -> Result<Outcome, RunError> {
    let mut render = RenderOptions::default();
    let mut messages = Vec::new();
    if let Some(s) = &c.system {
        messages.push(Message::new("system", s));
    }
    if !c.interactive {
        match &o.prompt {
            PromptSource::Text(t) => messages.push(Message::new("user", t)),
            PromptSource::Ids(_) => unreachable!("refused by RunOptions::validate"),
            PromptSource::File(_) | PromptSource::Stdin => {
                let conv = read_conversation(o)?;
                if c.system.is_some() && conv.messages.first().is_some_and(|m| m.role() == "system")
                {
                    return Err(RunError::BadOption {
                        name: "--system",
                        value: c.system.clone().unwrap_or_default(),
                        rule: "the conversation already starts with a system message",
                    });
                }
                messages.extend(conv.messages);
                render = conv.options;
            }
        }
    }
    let opts = ChatSessionOptions {
        generate: GenerateOptions {
            max_tokens: o.n_predict.unwrap_or(DEFAULT_CHAT_MAX_TOKENS),
            sampling: o.sampler_options(),
            ignore_eos: o.ignore_eos,
            stop_ids: Vec::new(),
            stop_strings: o.stop_strings.clone(),
        },
        render,
        context_shift: c.context_shift,
    };
    let model = o.model.session_options(o.batch.max(1));
    let mut chat = ChatSession::new(engine, &model, opts).map_err(RunError::Chat)?;
    for m in messages {
        chat.push(m);
    }
    if o.verbose {
        note_verbose(engine, chat.session().ctx(), &model, load_secs, fe)?;
    }
    let mut totals = Totals::default();
    if c.interactive {
        interactive(o, &mut chat, fe, &mut totals)?;
    } else {
        turn(o, &mut chat, fe, &mut totals, None)?;
    }
    let s = chat.session();
    Ok(Outcome::Generated(GenerationSummary {
        prompt_tokens: totals.prompt_tokens,
        prompt_secs: totals.prompt_secs,
        generated: totals.generated,
        gen_secs: totals.gen_secs,
        stop: totals.stop.unwrap_or(StopReason::Cancelled),
        peak_rss_kib: peak_rss_kib(),
        kv_bytes: s.state().kv_bytes(),
        ctx: s.ctx(),
        delta_bytes: s.state().delta_bytes(),
        spec: None,
    }))
}

/// The conversation JSON of `--file` or stdin.
fn read_conversation(o: &RunOptions) -> Result<Conversation, RunError> {
    let (what, file) = match &o.prompt {
        PromptSource::File(f) => (f.display().to_string(), Some(f.as_path())),
        _ => ("stdin".to_string(), None),
    };
    let text = read_text(file)?;
    Conversation::from_json(&text).map_err(|e| RunError::Conversation { what, err: e })
}

/// One reply: the user's message (if given) and the generation, streamed to `fe`.
/// In the interactive chat `cancel` polls Ctrl-C.
fn turn(
    o: &RunOptions,
    chat: &mut ChatSession,
    fe: &mut dyn RunFrontend,
    totals: &mut Totals,
    user: Option<&str>,
) -> Result<Reply, RunError> {
    let engine = chat.session().engine();
    let ctx = chat.session().ctx();
    let shift = chat.options().context_shift;
    let mut failed = None;
    let start = Instant::now();
    // The first prompt's time is the prompt's; the rest (the reply, and any prefill
    // after a context shift) the generation's.
    let mut first_prompt = None;
    let on = |ev: ChatEvent<'_>| {
        match ev {
            ChatEvent::Prompt(p) => {
                totals.prompt_tokens += p.fed;
                first_prompt.get_or_insert(start.elapsed().as_secs_f64());
                if p.dropped > 0 {
                    fe.info(&format!(
                        "mlb-run: context full ({ctx} positions): dropped the {} oldest messages, prefilled {} tokens again",
                        p.dropped, p.fed
                    ));
                }
            }
            ChatEvent::Token(step) => {
                if let (Some(_), Some(lp)) = (o.logprobs, &step.logprobs) {
                    fe.info(&logprobs_json(engine, step.id, lp));
                }
                if let Err(e) = fe.text(&step.text) {
                    failed = Some(e);
                    return ControlFlow::Break(());
                }
                if fe.interrupted() {
                    return ControlFlow::Break(());
                }
            }
            ChatEvent::Tail(s) => {
                if let Err(e) = fe.text(s) {
                    failed = Some(e);
                }
            }
        }
        ControlFlow::Continue(())
    };
    let r = match user {
        Some(text) => chat.say(text, on),
        None => chat.respond(on),
    };
    if let Some(e) = failed {
        return Err(RunError::Stdout(e));
    }
    let reply = r.map_err(RunError::Chat)?;
    fe.text("\n").map_err(RunError::Stdout)?;
    let total = start.elapsed().as_secs_f64();
    let prompt_secs = first_prompt.unwrap_or(total);
    totals.prompt_secs += prompt_secs;
    totals.gen_secs += total - prompt_secs;
    totals.generated += reply.tokens.len();
    totals.stop = Some(reply.stop);
    match reply.stop {
        StopReason::ContextFull if shift => fe.info(&format!(
            "mlb-run: context full ({ctx} positions): the reply was cut (the last turn fills the context)"
        )),
        StopReason::ContextFull => fe.info(&format!(
            "mlb-run: context full ({ctx} positions): the reply was cut; --context-shift drops the oldest turns instead"
        )),
        StopReason::Cancelled if user.is_some() => fe.info("mlb-run: (reply stopped)"),
        _ => {}
    }
    Ok(reply)
}

/// The interactive loop: lines, commands, turns.
fn interactive(
    o: &RunOptions,
    chat: &mut ChatSession,
    fe: &mut dyn RunFrontend,
    totals: &mut Totals,
) -> Result<(), RunError> {
    let read = |fe: &mut dyn RunFrontend, prompt: &str| {
        fe.read_line(prompt).map_err(|err| RunError::Read {
            what: "stdin".into(),
            err,
        })
    };
    loop {
        let Some(mut line) = read(fe, "> ")? else {
            return Ok(());
        };
        // A line ending in a backslash goes on on the next one.
        while let Some(head) = line.strip_suffix('\\') {
            let head = head.to_string();
            match read(fe, ". ")? {
                Some(next) => line = format!("{head}\n{next}"),
                None => {
                    line = head;
                    break;
                }
            }
        }
        let text = line.trim();
        if text.is_empty() {
            continue;
        }
        if let Some(cmd) = text.strip_prefix('/') {
            let (name, arg) = cmd.split_once(char::is_whitespace).unwrap_or((cmd, ""));
            match name {
                "exit" | "quit" => return Ok(()),
                "reset" => {
                    chat.reset();
                    fe.info("(the conversation starts over)");
                }
                "undo" => match chat.undo() {
                    0 => fe.info("(nothing to take back)"),
                    _ => fe.info("(the last turn is taken back)"),
                },
                "system" => {
                    let arg = arg.trim();
                    chat.set_system((!arg.is_empty()).then_some(arg));
                    fe.info(if arg.is_empty() {
                        "(no system prompt)"
                    } else {
                        "(system prompt set)"
                    });
                }
                "help" => {
                    for (c, what) in COMMANDS {
                        fe.info(&format!("{c:16} {what}"));
                    }
                    fe.info("A line ending in \\ goes on on the next line; Ctrl-C stops a reply.");
                }
                _ => fe.info(&format!("unknown command /{name}: /help lists them")),
            }
            continue;
        }
        fe.interrupted();
        match turn(o, chat, fe, totals, Some(text)) {
            Ok(_) => {}
            Err(RunError::Chat(
                e @ (ChatSessionError::ContextFull { .. } | ChatSessionError::Chat(_)),
            )) => {
                fe.info(&format!("mlb-run: {e}"));
            }
            Err(e) => return Err(e),
        }
    }
}
