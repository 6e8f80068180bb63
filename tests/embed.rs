//! Final hidden states and embeddings (`Session::feed_hidden`, `Output::*Hidden`,
//! `session::Pooler`): the same bits alone, in chunks and in a batch beside other
//! sessions (decoding, prefilling, wanting every position's logits) on every synthetic
//! case; mean and last pooling; normalized vectors of length 1.

use krafla::model::{Output, Packs, StateOptions};
use krafla::session::{feed_batch_with, l2_normalize, Engine, Pooler, Pooling, Session};

use crate::run::{all_logits, cases, load, tokens};

/// Every position's final hidden state of `ids` fed alone, in one call.
fn hidden_alone(e: &Engine, ids: &[u32]) -> Vec<Vec<f32>> {
    let mut s = e.session(&StateOptions::default()).unwrap();
    let mut rows = Vec::new();
    s.feed_hidden(ids, true, &mut |pos, h| {
        assert_eq!(pos, rows.len());
        rows.push(h.to_vec());
    })
    .unwrap();
    assert!(s.logits().is_none());
    assert_eq!(s.tokens(), ids);
    rows
}

#[test]
fn hidden_states_are_the_same_alone_in_chunks_and_batched() {
    for (ci, c) in cases().iter().enumerate() {
        let e = Engine::new(load(c, 71), Packs::none(), None).unwrap();
        let dim = e.config().dim;
        let ids = tokens(c.h.vocab, 23, 5 + ci as u64);
        let want = hidden_alone(&e, &ids);
        assert!(want
            .iter()
            .all(|r| r.len() == dim && r.iter().all(|v| v.is_finite())));
        // Fed in chunks, only the last row of each.
        let mut s = e.session(&StateOptions::default()).unwrap();
        for (a, b) in [(0, 5), (5, 6), (6, 23)] {
            let mut got = Vec::new();
            s.feed_hidden(&ids[a..b], false, &mut |pos, h| got.push((pos, h.to_vec())))
                .unwrap();
            assert_eq!(got.len(), 1, "{}", c.name);
            assert_eq!(got[0].0, b - 1);
            assert!(got[0].1 == want[b - 1], "{}: chunk {a}..{b}", c.name);
        }
        // Batched: this sequence in chunks (every row, then only the last) beside a
        // decoding session, a prefilling one and one wanting every position's logits.
        let others: Vec<Vec<u32>> = (0..3).map(|i| tokens(c.h.vocab, 20, 90 + i)).collect();
        let o = StateOptions::default();
        let mut ss: Vec<Session> = (0..4).map(|_| e.session(&o).unwrap()).collect();
        ss[1].feed(&others[0][..10]).unwrap();
        let mut got: Vec<Vec<(usize, Vec<f32>)>> = vec![Vec::new(); 4];
        for (from, to, out) in [
            (0, 9, Output::AllHidden),
            (9, 10, Output::AllHidden),
            (10, 23, Output::LastHidden),
        ] {
            let lists: Vec<&[u32]> = vec![
                &ids[from..to],
                &others[0][10 + from / 9..11 + from / 9],
                &others[1][from.min(19)..to.min(20)],
                &others[2][from.min(19)..to.min(20)],
            ];
            let outs = [
                out,
                Output::LastLogits,
                Output::LastLogits,
                Output::AllLogits,
            ];
            let mut refs: Vec<&mut Session> = ss.iter_mut().collect();
            feed_batch_with(&mut refs, &lists, &outs, &mut |i, pos, v| {
                got[i].push((pos, v.to_vec()))
            })
            .unwrap();
            assert!(ss[0].logits().is_none() && ss[1].logits().is_some());
        }
        let positions: Vec<usize> = got[0].iter().map(|g| g.0).collect();
        assert_eq!(positions, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 22], "{}", c.name);
        for (pos, h) in &got[0] {
            assert!(
                h[..] == want[*pos][..],
                "{}: hidden state {pos} batched",
                c.name
            );
        }
        // The session wanting every position's logits got its own, alone.
        let vocab = e.config().vocab;
        let all = all_logits(e.model(), &o, &others[2][..20]);
        for (pos, l) in &got[3] {
            assert!(
                l[..] == all[pos * vocab..(pos + 1) * vocab],
                "{}: logits",
                c.name
            );
        }
        assert_eq!(got[3].len(), 20);
    }
}

#[test]
fn mean_and_last_pooling_and_normalization() {
    let c = &cases()[0];
    let e = Engine::new(load(c, 3), Packs::none(), None).unwrap();
    let ids = tokens(c.h.vocab, 17, 8);
    let rows = hidden_alone(&e, &ids);
    let dim = rows[0].len();
    let mut s = e.session(&StateOptions::default()).unwrap();
    let last = s.embed(&ids, Pooling::Last).unwrap();
    assert!(last == rows[16]);
    s.reset();
    let mean = s.embed(&ids, Pooling::Mean).unwrap();
    let want: Vec<f32> = (0..dim)
        .map(|j| (rows.iter().map(|r| f64::from(r[j])).sum::<f64>() / 17.0) as f32)
        .collect();
    assert!(mean == want);
    assert!(mean != last);
    let mut p = Pooler::new(Pooling::Mean, dim);
    rows.iter().for_each(|r| p.add(r));
    let n = p.finish(None, true);
    let norm: f64 = n.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    assert!((norm - 1.0).abs() < 1e-6, "{norm}");
    let mut m2 = mean.clone();
    l2_normalize(&mut m2);
    assert!(m2 == n);
    assert_eq!(p.finish(Some(8), false), mean[..8]);
    assert_eq!(e.pooling(), Pooling::Last, "a decoder's own pooling");
    s.reset();
    assert!(s.embed(&ids, Pooling::Cls).unwrap() == rows[0]);
}
