//! The device flags shared by `run`, `bench decode` (and `serve`): which device beside the CPU,
//! its VRAM budget, PowerInfer's GPU-index flags, llama.cpp's `-ngl`, and the simulated GPU's
//! threads and speed. Also how a loaded engine's device is reported.

use std::time::Duration;

use powerinfer_engine::device::SimSpeed;
use powerinfer_engine::profile::LayerSplit;
use powerinfer_engine::{
    BalanceReport, DeviceChoice, DeviceReport, Engine, EngineOptions, GpuIndexMode, OpProfile,
};

/// Device flags.
#[derive(clap::Args, Clone, Debug)]
pub struct DeviceArgs {
    /// Device beside the CPU: `auto` (a CUDA GPU when one is usable, else the CPU alone),
    /// `cuda`, `cuda:N`, `sim` (a simulated GPU on this machine's cores) or `none`.
    #[arg(long = "gpu", default_value = "auto")]
    pub gpu: DeviceChoice,
    /// VRAM budget in GiB (default: 90% of the GPU's memory less 256 MiB; `sim`: everything
    /// the model could place there). PowerInfer files: dense parts first, then the hottest
    /// neurons' rows (`<model>.generated.gpuidx`, from `activation/` beside the model).
    #[arg(long = "vram-budget", value_parser = gib)]
    pub vram_budget: Option<f64>,
    /// Rebuild the GPU index even if a cached one is valid.
    #[arg(long = "reset-gpu-index")]
    pub reset_gpu_index: bool,
    /// Do not read or write a GPU index (all FFN neurons on the CPU).
    #[arg(long = "disable-gpu-index")]
    pub disable_gpu_index: bool,
    /// Dense GGUF files: offload this many layers (the last ones), as llama.cpp's `-ngl`.
    #[arg(long = "n-gpu-layers", visible_alias = "ngl")]
    pub n_gpu_layers: Option<usize>,
    /// `--gpu sim`: the simulated GPU's own worker threads.
    #[arg(long = "sim-threads", default_value_t = 1)]
    pub sim_threads: usize,
    /// `--gpu sim`: the card it plays, on its own clock (the balancer and the calibration
    /// read the card's time, `run --json` and `--profile` give the time per token on it):
    /// `h200` (4.3 TB/s, 141 GB), `rtx4090` (1.0 TB/s, 24 GB, PCIe 4.0 x16) or `none` (this
    /// machine's wall clock: a device as fast as its threads compute).
    #[arg(long = "sim-card", default_value = "h200", value_parser = sim_card)]
    pub sim_card: String,
    /// `--gpu sim`: play a device reading its memory at this many GB/s instead (with
    /// `--sim-launch-us` per kernel and a `--sim-link-gbps` host link).
    #[arg(long = "sim-bandwidth")]
    pub sim_bandwidth: Option<f64>,
    /// `--gpu sim` with `--sim-bandwidth`: microseconds per kernel launch.
    #[arg(long = "sim-launch-us", default_value_t = 5.0)]
    pub sim_launch_us: f64,
    /// `--gpu sim` with `--sim-bandwidth`: host link bandwidth in GB/s.
    #[arg(long = "sim-link-gbps", default_value_t = 25.0)]
    pub sim_link_gbps: f64,
    /// Capture each device program as a CUDA graph on first use and replay it with one launch
    /// (`on`/`off`; the simulated device charges one launch per program then).
    #[arg(long = "graphs", default_value = "off", value_parser = on_off, action = clap::ArgAction::Set)]
    pub graphs: bool,
    /// Balance each layer's active neurons between the device and the CPU from their measured
    /// times while decoding (`on`), or keep PowerInfer's static split (`off`: every neuron the
    /// device holds is computed there).
    #[arg(long = "balance", default_value = "on", value_parser = on_off, action = clap::ArgAction::Set)]
    pub balance: bool,
    /// Relative time difference within which a layer's split stays.
    #[arg(long = "balance-dead-band", default_value_t = 0.05)]
    pub balance_dead_band: f64,
    /// Largest share of a layer's device rows one rebalance moves.
    #[arg(long = "balance-step", default_value_t = 0.05)]
    pub balance_step: f64,
    /// The dynamic hot-neuron cache: swap the device's neurons that went cold for ones that
    /// got hot (`on`/`off`).
    #[arg(long = "hot-cache", default_value = "on", value_parser = on_off, action = clap::ArgAction::Set)]
    pub hot_cache: bool,
    /// Tokens of the hot-neuron cache's activation window.
    #[arg(long = "cache-window", default_value_t = 32)]
    pub cache_window: usize,
    /// Decode tokens between two looks of the cache at a layer.
    #[arg(long = "cache-interval", default_value_t = 8)]
    pub cache_interval: usize,
    /// Measure the CPU's and the device's speeds at load and start each layer's split from
    /// them (`on`/`off`).
    #[arg(long = "calibrate", default_value = "on", value_parser = on_off, action = clap::ArgAction::Set)]
    pub calibrate: bool,
    /// Calibration cache file (default: `$XDG_CACHE_HOME` or `~/.cache`,
    /// `powerinfer-rs/calibration.tsv`; `none`: measure at every load).
    #[arg(long = "calibration-cache")]
    pub calibration_cache: Option<String>,
    /// Q-Infer's placement: hold only the neurons that balance the two sides at the measured
    /// speed ratio, instead of filling the VRAM budget with the hottest (PowerInfer).
    #[arg(long = "balanced-placement")]
    pub balanced_placement: bool,
    /// Split each layer's attention over the KV positions between the device (a mirror of
    /// the first positions, reserved before the FFN's rows) and the CPU while one sequence
    /// decodes (`on`/`off`).
    #[arg(long = "attention-split", default_value = "off", value_parser = on_off, action = clap::ArgAction::Set)]
    pub attention_split: bool,
    /// Largest change of a layer's share of attended positions on the device per move.
    #[arg(long = "attention-step", default_value_t = 0.05)]
    pub attention_step: f64,
}

