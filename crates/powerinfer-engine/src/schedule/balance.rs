//! Run-time division of each layer's active neurons between the device and the CPU (Q-Infer's
//! dynamic scheduling, done for real on the device layer).
//!
//! Per layer with a hot slice ([`LayerBalance`]):
//!
//! - **held** neurons: the rows the device's slice holds (one per slot, fixed VRAM);
//! - **enabled** neurons: the held ones the device computes; an active held neuron that is
//!   not enabled is computed by the CPU from its own copy (the device's scores for it are set
//!   below any threshold, so the device skips it). Moving the enabled boundary costs nothing
//!   but a mask;
//! - **balancing**: after each evaluation the CPU's and the device's times for the layer are
//!   compared; outside a dead band, the coldest enabled neurons go to the CPU (device slower)
//!   or the hottest disabled held ones to the device (CPU slower), as many as the measured
//!   per-row costs say would even the times, at most a bounded share per step;
//! - **the hot-neuron cache**: a sliding window of each neuron's activations; every few
//!   tokens, held neurons that went cold are swapped for outside neurons that got hot when
//!   the CPU time the swap saves over the window exceeds the time of copying the rows
//!   ([`Device::replace_hot`]). The VRAM used never changes.
//!
//! Which device computes a row changes only the order in which partial sums are added: the
//! results equal the static schedule's up to floating-point reordering.

use std::collections::VecDeque;
use std::time::Duration;

use crate::device::{Device, HotId, HotSpec, HotSwap};
use crate::error::Result;
use crate::profile::ratio;

/// A neuron the slice does not hold.
const NOT_HELD: u32 = u32::MAX;

/// Weight of the static activation statistics in a neuron's activity, in tokens.
const PRIOR_TOKENS: f64 = 16.0;

/// Evaluations of at most this many tokens are decode steps (a token of each of a few
/// sequences): they move the split and the cache; longer ones (prompts) are only recorded.
pub(crate) const DECODE_MAX_TOKENS: usize = 16;

/// Evaluations averaged before the balancer acts (after a start, a move or a change of batch
/// size), so that it acts on the split it made.
const SETTLE: u32 = 2;

/// How the device and the CPU share each layer's work while decoding
/// ([`DeviceOptions::balance`](super::DeviceOptions::balance)).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct BalanceOptions {
    /// Move each layer's enabled set from the two sides' measured times (`true`, the default)
    /// or keep PowerInfer's static split: every held neuron computed on the device.
    pub balance: bool,
    /// Relative difference `|device − cpu| / (device + cpu)` within which a layer's split stays.
    pub dead_band: f64,
    /// Largest share of a layer's held work (expected active rows) one rebalance moves.
    pub max_step: f64,
    /// Swap held neurons that went cold for outside neurons that got hot (the dynamic
    /// hot-neuron cache).
    pub hot_cache: bool,
    /// Tokens of the sliding window of activations.
    pub window: usize,
    /// Decode tokens between two looks of the cache at a layer.
    pub interval: usize,
    /// Largest share of a layer's held rows one look of the cache replaces.
    pub max_swap: f64,
    /// Measure both sides' speeds when the model loads and start each layer's split from
    /// them ([`Calibration`](super::Calibration)); else start from PowerInfer's (every held
    /// neuron on the device).
    pub calibrate: bool,
    /// File caching calibrations per machine and device (`None`: measure at every load).
    pub calibration_cache: Option<std::path::PathBuf>,
    /// Q-Infer's placement: hold only the neurons that balance the two sides at the measured
    /// speed ratio ([`powerinfer_placement::solve_balanced`]), leaving the rest of the budget
    /// unused, instead of PowerInfer's (fill the budget with the hottest neurons).
    pub balanced_placement: bool,
    /// Split each layer's attention between the device (the first positions, over its mirror
    /// of them) and the CPU (the rest) while one sequence decodes; the mirror of the context's
    /// KV rows is reserved before the FFN's rows.
    pub attention_split: bool,
    /// Largest change of a layer's share of positions on the device per move.
    pub attention_step: f64,
}

