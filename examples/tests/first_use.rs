//! What a new user meets first (issue #44): refusals that name the flag and say why, paths said
//! once, warnings where llama.cpp warns, counts whose labels match, and model text that cannot
//! drive the terminal. Process tests where the process's words and exit codes are the subject;
//! the tiny synthetic model is made in-process.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use powerinfer_cli::cmd::{inspect, plan};
use powerinfer_cli::parse_args;

#[path = "support/cli.rs"]
mod cli;

fn powerinfer(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_powerinfer"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run powerinfer")
}

/// `powerinfer run -m MODEL ARGS` on one thread, without a device.
fn run_cpu(model: &Path, args: &[&str]) -> Output {
    let mut all = vec!["run", "-m", s(model), "--gpu", "none", "-t", "1"];
    all.extend_from_slice(args);
    powerinfer(&all)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

struct Files {
    dir: tempfile::TempDir,
    sparse: PathBuf,
    dense: PathBuf,
}

/// The tiny model (vocabulary of 512, trained context 512) and its dense twin.
fn model() -> Files {
    let dir = tempfile::tempdir().unwrap();
    let (sparse, dense) = cli::tiny_with_twin(dir.path(), "7");
    Files { dir, sparse, dense }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A misspelt `--chat-template` is refused by `run -cnv` as by `serve` (one rule: a file or a
/// known name), before the model loads, instead of becoming a template of its own.
#[test]
fn a_misspelt_chat_template_is_refused_by_run_and_serve() {
    let f = model();
    let run = powerinfer(&[
        "run",
        "-m",
        s(&f.sparse),
        "-cnv",
        "--chat-template",
        "chatmll",
    ]);
    let serve = powerinfer(&[
        "serve",
        "-m",
        s(&f.sparse),
        "--port",
        "0",
        "--chat-template",
        "chatmll",
    ]);
    for o in [run, serve] {
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains("--chat-template chatmll: neither a file nor a known name")
                && err.contains("chatml,"),
            "{err}"
        );
        assert!(!err.contains("listening"), "{err}");
    }
}

/// Negative numbers reach the flag's own check (`--vram-budget -1` as `--vram-budget=-1`):
/// usage errors (exit 2) that name the flag and the accepted values, before anything loads.
#[test]
fn negative_and_out_of_range_values_name_their_flag() {
    let cases: [(&[&str], &str, &str); 9] = [
        (&["run", "--vram-budget", "-1"], "--vram-budget", "GiB ≥ 0"),
        (&["run", "-c", "-5"], "--ctx-size", "whole number ≥ 0"),
        (&["run", "-t", "-1"], "--threads", "whole number ≥ 0"),
        (
            &["run", "-n", "-3"],
            "--n-predict",
            "-2 (until the context is full)",
        ),
        (&["run", "--top-p", "2"], "--top-p", "(0, 1]"),
        (&["run", "--top-p", "0"], "--top-p", "(0, 1]"),
        (&["run", "--dry-base", "0.5"], "--dry-base", "≥ 1"),
        (&["serve", "-c", "-5"], "--ctx-size", "whole number ≥ 0"),
        (&["plan", "--vram-budget", "-1"], "--vram-budget", "GiB ≥ 0"),
    ];
    for (args, flag, says) in cases {
        let mut all = args.to_vec();
        all.extend(["-m", "no-such-file.gguf"]);
        let o = powerinfer(&all);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(flag) && err.contains(says), "{args:?}: {err}");
        assert!(!err.contains("unexpected argument"), "{args:?}: {err}");
    }
}

/// A missing model path is said once; a folder given as the model is called a folder.
#[test]
fn model_paths_are_named_once_and_folders_called_folders() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.gguf");
    for args in [
        vec!["run", "-m", s(&missing)],
        vec!["serve", "-m", s(&missing), "--port", "0"],
        vec!["inspect", s(&missing)],
        vec!["tokenize", "-m", s(&missing), "hi"],
    ] {
        let o = powerinfer(&args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert_eq!(err.matches(s(&missing)).count(), 1, "{args:?}: {err}");
        assert!(err.contains("No such file"), "{args:?}: {err}");
    }
    let folder = s(dir.path());
    for args in [
        vec!["run", "-m", folder],
        vec!["serve", "-m", folder, "--port", "0"],
        vec!["inspect", folder],
    ] {
        let o = powerinfer(&args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert_eq!(
            err.trim_end(),
            format!("error: {folder}: is a directory, not a file"),
            "{args:?}"
        );
    }
}

/// `plan` on a dense GGUF says that the file is dense (no predictor, no `ffn_down_t`), not
/// that layer 0 lacks the `ffn_up` it has.
#[test]
fn plan_on_a_dense_file_says_it_is_dense() {
    let f = model();
    let args: plan::Args = parse_args(["-m", s(&f.dense), "--vram-budget", "1"]).unwrap();
    let err = plan::plan(&args)
        .map(|_| ())
        .expect_err("a dense file cannot be planned");
    assert!(
        err.contains("a dense GGUF file") && err.contains("ffn_down_t"),
        "{err}"
    );
    assert!(!err.contains("has no blk.0.ffn_up"), "{err}");
}

/// Accepted silently before: a logit bias for a token outside the vocabulary is refused; a
/// context longer than the model was trained for is warned about (as llama.cpp does) and
/// used.
#[test]
fn vocabulary_and_context_limits_are_said() {
    let f = model();
    let o = run_cpu(&f.sparse, &["--logit-bias", "99999+5", "-n", "2"]);
    let err = stderr(&o);
    // A flag's value that cannot be honoured: exit 2, the flag named.
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("token id 99999 is outside the vocabulary of 512 tokens"),
        "{err}"
    );
    let o = run_cpu(&f.sparse, &["-c", "1024", "-n", "2"]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("warning: the context of 1024 positions is longer than the 512"),
        "{err}"
    );
    // Within the trained context: no warning.
    let o = run_cpu(&f.sparse, &["-c", "256", "-n", "2"]);
    assert!(
        !stderr(&o).contains("warning: the context"),
        "{}",
        stderr(&o)
    );
}

/// `synth` does not create folders it was not asked for: a missing parent folder is refused
/// and nothing is made.
#[test]
fn synth_refuses_an_output_in_a_missing_folder() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("missing/sub/x.gguf");
    let o = powerinfer(&["synth", "--shape", "tiny", "--out", s(&out)]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("does not exist"), "{err}");
    assert!(!dir.path().join("missing").exists());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// The summary's figures match their labels: `-n 8` generates 8 tokens in 7 decode runs
/// (the first token comes from the prompt's evaluation), and says both.
#[test]
fn the_summary_counts_generated_tokens_and_decode_runs() {
    let f = model();
    let o = run_cpu(&f.sparse, &["-n", "8", "--temp", "0", "--ignore-eos"]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let line = |label: &str| {
        err.lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("no {label:?} line in {err}"))
            .to_string()
    };
    assert!(line("generated ").contains("   8 tokens"), "{err}");
    assert!(line("decode eval").contains("/    7 runs"), "{err}");
}

/// Model text goes to a pipe byte for byte (escape characters included) and ends with a
/// newline; on a terminal the same characters would be shown, not sent (`terminal::visible`,
/// tested beside it).
#[test]
fn model_text_in_a_pipe_keeps_its_bytes_and_ends_with_a_newline() {
    let f = model();
    let file = powerinfer_gguf::GgufFile::open(&f.sparse).unwrap();
    let tok = powerinfer_engine::tokenizer::Tokenizer::from_gguf(&file).unwrap();
    let esc = (0..512u32)
        .find(|&id| tok.token_to_piece(id, false).is_ok_and(|p| p == b"\x1b"))
        .expect("a token whose piece is ESC");
    let bias = format!("{esc}+100");
    let o = run_cpu(
        &f.sparse,
        &["-n", "3", "--temp", "0", "--logit-bias", &bias],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(o.stdout, b"\x1b\x1b\x1b\n");
}

/// Small ones: `plan --predict` shows a small budget in a unit that shows it; a zero VRAM
/// budget leaves no dangling separator; `synth` and `inspect` give the same predictor rank;
/// `convert`'s description names every family it converts.
#[test]
fn units_separators_ranks_and_descriptions() {
    let f = model();
    let o = powerinfer(&[
        "plan",
        "-m",
        s(&f.sparse),
        "--vram-budget",
        "0.002",
        "--predict",
        "--cpu-bw",
        "10",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.contains(": 2.05 MiB of VRAM holds"), "{out}");

    let o = powerinfer(&[
        "run",
        "-m",
        s(&f.sparse),
        "-n",
        "1",
        "--gpu",
        "sim",
        "--vram-budget",
        "0",
        "-t",
        "1",
    ]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let device = err
        .lines()
        .find(|l| l.starts_with("device: "))
        .expect("a device line");
    assert!(!device.trim_end().ends_with(';'), "{device}");

    let m = f.dir.path().join("r.powerinfer.gguf");
    let o = powerinfer(&[
        "synth",
        "--shape",
        "tiny",
        "--no-activation",
        "--out",
        s(&m),
    ]);
    let said = String::from_utf8_lossy(&o.stdout);
    let rank: u64 = said
        .split_once("predictor rank ")
        .and_then(|(_, r)| r.split(' ').next())
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("no rank in {said}"));
    let described = inspect::describe(&m).unwrap();
    assert_eq!(described["predictors"][0]["rank"], rank, "{said}");

    let help = String::from_utf8_lossy(&powerinfer(&["--help"]).stdout).into_owned();
    let convert = help
        .lines()
        .find(|l| l.trim_start().starts_with("convert"))
        .expect("convert in --help");
    assert!(
        convert.contains("Falcon") && convert.contains("OPT"),
        "{convert}"
    );
}
