//! Measured speeds of the CPU and the device on the sparse FFN, taken when a model loads (as
//! Q-Infer does) and cached per machine and device.
//!
//! Each side runs a layer's FFN over some of its neurons at two densities; a straight line
//! through the two times gives a fixed cost per evaluation and a cost per active neuron row
//! ([`LinearCost`]). The device's fixed cost holds its launches and copies; the ratio of the
//! per-row costs is the throughput ratio Q-Infer's balanced placement takes. Before every
//! timed run a buffer larger than the CPU's caches is read, so that the rows come from memory
//! as they do while decoding (a decode step passes over the whole model between two visits of
//! a layer).

use std::path::Path;
use std::time::{Duration, Instant};

use powerinfer_kernels_cpu::MatMul;

use crate::device::{Device, HotFfnOp, HotSpec, Op, Program, Span};
use crate::error::{EngineError, Result};
use powerinfer_kernels_cpu::ffn::{token_ffn, NeuronRows, TokenBufs};

/// Neurons of the layer the calibration runs over.
const CALIBRATION_NEURONS: usize = 2048;

/// Shares of those neurons active in the two measurements.
const DENSITIES: [f64; 2] = [0.1, 0.4];

/// Timed repetitions of each measurement (the fastest is kept: interference from other work
/// only adds time), after one warm-up.
const REPS: usize = 7;

/// Bytes read between two timed runs to push the rows out of the CPU's caches.
const EVICT_BYTES: usize = 96 << 20;

/// Reads all of `buf` (the caches then hold it rather than the measured rows).
fn evict(buf: &[u64]) -> u64 {
    buf.iter().step_by(8).fold(0u64, |a, &v| a.wrapping_add(v))
}

/// Time of an evaluation as a straight line in its active neuron rows.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct LinearCost {
    /// Microseconds whatever the rows (launches, copies, dispatch).
    pub fixed_us: f64,
    /// Microseconds per active neuron row (its gate, up and down rows) and token.
    pub per_row_us: f64,
}

impl LinearCost {
    /// Microseconds for `rows` active rows.
    pub fn time_us(&self, rows: f64) -> f64 {
        self.fixed_us + self.per_row_us * rows
    }

    /// Active rows per microsecond beyond the fixed cost.
    pub fn rows_per_us(&self) -> f64 {
        if self.per_row_us > 0.0 {
            1.0 / self.per_row_us
        } else {
            f64::INFINITY
        }
    }

    /// The line through `(r1, t1)` and `(r2, t2)`, costs not below 0 and rows never free.
    fn through(r1: f64, t1: f64, r2: f64, t2: f64) -> LinearCost {
        let per = if r2 > r1 { (t2 - t1) / (r2 - r1) } else { 0.0 };
        let fixed = t1 - per * r1;
        // Noise (a busy machine) can make the slope too steep for the first point, or flat or
        // negative; the line is then through the origin and the second point.
        if (per <= 0.0 || fixed < 0.0) && r2 > 0.0 {
            LinearCost {
                fixed_us: 0.0,
                per_row_us: t2.max(0.0) / r2,
            }
        } else {
            LinearCost {
                fixed_us: fixed.max(0.0),
                per_row_us: per.max(0.0),
            }
        }
    }
}

/// The two sides' measured costs ([`BalanceReport::calibration`](super::BalanceReport)).
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct Calibration {
    /// What was measured: machine, threads, device, weight type, widths and batch size (the
    /// cache key).
    pub key: String,
    /// Tokens per evaluation measured.
    pub batch: usize,
    /// The CPU's cost.
    pub cpu: LinearCost,
    /// The device's cost.
    pub device: LinearCost,
    /// Whether it came from the cache file instead of being measured now.
    pub cached: bool,
    /// Time the measurement took (zero when cached).
    pub took: Duration,
}

impl Calibration {
    /// The device's throughput over the CPU's, per active row (Q-Infer's ratio).
    pub fn ratio(&self) -> f64 {
        if self.device.per_row_us > 0.0 {
            self.cpu.per_row_us / self.device.per_row_us
        } else {
            f64::INFINITY
        }
    }

    /// The line of the cache file.
    fn to_line(&self) -> String {
        format!(
            "{}\t{}\t{}\t{}\t{}\t{}\n",
            self.key,
            self.batch,
            self.cpu.fixed_us,
            self.cpu.per_row_us,
            self.device.fixed_us,
            self.device.per_row_us
        )
    }