impl Default for BalanceOptions {
    fn default() -> Self {
        BalanceOptions {
            balance: true,
            dead_band: 0.05,
            max_step: 0.05,
            hot_cache: true,
            window: 32,
            interval: 8,
            max_swap: 0.25,
            calibrate: true,
            calibration_cache: None,
            balanced_placement: false,
            attention_split: false,
            attention_step: 0.05,
        }
    }
}

/// What the scheduling did in one layer ([`BalanceReport::layers`]).
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct LayerBalance {
    /// Layer index.
    pub layer: usize,
    /// Neuron rows the device holds.
    pub held: usize,
    /// Of which it computes (the rest are computed on the CPU).
    pub enabled: usize,
    /// Evaluations with a device part.
    pub evals: u64,
    /// The CPU's time on its part, over those evaluations.
    pub cpu: Duration,
    /// The device's time on its part.
    pub device: Duration,
    /// Active neurons computed on the CPU.
    pub active_cpu: u64,
    /// Active neurons computed on the device.
    pub active_device: u64,
    /// Active neurons (predicted), over all tokens.
    pub active: u64,
    /// Of which the device held.
    pub held_active: u64,
    /// Times the enabled set moved.
    pub rebalances: u64,
    /// Neurons those moves took between the sides.
    pub moved: u64,
    /// Evaluations of the layer when its enabled set last moved.
    pub last_move: u64,
    /// Evaluations of the layer when its two sides' times first came within the dead band
    /// (0: not yet).
    pub settled_at: u64,
    /// Times the hot-neuron cache replaced rows.
    pub migrations: u64,
    /// Rows it replaced.
    pub migrated_rows: u64,
    /// Time of those copies.
    pub migration_time: Duration,
    /// `(device − cpu) / (device + cpu)` of the last evaluations (averaged).
    pub imbalance: f64,
}

impl LayerBalance {
    /// Share of the active neurons the device held (the recall of the device's set).
    pub fn recall(&self) -> f64 {
        ratio(self.held_active, self.active)
    }

    /// Share of the active neurons computed on the device.
    pub fn device_share(&self) -> f64 {
        ratio(self.active_device, self.active_cpu + self.active_device)
    }
}

/// What the run-time scheduling did: [`Engine::balance_report`](crate::Engine::balance_report).
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct BalanceReport {
    /// The options it ran with.
    pub options: BalanceOptions,
    /// Per layer with neurons on the device.
    pub layers: Vec<LayerBalance>,
    /// The measured speeds it started from, if the engine calibrated at load.
    pub calibration: Option<super::calibrate::Calibration>,
    /// Per layer, the attention split (empty when off).
    pub attention: Vec<super::attention::AttentionBalance>,
}

impl BalanceReport {
    /// All layers' counters added up (`last_move` and `settled_at`: the latest layer's; `layer` and
    /// `imbalance` are meaningless there).
    pub fn total(&self) -> LayerBalance {
        let mut t = LayerBalance::default();
        for l in &self.layers {
            t.held += l.held;
            t.enabled += l.enabled;
            t.evals += l.evals;
            t.cpu += l.cpu;
            t.device += l.device;
            t.active_cpu += l.active_cpu;
            t.active_device += l.active_device;
            t.active += l.active;
            t.held_active += l.held_active;
            t.rebalances += l.rebalances;
            t.moved += l.moved;
            t.last_move = t.last_move.max(l.last_move);
            t.settled_at = t.settled_at.max(l.settled_at);
            t.migrations += l.migrations;
            t.migrated_rows += l.migrated_rows;
            t.migration_time += l.migration_time;
        }
        t
    }
}

/// The last `len` tokens' active neurons of a layer, and how often each neuron is among them.
#[derive(Debug)]
pub(crate) struct ActivationWindow {
    len: usize,
    tokens: VecDeque<Vec<u32>>,
    counts: Vec<u16>,
}

