//! The `powerinfer` command as a library: every subcommand ([`cmd`]), the model-file tools
//! ([`synth`], [`convert`], [`reorder`], [`predictor_storage`]) and models from the Hugging
//! Face Hub ([`hub`]), so that tests and other
//! programs call them directly instead of spawning the binary. `src/main.rs` is [`main`]; the
//! environment is read in [`env`](mod@env) alone.
//!
//! The tools build on the engine (`powerinfer-engine`) like any other program; the engine's
//! tests that run models are this package's (`tests/engine*.rs`) and use [`synth`].

#![forbid(unsafe_code)]

use clap::{CommandFactory, FromArgMatches, Subcommand};
use std::process::ExitCode;

pub mod cmd;
pub mod convert;
pub mod env;
pub mod hub;
pub mod predictor_storage;
pub mod reorder;
pub mod synth;

/// Hybrid GPU-CPU inference for ReLU-sparse LLMs (PowerInfer files and llama.cpp GGUF files).
#[derive(clap::Parser)]
#[command(name = "powerinfer", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List a GGUF or PowerInfer file's header, metadata and tensors.
    Inspect(cmd::inspect::Args),
    /// Benchmarks (`bench kernels`: CPU kernel throughput against memory bandwidth; `bench
    /// decode`: engine decode speed, bytes per token, llama.cpp side by side; `bench serve`: a
    /// load test of the server; `bench schedule`: the run-time scheduling on the simulated GPU).
    Bench(cmd::bench::Args),
    /// Print the token ids of a text under a GGUF file's tokenizer.
    Tokenize(cmd::tokenize::Args),
    /// Write a seeded synthetic ReLU-sparse model (PowerInfer file, dense twin, activation stats).
    Synth(Box<cmd::synth::Args>),
    /// Convert a GGUF or PowerInfer file's weights to another type (keeps the PWRI magic).
    Quantize(cmd::quantize::Args),
    /// Sort a PowerInfer file's FFN neurons by activation frequency (same model, faster sparse
    /// decode), permuting its activation statistics alike.
    Reorder(cmd::reorder::Args),
    /// Generate text on the CPU engine (no -m: a dense-vs-sparse speed demo on a synthetic model).
    Run(Box<cmd::run::Args>),
    /// Write the logits of every position of a token sequence (little-endian f32 rows).
    Logits(cmd::logits::Args),
    /// Decode N continuations of one prompt together (one batch per step), against one after
    /// another.
    Batched(Box<cmd::batched::Args>),
    /// Perplexity of a model on a text, as llama.cpp's `llama-perplexity` computes it.
    Perplexity(Box<cmd::perplexity::Args>),
    /// An OpenAI-compatible HTTP server (completions, chat, streaming) with a chat page.
    Serve(Box<cmd::serve::Args>),
    /// Plan which FFN neurons go to the GPU under a VRAM budget (writes the GPU index).
    Plan(cmd::plan::Args),
    /// Convert a Hugging Face LLaMA/Bamboo, ReluFalcon or OPT checkpoint and its predictors to a
    /// PowerInfer file.
    Convert(cmd::convert::Args),
    /// Count how often each FFN neuron fires on a text (writes activation statistics); with
    /// --eval-predictor, measure the model's predictor (recall, precision, density).
    Profile(cmd::profile::Args),
    /// Train per-layer activation predictors on a text (writes model_N.safetensors for convert).
    TrainPredictor(Box<cmd::train_predictor::Args>),
}

/// A subcommand's arguments parsed from `args` (the words after the subcommand's name) as the
/// command line parses them, defaults and checks included: how programs and tests call a
/// subcommand's functions directly, e.g.
/// `parse_args::<cmd::plan::Args>(["-m", "m.gguf", "--vram-budget", "4"])`. llama.cpp's
/// multi-letter short flags (`-ngl`, `-ctk`, ...) are taken as the command line takes them.
pub fn parse_args<A: clap::Args>(
    args: impl IntoIterator<Item = impl Into<std::ffi::OsString> + Clone>,
) -> Result<A, clap::Error> {
    let command = A::augment_args(clap::Command::new("powerinfer").no_binary_name(true));
    // llama.cpp's multi-letter short flags, as the command line takes them.
    let words = llama_flags(args.into_iter().map(Into::into))
        .map_err(|e| clap::Error::raw(clap::error::ErrorKind::UnknownArgument, e))?;
    let mut matches = negative_numbers_are_values(command).try_get_matches_from(words)?;
    A::from_arg_matches_mut(&mut matches)
}

