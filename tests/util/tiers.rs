//! The kernel tiers and thread counts the tests sweep: scalar == every tier, on 1 to 3
//! threads, reading weights from the map and packed.

use krafla::format::mlb::Mlb;
use krafla::kernels::pool::Pool;
use krafla::kernels::{self, Kernels, Tier};
use krafla::model::{Model, Packs};

/// Every kernel tier this CPU runs, the scalar reference first.
pub fn all_kernels() -> Vec<Kernels> {
    kernels::supported_tiers()
        .into_iter()
        .map(|t| Kernels::for_tier(t).unwrap())
        .collect()
}

/// The scalar reference tier.
pub fn scalar() -> Kernels {
    Kernels::for_tier(Tier::Scalar).unwrap()
}

/// Pools of 1, 2 and 3 threads for one test: not shared with tests running beside it,
/// where a busy pool would run a step on the caller's thread alone.
pub fn pools() -> [&'static Pool; 3] {
    [Pool::leak(1), Pool::leak(2), Pool::leak(3)]
}

/// Runs `f` on every tier this CPU has, in `pools` (of 1 to 3 threads), on `model` (read
/// from the map) and on a copy with the tier's packed weights (and `model`'s BF16
/// activations); `f` gets the tier, the
/// model and a label naming the tier, the weights and the thread count. Returns the
/// tiers that packed some matrix of `mlb`.
pub fn on_every_tier(
    pools: &[&'static Pool],
    mlb: &Mlb,
    model: &Model,
    mut f: impl FnMut(Tier, &Model, &str),
) -> Vec<Tier> {
    let mut packed = Vec::new();
    for t in kernels::supported_tiers() {
        let packs = Packs::new(mlb, &Kernels::for_tier(t).unwrap()).unwrap();
        if packs.bytes() > 0 {
            packed.push(t);
        }
        let pm = Model::with_packs(mlb, &packs)
            .unwrap()
            .with_half_acts(model.half_acts());
        for (threads, pool) in pools.iter().enumerate() {
            for (m, how) in [(model, "read from the map"), (&pm, "packed")] {
                let what = format!("tier {t}, {how}, {} threads", threads + 1);
                pool.install(|| kernels::with_tier(t, || f(t, m, &what)))
                    .unwrap();
            }
        }
    }
    packed
}
