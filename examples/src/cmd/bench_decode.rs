//! `powerinfer bench decode [-m FILE]... [--threads N] [--json] [--llama-bench PATH]`: decode
//! speed of the CPU engine, and the bytes it reads per token against this machine's measured
//! memory read bandwidth.
//!
//! For each model: the engine is loaded, a fixed prompt is evaluated, then `--tokens` tokens
//! are decoded greedily one at a time; the best of `--repeats` runs is kept. A PowerInfer file
//! is run twice: with its predictor (`sparse`) and with every neuron computed (`dense`, the
//! same file through the axpy over all rows); a dense GGUF file once (`dense`). Without `-m`
//! the demo model and its dense twin are used (written once, as `powerinfer run` does).
//!
//! Bytes per token are counted from the tensor directory: every 2-D weight read by a decode
//! step (attention, output head, predictor, dense FFN), the FFN rows of the neurons the
//! predictor selected (`ffn_gate`, `ffn_up`, `ffn_down_t` rows × the measured mean density),
//! one embedding row, and the F16 KV cache read by attention at the mean decode position.
//! `ratio` = bytes per token × tokens/s over the bandwidth; `ceiling_tps` = bandwidth over bytes
//! per token, the speed of a decode that did nothing but stream its bytes.
//!
//! Under each result a `weights:` line says how fast the memory holding that model's weights
//! reads (the file image the engine decodes from, read whole) and, for a mapped file, which
//! share of it the OS maps with 2 MiB pages: page-cache history can change decode speed by
//! tens of percent on a VM (see `WeightsMemory`), and this shows when it did.
//!
//! With `--batch B`, B sequences (the prompt with a different last token each) are decoded
//! together, one token of each per step (one [`Engine::eval`] of a `Batch::decode`), and tok/s counts all their
//! tokens; `--sequential` evaluates them one after the other instead, for comparison.
//!
//! With `--llama-bench PATH` (llama.cpp's `llama-bench`), each dense GGUF file is also run by
//! llama.cpp in the same invocation (`-p PROMPT -n TOKENS -t THREADS -r REPEATS -o json`) and its
//! tokens/s is printed beside ours, with the ratio; so is its prompt processing (the `pp` test
//! of PROMPT tokens, when PROMPT > 1) beside our prompt evaluation (PROMPT tokens in the engine's
//! blocks, best of the repeats). llama.cpp copies Q4_0 matrices into a
//! repacked layout in anonymous memory at load (its CPU repack or, on AMX CPUs, its AMX buffer),
//! so for Q4_0 files `--repack` is the like-for-like comparison.
//!
//! With `--powerinfer PATH` (PowerInfer's `main`, built CPU-only by `scripts/build-powerinfer`),
//! each PowerInfer file is also decoded by PowerInfer in the same rounds (`-p TEXT -n TOKENS -t
//! THREADS --temp 0 --ignore-eos`, best of the repeats; TEXT decodes to our prompt's tokens),
//! and its decode and prompt tok/s (from its `llama_print_timings`) are printed beside our
//! sparse row with the ratios. Every row also gets the fraction of its byte-bound ceiling at
//! the speed the weights' own memory reads (`weights_ceiling_share`).
//!
//! With `--rounds K`, the whole set (every file and mode, and llama.cpp) is measured K times,
//! the order reversed every other round, and each figure is the median over the rounds; the
//! ratios to llama.cpp are medians of the ratios within each round. On a machine whose memory
//! bandwidth drifts from minute to minute (shared VMs), ratios of runs made seconds apart are
//! far steadier than the speeds themselves. Every row is also compared with llama.cpp's run of
//! its twin (`vs llama twin`: e.g. a PowerInfer file's sparse decode against llama.cpp's dense
//! decode of its dense twin): the one file llama.cpp ran, if there is exactly one, else the one
//! file it ran of the row's architecture, layer count, widths and attention weight type.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use powerinfer_engine::tokenizer::Tokenizer;
use powerinfer_engine::KvType;
use powerinfer_engine::{AxpyCoefficients, Batch, Engine, EvalOptions};
use powerinfer_gguf::{FileKind, GgufFile};
use powerinfer_kernels_cpu::ThreadPool;
use serde_json::json;

use super::bench_shared::{argmax, budget_for, median};

