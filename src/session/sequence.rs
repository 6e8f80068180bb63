//! [`Session`]: one sequence over an [`Engine`]: its state, its token history, its
//! logits; feeding, snapshots, truncation.

use super::engine::Engine;
use super::error::SessionError;
use crate::model::delta::DeltaState;
use crate::model::forward::{HiddenSink, LogitsSink};
use crate::model::kv::{KvBuf, LayerCache};
use crate::model::{State, StateOptions};

/// One sequence: its [`State`] (KV caches, linear-attention state, every buffer of a
/// forward pass), the ids it holds and the logits after the last one.
pub struct Session<'e> {
    engine: &'e Engine,
    state: State,
    /// The ids whose keys and values the full-attention caches hold, position by
    /// position. The sequence is `held[..pos]`; after a truncation the rest is still
    /// there, valid for the old sequence, so a snapshot taken before can come back.
    held: Vec<u32>,
    /// vocab: the logits after the last fed id (meaningful when `has_logits`).
    logits: Vec<f32>,
    has_logits: bool,
}

/// What a session's later positions overwrite, taken at one position: the
/// linear-attention layers' state and the sliding layers' rings, the ids and the
/// logits. The full-attention caches are not copied (a position's keys and values
/// depend only on the ids up to it and are never overwritten by later ones), so
/// [`Session::restore`] needs the session to still hold this snapshot's ids.
#[derive(Clone)]
pub struct Snapshot {
    engine: u64,
    ctx: usize,
    tokens: Vec<u32>,
    logits: Option<Vec<f32>>,
    /// Per layer: a sliding layer's ring (keys, values), when it can wrap.
    rings: Vec<Option<(KvBuf, KvBuf)>>,
    /// Per layer: a linear-attention layer's state.
    delta: Vec<Option<DeltaState>>,
}

impl Snapshot {
    /// The position it was taken at.
    pub fn pos(&self) -> usize {
        self.tokens.len()
    }

    /// The ids it holds.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Bytes it holds (rings, linear-attention state, ids, logits).
    pub fn bytes(&self) -> usize {
        let rings: usize = self
            .rings
            .iter()
            .flatten()
            .map(|(k, v)| k.bytes() + v.bytes())
            .sum();
        let delta: usize = self.delta.iter().flatten().map(DeltaState::bytes).sum();
        rings + delta + self.tokens.len() * 4 + self.logits.as_ref().map_or(0, |l| l.len() * 4)
    }
}

/// A sliding layer's ring can lose positions that an earlier position still sees.
fn wraps(c: &LayerCache, ctx: usize) -> bool {
    c.cap < ctx
}