impl ActivationWindow {
    pub(crate) fn new(n_ff: usize, len: usize) -> ActivationWindow {
        ActivationWindow {
            len: len.clamp(1, u16::MAX as usize),
            tokens: VecDeque::new(),
            counts: vec![0; n_ff],
        }
    }

    /// Adds a token's active neurons (`scores ≥ threshold`), dropping the oldest token.
    pub(crate) fn push(&mut self, scores: &[f32], threshold: f32) {
        let mut list = if self.tokens.len() == self.len {
            let old = self.tokens.pop_front().unwrap_or_default();
            for &j in &old {
                self.counts[j as usize] -= 1;
            }
            old
        } else {
            Vec::new()
        };
        list.clear();
        list.extend((0..scores.len() as u32).filter(|&j| scores[j as usize] >= threshold));
        for &j in &list {
            self.counts[j as usize] += 1;
        }
        self.tokens.push_back(list);
    }

    /// Tokens in the window.
    pub(crate) fn tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Times neuron `j` was active in the window.
    pub(crate) fn count(&self, j: usize) -> u16 {
        self.counts[j]
    }

    /// The last token's active neurons.
    pub(crate) fn last(&self) -> &[u32] {
        self.tokens.back().map_or(&[], Vec::as_slice)
    }
}

/// One evaluation of a layer's hybrid FFN, as measured.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Measured {
    /// Tokens.
    pub(crate) t: usize,
    /// The CPU's part, from the device job's submission to the CPU's part done.
    pub(crate) cpu: Duration,
    /// The device's part, copies included.
    pub(crate) device: Duration,
    pub(crate) active_cpu: u64,
    pub(crate) active_device: u64,
}

/// A layer's run-time split (see the [module docs](self)).
#[derive(Debug)]
pub(crate) struct LayerBalanceState {
    /// The device's slice.
    pub(crate) hot: HotId,
    /// Neuron of each device slot.
    slots: Vec<u32>,
    /// Per neuron, its slot ([`NOT_HELD`] when the device does not hold it).
    slot_of: Vec<u32>,
    /// Per neuron, whether the device computes it when active (held and enabled): what the
    /// CPU skips.
    pub(crate) on_device: Vec<bool>,
    n_enabled: usize,
    /// Static activation probability per neuron (empty without statistics).
    prior: Vec<f32>,
    window: ActivationWindow,
    /// Averages of the measured times (seconds) and active rows since the last reset.
    sum: [f64; 4],
    samples: u32,
    /// Batch size the averages are of.
    batch: usize,
    /// Decode tokens since the cache last looked at the layer.
    since_look: usize,
    /// Seconds to copy one neuron's rows to the device (measured; `None` before the first copy).
    copy_secs: Option<f64>,
    /// Seconds a share of the CPU's costs whatever its rows (the copies to and from the device
    /// and the host's wait, the dispatch): a layer the device computes whole gives the CPU
    /// neurons only when the device's time exceeds this.
    cpu_floor: f64,
    report: LayerBalance,
}

impl LayerBalanceState {
    /// A layer whose slice `hot` holds `bucket` (slot `i` = neuron `bucket[i]`), all enabled.
    pub(crate) fn new(
        layer: usize,
        hot: HotId,
        n_ff: usize,
        bucket: &[u32],
        prior: Vec<f32>,
        window: usize,
    ) -> LayerBalanceState {
        let mut slot_of = vec![NOT_HELD; n_ff];
        let mut on_device = vec![false; n_ff];
        for (s, &j) in bucket.iter().enumerate() {
            slot_of[j as usize] = s as u32;
            on_device[j as usize] = true;
        }
        LayerBalanceState {
            hot,
            slots: bucket.to_vec(),
            slot_of,
            on_device,
            n_enabled: bucket.len(),
            prior,
            window: ActivationWindow::new(n_ff, window),
            sum: [0.0; 4],
            samples: 0,
            batch: 0,
            since_look: 0,
            copy_secs: None,
            cpu_floor: DEFAULT_CPU_FLOOR,
            report: LayerBalance {
                layer,
                held: bucket.len(),
                enabled: bucket.len(),
                ..LayerBalance::default()
            },
        }
    }

