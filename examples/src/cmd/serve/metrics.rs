//! The server's counters and gauges, and their Prometheus text (`GET /metrics`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Counters shared by the handlers and the decoding thread.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Responses by HTTP status.
    requests: Mutex<BTreeMap<u16, u64>>,
    /// Prompt tokens evaluated.
    pub tokens_in: AtomicU64,
    /// Tokens generated.
    pub tokens_out: AtomicU64,
    /// Sequences ended because their client went away.
    pub cancelled: AtomicU64,
    live: AtomicU64,
    queued: AtomicU64,
    /// f64 bits.
    density: AtomicU64,
    /// f64 bits.
    rate: AtomicU64,
    /// Batches the decoding thread evaluated.
    steps: AtomicU64,
    /// Nanoseconds it spent evaluating them.
    step_nanos: AtomicU64,
    /// Sequences in them, summed.
    step_sequences: AtomicU64,
    /// Tokens in them, summed.
    step_tokens: AtomicU64,
}

impl Metrics {
    /// Counts a response.
    pub fn response(&self, status: u16) {
        *self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(status)
            .or_default() += 1;
    }

    /// Sequences decoding and waiting.
    pub fn set_load(&self, live: usize, queued: usize) {
        self.live.store(live as u64, Ordering::Relaxed);
        self.queued.store(queued as u64, Ordering::Relaxed);
    }

    /// Mean FFN density so far.
    pub fn set_density(&self, d: f64) {
        self.density.store(d.to_bits(), Ordering::Relaxed);
    }

    /// Generated tokens per second since the start.
    pub fn set_rate(&self, r: f64) {
        self.rate.store(r.to_bits(), Ordering::Relaxed);
    }

    /// Counts one evaluated batch of `sequences` sequences and `tokens` tokens that took
    /// `elapsed`.
    pub fn step(&self, sequences: usize, tokens: usize, elapsed: std::time::Duration) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.step_nanos
            .fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
        self.step_sequences
            .fetch_add(sequences as u64, Ordering::Relaxed);
        self.step_tokens.fetch_add(tokens as u64, Ordering::Relaxed);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let f = |a: &AtomicU64| f64::from_bits(a.load(Ordering::Relaxed));
        let mut s = String::new();
        s.push_str("# HELP powerinfer_requests_total HTTP responses by status.\n");
        s.push_str("# TYPE powerinfer_requests_total counter\n");
        for (status, n) in self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            s.push_str(&format!(
                "powerinfer_requests_total{{status=\"{status}\"}} {n}\n"
            ));
        }
        let mut line = |name: &str, kind: &str, help: &str, v: String| {
            s.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
            ));
        };
        line(
            "powerinfer_prompt_tokens_total",
            "counter",
            "Prompt tokens evaluated.",
            self.tokens_in.load(Ordering::Relaxed).to_string(),
        );
        line(
            "powerinfer_generated_tokens_total",
            "counter",
            "Tokens generated.",
            self.tokens_out.load(Ordering::Relaxed).to_string(),
        );
        line(
            "powerinfer_cancelled_total",
            "counter",
            "Sequences ended because their client went away.",
            self.cancelled.load(Ordering::Relaxed).to_string(),
        );
        line(
            "powerinfer_tokens_per_second",
            "gauge",
            "Generated tokens per second since the start.",
            format!("{:.3}", f(&self.rate)),
        );
        line(
            "powerinfer_queue_length",
            "gauge",
            "Requests waiting for a decoding slot.",
            self.queued.load(Ordering::Relaxed).to_string(),
        );
        line(
            "powerinfer_live_sequences",
            "gauge",
            "Sequences decoding.",
            self.live.load(Ordering::Relaxed).to_string(),
        );
        let steps = self.steps.load(Ordering::Relaxed);
        let per_step = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 / steps.max(1) as f64;
        line(
            "powerinfer_steps_total",
            "counter",
            "Batches the decoding thread evaluated.",
            steps.to_string(),
        );
        line(
            "powerinfer_step_seconds_total",
            "counter",
            "Time the decoding thread spent evaluating batches.",
            format!(
                "{:.6}",
                self.step_nanos.load(Ordering::Relaxed) as f64 / 1e9
            ),
        );
        line(
            "powerinfer_busy_slots_per_step",
            "gauge",
            "Mean sequences per evaluated batch (llama.cpp's n_busy_slots_per_decode).",
            format!("{:.3}", per_step(&self.step_sequences)),
        );
        line(
            "powerinfer_tokens_per_step",
            "gauge",
            "Mean tokens (prompt and generated) per evaluated batch.",
            format!("{:.3}", per_step(&self.step_tokens)),
        );
        line(
            "powerinfer_ffn_density",
            "gauge",
            "Mean share of FFN neurons computed per token.",
            format!("{:.5}", f(&self.density)),
        );
        s
    }
}