/// `--sim-card`: a card [`SimSpeed::card`] knows, or `none` (the wall clock).
fn sim_card(s: &str) -> Result<String, String> {
    if s == "none" || SimSpeed::card(s).is_some() {
        Ok(s.to_string())
    } else {
        Err(format!(
            "`{s}`: expected {} or none",
            SimSpeed::CARDS.join(", ")
        ))
    }
}

/// A size in GiB: a number ≥ 0 (fractions allowed).
pub fn gib(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("`{s}`: expected a size in GiB ≥ 0")),
    }
}

/// `on`/`off` (also `true`/`false`, `1`/`0`).
fn on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" | "true" | "1" => Ok(true),
        "off" | "false" | "0" => Ok(false),
        _ => Err(format!("`{s}`: expected on or off")),
    }
}

/// The default calibration cache file.
fn default_cache() -> Option<std::path::PathBuf> {
    let base = crate::env::cache_home()?;
    Some(base.join("powerinfer-rs").join("calibration.tsv"))
}

impl DeviceArgs {
    /// Sets `o.device` from the flags.
    pub fn apply(&self, o: &mut EngineOptions) -> Result<(), String> {
        let d = &mut o.device;
        d.choice = self.gpu;
        d.vram_budget = match self.vram_budget {
            Some(gib) if gib.is_finite() && gib >= 0.0 => Some((gib * (1u64 << 30) as f64) as u64),
            Some(gib) => return Err(format!("--vram-budget {gib} is not a usable size")),
            None => None,
        };
        d.gpu_index = match (self.disable_gpu_index, self.reset_gpu_index) {
            (true, _) => GpuIndexMode::Disable,
            (false, true) => GpuIndexMode::Reset,
            _ => GpuIndexMode::Reuse,
        };
        d.n_gpu_layers = self.n_gpu_layers;
        d.graphs = self.graphs;
        if !(0.0..1.0).contains(&self.balance_dead_band) {
            return Err(format!(
                "--balance-dead-band {}: expected a share in [0, 1)",
                self.balance_dead_band
            ));
        }
        if !(self.balance_step > 0.0 && self.balance_step <= 1.0) {
            return Err(format!(
                "--balance-step {}: expected a share in (0, 1]",
                self.balance_step
            ));
        }
        if self.cache_window == 0 || self.cache_interval == 0 {
            return Err("--cache-window and --cache-interval must be at least 1".into());
        }
        let b = &mut d.balance;
        b.balance = self.balance;
        b.dead_band = self.balance_dead_band;
        b.max_step = self.balance_step;
        b.hot_cache = self.hot_cache;
        b.window = self.cache_window;
        b.interval = self.cache_interval;
        b.calibrate = self.calibrate;
        b.calibration_cache = match self.calibration_cache.as_deref() {
            Some("none") => None,
            Some(p) => Some(p.into()),
            None => default_cache(),
        };
        b.balanced_placement = self.balanced_placement;
        if !(self.attention_step > 0.0 && self.attention_step <= 1.0) {
            return Err(format!(
                "--attention-step {}: expected a share in (0, 1]",
                self.attention_step
            ));
        }
        b.attention_split = self.attention_split;
        b.attention_step = self.attention_step;
        d.sim.threads = self.sim_threads.max(1);
        d.sim.speed = match self.sim_bandwidth {
            None => SimSpeed::card(&self.sim_card),
            Some(bw) if bw > 0.0 && self.sim_link_gbps > 0.0 && self.sim_launch_us >= 0.0 => {
                Some(SimSpeed::new(
                    bw * 1e9,
                    Duration::from_secs_f64(self.sim_launch_us * 1e-6),
                    self.sim_link_gbps * 1e9,
                ))
            }
            Some(bw) => {
                return Err(format!(
                    "--sim-bandwidth {bw} / --sim-link-gbps {} / --sim-launch-us {}: need \
                     positive speeds",
                    self.sim_link_gbps, self.sim_launch_us
                ))
            }
        };
        Ok(())
    }
}