    /// The report.
    pub(crate) fn report(&self) -> LayerBalance {
        LayerBalance {
            enabled: self.n_enabled,
            ..self.report.clone()
        }
    }

    /// A neuron's expected activation probability: its window count, with the static
    /// statistics weighing as [`PRIOR_TOKENS`] tokens.
    fn activity(&self, j: usize) -> f64 {
        let w = self.window.tokens() as f64;
        let c = self.window.count(j) as f64;
        match self.prior.get(j) {
            Some(&p) => (c + PRIOR_TOKENS * p as f64) / (w + PRIOR_TOKENS),
            None if w > 0.0 => c / w,
            None => 0.0,
        }
    }

    /// Whether the device's copy of the scores must hide held neurons it does not compute.
    pub(crate) fn needs_mask(&self) -> bool {
        self.n_enabled < self.slots.len()
    }

    /// Whether the CPU computes some of the layer's neurons: the device does not hold them
    /// all, or does not compute all it holds.
    pub(crate) fn cpu_has_neurons(&self) -> bool {
        self.n_enabled < self.slot_of.len()
    }

    /// Per slot, whether the device computes it; `None` when it computes every slot.
    pub(crate) fn enabled_slots(&self) -> Option<Vec<bool>> {
        self.needs_mask().then(|| {
            self.slots
                .iter()
                .map(|&j| self.on_device[j as usize])
                .collect()
        })
    }

    /// Records the tokens' predicted activations (`scores`, `t × n_ff`): the window and the
    /// recall of the held set.
    pub(crate) fn observe(&mut self, scores: &[f32], t: usize, threshold: f32) {
        let nff = self.slot_of.len();
        for i in 0..t {
            self.window.push(&scores[i * nff..][..nff], threshold);
            let last = self.window.last();
            let held = last
                .iter()
                .filter(|&&j| self.slot_of[j as usize] != NOT_HELD)
                .count();
            self.report.active += last.len() as u64;
            self.report.held_active += held as u64;
        }
    }

    /// Takes an evaluation's measurements; with `act` (and `opts.balance`), moves the enabled
    /// set when the two sides' times differ by more than the dead band. Returns the neurons
    /// moved (positive: device → CPU).
    pub(crate) fn measured(&mut self, m: Measured, opts: &BalanceOptions, act: bool) -> i64 {
        let r = &mut self.report;
        r.evals += 1;
        r.cpu += m.cpu;
        r.device += m.device;
        r.active_cpu += m.active_cpu;
        r.active_device += m.active_device;
        if m.t != self.batch {
            self.batch = m.t;
            self.reset();
        }
        self.sum[0] += m.cpu.as_secs_f64();
        self.sum[1] += m.device.as_secs_f64();
        self.sum[2] += m.active_cpu as f64;
        self.sum[3] += m.active_device as f64;
        self.samples += 1;
        let n = self.samples as f64;
        let (cpu, dev) = (self.sum[0] / n, self.sum[1] / n);
        let imbalance = if cpu + dev > 0.0 {
            (dev - cpu) / (cpu + dev)
        } else {
            0.0
        };
        self.report.imbalance = imbalance;
        // A layer whose neurons the device computes all: the CPU would first pay its share's
        // fixed cost, so the device keeps everything while it is faster than that.
        let whole_on_device = self.sum[2] == 0.0 && self.sum[0] == 0.0;
        if whole_on_device && dev <= self.cpu_floor {
            if self.report.settled_at == 0 && self.samples >= SETTLE {
                self.report.settled_at = self.report.evals;
            }
            return 0;
        }
        if self.report.settled_at == 0
            && self.samples >= SETTLE
            && imbalance.abs() <= opts.dead_band
        {
            self.report.settled_at = self.report.evals;
        }
        if !act || !opts.balance || self.samples < SETTLE || imbalance.abs() <= opts.dead_band {
            return 0;
        }
        // Per active row, each side's cost; the rows whose move evens the two times.
        let (a_cpu, a_dev) = (self.sum[2] / n, self.sum[3] / n);
        let c_cpu = cpu / a_cpu.max(1.0);
        let c_dev = dev / a_dev.max(1.0);
        let rows = 0.5 * (dev - cpu) / (c_cpu + c_dev);
        // At most a share of the held neurons' work moves at once.
        let cap = opts.max_step * (self.expected_rows(m.t, true) + self.expected_rows(m.t, false));
        let moved = if rows > 0.0 {
            self.disable(rows, m.t, cap)
        } else {
            -(self.enable(-rows, m.t, cap) as i64)
        };
        if moved != 0 {
            self.report.rebalances += 1;
            self.report.moved += moved.unsigned_abs();
            self.report.last_move = self.report.evals;
            self.reset();
        }
        moved
    }

