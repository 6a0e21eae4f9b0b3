//! How a device is chosen and, for the simulated one, how fast it plays.

use std::time::Duration;

/// Which device runs the hot part of each layer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeviceChoice {
    /// Everything on the CPU.
    #[default]
    None,
    /// CUDA device 0 when one is usable, else the CPU (the reason is in the load report).
    Auto,
    /// CUDA device `N`; loading fails when it is not usable.
    Cuda(usize),
    /// The simulated GPU ([`SimOptions`]).
    Sim,
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;

    /// `auto`, `none`, `sim`, `cuda` or `cuda:N`.
    fn from_str(s: &str) -> std::result::Result<DeviceChoice, String> {
        match s {
            "auto" => Ok(DeviceChoice::Auto),
            "none" | "cpu" => Ok(DeviceChoice::None),
            "sim" => Ok(DeviceChoice::Sim),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(|| format!("`{s}`: expected auto, cuda, cuda:N, sim or none")),
        }
    }
}

/// The card the simulated device plays: what it charges for each piece of work (every kernel
/// launch, every copy over the host link, a latency and the bytes at the link's bandwidth, and
/// every time the host waits for the device) and the memory it has. With a speed the simulated
/// device keeps the modelled card's clock: its timing marks, and so the calibration and the
/// balancer, read the card's modelled time, not how long this machine took to emulate it; the
/// CPU side keeps its real time. [`DeviceReport::eval_secs`](super::DeviceReport::eval_secs)
/// is then an evaluation's time on the modelled card beside this machine's CPU.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct SimSpeed {
    /// What it plays (`H200`, `RTX 4090`, `custom`).
    pub name: &'static str,
    /// Bytes per second the device reads its memory at.
    pub bandwidth: f64,
    /// Time of one kernel launch.
    pub launch: Duration,
    /// Bytes per second of a copy between host and device.
    pub link_bandwidth: f64,
    /// Time of one copy between host and device before its bytes move.
    pub link_latency: Duration,
    /// Time the host loses each time it waits for the device (the wake-up after a
    /// synchronization).
    pub host_wait: Duration,
    /// Bytes of device memory (the default VRAM budget is what CUDA's would be: 90% less
    /// 256 MiB).
    pub memory: u64,
}

impl SimSpeed {
    /// A device reading `bandwidth` bytes/s, with `launch` per kernel and a host link of
    /// `link_bandwidth` bytes/s (the link latency, the host's wait and the memory as
    /// [`SimSpeed::h200`]).
    pub fn new(bandwidth: f64, launch: Duration, link_bandwidth: f64) -> SimSpeed {
        SimSpeed {
            name: "custom",
            bandwidth,
            launch,
            link_bandwidth,
            ..SimSpeed::h200()
        }
    }

    /// The figures of one H200 as the project measured it (`docs/tuning.md`, "The simulated
    /// GPU's speed model"): 4.3 TB/s of memory, 5 µs per launch, a host link of 25 GB/s with
    /// 10 µs per copy, 10 µs per host wait, 141 GB.
    pub fn h200() -> SimSpeed {
        SimSpeed {
            name: "H200",
            bandwidth: 4.3e12,
            launch: Duration::from_micros(5),
            link_bandwidth: 25e9,
            link_latency: Duration::from_micros(10),
            host_wait: Duration::from_micros(10),
            memory: 141_000_000_000,
        }
    }

    /// A 24 GB RTX 4090 on PCIe 4.0 x16: 1.0 TB/s of memory (its 1,008 GB/s peak), 5 µs per
    /// launch, a host link of 25 GB/s (what pinned copies reach on PCIe 4.0 x16) with 10 µs
    /// per copy, 10 µs per host wait.
    pub fn rtx4090() -> SimSpeed {
        SimSpeed {
            name: "RTX 4090",
            bandwidth: 1.0e12,
            memory: 24 << 30,
            ..SimSpeed::h200()
        }
    }

    /// The cards [`SimSpeed::card`] knows, by the name it takes.
    pub const CARDS: [&'static str; 2] = ["h200", "rtx4090"];

    /// The card named `name` (`h200`, `rtx4090`; case does not matter).
    pub fn card(name: &str) -> Option<SimSpeed> {
        match name.to_ascii_lowercase().as_str() {
            "h200" => Some(SimSpeed::h200()),
            "rtx4090" | "4090" => Some(SimSpeed::rtx4090()),
            _ => None,
        }
    }

    /// This speed with `link_latency` per copy and `host_wait` per wait of the host.
    pub fn with_latencies(mut self, link_latency: Duration, host_wait: Duration) -> SimSpeed {
        self.link_latency = link_latency;
        self.host_wait = host_wait;
        self
    }

    /// The time this card takes for `launches` kernel launches reading `read` bytes and
    /// `copies` copies of `copied` bytes over the host link.
    pub fn time_of(&self, launches: u64, read: u64, copies: u32, copied: u64) -> Duration {
        let secs = |bytes: u64, bps: f64| {
            if bps > 0.0 {
                Duration::from_secs_f64(bytes as f64 / bps)
            } else {
                Duration::ZERO
            }
        };
        let launches = u32::try_from(launches).unwrap_or(u32::MAX);
        self.launch * launches
            + secs(read, self.bandwidth)
            + self.link_latency * copies
            + secs(copied, self.link_bandwidth)
    }
}

/// Options of the simulated device.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct SimOptions {
    /// Its worker threads (its own, not the CPU side's pool).
    pub threads: usize,
    /// The card it plays (default: [`SimSpeed::h200`]); `None`: none, its marks are this
    /// machine's wall clock (a device as fast as its threads compute).
    pub speed: Option<SimSpeed>,
    /// With a speed: also make its work take at least the card's time on the wall clock (for
    /// benchmarks that time schedules by the wall clock, `bench schedule`); the card's clock
    /// does not need it.
    pub paced: bool,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            threads: 1,
            speed: Some(SimSpeed::h200()),
            paced: false,
        }
    }
}