/// One or two lines on where the model runs (stderr).
pub fn describe(engine: &Engine) -> Vec<String> {
    let r = engine.device_report();
    let mut lines = Vec::new();
    if r.kind == "none" {
        if let Some(n) = &r.note {
            lines.push(n.clone());
        }
        return lines;
    }
    let mut parts = vec![
        format!("budget {}", super::human_bytes(r.budget_bytes)),
        format!(
            "{} of {} layers, {} of {} dense matrices ({}), {} of {} FFN rows ({:.1}%)",
            r.layers,
            r.layers_total,
            r.dense_matrices,
            r.dense_total,
            super::human_bytes(r.dense_bytes),
            r.ffn_rows,
            r.ffn_total,
            100.0 * r.resident_share()
        ),
    ];
    if !r.placement.is_empty() {
        parts.push(r.placement.clone());
    }
    lines.push(format!("device: {}: {}", r.kind, parts.join("; ")));
    if let Some(n) = &r.note {
        lines.push(format!("note: {n}"));
    }
    lines
}

/// The device as JSON (`run --json`).
pub fn json(r: &DeviceReport) -> serde_json::Value {
    serde_json::json!({
        "kind": r.kind,
        "note": r.note,
        "budget_bytes": r.budget_bytes,
        "peak_bytes": r.peak_bytes,
        "dense_matrices": r.dense_matrices,
        "dense_bytes": r.dense_bytes,
        "ffn_rows": r.ffn_rows,
        "ffn_total": r.ffn_total,
        "resident_share": r.resident_share(),
        "active_device": r.active_device,
        "active_cpu": r.active_cpu,
        "active_share": r.active_share(),
        "overruns": r.overruns,
        "placement": r.placement,
        "layers": r.layers,
        "layers_total": r.layers_total,
        "work_bytes": r.work_bytes,
        "kv_bytes": r.kv_bytes,
        "tokens": r.tokens,
        "launches": r.launches,
        "host_waits": r.host_waits,
        "link_bytes": r.link_bytes,
        "launches_per_token": r.launches_per_token(),
        "syncs_per_token": r.syncs_per_token(),
        "link_bytes_per_token": r.link_bytes_per_token(),
        "timeline": timeline(r),
        "eval_secs": r.eval_secs,
        "ms_per_token": r.secs_per_token() * 1e3,
        "decode_tokens": r.decode_tokens,
        "decode_secs": r.decode_secs,
        "decode_tps": r.decode_tokens_per_sec(),
        "graphs_captured": r.graphs_captured,
        "late_allocations": r.late_allocations,
    })
}

/// Which clock the device's times are on: the card a simulated device models, else the wall
/// clock.
pub fn timeline(r: &DeviceReport) -> String {
    match r
        .kind
        .strip_prefix("sim (")
        .and_then(|k| k.split_once(" model"))
    {
        Some((card, _)) => format!("modelled {card}"),
        None => "wall clock".to_string(),
    }
}

/// What a device charged per token over a profile's evaluations: `(launches, host waits, link
/// bytes)`; `None` without a device.
pub fn traffic_per_token(p: &OpProfile) -> Option<(f64, f64, f64)> {
    let d = &p.device;
    if d.launches == 0 && d.syncs == 0 && d.link_bytes == 0 {
        return None;
    }
    let t = p.tokens.max(1) as f64;
    Some((
        d.launches as f64 / t,
        d.syncs as f64 / t,
        d.link_bytes as f64 / t,
    ))
}