impl<'e> Session<'e> {
    pub(crate) fn new(
        engine: &'e Engine,
        opts: &StateOptions,
    ) -> Result<Session<'e>, SessionError> {
        let state = engine.model().state(opts)?;
        Ok(Session {
            engine,
            state,
            held: Vec::new(),
            logits: vec![0.0; engine.config().vocab],
            has_logits: false,
        })
    }

    pub fn engine(&self) -> &'e Engine {
        self.engine
    }

    /// Positions held (the next id goes to this position).
    pub fn pos(&self) -> usize {
        self.state.pos()
    }

    /// Positions the session can hold.
    pub fn ctx(&self) -> usize {
        self.state.ctx()
    }

    /// The ids held, one per position.
    pub fn tokens(&self) -> &[u32] {
        &self.held[..self.pos()]
    }

    /// How many leading ids of `ids` the session already holds.
    pub fn common_prefix(&self, ids: &[u32]) -> usize {
        self.tokens()
            .iter()
            .zip(ids)
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// The logits after the last fed id: `None` before the first feed, after a
    /// truncation, and after a generation that ended without feeding its last token.
    pub fn logits(&self) -> Option<&[f32]> {
        self.has_logits.then_some(&self.logits[..])
    }

    /// The forward pass's state (memory figures, the imatrix observer).
    pub fn state(&self) -> &State {
        &self.state
    }

    pub fn state_mut(&mut self) -> &mut State {
        &mut self.state
    }

    /// Runs `ids` after what the session holds and returns the logits of the last.
    pub fn feed(&mut self, ids: &[u32]) -> Result<&[f32], SessionError> {
        self.feed_with(ids, None)
    }

    /// [`Session::feed`], passing every position's logits to `each` (position, logits).
    pub fn feed_with(
        &mut self,
        ids: &[u32],
        each: Option<LogitsSink>,
    ) -> Result<&[f32], SessionError> {
        // A model file truncated under the map would fault inside the pass.
        self.engine.mlb().check_unchanged()?;
        let p0 = self.pos();
        let last = self.engine.model().prefill(&mut self.state, ids, each)?;
        self.logits.copy_from_slice(last);
        self.fed(p0, ids);
        Ok(&self.logits)
    }

    /// Runs `ids` after what the session holds, passing the final hidden state (the
    /// classifier's input, `rmsnorm(x, final_norm)`: `dim` values) of the last id, or
    /// of every id with `every`, to `sink` with its position; no logits are computed
    /// (afterwards [`Session::logits`] is `None`). Embeddings pool these rows.
    pub fn feed_hidden(
        &mut self,
        ids: &[u32],
        every: bool,
        sink: HiddenSink,
    ) -> Result<(), SessionError> {
        self.engine.mlb().check_unchanged()?;
        let p0 = self.pos();
        self.engine
            .model()
            .prefill_hidden(&mut self.state, ids, every, sink)?;
        self.fed(p0, ids);
        self.has_logits = false;
        Ok(())
    }

    /// The state and the logits buffer, for a batched step ([`super::feed_batch`]).
    pub(super) fn step_parts(&mut self) -> (&mut State, &mut [f32]) {
        (&mut self.state, &mut self.logits)
    }

    /// After `ids` ran from position `p0` and their last logits are in place: the held
    /// ids and the logits as [`Session::feed`] leaves them.
    pub(super) fn fed(&mut self, p0: usize, ids: &[u32]) {
        self.has_logits = true;
        self.held.truncate(p0);
        self.held.extend_from_slice(ids);
    }

    /// Encodes `text` and feeds it; the tokenizer's BOS only at position 0.
    pub fn feed_text(&mut self, text: &str) -> Result<&[f32], SessionError> {
        let mut ids = self.engine.encode(text)?;
        if self.pos() > 0
            && ids
                .first()
                .is_some_and(|&f| Some(f) == self.engine.bos_added())
        {
            ids.remove(0);
        }
        self.feed(&ids)
    }

    /// Back to an empty sequence.
    pub fn reset(&mut self) {
        self.state.reset();
        self.held.clear();
        self.has_logits = false;
    }

    /// The state at this position (see [`Snapshot`]).
    pub fn snapshot(&self) -> Snapshot {
        let ctx = self.ctx();
        let (caches, delta) = self.state.layer_states();
        Snapshot {
            engine: self.engine.id(),
            ctx,
            tokens: self.tokens().to_vec(),
            logits: self.logits().map(<[f32]>::to_vec),
            rings: caches
                .iter()
                .map(|c| {
                    c.as_ref()
                        .filter(|c| wraps(c, ctx))
                        .map(|c| (c.k.clone(), c.v.clone()))
                })
                .collect(),
            delta: delta.to_vec(),
        }
    }

    /// Why `snap` cannot come back into this session, if it cannot.
    fn check_restore(&self, snap: &Snapshot) -> Result<(), SessionError> {
        let (caches, delta) = self.state.layer_states();
        let same_shape = snap.engine == self.engine.id()
            && snap.ctx == self.ctx()
            && snap.rings.len() == caches.len()
            && snap.delta.len() == delta.len()
            && caches.iter().zip(&snap.rings).all(|(c, r)| {
                let ring = c.as_ref().filter(|c| wraps(c, self.ctx()));
                match (ring, r) {
                    (Some(c), Some((k, _))) => c.k.len() == k.len() && c.k.kv_type() == k.kv_type(),
                    (None, None) => true,
                    _ => false,
                }
            });
        if !same_shape {
            return Err(SessionError::SnapshotMismatch);
        }
        let full = caches.iter().flatten().any(|c| !wraps(c, self.ctx()));
        let n = snap.pos();
        if full && (self.held.len() < n || self.held[..n] != snap.tokens[..]) {
            return Err(SessionError::SnapshotStale {
                pos: n,
                held: self.held.len(),
            });
        }
        Ok(())
    }

    /// Back to the state of `snap`, bit for bit as a fresh feed of its ids would
    /// give. The session must come from the same engine and options, and still hold
    /// `snap`'s ids in its full-attention caches: its ids (or those it held before a
    /// truncation) must start with them. Otherwise `SnapshotMismatch` /
    /// `SnapshotStale`, and the session is unchanged.
    pub fn restore(&mut self, snap: &Snapshot) -> Result<(), SessionError> {
        self.check_restore(snap)?;
        let ctx = self.ctx();
        let (pos, caches, delta) = self.state.layer_states_mut();
        for (c, r) in caches.iter_mut().zip(&snap.rings) {
            if let (Some(c), Some((k, v))) = (c.as_mut().filter(|c| wraps(c, ctx)), r) {
                c.k.copy_from(k);
                c.v.copy_from(v);
            }
        }
        for (d, s) in delta.iter_mut().zip(&snap.delta) {
            d.clone_from(s);
        }
        let n = snap.pos();
        *pos = n;
        if self.held.len() < n || self.held[..n] != snap.tokens[..] {
            self.held.clone_from(&snap.tokens);
        }
        if let Some(l) = &snap.logits {
            self.logits.copy_from_slice(l);
        }
        self.has_logits = snap.logits.is_some();
        Ok(())
    }

    /// Why the session cannot drop its positions from `n` on without a snapshot, if it
    /// cannot.
    fn check_truncate(&self, n: usize) -> Result<(), SessionError> {
        let pos = self.pos();
        let refuse = |why| Err(SessionError::Truncate { to: n, pos, why });
        if n > pos {
            return refuse("a session cannot grow by truncation");
        }
        if n == pos || n == 0 {
            return Ok(());
        }
        let (caches, delta) = self.state.layer_states();
        if delta.iter().any(Option::is_some) {
            return refuse(
                "linear-attention layers cannot rewind their state: restore a snapshot taken at or before it",
            );
        }
        // The next position n sees n−w+1..n; a ring holds pos−cap..pos−1.
        let lost = caches
            .iter()
            .flatten()
            .any(|c| wraps(c, self.ctx()) && c.first_visible(n) < pos.saturating_sub(c.cap));
        if lost {
            return refuse(
                "a sliding-window layer has overwritten positions it would need: restore a snapshot taken at or before it",
            );
        }
        Ok(())
    }

    /// Drops the positions from `n` on: the session then holds `tokens()[..n]`, bit
    /// for bit as a fresh feed of them would give, and has no logits until the next
    /// feed (to get those of position `n − 1`, truncate to `n − 1` and feed it again).
    ///
    /// Exact and free where the state allows it: always to 0 or to the current
    /// position; for models with only full-attention layers, to any `n`; sliding
    /// layers also need their ring to still hold the window before `n` (it does until
    /// it wraps). Linear-attention state cannot be rewound: such models truncate only
    /// through a [`Snapshot`] ([`Session::rewind`]). Otherwise `Truncate`, and the
    /// session is unchanged.
    pub fn truncate(&mut self, n: usize) -> Result<(), SessionError> {
        self.check_truncate(n)?;
        if n == self.pos() {
            return Ok(());
        }
        if n == 0 {
            let held = std::mem::take(&mut self.held);
            self.reset();
            self.held = held;
            return Ok(());
        }
        *self.state.layer_states_mut().0 = n;
        self.has_logits = false;
        Ok(())
    }

    /// Goes back to position `n` (≤ `pos()`) however the state allows: by
    /// [`Session::truncate`] when it can; else from the latest of `snapshots` at or
    /// before `n` that [`Session::restore`] accepts, feeding the ids between again;
    /// else from the start. The result is bit for bit a fresh feed of
    /// `tokens()[..n]`. Returns how many ids were fed again (0 when free).
    pub fn rewind(&mut self, n: usize, snapshots: &[Snapshot]) -> Result<usize, SessionError> {
        match self.check_truncate(n) {
            Ok(()) => {
                self.truncate(n)?;
                return Ok(0);
            }
            Err(e) if n > self.pos() => return Err(e),
            Err(_) => {}
        }
        let ids = self.tokens()[..n].to_vec();
        let best = snapshots
            .iter()
            .filter(|s| s.pos() <= n && ids[..s.pos()] == s.tokens[..])
            .filter(|s| self.check_restore(s).is_ok())
            .max_by_key(|s| s.pos());
        let from = match best {
            Some(s) => {
                self.restore(s)?;
                s.pos()
            }
            None => {
                self.truncate(0)?;
                0
            }
        };
        if from < n {
            self.feed(&ids[from..])?;
        }
        Ok(n - from)
    }

    /// After a generation that did not feed its last sampled token: the logits that
    /// chose it are no longer the session's.
    pub(super) fn drop_logits(&mut self) {
        self.has_logits = false;
    }
}

impl Engine {
    /// A new sequence over this model: its own KV caches and linear-attention state,
    /// sized by `opts` (see [`StateOptions`]).
    pub fn session(&self, opts: &StateOptions) -> Result<Session<'_>, SessionError> {
        Session::new(self, opts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_is_shared_across_threads() {
        fn send_sync<T: Send + Sync>() {}
        fn send<T: Send>() {}
        send_sync::<Engine>();
        send::<Session<'static>>();
    }
}
