//! # powerinfer-engine
//!
//! The inference engine of powerinfer-rs: loads `llama`, `bamboo`, `falcon` and `opt` models
//! from PowerInfer files (`PWRI`, sparse FFN with a predictor) and plain GGUF files, and
//! generates text on the CPU kernels, with the hottest neurons of each layer on a device beside
//! the CPU when one is asked for ([`DeviceOptions`]: a CUDA GPU, or the simulated GPU).
//!
//! ```no_run
//! use powerinfer_engine::{Engine, EngineOptions, SamplingParams};
//!
//! let engine = Engine::load("model.powerinfer.gguf", EngineOptions::default())?;
//! let mut session = engine.session();
//! for token in session.generate("Once upon a time", SamplingParams::greedy(32)) {
//!     print!("{}", token?.text);
//! }
//! eprintln!("{:.1} tokens/s", session.stats().decode_tps());
//! # Ok::<(), powerinfer_engine::EngineError>(())
//! ```
//!
//! - [`Engine`]: a loaded model and the one evaluation entry point, [`Engine::eval`] over a
//!   [`Batch`] of sequences' tokens with [`EvalOptions`];
//! - [`Session`]: one sequence with its own [`KvCache`], text generation and [`Stats`];
//! - [`Scheduler`]: many sequences decoded together (continuous batching);
//! - [`SamplingParams`] / [`Sampler`]: greedy, temperature, top-k/top-p/min-p, penalties;
//! - [`Model`]: what the file says (hyper-parameters, tensors), no execution state;
//! - [`tokenizer`]: SentencePiece and byte-level BPE tokenizers matching llama.cpp;
//! - [`FfnObserver`], [`OpProfile`]: what each layer's FFN computed, where the time went;
//! - [`device`]: the device beside the CPU and what it holds ([`Engine::device_report`]).
//!
//! The model-file tools (synthetic models, conversion from Hugging Face checkpoints, neuron
//! reordering) are not here: they are the library of the `powerinfer` command
//! (`powerinfer-cli`), which uses this crate like any other program.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod chat;
pub mod device;
mod engine;
mod error;
mod exec;
pub mod kv_cache;
pub mod model;
mod observer;
pub mod profile;
pub mod sampling;
pub mod schedule;
mod scheduler;
mod session;
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub mod test_hooks;
pub mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate};
pub use device::{DeviceChoice, DeviceReport};
pub use engine::{Engine, EngineOptions};
pub use error::{EngineError, Result};
pub use exec::{Batch, EvalOptions, EvalOutput, Logits, Segment};
pub use kv_cache::{KvCache, KvType, SeqId};
pub use model::{Arch, Hparams, Model};
pub use observer::FfnObserver;
/// The kernels' choices that [`EngineOptions`] takes, re-exported so that a user needs no
/// other crate to set them.
pub use powerinfer_kernels_cpu::{AxpyCoefficients, Backend};
pub use profile::{OpKind, OpProfile};
pub use sampling::{Sampler, SamplingParams};
pub use schedule::{BalanceOptions, BalanceReport, DeviceOptions, GpuIndexMode};
pub use scheduler::{Event, Finish, Scheduler, SchedulerOptions, SeqHandle};
pub use session::{Generate, Session, Stats, Token};
