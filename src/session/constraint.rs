//! Constrained decoding: every sampled token must continue a text the request's
//! [`Grammar`] accepts (a JSON schema, any JSON object, a regex, a Lark or GBNF
//! grammar), so the finished text always parses.
//!
//! The engine is llguidance (the grammar compiler, Earley parser and lexer that
//! llama.cpp and vLLM use) over a token trie built from Krafla's own tokenizer: each
//! token's bytes as generation decodes them, added tokens marked as specials (a grammar
//! reaches them only by name, `<|im_end|>`, never by spelling them), and the engine's
//! stop ids as the end-of-sequence set, allowed exactly where the grammar accepts.
//!
//! Per step: `mask = allowed(state)`; `logits[t] = -inf` for every `t` not in `mask`;
//! sample `t`; `state = consume(state, t)`. The sample needs the mask, but the mask
//! needs only the previous token, so a batched server computes the next masks
//! ([`Constraint::prepare`]) on another thread while the forward pass runs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use llguidance::api::{GrammarWithLexer, TopLevelGrammar};
use llguidance::toktrie::{SimpleVob, TokRxInfo, TokTrie, TokenizerEnv, INVALID_TOKEN};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value as Json};

use super::engine::Engine;
use super::error::ConstraintError;
use super::gbnf;

/// JSON whitespace between tokens: at most one run, either up to 20 spaces or tabs,
/// or one or two line breaks and up to 20 spaces or tabs of indent (llama.cpp's JSON
/// grammars' bound), so a model cannot fill its context with blank lines.
pub const JSON_WHITESPACE: &str = r"[\x20\x09]{1,20}|[\x0A\x0D]{1,2}[\x20\x09]{0,20}";

/// The whitespace of a tool call's JSON: at most one space between tokens. The call
/// formats are one line (`{"name": "f", "arguments": {"a": 1}}`, as the templates show
/// them), and a model given the room of [`JSON_WHITESPACE`] at each of a call's dozen
/// gaps can spend its length on indentation before the call closes.
pub const CALL_WHITESPACE: &str = r"\x20";

/// What the generated text must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// Any JSON object.
    JsonObject,
    /// A JSON value valid under this schema. `strict`: a keyword the engine cannot
    /// enforce refuses the schema (else it is ignored).
    JsonSchema { schema: Json, strict: bool },
    /// A regular expression (Rust `regex` syntax) the whole text matches.
    Regex(String),
    /// llguidance's Lark syntax (`start: ...`; `%json {...}` embeds a schema).
    Lark(String),
    /// llama.cpp's GBNF (`root ::= ...`), translated to Lark ([`gbnf`]).
    Gbnf(String),
    /// A Lark grammar around another one, which it names `@body` ([`BODY`]): a reply
    /// whose answer alone is in the client's format (harmony's final channel).
    Framed { frame: String, body: Box<Grammar> },
}

/// The name a [`Grammar::Framed`] frame gives its body.
pub const BODY: &str = "body";

impl Grammar {
    /// Its kind, as errors name it.
    pub fn kind(&self) -> &'static str {
        match self {
            Grammar::JsonObject => "json_object",
            Grammar::JsonSchema { .. } => "json_schema",
            Grammar::Regex(_) => "regex",
            Grammar::Lark(_) => "lark",
            Grammar::Gbnf(_) => "gbnf",
            // Errors are the body's (the client's grammar); the frame is ours.
            Grammar::Framed { body, .. } => body.kind(),
        }
    }

    /// A grammar text: GBNF when it reads as GBNF ([`gbnf::looks_like_gbnf`]), else Lark.
    pub fn from_text(text: &str) -> Grammar {
        if gbnf::looks_like_gbnf(text) {
            Grammar::Gbnf(text.to_string())
        } else {
            Grammar::Lark(text.to_string())
        }
    }

    /// llguidance's description of it.
    fn top_level(&self) -> Result<TopLevelGrammar, ConstraintError> {
        Ok(match self {
            Grammar::JsonObject => TopLevelGrammar::from_json_schema(with_json_options(
                json!({"type": "object"}),
                true,
            )),
            Grammar::JsonSchema { schema, strict } => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(ConstraintError::Grammar {
                        kind: self.kind(),
                        message: "a JSON schema must be an object (or true/false)".into(),
                    });
                }
                TopLevelGrammar::from_json_schema(with_json_options(schema.clone(), *strict))
            }
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Grammar::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
            Grammar::Gbnf(text) => {
                TopLevelGrammar::from_lark(gbnf::to_lark(text).map_err(|e| {
                    ConstraintError::Grammar {
                        kind: "gbnf",
                        message: e.to_string(),
                    }
                })?)
            }
            Grammar::Framed { frame, body } => {
                let mut grammars = vec![GrammarWithLexer::from_lark(frame.clone())];
                for mut g in body.top_level()?.grammars {
                    // The body's own grammar is the first; its name is the frame's
                    // reference (the frame's is "lark_grammar", so they never clash).
                    if grammars.len() == 1 {
                        g.name = Some(BODY.to_string());
                    }
                    grammars.push(g);
                }
                TopLevelGrammar {
                    grammars,
                    max_tokens: None,
                }
            }
        })
    }
}