/// [`traffic_per_token`] as JSON.
pub fn traffic_json(p: &OpProfile) -> serde_json::Value {
    match traffic_per_token(p) {
        Some((l, s, b)) => serde_json::json!({
            "launches_per_token": l, "syncs_per_token": s, "link_bytes_per_token": b,
            "ms_per_token": p.device.time.as_secs_f64() * 1e3 / p.tokens.max(1) as f64,
        }),
        None => serde_json::Value::Null,
    }
}

/// Per layer, per token: CPU, device, transfer, wait and idle time of a hybrid FFN
/// (milliseconds), and the device's share of active neurons.
pub fn split_rows(p: &OpProfile) -> Vec<(usize, [f64; 5], f64)> {
    let ms = |d: Duration, s: &LayerSplit| d.as_secs_f64() * 1e3 / s.tokens.max(1) as f64;
    p.layers()
        .iter()
        .enumerate()
        .filter(|(_, s)| s.calls > 0)
        .map(|(l, s)| {
            (
                l,
                [
                    ms(s.cpu, s),
                    ms(s.device, s),
                    ms(s.transfer, s),
                    ms(s.wait, s),
                    ms(s.device_idle(), s),
                ],
                s.device_share(),
            )
        })
        .collect()
}

/// The hybrid split as a table on stderr (nothing without a device's part).
pub fn print_split(p: &OpProfile) {
    let rows = split_rows(p);
    if rows.is_empty() {
        return;
    }
    eprintln!("hybrid FFN per layer, ms per token (cpu: the CPU's neurons; device: its job, copies included; wait: CPU idle for the device; idle: device idle for the CPU)");
    eprintln!(
        "{:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8}",
        "layer", "cpu", "device", "transfer", "wait", "idle", "dev.act"
    );
    let mut tot = [0.0; 5];
    for (l, t, share) in &rows {
        eprintln!(
            "{l:>5} {:>9.4} {:>9.4} {:>9.4} {:>9.4} {:>9.4} {:>7.1}%",
            t[0],
            t[1],
            t[2],
            t[3],
            t[4],
            100.0 * share
        );
        for (a, b) in tot.iter_mut().zip(t) {
            *a += b;
        }
    }
    let share = {
        let (c, d) = p.layers().iter().fold((0u64, 0u64), |a, s| {
            (a.0 + s.active_cpu, a.1 + s.active_device)
        });
        d as f64 / (c + d).max(1) as f64
    };
    eprintln!(
        "{:>5} {:>9.4} {:>9.4} {:>9.4} {:>9.4} {:>9.4} {:>7.1}%",
        "all",
        tot[0],
        tot[1],
        tot[2],
        tot[3],
        tot[4],
        100.0 * share
    );
}

/// The hybrid split as JSON: one object per layer.
pub fn split_json(p: &OpProfile) -> serde_json::Value {
    let rows: Vec<serde_json::Value> = split_rows(p)
        .into_iter()
        .map(|(l, t, share)| {
            serde_json::json!({
                "layer": l, "cpu_ms": t[0], "device_ms": t[1], "transfer_ms": t[2],
                "cpu_wait_ms": t[3], "device_idle_ms": t[4], "device_active_share": share,
            })
        })
        .collect();
    serde_json::Value::Array(rows)
}