    fn reset(&mut self) {
        self.sum = [0.0; 4];
        self.samples = 0;
    }

    /// Expected active rows per evaluation of `t` tokens of neuron `j`: the chance that any
    /// of the tokens activates it (a batch computes the union).
    fn rows_of(&self, j: usize, t: usize) -> f64 {
        let p = self.activity(j).clamp(0.0, 1.0);
        1.0 - (1.0 - p).powi(t as i32)
    }

    /// Hands the coldest enabled neurons to the CPU until they carry `rows` active rows per
    /// evaluation, or `cap` of them (at least one neuron). Returns how many.
    fn disable(&mut self, rows: f64, t: usize, cap: f64) -> i64 {
        let cand: Vec<(f64, u32)> = self
            .slots
            .iter()
            .filter(|&&j| self.on_device[j as usize])
            .map(|&j| (self.activity(j as usize), j))
            .collect();
        let moved = self.take(cand, rows.min(cap), t, false);
        for &j in &moved {
            self.on_device[j as usize] = false;
        }
        self.n_enabled -= moved.len();
        moved.len() as i64
    }

    /// Hands the hottest disabled held neurons back to the device until they carry `rows`
    /// active rows per evaluation, or `cap` of them (at least one neuron). Returns how many.
    fn enable(&mut self, rows: f64, t: usize, cap: f64) -> usize {
        let cand: Vec<(f64, u32)> = self
            .slots
            .iter()
            .filter(|&&j| !self.on_device[j as usize])
            .map(|&j| (self.activity(j as usize), j))
            .collect();
        let moved = self.take(cand, rows.min(cap), t, true);
        for &j in &moved {
            self.on_device[j as usize] = true;
        }
        self.n_enabled += moved.len();
        moved.len()
    }

    /// The coldest (or `hottest`) candidates whose expected rows add up to `rows` (at least
    /// one): selected in growing batches, so that a small move does not sort the layer.
    fn take(&self, mut cand: Vec<(f64, u32)>, rows: f64, t: usize, hottest: bool) -> Vec<u32> {
        let mut out = Vec::new();
        let mut acc = 0.0;
        let mut from = 0;
        let mut batch = 64;
        while from < cand.len() {
            let head = pick(&mut cand[from..], batch, hottest).to_vec();
            for &(_, j) in &head {
                if !out.is_empty() && acc >= rows {
                    return out;
                }
                acc += self.rows_of(j as usize, t);
                out.push(j);
            }
            from += head.len();
            batch *= 2;
        }
        out
    }

    /// Expected active rows per evaluation of `t` tokens of the enabled (`device`) or the
    /// other held neurons.
    fn expected_rows(&self, t: usize, device: bool) -> f64 {
        self.slots
            .iter()
            .filter(|&&j| self.on_device[j as usize] == device)
            .map(|&j| self.rows_of(j as usize, t))
            .sum()
    }

    /// Sets which held neurons the device computes (tests: arbitrary schedules).
    #[cfg(feature = "test-hooks")]
    pub(crate) fn set_enabled(&mut self, mut on: impl FnMut(u32) -> bool) {
        self.n_enabled = 0;
        for &j in &self.slots {
            let e = on(j);
            self.on_device[j as usize] = e;
            self.n_enabled += e as usize;
        }
    }

