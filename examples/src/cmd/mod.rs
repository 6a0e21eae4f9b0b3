//! The subcommands, one module each. Each has an `Args` struct and a `run(Args) -> Result<(), String>`;
//! an `Err` is printed as a one-line error and the process exits with status 1.

pub mod bench;
pub mod bench_decode;
pub mod convert;
pub mod inspect;
pub mod logits;
pub mod plan;
pub mod profile;
pub mod progress;
pub mod quantize;
pub mod reorder;
pub mod run;
pub mod synth;
pub mod tokenize;
pub mod train_predictor;
