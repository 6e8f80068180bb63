//! [`Engine`]: what every session of a model shares, loaded once: the mapped file, the
//! packed weights, the [`Model`] that borrows them, the tokenizer and its chat section
//! (templates and stop set).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use self_cell::self_cell;

use super::error::SessionError;
use crate::chat::{Chat, StopSet};
use crate::format::mlb::Mlb;
use crate::format::mlt::Mlt;
use crate::format::FormatError;
use crate::kernels::{self, HalfActs};
use crate::model::forward::DEFAULT_BATCH;
use crate::model::{BatchScratch, Config, Model, Packs, SlotMemory, StateOptions};
use crate::tokenizer::Tokenizer;

/// Where the tokenizer comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerSource {
    /// The `.mlt` of the same name beside the model, if there is one.
    Beside,
    /// This file (it must load).
    File(PathBuf),
    /// None: ids in, ids out.
    None,
}

/// How [`Engine::load`] loads a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadOptions {
    pub model: PathBuf,
    pub tokenizer: TokenizerSource,
    /// Pack the matrices for the active kernel tier's packed kernels (same results,
    /// faster where the tier has them; see docs/kernels.md, "Packed weights").
    pub pack: bool,
    /// What the model's BF16 matrices multiply: f32 activations (exact products, the
    /// default) or activations rounded to BF16 (docs/kernels.md, "BF16 activations").
    pub half_acts: HalfActs,
}

impl LoadOptions {
    /// `model` with the tokenizer beside it, packed.
    pub fn new(model: impl Into<PathBuf>) -> LoadOptions {
        LoadOptions {
            model: model.into(),
            tokenizer: TokenizerSource::Beside,
            pack: true,
            half_acts: HalfActs::F32,
        }
    }
}

/// The file and the packed copies that the model borrows.
struct Files {
    mlb: Mlb,
    packs: Packs,
}

self_cell!(
    struct Loaded {
        owner: Files,
        #[covariant]
        dependent: Model,
    }
);

/// Tells engines apart, so that a snapshot is only restored into a session of its own.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A loaded model and its tokenizer: shared, read-only, by every
/// [`Session`](super::Session) made from it (`Send + Sync`: sessions on several threads may share one engine).
pub struct Engine {
    loaded: Loaded,
    tokenizer: Option<Tokenizer>,
    /// The `.mlt`'s chat templates and stop set, when it has a chat section.
    chat: Option<Chat>,
    id: u64,
    /// The buffers of batched steps ([`super::feed_batch`]), made on first use.
    batch: Mutex<Batch>,
}

/// The batched steps' buffers and the most tokens a step runs in one pass.
struct Batch {
    scratch: Option<BatchScratch>,
    budget: usize,
}

impl Engine {
    /// Maps and validates the model, packs it (with `pack`), loads the tokenizer.
    pub fn load(o: &LoadOptions) -> Result<Engine, SessionError> {
        let mlb = Mlb::open(&o.model).map_err(SessionError::Format)?;
        let packs = if o.pack {
            Packs::new(&mlb, &kernels::kernels()).map_err(SessionError::Format)?
        } else {
            Packs::none()
        };
        let (path, explicit) = match &o.tokenizer {
            TokenizerSource::Beside => (o.model.with_extension("mlt"), false),
            TokenizerSource::File(p) => (p.clone(), true),
            TokenizerSource::None => (PathBuf::new(), false),
        };
        let mut engine = Engine::new(mlb, packs, None)?;
        engine
            .loaded
            .with_dependent_mut(|_, m| m.set_half_acts(o.half_acts));
        if !(explicit || (o.tokenizer == TokenizerSource::Beside && path.exists())) {
            return Ok(engine);
        }
        let (tokenizer, chat) = load_tokenizer(&path).map_err(SessionError::Tokenizer)?;
        let mut engine = engine.with_tokenizer(Some(tokenizer), Some(&path))?;
        engine.chat = chat;
        Ok(engine)
    }

    /// An engine over an opened file and its packed copies (e.g. an in-memory file in
    /// tests, with [`Packs::none`]), without a tokenizer.
    pub fn new(
        mlb: Mlb,
        packs: Packs,
        tokenizer: Option<Tokenizer>,
    ) -> Result<Engine, SessionError> {
        let loaded = Loaded::try_new(Files { mlb, packs }, |f| {
            Model::with_packs(&f.mlb, &f.packs)
        })
        .map_err(SessionError::Model)?;
        Engine {
            loaded,
            tokenizer: None,
            chat: None,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            batch: Mutex::new(Batch {
                scratch: None,
                budget: DEFAULT_BATCH,
            }),
        }
        .with_tokenizer(tokenizer, None)
    }

    /// Sets the tokenizer, refusing one with more tokens than the model's vocabulary.
    fn with_tokenizer(
        mut self,
        tokenizer: Option<Tokenizer>,
        path: Option<&Path>,
    ) -> Result<Engine, SessionError> {
        if let Some(t) = &tokenizer {
            let vocab = self.config().vocab;
            if t.n_vocab() > vocab {
                return Err(SessionError::TokenizerTooLarge {
                    path: path.map(Path::to_path_buf),
                    n_vocab: t.n_vocab(),
                    vocab,
                });
            }
        }
        self.tokenizer = tokenizer;
        Ok(self)
    }

