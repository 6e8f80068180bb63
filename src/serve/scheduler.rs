//! The model's thread: N slots (each a [`Session`] over the one [`Engine`]), the
//! requests waiting for one, and the step loop of continuous batching.
//!
//! Each turn of the loop:
//! 1. takes the new requests from the channel (it blocks only when there is nothing to do);
//! 2. drops the requests whose client has gone (their event channel is closed), so a
//!    client that disconnects frees its slot at the next step;
//! 3. gives free slots to waiting requests, first come first served: each goes to the
//!    free slot whose ids share the longest prefix with its prompt (ties: the least
//!    recently used), which keeps that prefix and prefills only the rest;
//! 4. runs one [`step_all`] over every busy slot: a decoding slot feeds the token it sampled
//!    last, a prefilling slot the next chunk of its prompt (at most `prefill_chunk`
//!    prompt ids per step over all slots, the oldest request first), so running streams
//!    keep flowing while a long prompt is read;
//! 5. samples the next token of every slot whose prompt is complete ([`Generator::step`])
//!    and sends it, ending the request at a stop.
//!
//! All model work of a step is the one call to [`step_all`]. A request with a grammar
//! (structured output, a required tool call) samples under its mask; the masks of the
//! next tokens ([`Constraint::prepare`]) are computed on a thread of their own while
//! `step_all` runs, so a constrained stream waits for its mask only when computing it
//! takes longer than the forward pass.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use super::api::{ApiError, Finish, TokenLogprob, Usage};
use super::error::ServeError;
use super::frontend::Frontend;
use super::metrics::Metrics;
use crate::model::config::LayerKind;
use crate::model::{Output, StateOptions};
use crate::session::speculative::{
    self, draft_batch, draft_sampler, lookup, Draft, DraftModel, DraftSource, SpecOptions,
};
use crate::session::{
    feed_batch_with, Constraint, Engine, GenerateOptions, Generator, Pooler, Pooling, Session,
    SessionError, Snapshot, Step, StopReason,
};

/// Snapshots a slot keeps (at the ends of its latest prompts), for models whose state
/// cannot be truncated (linear attention, sliding windows that wrap).
const SNAPSHOTS: usize = 2;

/// All model work of one scheduler step: session `i` is fed `ids[i]` (empty: skipped),
/// all of them in one batched forward step ([`session::feed_batch`]: the weights are
/// read once for every slot, each slot's logits bit-identical to feeding it alone);
/// afterwards each fed session holds the logits after the last of its ids (the sampler
/// reads them from the session).
pub fn step_all(sessions: &mut [&mut Session<'_>], ids: &[&[u32]]) -> Result<(), SessionError> {
    crate::session::feed_batch(sessions, ids).map(|_| ())
}

/// What the model thread tells a request's handler.
#[derive(Debug)]
pub enum Event {
    /// A slot took the request.
    Started,
    /// A sampled token: the text it completes (maybe empty) and its logprobs.
    Token {
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// The request is complete: the text no token gave out (held back, then flushed).
    Done {
        finish: Finish,
        usage: Usage,
        tail: String,
    },
    /// An embedding request's input `index` is done: its pooled vector (not
    /// normalized) and its ids.
    Embedding {
        index: usize,
        vector: Vec<f32>,
        tokens: usize,
    },
    /// The request failed or was cancelled by the server.
    Failed(ApiError),
}

/// Counts shared by the handlers and the model thread.
pub struct Shared {
    /// Requests admitted and not yet finished (waiting or in a slot).
    load: AtomicUsize,
    /// `parallel + queue`: more admitted requests are refused (503).
    limit: usize,
    pub processing: AtomicUsize,
    pub queued: AtomicUsize,
    /// Set at the first SIGINT/SIGTERM: new requests are refused.
    pub draining: AtomicBool,
}

impl Shared {
    pub fn new(limit: usize) -> Shared {
        Shared {
            load: AtomicUsize::new(0),
            limit,
            processing: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
            draining: AtomicBool::new(false),
        }
    }

    /// A place for one more request, if the slots and the queue have one.
    pub fn ticket(self: &Arc<Self>) -> Option<Ticket> {
        self.load
            .fetch_update(SeqCst, SeqCst, |n| (n < self.limit).then_some(n + 1))
            .ok()
            .map(|_| Ticket(self.clone()))
    }
}

/// A request's place; dropped (wherever the request ends) it frees the place.
pub struct Ticket(Arc<Shared>);

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.load.fetch_sub(1, SeqCst);
    }
}