    fn from_line(line: &str) -> Option<Calibration> {
        let f: Vec<&str> = line.split('\t').collect();
        if f.len() != 6 {
            return None;
        }
        let num = |s: &str| {
            s.trim()
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
        };
        Some(Calibration {
            key: f[0].to_string(),
            batch: f[1].parse().ok()?,
            cpu: LinearCost {
                fixed_us: num(f[2])?,
                per_row_us: num(f[3])?,
            },
            device: LinearCost {
                fixed_us: num(f[4])?,
                per_row_us: num(f[5])?,
            },
            cached: true,
            took: Duration::ZERO,
        })
    }
}

/// The CPU's model name (Linux: `/proc/cpuinfo`), for the cache key.
fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|n| n.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// What one calibration runs on.
pub(crate) struct Subject<'a> {
    /// The layer's whole host matrices (`bucket` ignored).
    pub(crate) spec: HotSpec<'a>,
    /// Device work buffers for `t` tokens: the FFN input, the scores, the output.
    pub(crate) bufs: [Span; 3],
    /// Neurons in the layer.
    pub(crate) n_ff: usize,
    /// Tokens per evaluation.
    pub(crate) t: usize,
    /// The predictor threshold.
    pub(crate) threshold: f32,
}

/// The cache key of a calibration of `subject` on `device` with `mm`'s threads.
pub(crate) fn key(device: &dyn Device, mm: &MatMul<'_>, s: &Subject<'_>) -> String {
    format!(
        "{} | {} threads {:?} | {} | {} {}x{} | t={}",
        cpu_name(),
        mm.pool().n_threads(),
        mm.backend(),
        device.identity(),
        s.spec.up.ty(),
        s.spec.up.cols(),
        s.n_ff,
        s.t
    )
    .replace(['\t', '\n'], " ")
}

/// The calibration of `subject` from the cache file `cache` (when it has one for this key),
/// else measured now and appended there.
pub(crate) fn calibrate(
    device: &dyn Device,
    mm: &MatMul<'_>,
    s: &Subject<'_>,
    cache: Option<&Path>,
) -> Result<Calibration> {
    let key = key(device, mm, s);
    if let Some(path) = cache {
        if let Ok(text) = std::fs::read_to_string(path) {
            if let Some(c) = text
                .lines()
                .rev()
                .filter_map(Calibration::from_line)
                .find(|c| c.key == key)
            {
                return Ok(c);
            }
        }
    }
    let c = measure(device, mm, s, key)?;
    if let Some(path) = cache {
        // A cache that cannot be written only costs a measurement next time.
        let _ = append(path, &c.to_line());
    }
    Ok(c)
}

fn append(path: &Path, line: &str) -> std::io::Result<()> {
    use std::io::Write;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    f.write_all(line.as_bytes())
}

fn fastest(v: Vec<f64>) -> f64 {
    v.into_iter().fold(f64::INFINITY, f64::min)
}