    /// Neurons of each slot (tests).
    #[cfg(feature = "test-hooks")]
    pub(crate) fn slots(&self) -> &[u32] {
        &self.slots
    }

    /// Sets what a share of the CPU costs whatever its rows (see `cpu_floor`), from the
    /// calibration's fixed cost.
    pub(crate) fn set_cpu_floor(&mut self, secs: f64) {
        if secs.is_finite() && secs > 0.0 {
            self.cpu_floor = secs;
        }
    }

    /// Sets the enabled set to the hottest held neurons carrying `share` of the held set's
    /// activity (the starting split from measured speeds).
    pub(crate) fn enable_share(&mut self, share: f64) {
        let mut cand: Vec<(f64, u32)> = self
            .slots
            .iter()
            .map(|&j| (self.activity(j as usize), j))
            .collect();
        let total: f64 = cand.iter().map(|c| c.0).sum();
        cand.sort_by(|a, b| b.0.total_cmp(&a.0));
        for &j in &self.slots {
            self.on_device[j as usize] = false;
        }
        let mut acc = 0.0;
        let mut n = 0;
        for &(a, j) in &cand {
            if n > 0 && acc >= share.clamp(0.0, 1.0) * total {
                break;
            }
            acc += a;
            self.on_device[j as usize] = true;
            n += 1;
        }
        self.n_enabled = n;
    }

    /// Counts decode tokens (`t` of them); every `opts.interval`, replaces held neurons that
    /// went cold by outside neurons that got hot where the copy pays for itself (see the
    /// [module docs](self)). `spec`: the layer's host matrices.
    pub(crate) fn maybe_migrate(
        &mut self,
        device: &dyn Device,
        spec: &HotSpec<'_>,
        t: usize,
        opts: &BalanceOptions,
    ) -> Result<usize> {
        if !opts.hot_cache || self.slots.is_empty() || self.slots.len() == self.slot_of.len() {
            return Ok(0);
        }
        self.since_look += t;
        if self.since_look < opts.interval.max(1) || self.window.tokens() < opts.interval.max(1) {
            return Ok(0);
        }
        self.since_look = 0;
        let cap = ((opts.max_swap * self.slots.len() as f64).ceil() as usize).max(1);
        let mut held: Vec<(f64, u32)> = self
            .slots
            .iter()
            .map(|&j| (self.activity(j as usize), j))
            .collect();
        let mut outside: Vec<(f64, u32)> = (0..self.slot_of.len() as u32)
            .filter(|&j| self.slot_of[j as usize] == NOT_HELD)
            .map(|j| (self.activity(j as usize), j))
            .collect();
        let cold = pick(&mut held, cap, false).to_vec();
        let hot = pick(&mut outside, cap, true).to_vec();
        // CPU seconds per active row (measured), and seconds to copy a neuron's rows.
        let r = &self.report;
        let c_cpu = if r.active_cpu > 0 {
            r.cpu.as_secs_f64() / r.active_cpu as f64
        } else {
            0.0
        };
        let bytes = neuron_bytes(spec) as f64;
        let copy = self.copy_secs.unwrap_or(bytes / DEFAULT_LINK_BYTES_PER_SEC);
        // A swap pays when the CPU rows it saves over the next window cost more than the copy,
        // and the neuron coming in is clearly hotter (a margin of one activation in the window
        // against noise).
        let horizon = opts.window as f64;
        let margin = 1.0 / self.window.tokens().max(1) as f64;
        let mut neurons = Vec::new();
        let mut out_neurons = Vec::new();
        for (&(a_in, j_in), &(a_out, j_out)) in hot.iter().zip(&cold) {
            let gain = (a_in - a_out) * horizon * c_cpu;
            if a_in <= a_out + margin || gain <= copy {
                break;
            }
            neurons.push(j_in);
            out_neurons.push(j_out);
        }
        if neurons.is_empty() {
            return Ok(0);
        }
        self.replace(device, spec, &out_neurons, &neurons)?;
        Ok(neurons.len())
    }

