//! `powerinfer run -cnv`: a terminal conversation over stdin/stdout; the conversation stays in
//! the KV cache between turns; Ctrl-C stops an answer, not the program.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[path = "support/cli.rs"]
mod cli;

fn model(dir: &tempfile::TempDir) -> PathBuf {
    let model = dir.path().join("m.powerinfer.gguf");
    cli::synth(
        &model,
        &["--shape", "tiny", "--type", "q8_0", "--seed", "5"],
    );
    model
}

/// Two turns: both answered; the second evaluates only what the cache does not hold.
#[test]
fn conversation_keeps_its_history_in_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(&dir);
    let run = |input: &str| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_powerinfer"))
            .args([
                "run",
                "-m",
                m.to_str().unwrap(),
                "-cnv",
                "-sys",
                "Be brief.",
            ])
            .args(["-n", "6", "--temp", "0", "--gpu", "none", "-t", "1"])
            .arg("--ignore-eos")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
        let out = c.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let prompt_tokens = |err: &str| -> usize {
        let line = err
            .lines()
            .find(|l| l.contains("turns:"))
            .expect("a summary line");
        line.split(": ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let one = run("hello there\n");
    let two = run("hello there\nand a second question\n");
    assert!(two.contains("2 turns"), "{two}");
    // Tokens generated, six an answer, not decode runs (one fewer an answer).
    assert!(one.contains(" 6 tokens generated"), "{one}");
    assert!(two.contains(" 12 tokens generated"), "{two}");
    // The second turn's rendering repeats the first turn; only its new part is evaluated, so
    // the two turns together cost less than twice the first plus the second's new text.
    let (p1, p2) = (prompt_tokens(&one), prompt_tokens(&two));
    assert!(
        p2 < 2 * p1,
        "{p1} then {p2}: the history was evaluated again"
    );
    assert!(p2 > p1);
}

/// Ctrl-C while an answer streams stops it; the chat goes on with the next line.
#[test]
fn ctrl_c_stops_the_answer_not_the_program() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(&dir);
    let mut c = Command::new(env!("CARGO_BIN_EXE_powerinfer"))
        .args([
            "run",
            "-m",
            m.to_str().unwrap(),
            "-cnv",
            "-n",
            "60",
            "--ignore-eos",
        ])
        .args([
            "--temp",
            "0",
            "-t",
            "1",
            "-c",
            "512",
            "--gpu",
            "sim",
            "--sim-bandwidth",
            "0.02",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = c.stdin.take().unwrap();
    let mut stdout = c.stdout.take().unwrap();
    stdin.write_all(b"tell me a long story\n").unwrap();
    // Wait for the answer to start streaming.
    let mut buf = [0u8; 64];
    let start = Instant::now();
    let n = stdout.read(&mut buf).unwrap();
    assert!(n > 0, "no answer");
    let status = Command::new("kill")
        .args(["-INT", &c.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    std::thread::sleep(Duration::from_millis(300));
    stdin.write_all(b"second\n").unwrap();
    drop(stdin);
    let out = c.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("[stopped]"), "{err}");
    assert!(err.contains("2 turns"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(120));
}