/// llguidance's JSON options (a schema's `x-guidance`): whitespace bounded by
/// [`JSON_WHITESPACE`]; `strict`: a keyword the engine cannot enforce is an error
/// (else it is ignored).
pub fn json_options(strict: bool) -> Json {
    json!({
        "whitespace_pattern": JSON_WHITESPACE,
        "lenient": !strict,
    })
}

/// llguidance's JSON options for a tool call's JSON: [`CALL_WHITESPACE`], keywords the
/// engine cannot enforce ignored (a tool's schema is the client's, written for OpenAI).
pub fn call_json_options() -> Json {
    json!({
        "whitespace_pattern": CALL_WHITESPACE,
        "lenient": true,
    })
}

/// The schema with [`json_options`] unless it sets its own (`x-guidance`).
fn with_json_options(mut schema: Json, strict: bool) -> Json {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance")
            .or_insert_with(|| json_options(strict));
    }
    schema
}

/// Longest engine message given out (a Lark error quotes the grammar's line).
const MAX_MESSAGE: usize = 600;

/// An llguidance error as a client may read it: without the engine's markers and the
/// backtrace of a panic it caught, at most [`MAX_MESSAGE`] bytes.
fn engine_message(e: impl std::fmt::Display) -> String {
    let full = e.to_string();
    let mut m = full.as_str();
    for marker in ["\n<backtrace>", "\n<non-verbose/>", "\n<state>"] {
        if let Some(at) = m.find(marker) {
            m = &m[..at];
        }
    }
    let m = m.trim_end();
    if m.len() <= MAX_MESSAGE {
        return m.to_string();
    }
    let mut end = MAX_MESSAGE;
    while !m.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &m[..end])
}

/// The tokenizer as llguidance sees it: the trie, and Krafla's encoder for the text a
/// grammar forces (so forced text is tokenized as the model would write it).
struct TokenEnv {
    engine: Arc<Engine>,
    trie: TokTrie,
}

impl TokenizerEnv for TokenEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        if let (Some(tok), Ok(text)) = (self.engine.tokenizer(), std::str::from_utf8(s)) {
            let ids = tok.encode_fragment(text);
            // Normalization (NFC) or a byte without a token would change the bytes.
            if self.trie.decode_raw(&ids) == s {
                return ids;
            }
        }
        self.trie.greedy_tokenize(s)
    }
}

/// Lexer states one grammar may build (1–2 kB each: this bounds a request's memory at
/// about 100 MB; llguidance's default is 250,000). The other budgets are llguidance's
/// defaults, counts rather than clock time, so a grammar fails the same way on any
/// machine: 1,000,000 units of lexer fuel to compile (about 20 ms), 200,000 per mask
/// (about 15 ms) and 50,000 Earley items per mask, 500,000 grammar symbols, 50,000
/// schema nodes. A grammar over budget at compile time is a 400; one that runs out
/// while generating ends its request with a 400 (or a stream's error event).
pub const MAX_LEXER_STATES: usize = 50_000;

/// The grammar compiler for one engine's tokenizer: made once (the trie and the
/// engine's token classes), then [`Grammars::compile`] per request. `Send + Sync`.
pub struct Grammars {
    factory: ParserFactory,
    vocab: usize,
}