    /// Replaces held neurons `outs` by outside neurons `ins` (pairwise; same slots) on the
    /// device and in the split; a neuron coming in is computed on the device. Returns the time
    /// of the copies.
    pub(crate) fn replace(
        &mut self,
        device: &dyn Device,
        spec: &HotSpec<'_>,
        outs: &[u32],
        ins: &[u32],
    ) -> Result<Duration> {
        let slots: Vec<u32> = outs.iter().map(|&j| self.slot_of[j as usize]).collect();
        if slots.contains(&NOT_HELD)
            || ins.iter().any(|&j| self.slot_of[j as usize] != NOT_HELD)
            || outs.len() != ins.len()
        {
            return Err(crate::error::EngineError::Device(
                "a replacement must swap held neurons for outside ones".into(),
            ));
        }
        let took = device.replace_hot(self.hot, &HotSwap::new(&slots, ins, spec)?)?;
        let per = took.as_secs_f64() / slots.len().max(1) as f64;
        self.copy_secs = Some(match self.copy_secs {
            Some(c) => 0.5 * (c + per),
            None => per,
        });
        for ((&s, &j_in), &j_out) in slots.iter().zip(ins).zip(outs) {
            let enabled = self.on_device[j_out as usize];
            self.on_device[j_out as usize] = false;
            self.slot_of[j_out as usize] = NOT_HELD;
            self.slots[s as usize] = j_in;
            self.slot_of[j_in as usize] = s;
            // A neuron coming in is hot: the device computes it; the balancer corrects.
            self.on_device[j_in as usize] = true;
            if !enabled {
                self.n_enabled += 1;
            }
        }
        self.report.migrations += 1;
        self.report.migrated_rows += slots.len() as u64;
        self.report.migration_time += took;
        Ok(took)
    }
}

/// Host-to-device copy speed assumed before the first copy is measured.
const DEFAULT_LINK_BYTES_PER_SEC: f64 = 10e9;

/// Seconds a share of the CPU costs whatever its rows, without a calibration: two copies over
/// the link, a host wait and a dispatch (`docs/tuning.md`, "The balancer's floor").
const DEFAULT_CPU_FLOOR: f64 = 200e-6;

/// Bytes of one neuron's rows in `spec`'s matrices.
fn neuron_bytes(spec: &HotSpec<'_>) -> usize {
    spec.gate.as_ref().map_or(0, |g| g.row_bytes()) + spec.up.row_bytes() + spec.down_t.row_bytes()
}

/// The `cap` hottest (`hottest`) or coldest entries of `cand`, in that order.
fn pick(cand: &mut [(f64, u32)], cap: usize, hottest: bool) -> &[(f64, u32)] {
    let key = |a: &(f64, u32), b: &(f64, u32)| {
        let o = a.0.total_cmp(&b.0).then(a.1.cmp(&b.1));
        if hottest {
            o.reverse()
        } else {
            o
        }
    };
    let cap = cap.min(cand.len());
    if cap == 0 {
        return &[];
    }
    if cap < cand.len() {
        cand.select_nth_unstable_by(cap - 1, key);
    }
    let head = &mut cand[..cap];
    head.sort_by(key);
    head
}

/// Every hot layer's state, behind the executor's lock.
#[derive(Debug, Default)]
pub(crate) struct Balance {
    pub(crate) options: BalanceOptions,
    /// Per layer (`None`: no device part).
    pub(crate) layers: Vec<Option<LayerBalanceState>>,
    pub(crate) calibration: Option<super::calibrate::Calibration>,
    /// The attention split, when on and the device holds the mirror.
    pub(crate) attention: Option<super::attention::AttentionSplit>,
}

