//! What a device holds and did: the public [`DeviceReport`] and the counters every device
//! keeps of what a GPU charges ([`Traffic`]).

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;

use crate::profile::ratio;

/// What the device holds and did: [`Engine::device_report`](crate::Engine::device_report).
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct DeviceReport {
    /// `none`, `sim` or `cuda:N (name)`.
    pub kind: String,
    /// Why no device runs anything, when none does although one was asked for (`--gpu auto`
    /// without a usable GPU, a budget of 0, ...).
    pub note: Option<String>,
    /// The device memory budget.
    pub budget_bytes: u64,
    /// The most device memory held at once.
    pub peak_bytes: u64,
    /// Bytes of the device's work buffers (the activations of a device step).
    pub work_bytes: u64,
    /// Bytes of the sequences' KV stores of the layers the device runs.
    pub kv_bytes: u64,
    /// Layers the device runs whole (attention, and the FFN where it holds it), of
    /// `layers_total`.
    pub layers: usize,
    /// Layers of the model.
    pub layers_total: usize,
    /// Dense matrices held on the device, and bytes.
    pub dense_matrices: usize,
    /// Their bytes.
    pub dense_bytes: u64,
    /// Dense matrices of the model that could have been placed there.
    pub dense_total: usize,
    /// FFN neuron rows held on the device, over all layers.
    pub ffn_rows: usize,
    /// FFN neurons of the model.
    pub ffn_total: usize,
    /// Where the neuron placement came from (`reused <file>`, `built <file>: reason`, ...).
    pub placement: String,
    /// Active FFN neurons computed on the device so far (all evaluations).
    pub active_device: u64,
    /// Active FFN neurons computed on the CPU so far.
    pub active_cpu: u64,
    /// Pieces of work the simulated device finished later than its speed model asked.
    pub overruns: u64,
    /// Tokens evaluated with the device (all evaluations), the denominator of the per-token
    /// figures below.
    pub tokens: u64,
    /// Kernels launched on the device so far.
    pub launches: u64,
    /// Times the host waited for the device so far.
    pub host_waits: u64,
    /// Bytes copied between host and device so far after loading (inputs, outputs, KV
    /// copies, parameters of the steps).
    pub link_bytes: u64,
    /// Programs captured as graphs so far (each instantiated while decoding, the second time
    /// its program is seen; `--graphs on`).
    pub graphs_captured: u64,
    /// Seconds the evaluations on the device took on its timeline: on the modelled card
    /// beside this machine's CPU for a simulated device playing one ([`SimSpeed`]: the CPU's
    /// real work, the card's modelled work and copies, the waits between), else the wall
    /// clock. Over [`DeviceReport::tokens`].
    ///
    /// [`SimSpeed`]: super::SimSpeed
    pub eval_secs: f64,
    /// Of [`DeviceReport::tokens`], those of decode steps (one token of each sequence).
    pub decode_tokens: u64,
    /// The decode steps' seconds on the device's timeline.
    pub decode_secs: f64,
    /// Host staging buffers made after load (a copy wider than the step's widest; 0 in a
    /// step).
    pub late_allocations: u64,
}

impl DeviceReport {
    /// Share of the FFN rows held on the device.
    pub fn resident_share(&self) -> f64 {
        ratio(self.ffn_rows as u64, self.ffn_total as u64)
    }

    /// Share of the active FFN neurons computed on the device.
    pub fn active_share(&self) -> f64 {
        ratio(self.active_device, self.active_device + self.active_cpu)
    }

    /// Kernel launches per token evaluated.
    pub fn launches_per_token(&self) -> f64 {
        per_token(self.launches, self.tokens)
    }

    /// Host waits (synchronizations) per token evaluated.
    pub fn syncs_per_token(&self) -> f64 {
        per_token(self.host_waits, self.tokens)
    }

    /// Seconds per token evaluated on the device's timeline ([`DeviceReport::eval_secs`]).
    pub fn secs_per_token(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.eval_secs / self.tokens as f64
        }
    }

    /// Decode tokens per second on the device's timeline: on the modelled card for a
    /// simulated device playing one (0 before any decode step).
    pub fn decode_tokens_per_sec(&self) -> f64 {
        if self.decode_secs > 0.0 {
            self.decode_tokens as f64 / self.decode_secs
        } else {
            0.0
        }
    }

    /// Bytes over the host link per token evaluated.
    pub fn link_bytes_per_token(&self) -> f64 {
        per_token(self.link_bytes, self.tokens)
    }
}

fn per_token(n: u64, tokens: u64) -> f64 {
    if tokens == 0 {
        0.0
    } else {
        n as f64 / tokens as f64
    }
}

/// What a device has charged since it started: kernel launches, host waits and bytes over the
/// host link; and what it made after load: programs captured as graphs, host staging buffers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Traffic {
    pub(crate) launches: u64,
    pub(crate) waits: u64,
    pub(crate) link_bytes: u64,
    pub(crate) captures: u64,
    pub(crate) late_allocs: u64,
}

impl std::ops::Sub for Traffic {
    type Output = Traffic;

    fn sub(self, o: Traffic) -> Traffic {
        Traffic {
            launches: self.launches - o.launches,
            waits: self.waits - o.waits,
            link_bytes: self.link_bytes - o.link_bytes,
            captures: self.captures - o.captures,
            late_allocs: self.late_allocs - o.late_allocs,
        }
    }
}

/// The counters of [`Traffic`], shared by a device's threads.
#[derive(Debug, Default)]
pub(crate) struct TrafficCounters {
    launches: AtomicU64,
    waits: AtomicU64,
    link_bytes: AtomicU64,
    captures: AtomicU64,
    late_allocs: AtomicU64,
}

impl TrafficCounters {
    /// `n` kernel launches.
    pub(crate) fn launched(&self, n: u64) {
        self.launches.fetch_add(n, Relaxed);
    }

    /// One host wait.
    pub(crate) fn waited(&self) {
        self.waits.fetch_add(1, Relaxed);
    }

    /// `bytes` over the host link.
    pub(crate) fn moved(&self, bytes: u64) {
        self.link_bytes.fetch_add(bytes, Relaxed);
    }

    /// One program captured as a graph.
    pub(crate) fn captured(&self) {
        self.captures.fetch_add(1, Relaxed);
    }

    /// One host staging buffer made after load.
    pub(crate) fn allocated_late(&self) {
        self.late_allocs.fetch_add(1, Relaxed);
    }

    pub(crate) fn get(&self) -> Traffic {
        Traffic {
            launches: self.launches.load(Relaxed),
            waits: self.waits.load(Relaxed),
            link_bytes: self.link_bytes.load(Relaxed),
            captures: self.captures.load(Relaxed),
            late_allocs: self.late_allocs.load(Relaxed),
        }
    }
}
