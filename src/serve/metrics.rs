//! `/metrics`: the server's counters in Prometheus' text format (version 0.0.4): one
//! `# HELP` and `# TYPE` line per family, then its samples, `name{label="v"} value`.
//!
//! The model thread counts tokens, time to first token, drafts, slots, the queue and
//! the KV cache; the HTTP side counts requests by route and status. Everything is an
//! atomic or a short lock, so scraping never waits for a step.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Upper bounds (seconds) of the time-to-first-token histogram's buckets.
pub const TTFT_BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// The tokens-per-second gauges average over this much recent time.
pub const RATE_WINDOW: Duration = Duration::from_secs(10);
/// Samples of the token counts are kept at most this often.
const SAMPLE_EVERY: Duration = Duration::from_millis(100);

/// A histogram of seconds: counts per bucket (not cumulative), the sum, the count.
#[derive(Debug, Default)]
struct Histogram {
    buckets: [u64; TTFT_BUCKETS.len()],
    over: u64,
    sum: f64,
}

/// Every counter the server exports.
pub struct Metrics {
    started: Instant,
    /// (route, status) → requests answered.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    /// Prompt ids run through the model (cached ones not counted).
    pub prompt_tokens: AtomicU64,
    /// Tokens sampled.
    pub generated_tokens: AtomicU64,
    /// Ids embedded (/v1/embeddings).
    pub embedded_tokens: AtomicU64,
    /// Speculative decoding: tokens drafted, and those kept.
    pub draft_tokens: AtomicU64,
    pub draft_accepted: AtomicU64,
    /// Requests in a slot, and waiting for one.
    pub slots_busy: AtomicUsize,
    pub queued: AtomicUsize,
    pub slots: usize,
    /// Positions held by the slots' KV caches (a free slot keeps its ids for prefix
    /// reuse), and all they can hold.
    pub kv_used: AtomicUsize,
    pub kv_capacity: usize,
    ttft: Mutex<Histogram>,
    /// (when, prompt tokens, generated tokens), at most every `SAMPLE_EVERY`, over the
    /// last `RATE_WINDOW`.
    samples: Mutex<VecDeque<(Instant, u64, u64)>>,
}

impl Metrics {
    /// For `slots` slots of `ctx` positions.
    pub fn new(slots: usize, ctx: usize) -> Metrics {
        let now = Instant::now();
        Metrics {
            started: now,
            requests: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            embedded_tokens: AtomicU64::new(0),
            draft_tokens: AtomicU64::new(0),
            draft_accepted: AtomicU64::new(0),
            slots_busy: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
            slots,
            kv_used: AtomicUsize::new(0),
            kv_capacity: slots.saturating_mul(ctx),
            ttft: Mutex::new(Histogram::default()),
            samples: Mutex::new(VecDeque::from([(now, 0, 0)])),
        }
    }

    /// A request to `route` was answered with `status`.
    pub fn request(&self, route: &str, status: u16) {
        let mut m = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry((route.to_string(), status)).or_insert(0) += 1;
    }

    /// A request's first token came `d` after it took a slot.
    pub fn first_token(&self, d: Duration) {
        let s = d.as_secs_f64();
        let mut h = self.ttft.lock().unwrap_or_else(|p| p.into_inner());
        match TTFT_BUCKETS.iter().position(|&b| s <= b) {
            Some(i) => h.buckets[i] += 1,
            None => h.over += 1,
        }
        h.sum += s;
    }

    /// Records the token counts for the rates (the model thread, after each step).
    pub fn sample(&self) {
        let now = Instant::now();
        let mut q = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        if q.back().is_some_and(|b| now - b.0 < SAMPLE_EVERY) {
            return;
        }
        q.push_back((
            now,
            self.prompt_tokens.load(Relaxed),
            self.generated_tokens.load(Relaxed),
        ));
        // Keep one sample at or before the window's start.
        while q.len() > 2 && now - q[1].0 >= RATE_WINDOW {
            q.pop_front();
        }
    }

    /// (prompt, generated) tokens per second over the last `RATE_WINDOW` (since the
    /// latest sample before it).
    fn rates(&self, now: Instant) -> (f64, f64) {
        let q = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        let (p, g) = (
            self.prompt_tokens.load(Relaxed),
            self.generated_tokens.load(Relaxed),
        );
        let from = q
            .iter()
            .rev()
            .find(|s| now - s.0 >= RATE_WINDOW)
            .or(q.front())
            .copied();
        match from {
            Some((t, p0, g0)) if now > t => {
                let dt = (now - t).as_secs_f64().max(1e-3);
                (
                    p.saturating_sub(p0) as f64 / dt,
                    g.saturating_sub(g0) as f64 / dt,
                )
            }
            _ => (0.0, 0.0),
        }
    }