/// `command` with every option's value allowed to be a negative number (`--vram-budget -1`,
/// `-c -5`), so that the option's own check refuses it with the option named, instead of clap
/// reading `-1` as an unknown flag. No flag of this command looks like a number.
fn negative_numbers_are_values(command: clap::Command) -> clap::Command {
    command
        .mut_args(|a| {
            if a.get_action().takes_values() {
                a.allow_negative_numbers(true)
            } else {
                a
            }
        })
        .mut_subcommands(negative_numbers_are_values)
}

/// Exit status of a command whose standard output was closed under it, as a shell reports a
/// process killed by SIGPIPE (128 + 13).
const BROKEN_PIPE_STATUS: i32 = 141;

/// `println!` panics when standard output is a closed pipe (`powerinfer inspect F | head`): end
/// the process quietly with [`BROKEN_PIPE_STATUS`] instead, as C tools do; any other panic is
/// reported as usual.
fn exit_quietly_on_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if message.starts_with("failed printing to stdout") && message.contains("Broken pipe") {
            std::process::exit(BROKEN_PIPE_STATUS);
        }
        default(info);
    }));
}

/// llama.cpp's multi-letter short flags (one dash, several letters), which a parser of single
/// letters would read as a short flag with a value (`-ngl 99` as `-n gl`): each is rewritten
/// to its long form here, or refused with what to use instead.
const LLAMA_SHORT: &[(&str, Result<&str, &str>)] = &[
    ("-cnv", Ok("--conversation")),
    ("-sys", Ok("--system-prompt")),
    ("-ngl", Ok("--n-gpu-layers")),
    ("-np", Ok("--parallel")),
    ("-hf", Ok("--hf-repo")),
    ("-hfr", Ok("--hf-repo")),
    ("-fa", Err("flash attention is not a switch here: attention always runs as one fused kernel; drop -fa")),
    ("-ctk", Ok("--cache-type-k")),
    ("-ctv", Ok("--cache-type-v")),
    ("-mli", Err("multi-line input is not supported; end each message with Enter")),
];

/// The command line with llama.cpp's multi-letter short flags rewritten (see [`LLAMA_SHORT`]),
/// or the message refusing one.
fn llama_flags(
    args: impl Iterator<Item = std::ffi::OsString>,
) -> Result<Vec<std::ffi::OsString>, String> {
    args.map(|a| {
        let flag = a.to_str().map(|s| s.split_once('=').map_or(s, |(f, _)| f));
        match flag.and_then(|f| LLAMA_SHORT.iter().find(|(k, _)| *k == f)) {
            None => Ok(a),
            Some((k, Ok(long))) => {
                let s = a.to_str().unwrap_or_default();
                Ok(format!("{long}{}", &s[k.len()..]).into())
            }
            Some((k, Err(why))) => Err(format!("{k}: {why}")),
        }
    })
    .collect()
}

/// The `powerinfer` command: parses the process's arguments, runs the subcommand, and returns
/// the exit status (2 for a usage error, a subcommand's error that starts with the flag it
/// refuses included; 1 for a failed command).
pub fn main() -> ExitCode {
    exit_quietly_on_broken_pipe();
    let argv = match llama_flags(std::env::args_os()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let matches = negative_numbers_are_values(Cli::command()).get_matches_from(argv);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let result = match cli.command {
        Command::Inspect(args) => cmd::inspect::run(args),
        Command::Bench(args) => cmd::bench::run(args),
        Command::Tokenize(args) => cmd::tokenize::run(args),
        Command::Synth(args) => cmd::synth::run(*args),
        Command::Quantize(args) => cmd::quantize::run(args),
        Command::Reorder(args) => cmd::reorder::run(args),
        Command::Run(args) => cmd::run::run(*args),
        Command::Batched(args) => cmd::batched::run(*args),
        Command::Perplexity(args) => cmd::perplexity::run(*args),
        Command::Serve(args) => cmd::serve::run(*args),
        Command::Logits(args) => cmd::logits::run(args),
        Command::Plan(args) => cmd::plan::run(args),
        Command::Convert(args) => cmd::convert::run(args),
        Command::Profile(args) => cmd::profile::run(args),
        Command::TrainPredictor(args) => cmd::train_predictor::run(*args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // An error that names a flag first refuses what the flags asked for: a usage error.
        Err(message) if message.starts_with("--") => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}
