//! The model description: what every reader fills in (`hf::config` from config.json,
//! `gguf::desc` from GGUF metadata, `gguf::export` from an `.mlb` header) and every
//! writer reads, one typed section per concern, checked once ([`check`]) and turned
//! into the `.mlb` header ([`header`]).
//!
//! Sections: [`Dims`] (sizes), [`Ffn`] (the feed-forward), [`Vocab`], [`Rope`], the
//! sliding window, per-layer [`LayerFlags`], [`AttnScales`], and the gated delta rule's
//! [`LinearDims`]. A mixture-of-experts model adds its experts to [`Ffn`] (count,
//! experts per token, expert FFN size, routing, a shared expert) and a dense-or-experts
//! kind to [`LayerFlags`]; the readers fill them in their `ffn` and `layers` sections.

pub mod check;
pub mod header;
pub mod model;

pub use model::{
    AttnScales, Dims, Ffn, LayerFlags, LinearDims, ModelDesc, Moe, Rope, RopeScaling, Vocab, Yarn,
};
