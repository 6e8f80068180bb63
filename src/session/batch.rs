//! Continuous batching: one forward step for several sessions of one engine
//! ([`feed_batch`]), each with its own state and position, the weights read once for
//! all of them. A server's loop: sample every active slot ([`super::Generator::step`]),
//! then one `feed_batch` with each slot's chosen id (and a chunk of a waiting prompt for
//! a prefilling slot), again.

use super::error::SessionError;
use super::sequence::Session;
use crate::model::ModelError;

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
    if sessions.len() != ids.len() {
        return Err(SessionError::BadOption {
            name: "ids",
            value: format!("{} lists for {} sessions", ids.len(), sessions.len()),
            rule: "feed_batch takes one list of ids per session",
        });
    }
    let Some(engine) = sessions.first().map(|s| s.engine()) else {
        return Ok(Vec::new());
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
    if tokens > 0 {
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
            let mut sink = |i: usize, _pos: usize, l: &[f32]| outs[i].copy_from_slice(l);
            model
                .forward_batch(bs, &mut seqs, false, &mut sink)
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
            }
        }
    }
    let sessions: &'a [&mut Session<'_>] = sessions;
    Ok(sessions
        .iter()
        .enumerate()
        .map(|(i, s)| s.logits().filter(|_| fed(i)))
        .collect())
}