/// A request for the model thread.
pub struct Job {
    pub ids: Vec<u32>,
    pub work: Work,
    /// The grammar the reply must match, compiled (its first mask computed), and the
    /// request field that gave it (a grammar that fails mid-generation is named);
    /// generation only.
    pub constraint: Option<Constraint>,
    pub grammar_field: Option<&'static str>,
    pub events: UnboundedSender<Event>,
    /// "chat", "completion" or "embedding" (the log line).
    pub label: &'static str,
    /// Held for its `Drop`: the request's place is free again when the job ends (the
    /// inputs of one embedding request share it).
    #[allow(dead_code)]
    pub ticket: Arc<Ticket>,
}

/// What a job asks of its slot.
pub enum Work {
    /// Generate after the ids.
    Generate(GenerateOptions),
    /// Pool the ids' final hidden states: input `index` of an embedding request.
    Embed { pooling: Pooling, index: usize },
}

/// Messages to the model thread.
pub enum Msg {
    Job(Box<Job>),
    /// Finish what is running (within the grace period), refuse the rest.
    Drain,
    /// Cancel everything now.
    CancelAll,
}

/// How the slots are made and run.
#[derive(Clone)]
pub struct SlotsOptions {
    pub parallel: usize,
    pub model: StateOptions,
    pub prefill_chunk: usize,
    /// How long running requests may go on after a shutdown signal.
    pub grace: Duration,
    /// Speculative decoding, if on (a draft model's engine comes to [`start`]).
    pub spec: Option<SpecOptions>,
}

/// What one slot holds, for the start-up summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotInfo {
    pub ctx: usize,
    pub kv_bytes: usize,
    pub delta_bytes: usize,
}

/// The slots' sessions, and with a draft model its sessions (the slots' context, cut
/// to its max_seq).
#[allow(clippy::type_complexity)]
fn slots<'e>(
    engine: &'e Engine,
    draft: Option<&'e Engine>,
    cfg: &SlotsOptions,
) -> Result<(Vec<Session<'e>>, Vec<Option<DraftModel<'e>>>), SessionError> {
    let sessions = (0..cfg.parallel)
        .map(|_| engine.session(&cfg.model))
        .collect::<Result<Vec<_>, _>>()?;
    let state = StateOptions {
        ctx: Some(sessions[0].ctx()),
        ..cfg.model
    };
    let drafts = (0..cfg.parallel)
        .map(|_| {
            draft
                .map(|d| DraftModel::new(d, &state, &Default::default()))
                .transpose()
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((sessions, drafts))
}

/// Starts the model thread with its slots (allocated before this returns, so that a
/// context that does not fit is an error at start).
pub fn start(
    engine: Arc<Engine>,
    draft: Option<Arc<Engine>>,
    cfg: SlotsOptions,
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
    fe: Arc<dyn Frontend>,
) -> Result<(Sender<Msg>, JoinHandle<()>, SlotInfo), ServeError> {
    let (tx, rx) = mpsc::channel();
    let (ready_tx, ready_rx) = mpsc::sync_channel(1);
    let thread = std::thread::Builder::new()
        .name("mlb-serve-model".into())
        .spawn(move || {
            let made = slots(&engine, draft.as_deref(), &cfg);
            let (sessions, drafts) = match made {
                Ok(s) => s,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let st = sessions[0].state();
            let _ = ready_tx.send(Ok(SlotInfo {
                ctx: st.ctx(),
                kv_bytes: st.kv_bytes(),
                delta_bytes: st.delta_bytes(),
            }));
            Scheduler::new(&engine, sessions, drafts, cfg, shared, metrics, fe).run(rx);
        })
        .map_err(|e| ServeError::Thread(e.to_string()))?;
    match ready_rx.recv() {
        Ok(Ok(info)) => Ok((tx, thread, info)),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(ServeError::Session(e))
        }
        Err(_) => {
            let _ = thread.join();
            Err(ServeError::Thread(
                "the model thread ended while making its slots".into(),
            ))
        }
    }
}

/// A speculative round under way: what the slot feeds this step, the drafts among it,
/// and the logits of every fed position (filled by the step).
struct Round {
    fed: Vec<u32>,
    draft: Draft,
    /// (1 + drafts) × vocab.
    rows: Vec<f32>,
    /// For state that cannot be truncated (linear attention): the state before.
    snapshot: Option<Snapshot>,
}

/// A request in a slot.
struct Task<'e> {
    job: Job,
    gen: Generator<'e>,
    /// Prompt ids fed so far (the prompt is being read while `fed < ids.len()`).
    fed: usize,
    /// Decoding: the sampled id to feed next.
    next: Option<u32>,
    /// Prompt ids the slot already held.
    cached: usize,
    /// Admission order (prefill goes oldest first).
    order: u64,
    started: Instant,
    first_token: Option<Duration>,
    /// Tokens sampled so far.
    sampled: usize,
    /// This step's speculative round, if drafting.
    round: Option<Round>,
    /// Drafted and kept tokens so far.
    drafted: usize,
    accepted: usize,
}

/// An embedding input in a slot: its prompt read chunk by chunk, the hidden states
/// pooled as they come.
struct EmbedTask {
    job: Job,
    pooler: Pooler,
    index: usize,
    /// Ids fed so far.
    fed: usize,
    order: u64,
    started: Instant,
}

struct Slot<'e> {
    session: Session<'e>,
    snapshots: Vec<Snapshot>,
    /// When it was last given a request (least recently used goes first on ties).
    used: u64,
    task: Option<Task<'e>>,
    embed: Option<EmbedTask>,
    /// The draft model's session for this slot (with `--draft`).
    draft: Option<DraftModel<'e>>,
}

