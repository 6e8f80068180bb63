//! Continuous batching: one forward step for several sessions of one engine
//! ([`feed_batch`]), each with its own state and position, the weights read once for
//! all of them. A server's loop: sample every active slot ([`super::Generator::step`]),
//! then one `feed_batch` with each slot's chosen id (and a chunk of a waiting prompt for
//! a prefilling slot), again.

use super::error::SessionError;
use super::sequence::Session;
use crate::model::forward::BatchSink;
use crate::model::{ModelError, Output};

/// One forward step for several sessions at once: session `i` takes the ids in `ids[i]`
/// (one id for a decoding slot, a chunk for a prefilling one; an empty list: the session
/// is skipped). Every matrix is read once for all tokens of the step
/// ([`Model::forward_batch`](crate::model::Model::forward_batch)).
///
/// Returns, per session, its logits after its last fed id (`None` when it fed nothing).
/// They are the session's own logits ([`Session::logits`]), not a copy: the result
/// borrows the sessions, so drop it (or copy what it needs) before using them again; a
/// caller that samples with [`Generator::step`](super::Generator::step) can ignore it.
/// Each session's logits are bit-identical to feeding it alone ([`Session::feed`]), and
/// its held ids, position and logits are left as `feed` leaves them.
///
/// Every session is checked before any runs: a bad id, a context too small for its ids,
/// or a session of another engine is `InBatch` naming the session's index, and no
/// session has changed. A step of more tokens than the engine's batch budget
/// ([`Engine::reserve_batch`](super::Engine::reserve_batch); [`DEFAULT_BATCH`]
/// otherwise) runs as several passes over the weights, single tokens first.
///
/// [`DEFAULT_BATCH`]: crate::model::forward::DEFAULT_BATCH
pub fn feed_batch<'a>(
    sessions: &'a mut [&mut Session<'_>],
    ids: &[&[u32]],
) -> Result<Vec<Option<&'a [f32]>>, SessionError> {
    let outputs = vec![Output::LastLogits; sessions.len()];
    feed_batch_with(sessions, ids, &outputs, &mut |_, _, _| {})?;
    let fed = |i: usize| ids.get(i).is_some_and(|l| !l.is_empty());
    let sessions: &'a [&mut Session<'_>] = sessions;
    Ok(sessions
        .iter()
        .enumerate()
        .map(|(i, s)| s.logits().filter(|_| fed(i)))
        .collect())
}

/// [`feed_batch`] with what each session gives back chosen per session
/// ([`Output`]): `sink(i, pos, values)` gets session `i`'s logits after its last id or
/// after each of its ids (vocab values), or its final hidden states (dim values, no
/// logits computed), in position order. Each is bit-identical to what the session
/// gives alone ([`Session::feed_with`], [`Session::feed_hidden`]). Afterwards a session
/// fed for logits holds those after its last id ([`Session::logits`]); one fed for
/// hidden states holds none.
pub fn feed_batch_with(
    sessions: &mut [&mut Session<'_>],
    ids: &[&[u32]],
    outputs: &[Output],
    sink: BatchSink,
) -> Result<(), SessionError> {
    if sessions.len() != ids.len() || sessions.len() != outputs.len() {
        return Err(SessionError::BadOption {
            name: "ids",
            value: format!(
                "{} lists and {} outputs for {} sessions",
                ids.len(),
                outputs.len(),
                sessions.len()
            ),
            rule: "feed_batch takes one list of ids and one output per session",
        });
    }
    let Some(engine) = sessions.first().map(|s| s.engine()) else {
        return Ok(());
    };
    for (i, s) in sessions.iter().enumerate() {
        if s.engine().id() != engine.id() {
            return Err(SessionError::InBatch {
                index: i,
                error: Box::new(SessionError::BadOption {
                    name: "session",
                    value: i.to_string(),
                    rule: "the sessions of a batch must come from one engine",
                }),
            });
        }
    }
    let fed = |i: usize| !ids[i].is_empty();
    let tokens: usize = ids.iter().map(|l| l.len()).sum();
    if tokens == 0 {
        return Ok(());
    }
    // A model file truncated under the map would fault inside the pass.
    engine.mlb().check_unchanged()?;
    let ctx = (0..sessions.len())
        .filter(|&i| fed(i))
        .map(|i| sessions[i].ctx())
        .max()
        .unwrap_or(1);
    let p0: Vec<usize> = sessions.iter().map(|s| s.pos()).collect();
    engine.with_batch(tokens, ctx, |model, bs| {
        let (mut seqs, mut outs) = (Vec::new(), Vec::new());
        for (s, &ids) in sessions.iter_mut().zip(ids) {
            let (state, logits) = s.step_parts();
            seqs.push((state, ids));
            outs.push(logits);
        }
        let mut each = |i: usize, pos: usize, v: &[f32]| {
            if !outputs[i].hidden() {
                outs[i].copy_from_slice(v);
            }
            sink(i, pos, v);
        };
        model
            .forward_batch_with(bs, &mut seqs, outputs, &mut each)
            .map_err(|e| match e {
                ModelError::InBatch { index, error } => SessionError::InBatch {
                    index,
                    error: Box::new(SessionError::Model(*error)),
                },
                e => SessionError::Model(e),
            })
    })??;
    for (i, s) in sessions.iter_mut().enumerate() {
        if fed(i) {
            s.fed(p0[i], ids[i]);
            if outputs[i].hidden() {
                s.drop_logits();
            }
        }
    }
    Ok(())
}
