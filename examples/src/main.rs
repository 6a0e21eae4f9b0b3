//! `powerinfer`: one subcommand per job. Each subcommand lives in its own module under `cmd/`.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod cmd;

/// Hybrid GPU-CPU inference for ReLU-sparse LLMs (PowerInfer files and llama.cpp GGUF files).
#[derive(Parser)]
#[command(name = "powerinfer", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List a GGUF or PowerInfer file's header, metadata and tensors.
    Inspect(cmd::inspect::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect(args) => cmd::inspect::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}