impl Slot<'_> {
    fn busy(&self) -> bool {
        self.task.is_some() || self.embed.is_some()
    }
}

struct Scheduler<'e> {
    engine: &'e Engine,
    slots: Vec<Slot<'e>>,
    waiting: VecDeque<Job>,
    cfg: SlotsOptions,
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
    fe: Arc<dyn Frontend>,
    clock: u64,
    /// When the shutdown signal came.
    draining: Option<Instant>,
    /// Whether prefix reuse needs snapshots (some state cannot be truncated).
    snapshots: bool,
    /// Whether a speculative round needs a snapshot to roll back (linear attention).
    round_snapshots: bool,
}

/// `finish_reason` of a stop, `None` for a cancellation.
fn finish_of(stop: StopReason) -> Option<Finish> {
    match stop {
        StopReason::StopId(_) | StopReason::StopString(_) => Some(Finish::Stop),
        StopReason::Length | StopReason::ContextFull => Some(Finish::Length),
        StopReason::Cancelled => None,
    }
}

/// Where a slot's rows of a step go.
enum Route<'a> {
    /// A prompt chunk or a plain decode step: the session keeps the last logits.
    Logits,
    /// A speculative round: every row's logits.
    Round(&'a mut Vec<f32>),
    /// An embedding: the hidden states.
    Pool(&'a mut Pooler),
}

impl<'e> Scheduler<'e> {
    fn new(
        engine: &'e Engine,
        sessions: Vec<Session<'e>>,
        drafts: Vec<Option<DraftModel<'e>>>,
        cfg: SlotsOptions,
        shared: Arc<Shared>,
        metrics: Arc<Metrics>,
        fe: Arc<dyn Frontend>,
    ) -> Scheduler<'e> {
        let ctx = sessions.first().map_or(0, Session::ctx);
        let snapshots = engine.config().layers.iter().any(|l| match l {
            LayerKind::Linear => true,
            LayerKind::Attention { window, .. } => window.is_some_and(|w| w < ctx),
        });
        let round_snapshots = sessions.first().is_some_and(speculative::needs_snapshot);
        Scheduler {
            engine,
            slots: sessions
                .into_iter()
                .zip(drafts)
                .map(|(session, draft)| Slot {
                    session,
                    snapshots: Vec::new(),
                    used: 0,
                    task: None,
                    embed: None,
                    draft,
                })
                .collect(),
            waiting: VecDeque::new(),
            cfg,
            shared,
            metrics,
            fe,
            clock: 0,
            draining: None,
            snapshots,
            round_snapshots,
        }
    }

    fn busy(&self) -> bool {
        !self.waiting.is_empty() || self.slots.iter().any(Slot::busy)
    }

    fn run(mut self, rx: Receiver<Msg>) {
        loop {
            if !self.busy() {
                match rx.recv() {
                    Ok(m) => self.on(m),
                    Err(_) => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(m) => self.on(m),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.cancel_all(ApiError::shutting_down());
                        return;
                    }
                }
            }
            self.drop_gone();
            if self.draining.is_some_and(|t| t.elapsed() >= self.cfg.grace) {
                self.cancel_all(ApiError::shutting_down());
            }
            self.admit();
            self.publish();
            if self.slots.iter().any(Slot::busy) {
                self.step();
            }
            self.publish();
        }
    }

    fn on(&mut self, m: Msg) {
        match m {
            Msg::Job(job) if self.draining.is_some() => {
                let _ = job.events.send(Event::Failed(ApiError::shutting_down()));
            }
            Msg::Job(job) => self.waiting.push_back(*job),
            Msg::Drain => {
                self.draining.get_or_insert_with(Instant::now);
                for job in self.waiting.drain(..) {
                    let _ = job.events.send(Event::Failed(ApiError::shutting_down()));
                }
            }
            Msg::CancelAll => {
                self.draining.get_or_insert_with(Instant::now);
                self.cancel_all(ApiError::shutting_down());
            }
        }
    }

    /// Ends every request with `err`.
    fn cancel_all(&mut self, err: ApiError) {
        for job in self.waiting.drain(..) {
            let _ = job.events.send(Event::Failed(err.clone()));
        }
        for i in 0..self.slots.len() {
            if let Some(t) = self.slots[i].task.take() {
                self.fail(i, &t, err.clone(), "cancelled (shutdown)");
            }
            if let Some(e) = self.slots[i].embed.take() {
                let _ = e.job.events.send(Event::Failed(err.clone()));
            }
        }
    }

    /// Drops the requests whose client has gone.
    fn drop_gone(&mut self) {
        self.waiting.retain(|j| !j.events.is_closed());
        for i in 0..self.slots.len() {
            if self.slots[i]
                .task
                .as_ref()
                .is_some_and(|t| t.job.events.is_closed())
            {
                let t = self.slots[i].task.take().expect("checked");
                self.log_end(i, &t, t.sampled, "cancelled (client gone)");
            }
            if self.slots[i]
                .embed
                .as_ref()
                .is_some_and(|e| e.job.events.is_closed())
            {
                self.slots[i].embed = None;
            }
        }
    }

    /// The free slot for `ids`: the longest common prefix, then the least recently used.
    fn pick(&self, ids: &[u32]) -> Option<usize> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.busy())
            .max_by_key(|(_, s)| (s.session.common_prefix(ids), std::cmp::Reverse(s.used)))
            .map(|(i, _)| i)
    }

    /// Gives free slots to waiting requests.
    fn admit(&mut self) {
        while let Some(i) = self.waiting.front().and_then(|j| self.pick(&j.ids)) {
            let mut job = self.waiting.pop_front().expect("front");
            self.clock += 1;
            let work = std::mem::replace(
                &mut job.work,
                Work::Embed {
                    pooling: Pooling::Last,
                    index: 0,
                },
            );
            let opts = match work {
                Work::Generate(opts) => opts,
                Work::Embed { pooling, index } => {
                    self.admit_embed(i, job, pooling, index);
                    continue;
                }
            };
            let gen = match Generator::new(self.engine, opts) {
                Ok(g) => match job.constraint.take() {
                    Some(c) => g.with_constraint(c),
                    None => g,
                },
                Err(e) => {
                    let _ = job
                        .events
                        .send(Event::Failed(ApiError::bad_request(e.to_string())));
                    continue;
                }
            };
            let slot = &mut self.slots[i];
            slot.used = self.clock;
            let cached = reuse(&mut slot.session, &slot.snapshots, &job.ids);
            if job.events.send(Event::Started).is_err() {
                continue;
            }
            if let Some(d) = &mut slot.draft {
                d.sampler = draft_sampler(gen.sampling());
            }
            slot.task = Some(Task {
                job,
                gen,
                fed: cached,
                next: None,
                cached,
                order: self.clock,
                started: Instant::now(),
                first_token: None,
                sampled: 0,
                round: None,
                drafted: 0,
                accepted: 0,
            });
        }
    }

    /// An embedding input takes slot `i`: mean and cls pooling need every position's
    /// hidden state (the first), so they start from an empty sequence; the last token's
    /// keeps the prefix.
    fn admit_embed(&mut self, i: usize, job: Job, pooling: Pooling, index: usize) {
        let slot = &mut self.slots[i];
        slot.used = self.clock;
        let fed = match pooling {
            Pooling::Mean | Pooling::Cls => {
                slot.session.reset();
                0
            }
            Pooling::Last => reuse(&mut slot.session, &slot.snapshots, &job.ids),
        };
        if job.events.send(Event::Started).is_err() {
            return;
        }
        slot.embed = Some(EmbedTask {
            job,
            pooler: Pooler::new(pooling, self.engine.config().dim),
            index,
            fed,
            order: self.clock,
            started: Instant::now(),
        });
    }

    fn publish(&self) {
        let busy = self.slots.iter().filter(|s| s.busy()).count();
        self.shared.processing.store(busy, SeqCst);
        self.shared.queued.store(self.waiting.len(), SeqCst);
        let m = &self.metrics;
        m.slots_busy.store(busy, SeqCst);
        m.queued.store(self.waiting.len(), SeqCst);
        m.kv_used
            .store(self.slots.iter().map(|s| s.session.pos()).sum(), SeqCst);
    }

    /// Drafts for every decoding slot (with speculation on): lookup, or one batched
    /// pass of the draft model per drafted token for all of them.
    fn draft(&mut self) {
        let Some(spec) = self.cfg.spec.clone() else {
            return;
        };
        // (slot, its ids and next token, most drafts)
        let mut want: Vec<(usize, Vec<u32>, usize)> = Vec::new();
        for (i, slot) in self.slots.iter().enumerate() {
            let Some(t) = &slot.task else { continue };
            let Some(next) = t.next else { continue };
            let room = slot.session.ctx().saturating_sub(slot.session.pos() + 1);
            let k = spec
                .draft_max
                .min(t.gen.remaining().saturating_sub(1))
                .min(room);
            if k == 0 {
                continue;
            }
            let mut context = slot.session.tokens().to_vec();
            context.push(next);
            want.push((i, context, k));
        }
        if want.is_empty() {
            return;
        }
        let drafts: Vec<Draft> = match &spec.source {
            DraftSource::Lookup => want
                .iter()
                .map(|(_, c, k)| Draft {
                    ids: lookup(c, spec.ngram, *k),
                    q: Vec::new(),
                })
                .collect(),
            DraftSource::Model(_) => {
                let mut drafters: Vec<&mut DraftModel<'e>> = Vec::new();
                let mut it = want.iter().peekable();
                for (i, slot) in self.slots.iter_mut().enumerate() {
                    if it.peek().is_some_and(|w| w.0 == i) {
                        it.next();
                        if let Some(d) = slot.draft.as_mut() {
                            drafters.push(d);
                        }
                    }
                }
                if drafters.len() != want.len() {
                    return;
                }
                let contexts: Vec<&[u32]> = want.iter().map(|w| w.1.as_slice()).collect();
                let ks: Vec<usize> = want.iter().map(|w| w.2).collect();
                match draft_batch(&mut drafters, &contexts, &ks, spec.p_min) {
                    Ok(d) => d,
                    Err(e) => {
                        // A draft that fails costs its speed, not the request.
                        self.fe.log(&format!(
                            "draft model: {e}; this step decodes without drafts"
                        ));
                        for (i, ..) in &want {
                            if let Some(d) = self.slots[*i].draft.as_mut() {
                                d.session.reset();
                            }
                        }
                        return;
                    }
                }
            }
        };
        let snap = self.round_snapshots;
        for ((i, _, _), draft) in want.into_iter().zip(drafts) {
            if draft.ids.is_empty() {
                continue;
            }
            let slot = &mut self.slots[i];
            let t = slot.task.as_mut().expect("decoding");
            let mut fed = Vec::with_capacity(draft.ids.len() + 1);
            fed.push(t.next.expect("decoding"));
            fed.extend_from_slice(&draft.ids);
            t.round = Some(Round {
                fed,
                draft,
                rows: Vec::new(),
                snapshot: snap.then(|| slot.session.snapshot()),
            });
        }
    }

    /// One step: drafts, then every busy slot's ids through one batched pass, then
    /// sampling (or pooling).
    fn step(&mut self) {
        self.draft();
        // Prompt ids per prefilling slot, oldest request first, within the budget.
        let mut take = vec![0usize; self.slots.len()];
        let mut reading: Vec<(u64, usize)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match (&s.task, &s.embed) {
                (Some(t), _) if t.next.is_none() => Some((t.order, i)),
                (_, Some(e)) => Some((e.order, i)),
                _ => None,
            })
            .collect();
        reading.sort_unstable();
        let mut budget = self.cfg.prefill_chunk;
        for &(_, i) in &reading {
            let s = &self.slots[i];
            let (len, fed) = match (&s.task, &s.embed) {
                (Some(t), _) => (t.job.ids.len(), t.fed),
                (_, Some(e)) => (e.job.ids.len(), e.fed),
                _ => unreachable!("reading slots are busy"),
            };
            take[i] = (len - fed).min(budget);
            budget -= take[i];
        }
        let mut who = Vec::new();
        let result = {
            let mut sessions: Vec<&mut Session<'e>> = Vec::new();
            let mut ids: Vec<&[u32]> = Vec::new();
            let mut outputs: Vec<Output> = Vec::new();
            let mut routes: Vec<Route> = Vec::new();
            let mut masks: Vec<&mut Constraint> = Vec::new();
            for (i, slot) in self.slots.iter_mut().enumerate() {
                let Slot {
                    session,
                    task,
                    embed,
                    ..
                } = slot;
                let (fed, output, route): (&[u32], Output, Route) = match (task, embed) {
                    (Some(t), _) => {
                        masks.extend(t.gen.constraint_mut().filter(|c| c.needs_prepare()));
                        match (&t.next, &mut t.round) {
                            (_, Some(r)) => {
                                r.rows.clear();
                                (&r.fed[..], Output::AllLogits, Route::Round(&mut r.rows))
                            }
                            (Some(_), None) => {
                                (t.next.as_slice(), Output::LastLogits, Route::Logits)
                            }
                            (None, None) => (
                                &t.job.ids[t.fed..t.fed + take[i]],
                                Output::LastLogits,
                                Route::Logits,
                            ),
                        }
                    }
                    (None, Some(e)) => {
                        let out = if e.pooler.pooling().every() {
                            Output::AllHidden
                        } else {
                            Output::LastHidden
                        };
                        (
                            &e.job.ids[e.fed..e.fed + take[i]],
                            out,
                            Route::Pool(&mut e.pooler),
                        )
                    }
                    (None, None) => continue,
                };
                if fed.is_empty() {
                    continue;
                }
                who.push(i);
                sessions.push(session);
                ids.push(fed);
                outputs.push(output);
                routes.push(route);
            }
            let mut sink = |k: usize, _pos: usize, v: &[f32]| match &mut routes[k] {
                Route::Logits => {}
                Route::Round(rows) => rows.extend_from_slice(v),
                Route::Pool(p) => p.add(v),
            };
            if masks.is_empty() {
                feed_batch_with(&mut sessions, &ids, &outputs, &mut sink)
            } else {
                // The next masks need only the tokens sampled last: compute them while
                // the forward pass runs.
                std::thread::scope(|s| {
                    s.spawn(move || masks.into_iter().for_each(Constraint::prepare));
                    feed_batch_with(&mut sessions, &ids, &outputs, &mut sink)
                })
            }
        };
        if let Err(e) = result {
            for &i in &who {
                let slot = &mut self.slots[i];
                slot.session.reset();
                slot.snapshots.clear();
                if let Some(t) = slot.task.take() {
                    self.fail(i, &t, ApiError::internal(e.to_string()), "failed");
                }
                if let Some(t) = self.slots[i].embed.take() {
                    let _ = t
                        .job
                        .events
                        .send(Event::Failed(ApiError::internal(e.to_string())));
                }
            }
            return;
        }
        let prompt: usize = who.iter().map(|&i| take[i]).sum();
        self.metrics.prompt_tokens.fetch_add(prompt as u64, Relaxed);
        for i in who {
            if self.slots[i].embed.is_some() {
                self.advance_embed(i, take[i]);
            } else {
                self.advance(i, take[i]);
            }
        }
        self.metrics.sample();
    }

    /// After a step: an embedding input's ids fed; done when all are.
    fn advance_embed(&mut self, i: usize, fed: usize) {
        let slot = &mut self.slots[i];
        let e = slot.embed.as_mut().expect("embedding");
        e.fed += fed;
        if e.fed < e.job.ids.len() {
            return;
        }
        let e = slot.embed.take().expect("embedding");
        let n = e.job.ids.len();
        self.metrics.embedded_tokens.fetch_add(n as u64, Relaxed);
        let _ = e.job.events.send(Event::Embedding {
            index: e.index,
            vector: e.pooler.finish(None, false),
            tokens: n,
        });
        self.fe.log(&format!(
            "embedding slot {i}: input {} of {n} tokens ({} pooling) in {:.3} s",
            e.index,
            e.pooler.pooling(),
            e.started.elapsed().as_secs_f64()
        ));
    }

    /// After a step: record the prompt ids fed, or take the next token (or, after a
    /// speculative round, the tokens the drafts gave).
    fn advance(&mut self, i: usize, fed: usize) {
        let snapshots = self.snapshots;
        let slot = &mut self.slots[i];
        let t = slot.task.as_mut().expect("busy");
        if t.next.is_none() {
            t.fed += fed;
            if t.fed < t.job.ids.len() {
                return;
            }
            if snapshots {
                if slot.snapshots.len() == SNAPSHOTS {
                    slot.snapshots.remove(0);
                }
                slot.snapshots.push(slot.session.snapshot());
            }
        }
        let steps: Result<Vec<Step>, SessionError> = match t.round.take() {
            Some(r) => speculative::verify(
                &mut t.gen,
                &mut slot.session,
                &r.draft,
                &r.rows,
                r.snapshot.as_ref(),
            )
            .map(|v| {
                t.drafted += r.draft.ids.len();
                t.accepted += v.accepted;
                self.metrics
                    .draft_tokens
                    .fetch_add(r.draft.ids.len() as u64, Relaxed);
                self.metrics
                    .draft_accepted
                    .fetch_add(v.accepted as u64, Relaxed);
                v.steps
            }),
            None => t.gen.step(&slot.session).map(|s| vec![s]),
        };
        let steps = match steps {
            Ok(s) => s,
            Err(e) => {
                let t = slot.task.take().expect("busy");
                slot.session.reset();
                let err = match (&e, t.job.grammar_field) {
                    // The request's grammar hit an engine limit: the request's fault.
                    (SessionError::Constraint(_), Some(field)) => ApiError {
                        code: Some("invalid_grammar"),
                        ..ApiError::invalid(field, format!("'{field}': {e}"))
                    },
                    _ => ApiError::internal(e.to_string()),
                };
                self.fail(i, &t, err, "failed");
                return;
            }
        };
        for step in steps {
            if self.deliver(i, step) {
                return;
            }
        }
    }

    /// Sends slot `i`'s sampled `step`; ends the request at a stop. True when it ended.
    fn deliver(&mut self, i: usize, step: Step) -> bool {
        let slot = &mut self.slots[i];
        let t = slot.task.as_mut().expect("busy");
        if t.first_token.is_none() {
            let d = t.started.elapsed();
            t.first_token = Some(d);
            self.metrics.first_token(d);
        }
        t.sampled += 1;
        self.metrics.generated_tokens.fetch_add(1, Relaxed);
        let logprob = match (step.stop, step.logprobs) {
            (Some(StopReason::StopId(_)), _) | (_, None) => None,
            (_, Some(l)) => Some(TokenLogprob {
                id: step.id,
                logprob: l.chosen,
                top: l.top,
            }),
        };
        let gone = (!step.text.is_empty() || logprob.is_some())
            && t.job
                .events
                .send(Event::Token {
                    text: step.text,
                    logprob,
                })
                .is_err();
        match step.stop {
            _ if gone => {
                let t = slot.task.take().expect("busy");
                self.log_end(i, &t, t.sampled, "cancelled (client gone)");
                true
            }
            Some(stop) => {
                let t = slot.task.take().expect("busy");
                let prompt = t.job.ids.len();
                let cached = t.cached;
                let (events, label) = (t.job.events.clone(), t.job.label);
                let started = t.started;
                let first = t.first_token;
                let drafts = if t.drafted > 0 {
                    format!(", drafts kept {}/{}", t.accepted, t.drafted)
                } else {
                    String::new()
                };
                let mut gen = t.gen;
                let grammar = gen.constraint_mut().map_or(String::new(), |c| {
                    let (n, time) = c.stats();
                    format!(
                        ", grammar {:.3} ms per mask",
                        time.as_secs_f64() * 1e3 / n.max(1) as f64
                    )
                });
                let g = gen.finish();
                let usage = Usage {
                    prompt,
                    completion: g.tokens.len(),
                    cached,
                };
                let finish = finish_of(stop).unwrap_or(Finish::Stop);
                let _ = events.send(Event::Done {
                    finish,
                    usage,
                    tail: g.tail,
                });
                self.fe.log(&format!(
                    "{label} slot {i}: prompt {prompt} tokens ({cached} cached), {} generated in {:.3} s (first token {:.3} s{drafts}{grammar}): {}",
                    usage.completion,
                    started.elapsed().as_secs_f64(),
                    first.unwrap_or_default().as_secs_f64(),
                    finish.as_str()
                ));
                true
            }
            None => {
                t.next = Some(step.id);
                false
            }
        }
    }

    /// Ends slot `i`'s task `t` (taken from the slot) with `err`, logged as `how`.
    fn fail(&self, i: usize, t: &Task, err: ApiError, how: &str) {
        let _ = t.job.events.send(Event::Failed(err));
        self.log_end(i, t, t.sampled, how);
    }

    fn log_end(&self, i: usize, t: &Task, generated: usize, how: &str) {
        self.fe.log(&format!(
            "{} slot {i}: prompt {} tokens ({} cached), {generated} generated in {:.3} s: {how}",
            t.job.label,
            t.job.ids.len(),
            t.cached,
            t.started.elapsed().as_secs_f64(),
        ));
    }
}

/// Makes `s` hold the longest prefix of `ids` it can keep (at most all but the last id:
/// the last is fed to get the logits to sample from) and returns its length: by
/// truncation where the state allows it, else from the latest snapshot that holds a
/// prefix of `ids`, else from the start.
fn reuse(s: &mut Session, snapshots: &[Snapshot], ids: &[u32]) -> usize {
    let n = s.common_prefix(ids).min(ids.len().saturating_sub(1));
    if s.truncate(n).is_ok() {
        return n;
    }
    let mut usable: Vec<&Snapshot> = snapshots
        .iter()
        .filter(|p| p.pos() <= n && ids.starts_with(p.tokens()))
        .collect();
    usable.sort_by_key(|p| std::cmp::Reverse(p.pos()));
    for p in usable {
        if s.restore(p).is_ok() {
            return p.pos();
        }
    }
    // Truncating to 0 always succeeds.
    let _ = s.truncate(0);
    0
}
