//! What every source shares once the model is described: the type of every matrix
//! ([`plan`], [`mix`] for `--target-bpw`), the importance matrix ([`imatrix`]), the
//! spec's row orders ([`permute`]) and the streamed write ([`stream`]).

pub mod imatrix;
pub mod mix;
pub mod permute;
pub mod plan;
pub mod stream;