/// Arguments of `powerinfer bench decode`.
#[derive(clap::Args)]
pub struct DecodeArgs {
    /// Model files (PowerInfer or dense GGUF); repeat the flag for several. Default: the demo
    /// model and its dense twin.
    #[arg(short = 'm', long = "model")]
    models: Vec<PathBuf>,
    /// Models on the Hugging Face Hub (`OWNER/NAME[:FILE]`, as `run -hf`), fetched into its
    /// cache and measured after the `-m` files; repeat the flag for several.
    #[arg(long = "hf-repo", visible_alias = "hf", value_name = "REPO[:FILE]")]
    hf_repos: Vec<crate::hub::HubModel>,
    /// Threads (0: all cores).
    #[arg(short = 't', long, default_value_t = 0, value_parser = crate::cmd::whole_number)]
    threads: usize,
    /// Tokens decoded per run.
    #[arg(short = 'n', long, default_value_t = 64)]
    tokens: usize,
    /// Prompt tokens evaluated before decoding.
    #[arg(long, default_value_t = 8)]
    prompt: usize,
    /// Runs per model and mode (the best is kept).
    #[arg(short = 'r', long, default_value_t = 3)]
    repeats: usize,
    /// Predictor threshold (default: as `powerinfer run`).
    #[arg(long)]
    sparse_threshold: Option<f32>,
    /// Read the model files into memory (huge pages requested) instead of mapping them.
    #[arg(long = "no-mmap")]
    no_mmap: bool,
    /// Repack dense Q4_0 matrices (`EngineOptions::repack`, like llama.cpp's default). Every
    /// copy is made right after loading (`Engine::repack_now`, timed as part of the load), so
    /// that the decode timing sees only steady steps.
    #[arg(long)]
    repack: bool,
    /// Sparse FFN: multiply the hidden values into the down rows as int8 per block with
    /// integer dot instructions instead of f32 FMAs (`EngineOptions::axpy`; Q4_0 rows on
    /// AVX-512 with VBMI; results differ from the default by at most max|c|/254 per weight
    /// and block; the default keeps PowerInfer's arithmetic).
    #[arg(long)]
    int8_axpy: bool,
    /// Only the sparse mode of PowerInfer files (skip their dense mode).
    #[arg(long)]
    sparse_only: bool,
    /// llama.cpp's `llama-bench` binary: also run every dense GGUF file with it.
    #[arg(long)]
    llama_bench: Option<PathBuf>,
    /// PowerInfer's `main` binary (its `llama-bench` does not load PowerInfer files): also
    /// decode every PowerInfer file with it beside each of our sparse and hybrid rows, with that
    /// row's VRAM budget (`--vram-budget`; 0 beside the CPU's row). `scripts/build-powerinfer`
    /// builds it from its public source, `--cuda` with CUDA.
    #[arg(long)]
    powerinfer: Option<PathBuf>,
    /// Sequences decoded together: each step evaluates one token of each of them in one
    /// batch ([`powerinfer_engine::Batch::decode`]); tok/s counts the tokens of all sequences.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// With `--batch`: decode the sequences one after the other each step (one
    /// [`Engine::eval`] per sequence) instead of in one batch, for comparison.
    #[arg(long)]
    sequential: bool,
    /// Measure everything this many times, alternating the order, and report medians (and
    /// per-round ratios to llama.cpp).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Print a JSON array of result objects instead of a table.
    #[arg(long)]
    json: bool,
    /// PowerInfer files: also decode with these shares of the FFN's bytes resident on the
    /// device (`--gpu`), e.g. `0,0.1,0.25,0.5,1`, each a `hybrid` row beside the CPU's `sparse`
    /// row (the dense parts go to the device first, as the placement orders them).
    #[arg(long = "ffn-resident", value_delimiter = ',')]
    ffn_resident: Vec<f64>,
    /// The device beside the CPU (sparse rows; with `--ffn-resident`, the hybrid rows).
    #[command(flatten)]
    device: super::device::DeviceArgs,
    /// The KV cache's types.
    #[command(flatten)]
    cache: super::CacheTypes,
}

/// One measurement of a round.
#[derive(Clone, Copy, Debug)]
enum Job {
    /// Our engine on configuration `i`.
    Ours(usize),
    /// llama.cpp's `llama-bench` on dense file `i`.
    Llama(usize),
    /// PowerInfer's `main` beside configuration `i` (a PowerInfer file's CPU or hybrid row, with
    /// the same VRAM budget).
    PowerInfer(usize),
}

/// What a row measures.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// Every neuron computed (a dense file, or a PowerInfer file through its axpy).
    Dense,
    /// The predictor-driven FFN (on the device of `--gpu`, without `--ffn-resident`).
    Sparse,
    /// The sparse FFN with this share of the FFN's bytes on the device.
    Hybrid(f64),
}

/// One measured configuration.
struct Row {
    model: String,
    mode: String,
    tps: f64,
    density: f64,
    bytes_per_token: f64,
    load_ms: f64,
    /// Milliseconds of one sequence's prompt evaluation, best of the repeats.
    prompt_ms: f64,
    /// How the engine's copy of the file reads (see [`WeightsMemory`]).
    memory: WeightsMemory,
    /// The device's report and the timed steps' profile, when a device computed a part.
    hybrid: Option<(
        powerinfer_engine::DeviceReport,
        powerinfer_engine::OpProfile,
    )>,
}

/// How fast the memory that holds a model's weights reads, and how it is mapped: the same file
/// decodes at very different speeds depending on its page-cache history (`docs/tuning.md`,
/// "Page-cache history"). Printed beside each result so that such differences show.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct WeightsMemory {
    /// Bytes/s of a read of the whole file image the engine decodes from (the benchmark's
    /// threads, the faster of the kernels' two reading paths, medians of 3: `bandwidth::read_bps`).
    pub(crate) read_bps: f64,
    /// Of the file's resident mapped bytes, the share mapped with 2 MiB pages (`FilePmdMapped`
    /// over `Rss` of its mappings in `/proc/self/smaps`); `None` when not mapped or unknown.
    pub(crate) huge_share: Option<f64>,
}

impl WeightsMemory {
    /// Measures `engine`'s weights: their read speed with the engine's thread count, and
    /// (unless `copied`) the page sizes of `path`'s mappings.
    pub(crate) fn of(engine: &Engine, path: &Path, copied: bool) -> WeightsMemory {
        let pool = ThreadPool::new(engine.threads());
        WeightsMemory {
            read_bps: super::bandwidth::read_bps(&pool, engine.model().file().bytes(), 3),
            huge_share: if copied { None } else { huge_page_share(path) },
        }
    }

    /// One line for people: page sizes, read speed against `bandwidth` (bytes/s), and a hint
    /// when the weights read below 0.8 of it.
    pub(crate) fn describe(&self, bandwidth: f64) -> String {
        let pages = match self.huge_share {
            Some(h) => format!("{:.0}% in 2 MiB pages, ", 100.0 * h),
            None => String::new(),
        };
        let ratio = self.read_bps / bandwidth;
        format!(
            "weights: {pages}read at {:.1} GB/s ({ratio:.2} of the bandwidth){}",
            self.read_bps / 1e9,
            if ratio < 0.8 {
                "; slower than the bandwidth: --no-mmap (a copy in fresh memory) may decode faster"
            } else {
                ""
            }
        )
    }
}

