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

/// A speed to play for the simulated device: each piece of work takes at least the time
/// these figures give it (the work itself runs for real on the device's threads; when that
/// takes longer, the device is slower than asked and [`DeviceReport::overruns`](super::DeviceReport::overruns) counts it).
/// It charges what a GPU charges: every kernel launch, every copy over the host link (a
/// latency and the bytes at the link's bandwidth, on the device's stream), and every time the
/// host waits for the device.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct SimSpeed {
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
}

impl SimSpeed {
    /// A device reading `bandwidth` bytes/s, with `launch` per kernel and a host link of
    /// `link_bandwidth` bytes/s (the link latency and the host's wait as [`SimSpeed::h200`]).
    pub fn new(bandwidth: f64, launch: Duration, link_bandwidth: f64) -> SimSpeed {
        SimSpeed {
            bandwidth,
            launch,
            link_bandwidth,
            ..SimSpeed::h200()
        }
    }

    /// The figures of one H200 as the project measured it (`docs/tuning.md`, "The simulated
    /// GPU's speed model"): 4.3 TB/s of memory, 5 µs per launch, a host link of 25 GB/s with
    /// 10 µs per copy, 10 µs per host wait.
    pub fn h200() -> SimSpeed {
        SimSpeed {
            bandwidth: 4.3e12,
            launch: Duration::from_micros(5),
            link_bandwidth: 25e9,
            link_latency: Duration::from_micros(10),
            host_wait: Duration::from_micros(10),
        }
    }

    /// This speed with `link_latency` per copy and `host_wait` per wait of the host.
    pub fn with_latencies(mut self, link_latency: Duration, host_wait: Duration) -> SimSpeed {
        self.link_latency = link_latency;
        self.host_wait = host_wait;
        self
    }
}

/// Options of the simulated device.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct SimOptions {
    /// Its worker threads (its own, not the CPU side's pool).
    pub threads: usize,
    /// The speed it plays; `None`: as fast as its threads compute.
    pub speed: Option<SimSpeed>,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            threads: 1,
            speed: None,
        }
    }
}