    pub fn model(&self) -> &Model<'_> {
        self.loaded.borrow_dependent()
    }

    pub fn config(&self) -> &Config {
        &self.model().cfg
    }

    /// The validated file (also for [`Mlb::check_unchanged`]).
    pub fn mlb(&self) -> &Mlb {
        &self.loaded.borrow_owner().mlb
    }

    /// Bytes of the packed copies (0 when nothing was packed).
    pub fn packed_bytes(&self) -> usize {
        self.loaded.borrow_owner().packs.bytes()
    }

    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    /// Sets the chat templates and stop set (e.g. built in memory in tests; [`Engine::load`]
    /// takes them from the `.mlt`). Their ids must be below the model's vocabulary.
    pub fn with_chat(mut self, chat: Option<Chat>) -> Result<Engine, SessionError> {
        let vocab = self.config().vocab;
        if let Some(id) = chat
            .iter()
            .flat_map(|c| c.stop().ids())
            .find(|&id| id as usize >= vocab)
        {
            return Err(SessionError::BadOption {
                name: "stop id",
                value: id.to_string(),
                rule: "not below the model's vocab",
            });
        }
        self.chat = chat;
        Ok(self)
    }

    /// The chat templates and stop set of the tokenizer, when its `.mlt` has a chat
    /// section (`mlt-convert` writes one when the checkpoint has a template).
    pub fn chat(&self) -> Option<&Chat> {
        self.chat.as_ref()
    }

    /// The stop set: the `.mlt`'s (its EOS, generation_config.json's `eos_token_id`, the
    /// templates' end-of-turn tokens, `mlt-convert --stop-token`) and the tokenizer's
    /// EOS. Empty without a tokenizer.
    pub fn stop_set(&self) -> StopSet {
        let mut s = self
            .chat
            .as_ref()
            .map(|c| c.stop().clone())
            .unwrap_or_default();
        if let Some(eos) = self.tokenizer.as_ref().and_then(Tokenizer::eos) {
            s.add_id(eos, crate::format::mlt_chat::STOP_EOS);
        }
        s
    }

    /// The ids that end a generation ([`Engine::stop_set`]), in increasing order. With
    /// no tokenizer, or one that names no EOS and has no chat section, the set is empty
    /// and generation stops only at its length or a full context (no id is guessed: in
    /// byte-level vocabularies a small id such as 2 is an ordinary token).
    pub fn stop_ids(&self) -> Vec<u32> {
        self.stop_set().ids().collect()
    }

    /// The BOS id when the tokenizer puts one before every text it encodes.
    pub fn bos_added(&self) -> Option<u32> {
        let t = self.tokenizer.as_ref()?;
        t.bos().filter(|b| t.encode("").first() == Some(b))
    }

    /// `text` as ids (with the BOS the tokenizer adds, if any).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, SessionError> {
        let t = self.tokenizer.as_ref().ok_or(SessionError::NoTokenizer)?;
        Ok(t.encode(text))
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The memory one session with `opts` takes (a server prints it for its slots):
    /// KV caches (per position and in all), delta states, step buffers.
    pub fn slot_memory(&self, opts: &StateOptions) -> Result<SlotMemory, SessionError> {
        Ok(self.model().slot_memory(opts)?)
    }

    /// Allocates the buffers of batched steps ([`super::feed_batch`]) now, for steps
    /// of up to `tokens` tokens (a longer step runs as several passes over the
    /// weights; [`DEFAULT_BATCH`] without this call) and sessions of up to `ctx`
    /// positions (`None`: the default context). Returns their bytes. Without this call
    /// they are made at the first batched step and grown when a step needs more.
    pub fn reserve_batch(&self, tokens: usize, ctx: Option<usize>) -> Result<u128, SessionError> {
        let bs = self.model().batch_scratch(tokens, ctx)?;
        let bytes = self
            .model()
            .batch_scratch_bytes(bs.tokens(), bs.ctx())
            .unwrap_or(u128::MAX);
        let mut b = self.batch.lock().unwrap_or_else(|p| p.into_inner());
        b.budget = bs.tokens();
        b.scratch = Some(bs);
        Ok(bytes)
    }

    /// Runs `f` with the model and the batch buffers, made (or grown) for `tokens`
    /// tokens (at most the budget) and contexts of `ctx`.
    pub(super) fn with_batch<R>(
        &self,
        tokens: usize,
        ctx: usize,
        f: impl FnOnce(&Model<'_>, &mut BatchScratch) -> R,
    ) -> Result<R, SessionError> {
        let mut b = self.batch.lock().unwrap_or_else(|p| p.into_inner());
        let want = tokens.min(b.budget).max(1);
        let fits = b
            .scratch
            .as_ref()
            .is_some_and(|s| s.tokens() >= want && s.ctx() >= ctx);
        if !fits {
            let (t, c) = match &b.scratch {
                Some(s) => (s.tokens().max(want), s.ctx().max(ctx)),
                None => (want, ctx),
            };
            // The old buffers go first: both need not fit at once.
            b.scratch = None;
            b.scratch = Some(self.model().batch_scratch(t, Some(c))?);
        }
        let bs = b.scratch.as_mut().expect("made above");
        Ok(f(self.model(), bs))
    }
}

/// The tokenizer of an `.mlt` file and its chat section's templates, compiled.
fn load_tokenizer(path: &Path) -> Result<(Tokenizer, Option<Chat>), FormatError> {
    let mlt = Mlt::load(path)?;
    let tok = Tokenizer::from_mlt(&mlt).map_err(|e| e.in_file(path))?;
    let chat = Chat::from_mlt(&mlt)
        .map_err(|e| FormatError::format("chat", "", e.to_string()).in_file(path))?;
    Ok((tok, chat))
}
