//! The covariance extension read and written through whole MLI files.

use super::cov::*;
use super::{parse as parse_mli, Mli, Slot, VERSION};
use crate::format::Status;

/// A 2-layer MLI1 (dim 32, hidden 64, q_dim 32) with covariances of layer 1's W2
/// input and of the classifier's.
fn sample() -> (Mli, Vec<f64>, Vec<f64>, Vec<u8>) {
    let mut m = Mli::new(2, 32, 64, 32);
    m.tokens = 5;
    m.cls_tokens = 5;
    let w2: Vec<f64> = (0..64 * 65 / 2).map(|i| (i % 7) as f64).collect();
    let cls: Vec<f64> = (0..32 * 33 / 2).map(|i| i as f64 * 0.5).collect();
    let data = [
        CovData {
            layer: None,
            slot: CovSlot::Cls,
            expert: None,
            tokens: 5,
            n: 32,
            tri: &cls,
        },
        CovData {
            layer: Some(1),
            slot: CovSlot::Layer(Slot::W2),
            expert: None,
            tokens: 5,
            n: 64,
            tri: &w2,
        },
    ];
    let b = write(m.to_bytes(), &data);
    (m, w2, cls, b)
}

#[test]
fn roundtrip_sorted_and_flagged() {
    let (m, w2, cls, b) = sample();
    assert_eq!(u32_at(&b, 4), VERSION | FLAG);
    let p = parse_mli(&b).unwrap();
    assert_eq!(p.sums, m.sums);
    let c = p.covariance.as_ref().unwrap();
    assert_eq!(c.entries.len(), 2);
    assert_eq!(c.entries[0].layer, Some(1)); // written sorted
    let e = c.find(Some(1), CovSlot::Layer(Slot::W2)).unwrap();
    assert_eq!((e.n, e.tokens), (64, 5));
    assert_eq!(values(&b, e), w2);
    assert_eq!(values(&b, c.find(None, CovSlot::Cls).unwrap()), cls);
    assert!(c.find(Some(0), CovSlot::Layer(Slot::W2)).is_none());
    assert_eq!(c.value_bytes(), 4 * (64 * 65 / 2 + 32 * 33 / 2));
    // Files without the section are as before.
    assert_eq!(parse_mli(&m.to_bytes()).unwrap().covariance, None);
}

#[test]
fn errors() {
    let (m, _, _, good) = sample();
    let body = m.to_bytes().len();
    let st = |b: &[u8]| parse_mli(b).unwrap_err();
    let set = |b: &mut Vec<u8>, at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    // The flag without a section; a section without the flag.
    let mut b = m.to_bytes();
    set(&mut b, 4, VERSION | FLAG);
    assert_eq!(st(&b).status, Status::Format);
    let mut b = good.clone();
    set(&mut b, 4, VERSION);
    assert_eq!(st(&b).field, "file");
    // Another unknown version bit.
    let mut b = good.clone();
    set(&mut b, 4, VERSION | FLAG | 1 << 17);
    assert_eq!(st(&b).field, "version");
    let e0 = body + 8;
    for (at, v, field, status) in [
        (body, 0, "covariance.n_entries", Status::Format),
        (body + 4, 1, "covariance.reserved", Status::Format),
        (e0 + 4, 9, "covariance.entries[0].slot", Status::Format),
        (e0, 2, "covariance.entries[0].layer", Status::Format),
        (e0 + 8, 3, "covariance.entries[0].expert", Status::Format),
        (e0 + 12, 32, "covariance.entries[0].n", Status::Shape),
        (e0 + 24, 0, "covariance.entries[1].layer", Status::Format),
    ] {
        let mut b = good.clone();
        set(&mut b, at, v);
        let e = st(&b);
        assert_eq!((e.field.as_str(), e.status), (field, status), "{e}");
    }
    // Entry 1 out of order: both the classifier.
    let mut b = good.clone();
    set(&mut b, e0, NONE);
    set(&mut b, e0 + 4, 4);
    set(&mut b, e0 + 12, 32);
    assert_eq!(st(&b).field, "covariance.entries[1].layer");
    assert_eq!(st(&good[..good.len() - 4]).field, "file");
    // A negative diagonal (row 1's, after row 0's 64 values); a NaN off it.
    let vals = e0 + 2 * 24;
    let mut b = good.clone();
    b[vals + 4 * 64..vals + 4 * 65].copy_from_slice(&(-1.0f32).to_le_bytes());
    assert_eq!(st(&b).field, "covariance.entries[0].values[64]");
    let mut b = good.clone();
    b[vals + 4..vals + 8].copy_from_slice(&f32::NAN.to_le_bytes());
    assert_eq!(st(&b).field, "covariance.entries[0].values[1]");
    let mut b = good;
    b[vals + 4 * 65..vals + 4 * 66].copy_from_slice(&(-1.0f32).to_le_bytes());
    assert!(parse_mli(&b).is_ok(), "off-diagonal values may be negative");
}