/// Of this process's mappings of `path`, the share of resident bytes mapped with 2 MiB pages
/// (Linux `/proc/self/smaps`; `None` elsewhere or when nothing of it is resident).
fn huge_page_share(path: &Path) -> Option<f64> {
    let want = std::fs::canonicalize(path).ok()?;
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let (mut mine, mut rss, mut pmd) = (false, 0u64, 0u64);
    for line in smaps.lines() {
        let mut f = line.split_whitespace();
        let Some(first) = f.next() else { continue };
        if first.contains('-') && !first.ends_with(':') {
            // A mapping's header: "start-end perms offset dev inode [path]".
            mine = f.nth(4).is_some_and(|p| Path::new(p) == want);
            continue;
        }
        if !mine {
            continue;
        }
        let kb = || {
            f.clone()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        match first {
            "Rss:" => rss += kb(),
            "FilePmdMapped:" => pmd += kb(),
            _ => {}
        }
    }
    (rss > 0).then(|| pmd as f64 / rss as f64)
}

/// Per-token byte counts of a file, split by how they scale.
struct ByteModel {
    /// Bytes read by every decode step whatever the sparsity.
    fixed: f64,
    /// Bytes of all sparse FFN rows (`ffn_gate`, `ffn_up`, `ffn_down_t`): read × density.
    sparse_rows: f64,
    /// Bytes of the predictor tensors (read only in sparse mode).
    predictor: f64,
    /// KV cache bytes per position (K and V, F16, all layers).
    kv_per_pos: f64,
    is_powerinfer: bool,
    /// What a dense twin shares with this model: architecture, layers, widths and the type of
    /// the first layer's attention weights (a PowerInfer file and the dense GGUF of the same
    /// weights agree on all of them).
    twin_key: String,
}

fn byte_model(path: &Path) -> Result<ByteModel, String> {
    let f = GgufFile::open(path).map_err(|e| super::file_error(path, e))?;
    let md = f.metadata();
    let arch = md
        .get_str("general.architecture")
        .map_err(|e| e.to_string())?
        .to_string();
    let uint = |k: &str| md.get(&format!("{arch}.{k}")).and_then(|v| v.to_u64());
    let n_embd = uint("embedding_length").unwrap_or(0) as f64;
    let n_head = uint("attention.head_count").unwrap_or(1).max(1) as f64;
    let n_head_kv = uint("attention.head_count_kv").map_or(n_head, |v| v as f64);
    let n_layer = uint("block_count").unwrap_or(0) as f64;
    let kv_per_pos = 2.0 * 2.0 * n_layer * n_embd / n_head * n_head_kv;
    let attn_type = ["blk.0.attn_q.weight", "blk.0.attn_qkv.weight"]
        .iter()
        .find_map(|n| f.tensor_info(n))
        .map(|t| t.ggml_type().to_string());
    let twin_key = format!(
        "{arch}/{n_layer}/{n_embd}/{n_head}/{n_head_kv}/{:?}/{attn_type:?}",
        uint("feed_forward_length")
    );
    let mut m = ByteModel {
        fixed: 0.0,
        sparse_rows: 0.0,
        predictor: 0.0,
        kv_per_pos,
        is_powerinfer: f.kind() == FileKind::PowerInfer,
        twin_key,
    };
    for t in f.tensors() {
        let name = t.name();
        let bytes = t.n_bytes() as f64;
        if t.shape().len() < 2 {
            m.fixed += bytes;
        } else if name == "token_embd.weight" {
            // One row per token.
            m.fixed += bytes / t.shape()[1].max(1) as f64;
        } else if name.ends_with(".fc1.weight") || name.ends_with(".fc2.weight") {
            m.predictor += bytes;
        } else if m.is_powerinfer
            && (name.ends_with(".ffn_gate.weight")
                || name.ends_with(".ffn_up.weight")
                || name.ends_with(".ffn_down_t.weight"))
        {
            m.sparse_rows += bytes;
        } else {
            m.fixed += bytes;
        }
    }
    Ok(m)
}

impl ByteModel {
    /// Bytes per token of a decode step of `batch` sequences (one token each). Weights read
    /// whole are shared by the step's tokens; a sparse FFN's rows are counted per token (the
    /// union of the batch's active rows is not measured, so for `batch` > 1 this is an upper
    /// bound).
    fn per_token(&self, sparse: bool, density: f64, mean_pos: f64, batch: usize) -> f64 {
        let b = batch.max(1) as f64;
        let ffn = if sparse {
            self.predictor / b + self.sparse_rows * density
        } else {
            self.sparse_rows / b
        };
        self.fixed / b + ffn + self.kv_per_pos * mean_pos
    }
}

/// The VRAM budget (bytes) that holds the dense parts and `frac` of the FFN's bytes of `path`
/// with the options of `a` (what a `hybrid` row runs with).
fn hybrid_budget(path: &Path, a: &DecodeArgs, frac: f64) -> Result<u64, String> {
    let mut probe = super::engine_options(a.threads, a.sparse_threshold);
    a.device.apply(&mut probe)?;
    a.cache.apply(&mut probe)?;
    probe.ctx_len = (a.prompt + a.tokens + 8).max(64);
    probe.batch = 64;
    budget_for(path, &probe, frac)
}

/// The VRAM budget (GiB) PowerInfer gets beside configuration `mode` of `path`: the hybrid
/// row's budget, `--vram-budget` for a sparse row on the device, 0 for the CPU's row.
fn powerinfer_budget(path: &Path, a: &DecodeArgs, mode: Mode) -> Result<f64, String> {
    Ok(match mode {
        Mode::Hybrid(frac) => hybrid_budget(path, a, frac)? as f64 / (1u64 << 30) as f64,
        Mode::Sparse if a.ffn_resident.is_empty() => a.device.vram_budget.unwrap_or(0.0),
        _ => 0.0,
    })
}

fn measure(path: &Path, a: &DecodeArgs, mode: Mode) -> Result<Row, String> {
    let dense = mode == Mode::Dense;
    let mut opts = super::engine_options(a.threads, a.sparse_threshold);
    opts.dense = dense;
    match mode {
        // A dense GGUF file's layers on the device with `-ngl` (a PowerInfer file's dense mode
        // stays on the CPU).
        Mode::Dense if a.device.n_gpu_layers.is_some() && !byte_model(path)?.is_powerinfer => {
            a.device.apply(&mut opts)?
        }
        Mode::Dense => {}
        Mode::Sparse if a.ffn_resident.is_empty() => a.device.apply(&mut opts)?,
        Mode::Sparse => {}
        Mode::Hybrid(frac) => {
            a.device.apply(&mut opts)?;
            opts.device.vram_budget = Some(hybrid_budget(path, a, frac)?);
        }
    }
    a.cache.apply(&mut opts)?;
    opts.ctx_len = (a.prompt + a.tokens + 8).max(64);
    opts.batch = 64;
    opts.mmap = !a.no_mmap;
    opts.repack = a.repack;
    if a.int8_axpy {
        opts.axpy = AxpyCoefficients::Int8;
    }
    let t0 = Instant::now();
    let engine = Engine::load(path, opts).map_err(|e| super::file_error(path, e))?;
    engine
        .repack_now()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let memory = WeightsMemory::of(&engine, path, a.no_mmap);
    let n_vocab = engine.model().hparams().n_vocab as u32;
    // A fixed prompt of ordinary token ids (BOS first).
    let prompt: Vec<u32> = std::iter::once(1)
        .chain((0..a.prompt.saturating_sub(1) as u32).map(|i| (100 + 37 * i) % n_vocab))
        .collect();
    let nb = a.batch.max(1);
    let mut best: Option<(f64, f64, powerinfer_engine::OpProfile)> = None;
    let mut prompt_ms = f64::INFINITY;
    for _ in 0..a.repeats.max(1) {
        let mut cache = engine.new_cache();
        // Every sequence gets the prompt with its own last token, so the sequences differ.
        let mut toks = Vec::with_capacity(nb);
        let t = Instant::now();
        for i in 0..nb {
            let seq = cache.add_sequence();
            let mut p = prompt.clone();
            if let Some(last) = p.last_mut() {
                *last = (*last + 7 * i as u32) % n_vocab;
            }
            let out = engine
                .eval(&mut cache, &Batch::one(seq, &p), EvalOptions::new())
                .map_err(|e| e.to_string())?;
            toks.push((seq, argmax(&out[0].logits)));
        }
        prompt_ms = prompt_ms.min(t.elapsed().as_secs_f64() * 1e3 / nb as f64);
        let mut density = 0.0;
        let mut prof = powerinfer_engine::OpProfile::new();
        let device = engine.device_report().kind != "none";
        // The hybrid split's clocks cost well under a microsecond per layer.
        fn eval_opts(p: &mut powerinfer_engine::OpProfile, on: bool) -> EvalOptions<'_> {
            if on {
                EvalOptions::new().profile(p)
            } else {
                EvalOptions::new()
            }
        }
        let t = Instant::now();
        for _ in 0..a.tokens {
            let outs = if nb == 1 || a.sequential {
                toks.iter()
                    .map(|&(seq, tok)| {
                        let one = Batch::one(seq, std::slice::from_ref(&tok));
                        engine.eval(&mut cache, &one, eval_opts(&mut prof, device))
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map(|v| v.concat())
            } else {
                engine.eval(
                    &mut cache,
                    &Batch::decode(&toks),
                    eval_opts(&mut prof, device),
                )
            }
            .map_err(|e| e.to_string())?;
            for (entry, out) in toks.iter_mut().zip(&outs) {
                density += out.density.iter().map(|&d| d as f64).sum::<f64>();
                entry.1 = argmax(&out.logits);
            }
        }
        let tps = (a.tokens * nb) as f64 / t.elapsed().as_secs_f64();
        let density = density / (a.tokens * nb).max(1) as f64;
        if best.as_ref().is_none_or(|b| tps > b.0) {
            best = Some((tps, density, prof));
        }
    }
    let (tps, density, prof) = best.expect("at least one run");
    let report = engine.device_report();
    let hybrid = (report.kind != "none").then_some((report, prof));
    let bm = byte_model(path)?;
    let sparse = bm.is_powerinfer && !dense;
    let mean_pos = a.prompt as f64 + a.tokens as f64 / 2.0;
    Ok(Row {
        model: path.display().to_string(),
        mode: match mode {
            Mode::Hybrid(f) => format!("hybrid{:.0}%", 100.0 * f),
            _ if sparse => "sparse".into(),
            _ => "dense".into(),
        },
        tps,
        density,
        bytes_per_token: bm.per_token(sparse, density, mean_pos, if a.sequential { 1 } else { nb }),
        load_ms,
        prompt_ms,
        memory,
        hybrid,
    })
}

/// The hybrid split summed over layers, per token (ms), and the device's share of actives.
fn hybrid_totals(p: &powerinfer_engine::OpProfile) -> serde_json::Value {
    let rows = super::device::split_rows(p);
    let sum = |i: usize| rows.iter().map(|r| r.1[i]).sum::<f64>();
    let (cpu, dev) = p.layers().iter().fold((0u64, 0u64), |a, s| {
        (a.0 + s.active_cpu, a.1 + s.active_device)
    });
    json!({
        "cpu_ms": sum(0), "device_ms": sum(1), "transfer_ms": sum(2), "cpu_wait_ms": sum(3),
        "device_idle_ms": sum(4), "device_active_share": dev as f64 / (cpu + dev).max(1) as f64,
    })
}

/// The index in `v` of its (lower) median element.
fn median_index(v: &[f64]) -> usize {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&i, &j| v[i].total_cmp(&v[j]));
    idx.get(v.len().saturating_sub(1) / 2).copied().unwrap_or(0)
}

/// What `llama-bench` measured on one file.
#[derive(Clone, Copy, Debug)]
struct LlamaRun {
    /// Tokens/s of its text generation test (`tg`).
    tg: f64,
    /// Tokens/s of its prompt processing test (`pp`), when one was asked for and printed.
    pp: Option<f64>,
}

/// llama.cpp's text generation test on `path` after a prompt of `a.prompt` tokens (its KV
/// cache filled to that depth first, `-d`, as our decode runs after the prompt) and, for
/// prompts of more than one token, its prompt processing test of `a.prompt` tokens; the KV
/// cache's types as ours (`-ctk`/`-ctv`, with flash attention for a quantized V, which
/// llama.cpp needs).
fn llama_bench(
    bin: &Path,
    path: &Path,
    a: &DecodeArgs,
    threads: usize,
) -> Result<LlamaRun, String> {
    let depth = if a.prompt > 1 { a.prompt } else { 0 };
    let tests = run_llama_bench(bin, path, a, threads, (0, a.tokens, depth))?;
    let tg = speed(&tests, |_, gen| gen > 0)
        .ok_or_else(|| "llama-bench printed no text-generation result".to_string())?;
    let pp = if depth > 0 {
        let tests = run_llama_bench(bin, path, a, threads, (a.prompt, 0, 0))?;
        speed(&tests, |prompt, gen| prompt > 0 && gen == 0)
    } else {
        None
    };
    Ok(LlamaRun { tg, pp })
}

/// The tokens/s of the first of llama-bench's `tests` whose prompt and generated token
/// counts `want` takes.
fn speed(tests: &[serde_json::Value], want: fn(u64, u64) -> bool) -> Option<f64> {
    tests
        .iter()
        .find(|r| {
            want(
                r["n_prompt"].as_u64().unwrap_or(0),
                r["n_gen"].as_u64().unwrap_or(0),
            )
        })
        .and_then(|r| r["avg_ts"].as_f64())
}

/// One `llama-bench` run of `(prompt tokens, generated tokens, depth)`: its JSON tests.
fn run_llama_bench(
    bin: &Path,
    path: &Path,
    a: &DecodeArgs,
    threads: usize,
    (pp, tg, depth): (usize, usize, usize),
) -> Result<Vec<serde_json::Value>, String> {
    let out = Command::new(bin)
        .arg("-m")
        .arg(path)
        .args(["-p", &pp.to_string(), "-n", &tg.to_string()])
        .args(["-d", &depth.to_string()])
        .args(["-t", &threads.to_string()])
        .args(["-r", &a.repeats.max(1).to_string()])
        .args(["-ctk", a.cache.k.name(), "-ctv", a.cache.v.name()])
        // llama.cpp quantizes V only with flash attention.
        .args(if a.cache.v == KvType::F16 {
            &[][..]
        } else {
            &["-fa", "on"][..]
        })
        .args(["-o", "json"])
        .output()
        .map_err(|e| format!("{}: {e}", bin.display()))?;
    if !out.status.success() {
        return Err(format!(
            "llama-bench failed on {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        ));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("llama-bench output is not JSON: {e}"))?;
    Ok(v.as_array().cloned().unwrap_or_default())
}

/// The text PowerInfer's `main` is given: our prompt's tokens after BOS, decoded (`main` adds
/// its own BOS; it re-tokenizes the text, and the prompt count it reports is the one used).
fn prompt_text(path: &Path, a: &DecodeArgs) -> Result<String, String> {
    let f = GgufFile::open(path).map_err(|e| super::file_error(path, e))?;
    let tok = Tokenizer::from_gguf(&f).map_err(|e| format!("{}: {e}", path.display()))?;
    let n_vocab = tok.n_tokens() as u32;
    let ids: Vec<u32> = (0..a.prompt.saturating_sub(1) as u32)
        .map(|i| (100 + 37 * i) % n_vocab)
        .collect();
    tok.decode_lossy(&ids, false, false)
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Milliseconds and count of one `llama_print_timings` line of PowerInfer's `main`
/// (`prompt eval time =  69.04 ms /  4 tokens (...)`).
fn timing(stderr: &str, label: &str) -> Option<(f64, f64)> {
    let line = stderr
        .lines()
        .find(|l| l.contains("llama_print_timings") && l.contains(label))?;
    let rest = line.split_once('=')?.1;
    let mut words = rest.split_whitespace();
    let ms: f64 = words.next()?.parse().ok()?;
    let _unit = words.next()?;
    let _slash = words.next()?;
    let n: f64 = words.next()?.parse().ok()?;
    Some((ms, n))
}

/// PowerInfer's `main` on a PowerInfer file with `vram_gib` of VRAM (`--vram-budget`; a build
/// without CUDA warns and ignores it): greedy decode of `a.tokens` tokens after the prompt, best
/// of `a.repeats` runs; decode tok/s from its `eval time`, prompt tok/s from its `prompt eval
/// time`.
fn powerinfer_main(
    bin: &Path,
    (path, vram_gib): (&Path, f64),
    a: &DecodeArgs,
    threads: usize,
    text: &str,
) -> Result<LlamaRun, String> {
    let mut best = LlamaRun { tg: 0.0, pp: None };
    // `main` writes its `main.log` into its working directory: run it in the temporary
    // directory, with the model's path made absolute.
    let path = std::path::absolute(path).map_err(|e| format!("{}: {e}", path.display()))?;
    // A binary named by a path (not looked up in PATH) made absolute too.
    let bin = if bin.components().count() > 1 {
        std::path::absolute(bin).map_err(|e| format!("{}: {e}", bin.display()))?
    } else {
        bin.to_path_buf()
    };
    for _ in 0..a.repeats.max(1) {
        let out = Command::new(&bin)
            .current_dir(std::env::temp_dir())
            .arg("-m")
            .arg(&path)
            .args(["-p", text])
            .args(["-n", &a.tokens.to_string()])
            .args(["-t", &threads.to_string()])
            .args(["-c", &(a.prompt + a.tokens + 64).to_string()])
            .args(["--temp", "0", "--ignore-eos", "--seed", "1"])
            .args(["--vram-budget", &format!("{vram_gib:.4}")])
            // Only when asked for: its default is F16, as ours.
            .args(match (a.cache.k, a.cache.v) {
                (KvType::F16, KvType::F16) => vec![],
                (k, v) => vec!["-ctk", k.name(), "-ctv", v.name()],
            })
            .output()
            .map_err(|e| format!("{}: {e}", bin.display()))?;
        let err = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            return Err(format!(
                "PowerInfer failed on {}: {}",
                path.display(),
                err.lines().last().unwrap_or("")
            ));
        }
        // The decode line: `eval time` without `prompt`.
        let (ms, runs) = err
            .lines()
            .filter(|l| !l.contains("prompt"))
            .find_map(|l| timing(l, " eval time"))
            .ok_or_else(|| format!("PowerInfer printed no eval time for {}", path.display()))?;
        let tg = runs / (ms / 1e3);
        let pp = timing(&err, "prompt eval time").map(|(ms, n)| n / (ms / 1e3));
        if tg > best.tg {
            best = LlamaRun { tg, pp };
        }
    }
    Ok(best)
}

/// Runs `powerinfer bench decode`.
pub fn run(a: DecodeArgs) -> Result<(), String> {
    let mut models = a.models.clone();
    if !a.hf_repos.is_empty() {
        let options = crate::hub::HubOptions::from_env();
        for m in &a.hf_repos {
            models.push(super::model::fetch(m, &options)?);
        }
    }
    if models.is_empty() {
        let (sparse, twin) = super::demo_model::demo_files()?;
        models = vec![twin, sparse];
    }
    let threads = if a.threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        a.threads
    };
    let pool = ThreadPool::new(threads);
    let bw = super::bandwidth::read_bandwidth(&pool, 1 << 30, 5);
    drop(pool);
    if !a.json {
        eprintln!(
            "memory read bandwidth ({threads} threads): {:.1} GB/s",
            bw / 1e9
        );
    }
    // Configurations in the order of the command line: (file, mode).
    let mut configs: Vec<(PathBuf, Mode)> = Vec::new();
    for path in &models {
        if byte_model(path)?.is_powerinfer {
            configs.push((path.clone(), Mode::Sparse));
            for &f in &a.ffn_resident {
                configs.push((path.clone(), Mode::Hybrid(f)));
            }
            if !a.sparse_only {
                configs.push((path.clone(), Mode::Dense));
            }
        } else {
            configs.push((path.clone(), Mode::Dense));
        }
    }
    let llama_files: Vec<&PathBuf> = match &a.llama_bench {
        Some(_) => models
            .iter()
            .filter(|p| byte_model(p).is_ok_and(|b| !b.is_powerinfer))
            .collect(),
        None => Vec::new(),
    };
    let pi_files: Vec<&PathBuf> = match &a.powerinfer {
        Some(_) => models
            .iter()
            .filter(|p| byte_model(p).is_ok_and(|b| b.is_powerinfer))
            .collect(),
        None => Vec::new(),
    };
    let pi_texts: Vec<String> = pi_files
        .iter()
        .map(|p| prompt_text(p, &a))
        .collect::<Result<_, _>>()?;
    let rounds = a.rounds.max(1);
    // measured[c][r]: configuration c in round r; llama[f][r]: llama.cpp on llama_files[f];
    // pi[c][r]: PowerInfer beside configuration c (empty where it does not run).
    let mut measured: Vec<Vec<Row>> = (0..configs.len()).map(|_| Vec::new()).collect();
    let mut llama: Vec<Vec<LlamaRun>> = (0..llama_files.len()).map(|_| Vec::new()).collect();
    let mut pi: Vec<Vec<LlamaRun>> = (0..configs.len()).map(|_| Vec::new()).collect();
    // pi_gib[c]: the VRAM budget PowerInfer gets beside configuration c.
    let pi_gib: Vec<f64> = (configs.iter())
        .map(
            |(path, mode)| match pi_files.contains(&path) && *mode != Mode::Dense {
                true => powerinfer_budget(path, &a, *mode),
                false => Ok(0.0),
            },
        )
        .collect::<Result<_, _>>()?;
    for round in 0..rounds {
        // Every job of the round: ours (configuration index), llama.cpp or PowerInfer (file
        // index), each reference next to the first row of its file.
        let mut jobs: Vec<Job> = Vec::new();
        for (c, (path, mode)) in configs.iter().enumerate() {
            jobs.push(Job::Ours(c));
            if let Some(f) = llama_files.iter().position(|p| *p == path) {
                jobs.push(Job::Llama(f));
            }
            if pi_files.contains(&path) && *mode != Mode::Dense {
                jobs.push(Job::PowerInfer(c));
            }
        }
        if round % 2 == 1 {
            jobs.reverse();
        }
        for job in jobs {
            let (name, file, run, store) = match job {
                Job::Ours(i) => {
                    let (path, mode) = &configs[i];
                    let r = measure(path, &a, *mode)?;
                    if !a.json {
                        eprintln!(
                            "round {}: measured {} ({}): {:.2} tok/s",
                            round + 1,
                            r.model,
                            r.mode,
                            r.tps
                        );
                    }
                    measured[i].push(r);
                    continue;
                }
                Job::Llama(i) => {
                    let bin = a.llama_bench.as_ref().expect("llama files need the binary");
                    let run = llama_bench(bin, llama_files[i], &a, threads)?;
                    ("llama.cpp", llama_files[i], run, &mut llama[i])
                }
                Job::PowerInfer(i) => {
                    let bin = a
                        .powerinfer
                        .as_ref()
                        .expect("PowerInfer files need the binary");
                    let path = &configs[i].0;
                    let f = pi_files.iter().position(|p| *p == path).expect("a PI file");
                    let run = powerinfer_main(bin, (path, pi_gib[i]), &a, threads, &pi_texts[f])?;
                    ("PowerInfer", path, run, &mut pi[i])
                }
            };
            if !a.json {
                eprintln!(
                    "round {}: {name} {}: {:.2} tok/s{}",
                    round + 1,
                    file.display(),
                    run.tg,
                    run.pp
                        .map(|p| format!(", prompt {p:.1} tok/s"))
                        .unwrap_or_default()
                );
            }
            store.push(run);
        }
    }
    // llama_tg[f][r] / llama_pp[f][r]: llama.cpp's speeds (prompt where it printed one).
    let llama_tg: Vec<Vec<f64>> = llama
        .iter()
        .map(|v| v.iter().map(|r| r.tg).collect())
        .collect();
    let llama_pp: Vec<Vec<Option<f64>>> = llama
        .iter()
        .map(|v| v.iter().map(|r| r.pp).collect())
        .collect();
    let llama = llama_tg;
    let llama_index = |m: &Path| llama_files.iter().position(|p| p.as_path() == m);
    // Each row's twin reference: the one file llama.cpp ran, if there is exactly one, else
    // the one llama.cpp file of the row's shape and weight type (see `ByteModel::twin_key`).
    let llama_keys: Vec<String> = llama_files
        .iter()
        .map(|p| byte_model(p).map(|b| b.twin_key))
        .collect::<Result<_, _>>()?;
    let twins: Vec<Option<usize>> = configs
        .iter()
        .map(|(path, _)| {
            if llama_files.len() == 1 {
                return Ok(Some(0));
            }
            let key = byte_model(path)?.twin_key;
            let mut same = llama_keys.iter().enumerate().filter(|(_, k)| **k == key);
            Ok(match (same.next(), same.next()) {
                (Some((f, _)), None) => Some(f),
                _ => None,
            })
        })
        .collect::<Result<_, String>>()?;
    let any_twin = twins.iter().any(Option::is_some);
    let objects: Vec<serde_json::Value> = configs
        .iter()
        .zip(&measured)
        .zip(&twins)
        .zip(pi.iter().zip(&pi_gib))
        .map(|((((path, _), runs), twin), (pi_runs, pi_gib))| {
            let tps_rounds: Vec<f64> = runs.iter().map(|r| r.tps).collect();
            let prompt_rounds: Vec<f64> = runs
                .iter()
                .map(|r| a.prompt as f64 / (r.prompt_ms / 1e3))
                .collect();
            let tps = median(&tps_rounds);
            // The row of the median round supplies density and bytes (they hardly vary).
            let r = &runs[median_index(&tps_rounds)];
            let gbps = r.bytes_per_token * tps / 1e9;
            let mut o = json!({
                "model": r.model,
                "mode": r.mode,
                "threads": threads,
                "tokens": a.tokens,
                "batch": a.batch.max(1),
                "batch_mode": if a.sequential { "sequential" } else { "batched" },
                "rounds": rounds,
                "decode_tps": tps,
                "decode_tps_rounds": tps_rounds,
                "ffn_density": r.density,
                "bytes_per_token": r.bytes_per_token,
                "gbps": gbps,
                "bandwidth_gbps": bw / 1e9,
                "ratio": gbps / (bw / 1e9),
                "ceiling_tps": bw / r.bytes_per_token,
                "load_ms": r.load_ms,
                "prompt_ms": r.prompt_ms,
                "prompt_tokens": a.prompt,
                "prompt_tps": median(&prompt_rounds),
                "prompt_tps_rounds": prompt_rounds,
                "weights_read_gbps": r.memory.read_bps / 1e9,
                "weights_huge_page_share": r.memory.huge_share,
                // The byte-bound ceiling at the speed the weights' own memory reads.
                "weights_ceiling_tps": r.memory.read_bps / r.bytes_per_token,
                "weights_ceiling_share": tps * r.bytes_per_token / r.memory.read_bps,
            });
            if !pi_runs.is_empty() {
                let tg: Vec<f64> = pi_runs.iter().map(|r| r.tg).collect();
                o["powerinfer_vram_budget_gib"] = (*pi_gib).into();
                let ratios: Vec<f64> = tps_rounds.iter().zip(&tg).map(|(o, l)| o / l).collect();
                o["powerinfer_tps"] = median(&tg).into();
                o["powerinfer_tps_rounds"] = tg.into();
                o["vs_powerinfer"] = median(&ratios).into();
                o["vs_powerinfer_rounds"] = ratios.into();
                let pp: Option<Vec<f64>> = pi_runs.iter().map(|r| r.pp).collect();
                if let Some(pp) = pp {
                    let ratios: Vec<f64> =
                        prompt_rounds.iter().zip(&pp).map(|(o, l)| o / l).collect();
                    o["powerinfer_prompt_tps"] = median(&pp).into();
                    o["prompt_vs_powerinfer"] = median(&ratios).into();
                    o["prompt_vs_powerinfer_rounds"] = ratios.into();
                }
            }
            if let Some((report, prof)) = &r.hybrid {
                o["device"] = super::device::json(report);
                o["hybrid_per_layer"] = super::device::split_json(prof);
                o["hybrid_per_token"] = hybrid_totals(prof);
            }
            let ratios = |f: usize| -> Vec<f64> {
                tps_rounds
                    .iter()
                    .zip(&llama[f])
                    .map(|(o, l)| o / l)
                    .collect()
            };
            if let Some(f) = llama_index(path) {
                o["llama_cpp_tps"] = median(&llama[f]).into();
                o["llama_cpp_tps_rounds"] = llama[f].clone().into();
                o["vs_llama_cpp"] = median(&ratios(f)).into();
                o["vs_llama_cpp_rounds"] = ratios(f).into();
            }
            if let Some(f) = *twin {
                o["vs_llama_twin"] = median(&ratios(f)).into();
                o["vs_llama_twin_rounds"] = ratios(f).into();
            }
            // Prompt processing: only where llama.cpp printed it in every round.
            let pp = |f: usize| -> Option<Vec<f64>> { llama_pp[f].iter().copied().collect() };
            let pp_ratios = |l: &[f64]| -> Vec<f64> {
                prompt_rounds.iter().zip(l).map(|(o, l)| o / l).collect()
            };
            if let Some(l) = llama_index(path).and_then(pp) {
                o["llama_cpp_prompt_tps"] = median(&l).into();
                o["llama_cpp_prompt_tps_rounds"] = l.clone().into();
                o["prompt_vs_llama_cpp"] = median(&pp_ratios(&l)).into();
                o["prompt_vs_llama_cpp_rounds"] = pp_ratios(&l).into();
            }
            if let Some(l) = twin.and_then(pp) {
                o["prompt_vs_llama_twin"] = median(&pp_ratios(&l)).into();
                o["prompt_vs_llama_twin_rounds"] = pp_ratios(&l).into();
            }
            o
        })
        .collect();
    if a.json {
        println!("{}", serde_json::Value::Array(objects));
        return Ok(());
    }
    if rounds > 1 {
        println!("medians of {rounds} rounds (ratios: medians of the per-round ratios)");
    }
    println!(
        "{:<44} {:>6} {:>8} {:>7} {:>9} {:>7} {:>6} {:>8} {:>10}{}",
        "model",
        "mode",
        "tok/s",
        "density",
        "MB/token",
        "GB/s",
        "ratio",
        "ceiling",
        "llama.cpp",
        if any_twin {
            format!(" {:>14}", "vs llama twin")
        } else {
            String::new()
        }
    );
    for o in &objects {
        let model = o["model"].as_str().unwrap_or("");
        let name = Path::new(model)
            .file_name()
            .map_or(model.to_string(), |n| n.to_string_lossy().into_owned());
        let num = |k: &str| o[k].as_f64().unwrap_or(0.0);
        let llama = match o.get("llama_cpp_tps") {
            Some(l) => format!(
                "{:.2} ({:.2}x)",
                l.as_f64().unwrap_or(0.0),
                num("vs_llama_cpp")
            ),
            None => String::from("-"),
        };
        let twin_col = match (any_twin, o.get("vs_llama_twin")) {
            (true, Some(_)) => format!(" {:>13.2}x", num("vs_llama_twin")),
            (true, None) => format!(" {:>14}", "-"),
            (false, _) => String::new(),
        };
        println!(
            "{:<44} {:>6} {:>8.2} {:>7.3} {:>9.1} {:>7.1} {:>6.2} {:>8.1} {:>10}{}",
            name,
            o["mode"].as_str().unwrap_or(""),
            num("decode_tps"),
            num("ffn_density"),
            num("bytes_per_token") / 1e6,
            num("gbps"),
            num("ratio"),
            num("ceiling_tps"),
            llama,
            twin_col
        );
        let memory = WeightsMemory {
            read_bps: num("weights_read_gbps") * 1e9,
            huge_share: o["weights_huge_page_share"].as_f64(),
        };
        println!("    {}", memory.describe(bw));
        if let Some(h) = o.get("hybrid_per_token") {
            let f = |k: &str| h[k].as_f64().unwrap_or(0.0);
            println!(
                "    device {}: {:.1}% of FFN rows resident, {:.1}% of active neurons there; per \
                 token: CPU {:.3} ms, device {:.3} ms (copies {:.3}), CPU waiting {:.3}, device \
                 idle {:.3}",
                o["device"]["kind"].as_str().unwrap_or(""),
                100.0 * o["device"]["resident_share"].as_f64().unwrap_or(0.0),
                100.0 * f("device_active_share"),
                f("cpu_ms"),
                f("device_ms"),
                f("transfer_ms"),
                f("cpu_wait_ms"),
                f("device_idle_ms")
            );
        }
        let prompt_vs = match (o.get("llama_cpp_prompt_tps"), o.get("prompt_vs_llama_twin")) {
            (Some(l), _) => format!(
                "; llama.cpp {:.1} tok/s ({:.2}x)",
                l.as_f64().unwrap_or(0.0),
                num("prompt_vs_llama_cpp")
            ),
            (None, Some(t)) => format!(
                "; {:.2}x llama.cpp's on its twin",
                t.as_f64().unwrap_or(0.0)
            ),
            (None, None) => String::new(),
        };
        println!(
            "    prompt: {} tokens at {:.1} tok/s{prompt_vs}",
            a.prompt,
            num("prompt_tps")
        );
        println!(
            "    byte-bound ceiling at the weights' read speed: {:.1} tok/s; this row at {:.2} of it",
            num("weights_ceiling_tps"),
            num("weights_ceiling_share")
        );
        if o.get("powerinfer_tps").is_some() {
            println!(
                "    PowerInfer on the same file: {:.2} tok/s, ours {:.2}x{}",
                num("powerinfer_tps"),
                num("vs_powerinfer"),
                match o.get("prompt_vs_powerinfer") {
                    Some(r) => format!(
                        "; prompt {:.1} tok/s, ours {:.2}x",
                        num("powerinfer_prompt_tps"),
                        r.as_f64().unwrap_or(0.0)
                    ),
                    None => String::new(),
                }
            );
        }
        if rounds > 1 {
            let list = |k: &str| {
                o[k].as_array()
                    .map(|v| {
                        v.iter()
                            .map(|x| format!("{:.2}", x.as_f64().unwrap_or(0.0)))
                            .collect::<Vec<_>>()
                            .join(" ")
                    })
                    .unwrap_or_default()
            };
            println!("    tok/s by round: {}", list("decode_tps_rounds"));
            if o.get("vs_llama_cpp_rounds").is_some() {
                println!(
                    "    llama.cpp tok/s by round: {}",
                    list("llama_cpp_tps_rounds")
                );
                println!(
                    "    ratio to llama.cpp by round: {}",
                    list("vs_llama_cpp_rounds")
                );
            }
            if o.get("vs_llama_twin_rounds").is_some() {
                println!(
                    "    ratio to llama twin by round: {}",
                    list("vs_llama_twin_rounds")
                );
            }
            if o.get("vs_powerinfer_rounds").is_some() {
                println!(
                    "    PowerInfer tok/s by round: {}",
                    list("powerinfer_tps_rounds")
                );
                println!(
                    "    ratio to PowerInfer by round: {}",
                    list("vs_powerinfer_rounds")
                );
            }
            if o.get("prompt_vs_powerinfer_rounds").is_some() {
                println!(
                    "    prompt ratio to PowerInfer by round: {}",
                    list("prompt_vs_powerinfer_rounds")
                );
            }
            if o.get("prompt_vs_llama_cpp_rounds").is_some() {
                println!(
                    "    prompt ratio to llama.cpp by round: {}",
                    list("prompt_vs_llama_cpp_rounds")
                );
            }
            if o.get("prompt_vs_llama_twin_rounds").is_some() {
                println!(
                    "    prompt ratio to llama twin by round: {}",
                    list("prompt_vs_llama_twin_rounds")
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::timing;

    #[test]
    fn reads_powerinfer_timings() {
        let err = "llama_print_timings:        load time =      85.51 ms\n\
            llama_print_timings: prompt eval time =      69.04 ms /     4 tokens (   17.26 ms per token,    57.94 tokens per second)\n\
            llama_print_timings:        eval time =     366.66 ms /    15 runs   (   24.44 ms per token,    40.91 tokens per second)\n";
        assert_eq!(timing(err, "prompt eval time"), Some((69.04, 4.0)));
        let decode = err
            .lines()
            .filter(|l| !l.contains("prompt"))
            .find_map(|l| timing(l, " eval time"));
        assert_eq!(decode, Some((366.66, 15.0)));
        assert_eq!(timing("no timings here", "eval time"), None);
        assert_eq!(
            timing(
                "llama_print_timings: eval time = x ms / 3 runs",
                "eval time"
            ),
            None
        );
    }
}
