//! The subcommands, one module each. Each has an `Args` struct and a `run(Args) -> Result<(), String>`;
//! an `Err` is printed as a one-line error and the process exits with status 1.

pub mod batched;
pub mod bench;
pub mod bench_decode;
pub mod bench_schedule;
pub mod bench_serve;
pub mod bench_shared;
pub mod chat;
pub mod convert;
pub mod device;
pub mod inspect;
pub mod logits;
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
pub mod tokenize;
pub mod train_predictor;

use std::io::{self, BufWriter, Write};

use powerinfer_engine::EngineOptions;

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
    o.sparse_threshold = sparse_threshold.or_else(|| {
        std::env::var("LLAMA_SPARSE_PRED_THRESHOLD")
            .ok()
            .and_then(|s| s.trim().parse::<f32>().ok())
    });
    o.fuse = std::env::var_os("POWERINFER_NOFUSE").is_none();
    if std::env::var("POWERINFER_CPU_ISA").is_ok_and(|v| v.eq_ignore_ascii_case("scalar")) {
        let b = powerinfer_kernels_cpu::Backend::Scalar;
        // Fixed for the process before any kernel runs.
        let _ = b.prefer();
        o.backend = Some(b);
    }
    o
}
