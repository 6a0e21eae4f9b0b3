//! `powerinfer` subcommands called in-process, for tests that need what a subcommand makes
//! (a model file) rather than how the process behaves; each test file includes this file with
//! `#[path]`.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use powerinfer_cli::{cmd, parse_args};

/// `powerinfer synth ARGS --out OUT`, called in-process; panics with the error.
pub fn synth(out: &Path, args: &[&str]) {
    let mut words: Vec<&OsStr> = args.iter().map(OsStr::new).collect();
    words.extend([OsStr::new("--out"), out.as_os_str()]);
    let parsed =
        parse_args::<cmd::synth::Args>(words).unwrap_or_else(|e| panic!("synth {args:?}: {e}"));
    cmd::synth::run(parsed).unwrap_or_else(|e| panic!("synth {args:?}: {e}"));
}

/// The tiny synthetic model (Q8_0, vocabulary of 512, trained context 512) made with `seed` in
/// `dir` as `m.powerinfer.gguf` with `activation/`, and its dense twin `m.gguf`: `(PowerInfer
/// file, dense twin)`.
pub fn tiny_with_twin(dir: &Path, seed: &str) -> (PathBuf, PathBuf) {
    let sparse = dir.join("m.powerinfer.gguf");
    let dense = dir.join("m.gguf");
    let twin = dense.to_str().unwrap();
    synth(
        &sparse,
        &[
            "--shape",
            "tiny",
            "--type",
            "q8_0",
            "--seed",
            seed,
            "--dense-out",
            twin,
        ],
    );
    (sparse, dense)
}