/// The run-time scheduling as a table on stderr (`run --stats`): per layer the two sides'
/// times per evaluation, the device's share of the active neurons, the recall of the device's
/// set, its rows held and computed, rebalances and cache migrations.
pub fn print_balance(r: &BalanceReport) {
    if let Some(c) = &r.calibration {
        eprintln!(
            "calibration{}: CPU {:.1} us + {:.4} us/row, device {:.1} us + {:.4} us/row (device/CPU \
             throughput {:.2}); {}",
            if c.cached { " (cached)" } else { "" },
            c.cpu.fixed_us,
            c.cpu.per_row_us,
            c.device.fixed_us,
            c.device.per_row_us,
            c.ratio(),
            c.key
        );
    }
    if r.layers.is_empty() {
        eprintln!("scheduling: no layer has neurons on the device");
        print_attention(r);
        return;
    }
    eprintln!(
        "scheduling (balance {}, hot cache {}): per layer, ms per evaluation",
        if r.options.balance { "on" } else { "off" },
        if r.options.hot_cache { "on" } else { "off" }
    );
    eprintln!(
        "{:>5} {:>8} {:>8} {:>7} {:>7} {:>7} {:>7} {:>6} {:>6} {:>6} {:>7}",
        "layer",
        "cpu",
        "device",
        "imbal",
        "dev.act",
        "recall",
        "held",
        "on.dev",
        "moves",
        "migr",
        "rows"
    );
    let row = |name: String, l: &powerinfer_engine::schedule::LayerBalance| {
        let ms = |d: Duration| d.as_secs_f64() * 1e3 / l.evals.max(1) as f64;
        eprintln!(
            "{name:>5} {:>8.4} {:>8.4} {:>+7.3} {:>6.1}% {:>6.1}% {:>7} {:>6} {:>6} {:>6} {:>7}",
            ms(l.cpu),
            ms(l.device),
            l.imbalance,
            100.0 * l.device_share(),
            100.0 * l.recall(),
            l.held,
            l.enabled,
            l.rebalances,
            l.migrations,
            l.migrated_rows
        );
    };
    for l in &r.layers {
        row(l.layer.to_string(), l);
    }
    let mut t = r.total();
    t.imbalance = r.layers.iter().map(|l| l.imbalance).sum::<f64>() / r.layers.len() as f64;
    t.evals /= r.layers.len() as u64;
    row("all".into(), &t);
    print_attention(r);
}

/// The attention split per layer (nothing when off).
fn print_attention(r: &BalanceReport) {
    if r.attention.is_empty() {
        return;
    }
    eprintln!(
        "attention split: per layer, ms per split evaluation; share of positions on the device"
    );
    eprintln!(
        "{:>5} {:>6} {:>8} {:>8} {:>7} {:>6} {:>8}",
        "layer", "evals", "cpu", "device", "share", "moves", "copied"
    );
    for a in &r.attention {
        let ms = |d: Duration| d.as_secs_f64() * 1e3 / a.evals.max(1) as f64;
        eprintln!(
            "{:>5} {:>6} {:>8.4} {:>8.4} {:>6.1}% {:>6} {:>8}",
            a.layer,
            a.evals,
            ms(a.cpu),
            ms(a.device),
            100.0 * a.share,
            a.moves,
            a.copied_rows
        );
    }
}

/// The run-time scheduling as JSON (`run --stats --json`).
pub fn balance_json(r: &BalanceReport) -> serde_json::Value {
    let layer = |l: &powerinfer_engine::schedule::LayerBalance| {
        serde_json::json!({
            "layer": l.layer, "held": l.held, "enabled": l.enabled, "evals": l.evals,
            "cpu_ms": l.cpu.as_secs_f64() * 1e3, "device_ms": l.device.as_secs_f64() * 1e3,
            "active_cpu": l.active_cpu, "active_device": l.active_device,
            "device_share": l.device_share(), "active": l.active, "held_active": l.held_active,
            "recall": l.recall(), "rebalances": l.rebalances, "moved": l.moved,
            "last_move": l.last_move, "settled_at": l.settled_at, "migrations": l.migrations,
            "migrated_rows": l.migrated_rows,
            "migration_ms": l.migration_time.as_secs_f64() * 1e3, "imbalance": l.imbalance,
        })
    };
    let t = r.total();
    serde_json::json!({
        "balance": r.options.balance,
        "hot_cache": r.options.hot_cache,
        "calibration": r.calibration.as_ref().map(|c| serde_json::json!({
            "key": c.key, "cached": c.cached, "batch": c.batch,
            "cpu_fixed_us": c.cpu.fixed_us, "cpu_per_row_us": c.cpu.per_row_us,
            "device_fixed_us": c.device.fixed_us, "device_per_row_us": c.device.per_row_us,
            "ratio": c.ratio(),
        })),
        "recall": t.recall(),
        "device_share": t.device_share(),
        "rebalances": t.rebalances,
        "migrations": t.migrations,
        "migrated_rows": t.migrated_rows,
        "layers": r.layers.iter().map(layer).collect::<Vec<_>>(),
        "attention": r.attention.iter().map(|a| serde_json::json!({
            "layer": a.layer, "share": a.share, "evals": a.evals,
            "cpu_ms": a.cpu.as_secs_f64() * 1e3, "device_ms": a.device.as_secs_f64() * 1e3,
            "device_positions": a.device_positions, "cpu_positions": a.cpu_positions,
            "moves": a.moves, "copied_rows": a.copied_rows,
            "copy_ms": a.copy_time.as_secs_f64() * 1e3,
        })).collect::<Vec<_>>(),
    })
}
