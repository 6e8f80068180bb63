//! What the server shows as it runs: the [`Frontend`] the binary implements and the
//! start-up summary ([`Ready`]).

use std::fmt;
use std::net::SocketAddr;

/// What the server shows as it runs (the binary prints it).
pub trait Frontend: Send + Sync {
    /// The server listens: print the address (and the memory per slot).
    fn ready(&self, ready: &Ready);
    /// One line for the log (a finished request, shutdown).
    fn log(&self, line: &str);
}

/// The server at start: where it listens and what each slot holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ready {
    pub addr: SocketAddr,
    pub model: String,
    pub slots: usize,
    /// Positions per slot.
    pub ctx: usize,
    /// Bytes of one slot's KV cache.
    pub kv_bytes: usize,
    /// Bytes of one slot's linear-attention state.
    pub delta_bytes: usize,
    pub chat: bool,
    pub threads: usize,
    /// Speculative decoding, in words (`None`: off).
    pub spec: Option<String>,
}

impl Ready {
    /// `http://HOST:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

fn mib(b: usize) -> String {
    format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0))
}

impl fmt::Display for Ready {
    /// The start-up summary: model, slots and the memory of each.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let per = self.kv_bytes + self.delta_bytes;
        write!(
            f,
            "{}: {} slot{} of {} positions; memory per slot: KV cache {}",
            self.model,
            self.slots,
            if self.slots == 1 { "" } else { "s" },
            self.ctx,
            mib(self.kv_bytes)
        )?;
        if self.delta_bytes > 0 {
            write!(f, " + linear-attention state {}", mib(self.delta_bytes))?;
        }
        write!(
            f,
            " ({} for all slots); chat template: {}; {} thread{}",
            mib(per * self.slots),
            if self.chat { "yes" } else { "none" },
            self.threads,
            if self.threads == 1 { "" } else { "s" }
        )?;
        match &self.spec {
            Some(s) => write!(f, "; speculative decoding: {s}"),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_names_the_memory_per_slot() {
        let r = Ready {
            addr: "127.0.0.1:8080".parse().unwrap(),
            model: "m".into(),
            slots: 4,
            ctx: 256,
            kv_bytes: 1 << 20,
            delta_bytes: 0,
            chat: false,
            threads: 2,
            spec: None,
        };
        assert_eq!(r.url(), "http://127.0.0.1:8080");
        assert_eq!(
            r.to_string(),
            "m: 4 slots of 256 positions; memory per slot: KV cache 1.0 MiB (4.0 MiB for all slots); chat template: none; 2 threads"
        );
    }
}