/// A MoE layer's W2 slot: routed expert e's ew2 input (expert_hidden wide) and, without
/// an expert, the shared expert's sw2 input (shared_hidden wide); an expert index
/// anywhere else, or a shared entry where the layer has no shared expert, is refused.
#[test]
fn experts_in_a_moe_layer() {
    use super::MoeSums;
    // Layer 1 of 2 is MoE: 4 experts of 16, a shared expert of 8; layer 0 dense (64).
    let mli = |shared: usize| {
        let mut m = Mli::new(2, 32, 64, 32).with_moe(MoeSums::new(vec![1], 4, 32, 16, shared));
        m.tokens = 5;
        m
    };
    let tri = |n: usize| -> Vec<f64> { (0..n * (n + 1) / 2).map(|i| (i % 5) as f64).collect() };
    let (t16, t8, t64) = (tri(16), tri(8), tri(64));
    let file = |m: &Mli, data: &[(usize, Slot, Option<u32>, &[f64])]| {
        let data: Vec<CovData> = data
            .iter()
            .map(|&(l, slot, expert, tri)| CovData {
                layer: Some(l),
                slot: CovSlot::Layer(slot),
                expert,
                tokens: 5,
                n: (((8 * tri.len() + 1) as f64).sqrt() as usize - 1) / 2,
                tri,
            })
            .collect();
        write(m.to_bytes(), &data)
    };
    let m = mli(8);
    let good = file(
        &m,
        &[
            (1, Slot::W2, None, &t8),
            (1, Slot::W2, Some(2), &t16),
            (0, Slot::W2, None, &t64),
        ],
    );
    let p = parse_mli(&good).unwrap();
    let c = p.covariance.unwrap();
    // Sorted by (layer, slot, expert), the expert-less entry after the experts'.
    let keys: Vec<_> = c.entries.iter().map(|e| (e.layer, e.expert, e.n)).collect();
    assert_eq!(
        keys,
        [
            (Some(0), None, 64),
            (Some(1), Some(2), 16),
            (Some(1), None, 8)
        ]
    );
    let w2 = CovSlot::Layer(Slot::W2);
    assert_eq!(c.find_expert(Some(1), w2, Some(2)).unwrap().n, 16);
    assert_eq!(c.find(Some(1), w2).unwrap().n, 8);
    assert!(c.find_expert(Some(1), w2, Some(1)).is_none());

    let refused = |m: &Mli, data: &[(usize, Slot, Option<u32>, &[f64])]| {
        let e = parse_mli(&file(m, data)).unwrap_err();
        (e.field.clone(), e.status, e.to_string())
    };
    for (m, data, field, says) in [
        (
            mli(8),
            vec![(1, Slot::W2, Some(4), &t16[..])],
            "expert",
            "n_experts (4)",
        ),
        (
            mli(8),
            vec![(0, Slot::W2, Some(0), &t64[..])],
            "expert",
            "only a mixture-of-experts",
        ),
        (
            mli(8),
            vec![(1, Slot::W13, Some(0), &tri(32)[..])],
            "expert",
            "W2 slot only",
        ),
        (
            mli(0),
            vec![(1, Slot::W2, None, &t8[..])],
            "expert",
            "without a shared expert",
        ),
        (
            mli(8),
            vec![(1, Slot::W2, Some(0), &t8[..])],
            "n",
            "16 channels",
        ),
    ] {
        let (f, status, msg) = refused(&m, &data);
        assert_eq!(f, format!("covariance.entries[0].{field}"), "{msg}");
        assert_eq!(
            status,
            if field == "n" {
                Status::Shape
            } else {
                Status::Format
            }
        );
        assert!(msg.contains(says), "{msg}");
    }
}