impl Grammars {
    /// Builds the trie of `engine`'s tokenizer; `stop_ids` end a generation where the
    /// grammar accepts (the ids the generator stops at).
    pub fn new(engine: Arc<Engine>, stop_ids: &[u32]) -> Result<Grammars, ConstraintError> {
        let tok = engine.tokenizer().ok_or(ConstraintError::NoTokenizer)?;
        let vocab = engine.config().vocab.max(tok.n_vocab());
        let mut words = vec![Vec::new(); vocab];
        for (id, w) in words.iter_mut().enumerate().take(tok.n_vocab()) {
            let id = id as u32;
            if tok.is_added(id) {
                w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                w.extend_from_slice(tok.token_bytes(id).unwrap_or_default());
            } else {
                tok.piece(id, w);
            }
        }
        let mut stops: Vec<u32> = stop_ids
            .iter()
            .copied()
            .filter(|&id| (id as usize) < vocab)
            .collect();
        stops.sort_unstable();
        stops.dedup();
        let info = TokRxInfo::new(
            vocab as u32,
            stops.first().copied().unwrap_or(INVALID_TOKEN),
        );
        let mut trie = TokTrie::from(&info, &words);
        if stops.len() > 1 {
            trie = trie.with_eos_tokens(&stops);
        }
        let env: llguidance::toktrie::TokEnv = Arc::new(TokenEnv { engine, trie });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| ConstraintError::Engine {
            message: e.to_string(),
        })?;
        factory.quiet();
        let limits = factory.limits_mut();
        limits.verbose_errors = false;
        limits.max_lexer_states = MAX_LEXER_STATES;
        Ok(Grammars { factory, vocab })
    }

    /// Token ids the grammar's masks cover (the model's vocabulary, or the tokenizer's
    /// if larger).
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Whether the tokenizer has `text` as one added (special) token, which a Lark
    /// grammar names as `<text>`.
    pub fn has_special(&self, text: &str) -> bool {
        self.factory
            .tok_env()
            .tok_trie()
            .get_special_token(text)
            .is_some()
    }

    /// Compiles `g` and computes its first mask: a grammar that does not compile, or
    /// allows no first token, is refused here (the request's 400), not mid-generation.
    pub fn compile(&self, g: &Grammar) -> Result<Constraint, ConstraintError> {
        let top = g.top_level()?;
        let bad = |message: String| ConstraintError::Grammar {
            kind: g.kind(),
            message,
        };
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| bad(engine_message(e)))?;
        let mut c = Constraint {
            matcher: Matcher::new(Ok(parser)),
            pending: None,
            mask: None,
            error: None,
            masks: 0,
            time: Duration::ZERO,
        };
        c.prepare();
        match c.error.take() {
            Some(e) => Err(bad(e)),
            None => Ok(c),
        }
    }
}

/// One generation's grammar state: the mask for its next token, and the last sampled
/// token until the state has consumed it.
pub struct Constraint {
    matcher: Matcher,
    /// Sampled, not yet consumed by the matcher.
    pending: Option<u32>,
    /// The allowed tokens of the next step, once computed.
    mask: Option<SimpleVob>,
    /// The matcher failed (kept: the next sample reports it).
    error: Option<String>,
    /// Masks computed, and the time spent consuming tokens and computing them.
    masks: usize,
    time: Duration,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("pending", &self.pending)
            .field("ready", &self.mask.is_some())
            .field("error", &self.error)
            .finish()
    }
}

impl Constraint {
    /// Consumes the last sampled token and computes the next mask, unless done. Runs
    /// while the model computes the logits it will mask (another thread may call it).
    pub fn prepare(&mut self) {
        if self.error.is_some() || (self.pending.is_none() && self.mask.is_some()) {
            return;
        }
        let t0 = Instant::now();
        if let Some(id) = self.pending.take() {
            if let Err(e) = self.matcher.consume_token(id) {
                self.error = Some(engine_message(e));
                return;
            }
        }
        match self.matcher.compute_mask_or_eos() {
            Ok(m) => self.mask = Some(m),
            Err(e) => self.error = Some(engine_message(e)),
        }
        self.masks += 1;
        self.time += t0.elapsed();
    }

    /// Whether [`Constraint::prepare`] has work to do.
    pub fn needs_prepare(&self) -> bool {
        self.error.is_none() && (self.pending.is_some() || self.mask.is_none())
    }

    /// Sets every logit the grammar does not allow next to −∞ (preparing first if
    /// that has not been done).
    pub fn mask_logits(&mut self, logits: &mut [f32]) -> Result<(), ConstraintError> {
        self.prepare();
        if let Some(e) = &self.error {
            return Err(ConstraintError::Mask { message: e.clone() });
        }
        let mask = self.mask.take().expect("prepared");
        if mask.is_zero() {
            return Err(ConstraintError::Mask {
                message: "no token may come next (the grammar is complete and the model has no stop token)".into(),
            });
        }
        let words = mask.as_slice();
        for (i, chunk) in logits.chunks_mut(32).enumerate() {
            let w = words.get(i).copied().unwrap_or(0);
            if w == u32::MAX {
                continue;
            }
            for (b, l) in chunk.iter_mut().enumerate() {
                if w >> b & 1 == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        Ok(())
    }

    /// Records the sampled token (consumed at the next [`Constraint::prepare`]).
    pub fn commit(&mut self, id: u32) {
        self.pending = Some(id);
        self.mask = None;
    }

    /// Masks computed and the time spent on them (consuming tokens included).
    pub fn stats(&self) -> (usize, Duration) {
        (self.masks, self.time)
    }

    /// Whether the text so far is complete under the grammar.
    pub fn accepting(&mut self) -> bool {
        self.prepare();
        self.error.is_none() && self.matcher.is_accepting().unwrap_or(false)
    }
}