/// Measures both sides (see the [module docs](self)).
fn measure(
    device: &dyn Device,
    mm: &MatMul<'_>,
    s: &Subject<'_>,
    key: String,
) -> Result<Calibration> {
    let start = Instant::now();
    let (nff, t) = (s.n_ff, s.t.max(1));
    let ne = s.spec.down_t.cols();
    let n = nff.min(CALIBRATION_NEURONS);
    let bucket: Vec<u32> = (0..n as u32).collect();
    let spec = HotSpec {
        gate: s.spec.gate,
        up: s.spec.up,
        down_t: s.spec.down_t,
        bucket: &bucket,
        up_bias: s.spec.up_bias,
        act: s.spec.act,
    };
    let hot = device.upload_hot(&spec)?;
    let x: Vec<f32> = (0..t * ne)
        .map(|i| ((i as f32 * 0.618_034).fract() - 0.5) * 2.0)
        .collect();
    let mut points = Vec::new();
    let mut result = Ok(());
    // One u64 per cache line is read; the buffer is written once so its pages are real.
    let flush: Vec<u64> = (0..EVICT_BYTES / 8).map(|i| i as u64).collect();
    let mut sink = 0u64;
    for d in DENSITIES {
        let k = ((d * n as f64).round() as usize).clamp(1, n);
        let step = n / k;
        let list: Vec<u32> = (0..k).map(|i| (i * step) as u32).collect();
        let mut scores = vec![f32::NEG_INFINITY; t * nff];
        for i in 0..t {
            for &j in &list {
                scores[i * nff + j as usize] = s.threshold;
            }
        }
        let [xb, sb, yb] = s.bufs;
        if xb.len != t * ne || sb.len != t * nff || yb.len != t * ne {
            result = Err(EngineError::Device(
                "calibration buffers of the wrong size".into(),
            ));
            break;
        }
        let mut dev = Vec::with_capacity(REPS);
        let mut y = vec![0f32; t * ne];
        let mut r = Ok(());
        for rep in 0..=REPS {
            sink = sink.wrapping_add(evict(&flush));
            // The device's FFN between two marks; its inputs copied in before them.
            let mut run = || -> Result<f64> {
                let mut prog = Program::default();
                prog.write(device, xb, &x)?;
                prog.write(device, sb, &scores)?;
                let ffn = Op::HotFfn(HotFfnOp {
                    hot,
                    x: xb,
                    scores: sb,
                    threshold: s.threshold,
                    t,
                    y: yb,
                    accumulate: false,
                    count: None,
                });
                prog.timed(device, 0, ffn)?;
                let read = prog.read(device, yb)?;
                device.wait(read, &mut y)?;
                Ok(device.elapsed(0, 1)?.as_secs_f64() * 1e6)
            };
            match run() {
                Ok(us) if rep > 0 => dev.push(us),
                Ok(_) => {}
                Err(e) => {
                    r = Err(e);
                    break;
                }
            }
        }
        if let Err(e) = r {
            result = Err(e);
            break;
        }
        let rows = NeuronRows {
            gate: s.spec.gate.as_ref(),
            up: &s.spec.up,
            down: &s.spec.down_t,
            up_bias: s.spec.up_bias,
            act: s.spec.act,
        };
        let (mut g, mut u, mut fired) = (vec![0f32; nff], vec![0f32; nff], Vec::new());
        let mut cpu = Vec::with_capacity(REPS);
        for rep in 0..=REPS {
            sink = sink.wrapping_add(evict(&flush));
            let t0 = Instant::now();
            for i in 0..t {
                let mut bufs = TokenBufs {
                    g: &mut g,
                    u: &mut u,
                    fired: &mut fired,
                };
                token_ffn(
                    mm,
                    &rows,
                    &x[i * ne..][..ne],
                    &list,
                    &mut bufs,
                    &mut y[i * ne..][..ne],
                )?;
            }
            if rep > 0 {
                cpu.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
        points.push(((k * t) as f64, fastest(cpu), fastest(dev)));
    }
    std::hint::black_box(sink);
    device.drop_hot(hot)?;
    result?;
    let [(r1, c1, d1), (r2, c2, d2)] = points[..] else {
        return Err(EngineError::Device("calibration measured nothing".into()));
    };
    Ok(Calibration {
        key,
        batch: t,
        cpu: LinearCost::through(r1, c1, r2, c2),
        device: LinearCost::through(r1, d1, r2, d2),
        cached: false,
        took: start.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_through_two_points() {
        let c = LinearCost::through(10.0, 30.0, 50.0, 110.0);
        assert!((c.per_row_us - 2.0).abs() < 1e-12);
        assert!((c.fixed_us - 10.0).abs() < 1e-12);
        assert!((c.time_us(20.0) - 50.0).abs() < 1e-12);
        // A slope too steep for the first point: no negative fixed cost.
        let c = LinearCost::through(10.0, 5.0, 50.0, 110.0);
        assert_eq!(c.fixed_us, 0.0);
        assert!(c.per_row_us > 0.0);
        // A first point slower than the second (a busy machine): rows still cost.
        let c = LinearCost::through(10.0, 131.0, 40.0, 100.0);
        assert_eq!((c.fixed_us, c.per_row_us), (0.0, 2.5));
    }

    #[test]
    fn cache_lines_round_trip_and_reject_garbage() {
        let c = Calibration {
            key: "cpu | 2 threads Avx2 | sim | Q4_0 2048x5632 | t=1".into(),
            batch: 1,
            cpu: LinearCost {
                fixed_us: 3.5,
                per_row_us: 0.25,
            },
            device: LinearCost {
                fixed_us: 20.0,
                per_row_us: 0.05,
            },
            cached: false,
            took: Duration::from_millis(3),
        };
        let back = Calibration::from_line(c.to_line().trim_end()).unwrap();
        assert_eq!(back.cpu, c.cpu);
        assert_eq!(back.device, c.device);
        assert!(back.cached);
        assert!((c.ratio() - 5.0).abs() < 1e-12);
        for bad in [
            "",
            "a\tb",
            "k\t1\tx\t1\t1\t1",
            "k\t1\t-1\t1\t1\t1",
            "k\t1\tNaN\t1\t1\t1",
        ] {
            assert!(Calibration::from_line(bad).is_none(), "{bad:?}");
        }
    }
}