impl Balance {
    /// The report.
    pub(crate) fn report(&self) -> BalanceReport {
        BalanceReport {
            options: self.options.clone(),
            layers: self
                .layers
                .iter()
                .flatten()
                .map(LayerBalanceState::report)
                .collect(),
            calibration: self.calibration.clone(),
            attention: self
                .attention
                .as_ref()
                .map_or_else(Vec::new, super::attention::AttentionSplit::report),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_counts_the_last_tokens() {
        let mut w = ActivationWindow::new(4, 2);
        w.push(&[1.0, 0.0, 1.0, 0.0], 0.5);
        w.push(&[1.0, 1.0, 0.0, 0.0], 0.5);
        assert_eq!((w.count(0), w.count(1), w.count(2)), (2, 1, 1));
        w.push(&[0.0, 0.0, 0.0, 1.0], 0.5);
        assert_eq!(
            (0..4).map(|j| w.count(j)).collect::<Vec<_>>(),
            vec![1, 1, 0, 1]
        );
        assert_eq!(w.tokens(), 2);
        assert_eq!(w.last(), &[3]);
    }

    #[test]
    fn pick_orders_hottest_and_coldest() {
        let mut c = vec![(0.5, 0), (0.1, 1), (0.9, 2), (0.3, 3), (0.7, 4)];
        assert_eq!(
            pick(&mut c.clone(), 2, true)
                .iter()
                .map(|x| x.1)
                .collect::<Vec<_>>(),
            vec![2, 4]
        );
        assert_eq!(
            pick(&mut c, 3, false)
                .iter()
                .map(|x| x.1)
                .collect::<Vec<_>>(),
            vec![1, 3, 0]
        );
    }

    fn state(prior: Vec<f32>) -> LayerBalanceState {
        let bucket: Vec<u32> = (0..8).collect();
        LayerBalanceState::new(0, HotId(0), 16, &bucket, prior, 8)
    }

    fn measure(cpu_ms: u64, dev_ms: u64) -> Measured {
        Measured {
            t: 1,
            cpu: Duration::from_millis(cpu_ms),
            device: Duration::from_millis(dev_ms),
            active_cpu: 4,
            active_device: 4,
        }
    }

    #[test]
    fn a_slow_device_gives_its_coldest_neurons_to_the_cpu() {
        let prior: Vec<f32> = (0..16).map(|j| 1.0 - j as f32 / 16.0).collect();
        let mut s = state(prior);
        let o = BalanceOptions {
            max_step: 0.1,
            ..BalanceOptions::default()
        };
        assert_eq!(s.measured(measure(1, 3), &o, true), 0, "waits to settle");
        let moved = s.measured(measure(1, 3), &o, true);
        assert!(moved > 0 && moved <= 2, "moved {moved}");
        // The coldest held neurons (7, then 6) went to the CPU.
        assert!(!s.on_device[7]);
        assert!(s.on_device[0]);
        assert_eq!(s.n_enabled, 8 - moved as usize);
        assert!(s.needs_mask());
        // The device's flags per slot: slot 7 (neuron 7) off, slot 0 on.
        let slots = s.enabled_slots().unwrap();
        assert!(!slots[7] && slots[0]);
        assert!(s.cpu_has_neurons());
        // Balanced times inside the dead band move nothing; a slow CPU takes them back.
        assert_eq!(s.measured(measure(2, 2), &o, true), 0);
        assert_eq!(s.measured(measure(2, 2), &o, true), 0);
        let back = s.measured(measure(3, 1), &o, true) + s.measured(measure(3, 1), &o, true);
        assert!(back < 0, "moved {back}");
        assert!(s.on_device[7] || s.on_device[6]);
    }

    #[test]
    fn static_split_never_moves() {
        let mut s = state(Vec::new());
        let o = BalanceOptions {
            balance: false,
            ..BalanceOptions::default()
        };
        for _ in 0..5 {
            assert_eq!(s.measured(measure(1, 9), &o, true), 0);
        }
        assert_eq!(s.n_enabled, 8);
        assert!(!s.needs_mask());
    }

    #[test]
    fn enable_share_takes_the_hottest() {
        let prior: Vec<f32> = (0..16).map(|j| if j < 2 { 0.9 } else { 0.1 }).collect();
        let mut s = state(prior);
        s.enable_share(0.5);
        assert!(s.on_device[0] && s.on_device[1]);
        assert!(s.n_enabled <= 3, "{}", s.n_enabled);
    }
}