    /// The text of `/metrics`.
    pub fn render(&self) -> String {
        let now = Instant::now();
        let mut out = String::new();
        let name = family_line(
            &mut out,
            "requests_total",
            "counter",
            "HTTP requests answered, by route and status code.",
        );
        for ((route, status), n) in self
            .requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "{name}{{route=\"{}\",status=\"{status}\"}} {n}",
                escape(route)
            );
        }
        let (pr, gr) = self.rates(now);
        let used = self.kv_used.load(Relaxed);
        let count = |a: &AtomicU64| a.load(Relaxed) as f64;
        let families: [(&str, &str, &str, f64); 14] = [
            (
                "prompt_tokens_total",
                "counter",
                "Prompt tokens run through the model (cached prefixes not counted).",
                count(&self.prompt_tokens),
            ),
            (
                "generated_tokens_total",
                "counter",
                "Tokens generated.",
                count(&self.generated_tokens),
            ),
            (
                "embedding_tokens_total",
                "counter",
                "Tokens embedded by /v1/embeddings.",
                count(&self.embedded_tokens),
            ),
            (
                "draft_tokens_total",
                "counter",
                "Speculative decoding: tokens drafted.",
                count(&self.draft_tokens),
            ),
            (
                "draft_accepted_tokens_total",
                "counter",
                "Speculative decoding: drafted tokens the model kept.",
                count(&self.draft_accepted),
            ),
            (
                "prompt_tokens_per_second",
                "gauge",
                "Prompt tokens per second over the last 10 seconds.",
                pr,
            ),
            (
                "generated_tokens_per_second",
                "gauge",
                "Generated tokens per second over the last 10 seconds.",
                gr,
            ),
            (
                "requests_queued",
                "gauge",
                "Requests waiting for a slot (queue depth).",
                self.queued.load(Relaxed) as f64,
            ),
            (
                "slots_busy",
                "gauge",
                "Slots running a request.",
                self.slots_busy.load(Relaxed) as f64,
            ),
            ("slots_total", "gauge", "Slots.", self.slots as f64),
            (
                "kv_cache_used_tokens",
                "gauge",
                "Positions the slots' KV caches hold (free slots keep theirs for prefix reuse).",
                used as f64,
            ),
            (
                "kv_cache_capacity_tokens",
                "gauge",
                "Positions all slots' KV caches can hold.",
                self.kv_capacity as f64,
            ),
            (
                "kv_cache_usage_ratio",
                "gauge",
                "Used over capacity of the KV caches.",
                if self.kv_capacity > 0 {
                    used as f64 / self.kv_capacity as f64
                } else {
                    0.0
                },
            ),
            (
                "uptime_seconds",
                "gauge",
                "Seconds since the server started.",
                (now - self.started).as_secs_f64(),
            ),
        ];
        for (n, kind, help, v) in families {
            let name = family_line(&mut out, n, kind, help);
            let _ = writeln!(out, "{name} {}", number(v));
        }
        let name = family_line(
            &mut out,
            "time_to_first_token_seconds",
            "histogram",
            "Seconds from a request taking its slot to its first token.",
        );
        let h = self.ttft.lock().unwrap_or_else(|p| p.into_inner());
        let mut acc = 0;
        for (b, n) in TTFT_BUCKETS.iter().zip(h.buckets) {
            acc += n;
            let _ = writeln!(out, "{name}_bucket{{le=\"{}\"}} {acc}", number(*b));
        }
        let count = acc + h.over;
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum {}", number(h.sum));
        let _ = writeln!(out, "{name}_count {count}");
        out
    }
}

/// Writes a family's HELP and TYPE lines; returns its full name.
fn family_line(out: &mut String, name: &str, kind: &str, help: &str) -> String {
    let _ = writeln!(
        out,
        "# HELP krafla_{name} {help}\n# TYPE krafla_{name} {kind}"
    );
    format!("krafla_{name}")
}

/// A sample value as Prometheus reads it.
fn number(v: f64) -> String {
    if v.is_finite() {
        format!("{v}")
    } else if v.is_nan() {
        "NaN".into()
    } else if v > 0.0 {
        "+Inf".into()
    } else {
        "-Inf".into()
    }
}

/// A label value with `\`, `"` and newlines escaped.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_has_every_family() {
        let m = Metrics::new(2, 100);
        m.request("/v1/completions", 200);
        m.request("/v1/completions", 200);
        m.request("/x\"", 404);
        m.first_token(Duration::from_millis(30));
        m.first_token(Duration::from_secs(100));
        m.kv_used.store(50, Relaxed);
        let t = m.render();
        assert!(
            t.contains("krafla_requests_total{route=\"/v1/completions\",status=\"200\"} 2\n"),
            "{t}"
        );
        assert!(t.contains("route=\"/x\\\"\",status=\"404\"} 1"), "{t}");
        assert!(
            t.contains("krafla_time_to_first_token_seconds_bucket{le=\"0.05\"} 1\n"),
            "{t}"
        );
        assert!(
            t.contains("krafla_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2\n"),
            "{t}"
        );
        assert!(
            t.contains("krafla_time_to_first_token_seconds_count 2\n"),
            "{t}"
        );
        assert!(t.contains("krafla_kv_cache_usage_ratio 0.25\n"), "{t}");
        assert!(
            t.contains("# TYPE krafla_slots_total gauge\nkrafla_slots_total 2\n"),
            "{t}"
        );
    }
}
