//! The subcommands, one module each. Each has an `Args` struct and a `run(Args) -> Result<(), String>`;
//! an `Err` is printed as a one-line error and the process exits with status 1.

pub mod bandwidth;
pub mod batched;
pub mod bench;
pub mod bench_decode;
pub mod bench_schedule;
pub mod bench_serve;
pub mod bench_shared;
pub mod chat;
pub mod convert;
pub mod demo_model;
pub mod device;
pub mod inspect;
pub mod logits;
pub mod model;
pub mod perplexity;
pub mod plan;
pub mod predictor_check;
pub mod profile;
pub mod progress;
pub mod quantize;
pub mod reorder;
pub mod run;
pub mod serve;
pub mod synth;
pub mod terminal;
pub mod tokenize;
pub mod train_predictor;

use std::fmt::Display;
use std::io::{self, BufWriter, Write};
use std::path::Path;

use powerinfer_engine::{DeviceChoice, Engine, EngineOptions, KvType};

/// The one-line error for `error`, which happened on the file `path`: the path said once (the
/// libraries' I/O errors already start with it), and a folder given for a file named as one.
pub fn file_error(path: impl AsRef<Path>, error: impl Display) -> String {
    let path = path.as_ref();
    if path.is_dir() {
        return format!("{}: is a directory, not a file", path.display());
    }
    let prefix = format!("{}: ", path.display());
    let text = error.to_string();
    if text.starts_with(&prefix) {
        text
    } else {
        prefix + &text
    }
}

/// Loads the model at `path`; its errors as [`file_error`] words them. A context longer than
/// the model was trained for is allowed with a warning, as llama.cpp does.
pub fn load_engine(path: &Path, options: EngineOptions) -> Result<Engine, String> {
    let engine = Engine::load(path, options).map_err(|e| file_error(path, e))?;
    let trained = engine.model().hparams().n_ctx_train;
    if engine.ctx_len() > trained {
        eprintln!(
            "warning: the context of {} positions is longer than the {trained} the model was \
             trained on; expect worse text past {trained}",
            engine.ctx_len()
        );
    }
    Ok(engine)
}

/// `bytes` in the largest binary unit it fills (GiB, MiB, KiB), with two decimals: 2 MiB of a
/// GiB budget reads `2.00 MiB`, not `0.00 GiB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    match UNITS.iter().find(|(_, size)| bytes >= *size) {
        Some((unit, size)) => format!("{:.2} {unit}", bytes as f64 / *size as f64),
        None => format!("{bytes} bytes"),
    }
}

/// A whole number ≥ 0 (thread counts, context sizes), with a message that says so for a
/// negative one.
pub fn whole_number(s: &str) -> Result<usize, String> {
    s.trim()
        .parse::<usize>()
        .map_err(|_| format!("`{s}`: expected a whole number ≥ 0"))
}

/// Writes a command's result on stdout through `write`; a closed pipe (`powerinfer inspect F |
/// head`) is not an error.
pub fn write_stdout(write: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> Result<(), String> {
    let stdout = io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    write(&mut out)
        .and_then(|()| out.flush())
        .or_else(|e| match e.kind() {
            io::ErrorKind::BrokenPipe => Ok(()),
            _ => Err(format!("writing output: {e}")),
        })
}

/// Writes `value` as one line of JSON.
pub fn json_line(out: &mut dyn Write, value: &serde_json::Value) -> io::Result<()> {
    serde_json::to_writer(&mut *out, value).map_err(io::Error::from)?;
    writeln!(out)
}

/// The KV cache's types (llama.cpp's `-ctk`/`-ctv`), on every command that evaluates.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct CacheTypes {
    /// The type the KV cache stores keys in: f16 (default), f32, bf16, q8_0 (half of f16's
    /// bytes), q4_0 (heads must be a multiple of 32 values for q8_0 and q4_0).
    #[arg(long = "cache-type-k", visible_alias = "ctk", default_value = "f16")]
    pub k: powerinfer_engine::KvType,
    /// The type the KV cache stores values in (as `--cache-type-k`).
    #[arg(long = "cache-type-v", visible_alias = "ctv", default_value = "f16")]
    pub v: powerinfer_engine::KvType,
}

impl CacheTypes {
    /// Sets `o`'s cache types (after its device): a CUDA device keeps F16 KV stores only, so
    /// another type with `--gpu cuda` is refused (with `--gpu auto` the engine then leaves the
    /// GPU out and says so).
    pub fn apply(&self, o: &mut EngineOptions) -> Result<(), String> {
        o.cache_type_k = self.k;
        o.cache_type_v = self.v;
        let quantized = (self.k, self.v) != (KvType::F16, KvType::F16);
        match o.device.choice {
            DeviceChoice::Cuda(n) if quantized => Err(format!(
                "--cache-type-k {} --cache-type-v {} with --gpu cuda:{n}: the CUDA device keeps \
                 its KV stores in F16 only (other types run on the CPU or --gpu sim)",
                self.k, self.v
            )),
            _ => Ok(()),
        }
    }
}

/// Engine options with the environment variables PowerInfer and earlier versions of this tool
/// read applied (the engine library reads none): `LLAMA_SPARSE_PRED_THRESHOLD` (predictor
/// threshold, when no flag gave one), `POWERINFER_NOFUSE` (one dispatch per product) and
/// `POWERINFER_CPU_ISA=scalar` (scalar kernels everywhere).
pub fn engine_options(threads: usize, sparse_threshold: Option<f32>) -> EngineOptions {
    let mut o = EngineOptions::default();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    o.threads = if threads > 4 * cores {
        eprintln!(
            "warning: {threads} threads is far past this machine's {cores} cores; using {cores}"
        );
        cores
    } else {
        threads
    };
    let tuning = crate::env::Tuning::from_env();
    o.sparse_threshold = sparse_threshold.or(tuning.sparse_threshold);
    o.fuse = !tuning.no_fuse;
    if tuning.scalar_kernels {
        let b = powerinfer_kernels_cpu::Backend::Scalar;
        // Fixed for the process before any kernel runs.
        let _ = b.prefer();
        o.backend = Some(b);
    }
    o
}
