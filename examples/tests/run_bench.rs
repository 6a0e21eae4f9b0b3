//! `powerinfer run` with the GPU-index flags and `powerinfer bench decode`, run as processes on
//! a tiny synthetic model.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value as Json;

#[path = "support/cli.rs"]
mod cli;

fn powerinfer(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_powerinfer"))
        .args(args)
        .output()
        .expect("run powerinfer");
    assert!(
        out.status.success(),
        "powerinfer {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `powerinfer bench decode --json` on `models` (1 thread, one run per configuration, `tokens`
/// decoded after a prompt of `prompt` tokens) with `extra` flags; its rows.
fn bench_decode(models: &[&Path], tokens: &str, prompt: &str, extra: &[&str]) -> Vec<Json> {
    let mut args = vec!["bench", "decode"];
    for m in models {
        args.extend(["-m", s(m)]);
    }
    args.extend([
        "-t", "1", "-n", tokens, "--prompt", prompt, "-r", "1", "--json",
    ]);
    args.extend(extra);
    let out = powerinfer(&args);
    let rows: Json = serde_json::from_slice(&out.stdout).unwrap();
    rows.as_array().unwrap().clone()
}

struct Files {
    _dir: tempfile::TempDir,
    sparse: PathBuf,
    dense: PathBuf,
}

fn synth() -> Files {
    let dir = tempfile::tempdir().unwrap();
    let (sparse, dense) = cli::tiny_with_twin(dir.path(), "3");
    Files {
        _dir: dir,
        sparse,
        dense,
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `--gpu sim` with PowerInfer's GPU-index flags: the placement is built and written, reused,
/// rebuilt, or disabled, and reported; the greedy text is the CPU engine's (Q8_0 weights: the
/// device's partial sums change no token).
#[test]
fn gpu_index_flags_build_reuse_reset_disable() {
    let f = synth();
    let base = [
        "run",
        "-m",
        s(&f.sparse),
        "-n",
        "6",
        "-t",
        "1",
        "--temp",
        "0",
    ];
    let mut cpu = base.to_vec();
    cpu.extend(["--gpu", "none"]);
    let plain = powerinfer(&cpu);
    let gpuidx = PathBuf::from(format!("{}.generated.gpuidx", s(&f.sparse)));
    assert!(!gpuidx.exists());

    let run = |extra: &[&str]| {
        let mut a: Vec<&str> = base.to_vec();
        a.extend(["--gpu", "sim"]);
        a.extend_from_slice(extra);
        let out = powerinfer(&a);
        assert_eq!(out.stdout, plain.stdout, "{extra:?}");
        String::from_utf8(out.stderr).unwrap()
    };
    let err = run(&["--vram-budget", "0.01"]);
    assert!(
        err.contains("device: sim") && err.contains("(no cached GPU index)"),
        "{err}"
    );
    assert!(gpuidx.is_file());
    let err = run(&["--vram-budget", "0.01"]);
    assert!(err.contains("reused"), "{err}");
    let err = run(&["--vram-budget", "0.01", "--reset-gpu-index"]);
    assert!(err.contains("(--reset-gpu-index)"), "{err}");
    let err = run(&["--vram-budget", "0.01", "--disable-gpu-index"]);
    assert!(err.contains("GPU index disabled"), "{err}");
    // `auto` without a GPU says so in one line and runs on the CPU.
    if powerinfer_kernels_cuda::Gpu::detect().is_err() {
        let out = powerinfer(&base);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("no usable GPU") && err.contains("runs on the CPU"),
            "{err}"
        );
        assert_eq!(out.stdout, plain.stdout);
    }
    // The index is read by our gguf reader as a PowerInfer GPU-index file.
    powerinfer(&["inspect", s(&gpuidx)]);
}

#[test]
fn bench_decode_reports_bytes_and_ratios() {
    let f = synth();
    let rows = &bench_decode(&[&f.dense, &f.sparse], "4", "3", &[]);
    assert_eq!(rows.len(), 3, "{rows:?}");
    let modes: Vec<&str> = rows.iter().map(|r| r["mode"].as_str().unwrap()).collect();
    assert_eq!(modes, ["dense", "sparse", "dense"]);
    for r in rows {
        let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
        assert!(f("decode_tps") > 0.0);
        assert!(f("bandwidth_gbps") > 0.0);
        // The prompt's 3 tokens over its time.
        assert_eq!(r["prompt_tokens"].as_u64(), Some(3));
        let pp = 3.0 / (f("prompt_ms") / 1e3);
        assert!((f("prompt_tps") - pp).abs() <= 1e-9 * pp, "{r}");
        let gbps = f("bytes_per_token") * f("decode_tps") / 1e9;
        assert!((f("gbps") - gbps).abs() <= 1e-9 * gbps.max(1.0));
        assert!((f("ratio") - gbps / f("bandwidth_gbps")).abs() < 1e-9);
        let ceiling = f("bandwidth_gbps") * 1e9 / f("bytes_per_token");
        assert!((f("ceiling_tps") - ceiling).abs() <= 1e-6 * ceiling);
        // The file image was read, and (mapped on Linux) its page sizes found.
        assert!(f("weights_read_gbps") > 0.0);
        let share = &r["weights_huge_page_share"];
        if cfg!(target_os = "linux") {
            let h = share
                .as_f64()
                .unwrap_or_else(|| panic!("page share in {r}"));
            assert!((0.0..=1.0).contains(&h), "{h}");
        } else {
            assert!(share.is_null());
        }
    }
    let (dense_twin, sparse, dense_pwri) = (&rows[0], &rows[1], &rows[2]);
    let d = sparse["ffn_density"].as_f64().unwrap();
    assert!(d > 0.0 && d < 0.6, "sparse density {d}");
    assert_eq!(dense_pwri["ffn_density"].as_f64(), Some(1.0));
    assert_eq!(dense_twin["ffn_density"].as_f64(), Some(1.0));
    // Sparse decode reads fewer bytes than computing every neuron; the dense twin and the
    // PowerInfer file in dense mode read the same FFN weights (predictor aside).
    let b = |r: &Json| r["bytes_per_token"].as_f64().unwrap();
    assert!(b(sparse) < b(dense_pwri));
    assert!((b(dense_twin) - b(dense_pwri)).abs() <= 1e-6 * b(dense_pwri));
}

#[test]
fn closed_stdout_ends_quietly() {
    // `tokenize` prints with `println!`, which panics on a closed pipe without the hook.
    use std::process::Stdio;
    let f = synth();
    // More output than a pipe buffer holds (~16k lines, ~160 KB; 64 KiB buffers): even if a
    // process forked by a parallel test briefly holds a copy of the read end, the command
    // cannot finish writing before every read end is closed.
    let text = "hello world ".repeat(8000);
    let mut child = Command::new(env!("CARGO_BIN_EXE_powerinfer"))
        .args(["tokenize", "--pieces", "-m", s(&f.sparse), &text])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Close the read end before the command prints (as `| head -0` would).
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.code(), Some(141), "{err}");
}

/// `--rounds` with `--llama-bench`: every configuration and llama.cpp once per round (its
/// text generation after a filled context of the prompt's length, then its prompt test: two
/// calls), medians over the rounds, and ratios that are medians of the per-round ratios, for
/// decoding and for the prompt. llama.cpp is stood in for by a script that prints
/// `llama-bench`'s JSON (a prompt-processing and a text-generation test) with different speeds
/// on each call (the order of the calls and the arguments are what the script records).
#[cfg(unix)]
#[test]
fn bench_decode_rounds_pair_each_round_with_llama() {
    use std::os::unix::fs::PermissionsExt;
    let f = synth();
    let dir = tempfile::tempdir().unwrap();
    let count = dir.path().join("calls");
    let args = dir.path().join("args");
    let fake = dir.path().join("llama-bench");
    std::fs::write(
        &fake,
        format!(
            "#!/bin/sh\nn=$(cat {c} 2>/dev/null || echo 0)\nn=$((n + 1))\necho $n > {c}\n\
             echo \"$*\" >> {a}\n\
             echo \"[{{\\\"n_prompt\\\": 2, \\\"n_gen\\\": 0, \\\"avg_ts\\\": $((n * 10))}}, \
             {{\\\"n_prompt\\\": 0, \\\"n_gen\\\": 2, \\\"avg_ts\\\": $((n * 100))}}]\"\n",
            c = count.display(),
            a = args.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let rows = &bench_decode(
        &[&f.sparse, &f.dense],
        "2",
        "2",
        &["--sparse-only", "--rounds", "3", "--llama-bench", s(&fake)],
    );
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(std::fs::read_to_string(&count).unwrap().trim(), "6");
    let list = |r: &Json, k: &str| -> Vec<f64> {
        r[k].as_array()
            .unwrap_or_else(|| panic!("{k} in {r}"))
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect()
    };
    let median3 = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[1]
    };
    // JSON numbers come back within an ulp or two (serde_json's default float parsing).
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * a.abs().max(b.abs());
    let (sparse, dense) = (&rows[0], &rows[1]);
    // llama.cpp's text generation ran first in each round (calls 1, 3, 5): 100, 300, 500 tok/s,
    // in that order.
    assert_eq!(list(dense, "llama_cpp_tps_rounds"), [100.0, 300.0, 500.0]);
    assert_eq!(dense["llama_cpp_tps"].as_f64(), Some(300.0));
    // A row's figures `ours` by round against llama.cpp's `llama` (the only file llama.cpp
    // ran is every row's twin): their median, the per-round ratios `ratio`_rounds, and the
    // median of those as `ratio`.
    let check = |r: &Json, ours: &str, llama: [f64; 3], ratio: &str| {
        let v = list(r, &format!("{ours}_rounds"));
        assert!(v.len() == 3 && v.iter().all(|&x| x > 0.0), "{v:?}");
        assert!(close(r[ours].as_f64().unwrap(), median3(v.clone())));
        let want: Vec<f64> = v.iter().zip(llama).map(|(o, l)| o / l).collect();
        let got = list(r, &format!("{ratio}_rounds"));
        assert!(
            got.len() == 3 && got.iter().zip(&want).all(|(g, w)| close(*g, *w)),
            "{got:?} vs {want:?}"
        );
        assert!(close(r[ratio].as_f64().unwrap(), median3(want)));
    };
    for r in [sparse, dense] {
        assert_eq!(r["rounds"].as_u64(), Some(3));
        check(r, "decode_tps", [100.0, 300.0, 500.0], "vs_llama_twin");
    }
    assert!(close(
        dense["vs_llama_cpp"].as_f64().unwrap(),
        dense["vs_llama_twin"].as_f64().unwrap()
    ));
    assert!(sparse.get("vs_llama_cpp").is_none());
    // The generation test after the 2-token prompt's depth; the prompt: llama.cpp asked for a
    // 2-token prompt test from an empty cache, which ran at 20, 40, 60 tok/s (calls 2, 4, 6);
    // ours is the prompt's tokens over its time, compared round by round.
    let called = std::fs::read_to_string(&args).unwrap();
    let calls: Vec<&str> = called.lines().collect();
    assert_eq!(calls.len(), 6, "{called}");
    for pair in calls.chunks(2) {
        assert!(pair[0].contains("-p 0 -n 2 -d 2"), "{called}");
        assert!(pair[1].contains("-p 2 -n 0 -d 0"), "{called}");
    }
    assert_eq!(
        list(dense, "llama_cpp_prompt_tps_rounds"),
        [20.0, 40.0, 60.0]
    );
    for r in [sparse, dense] {
        assert_eq!(r["prompt_tokens"].as_u64(), Some(2));
        check(r, "prompt_tps", [20.0, 40.0, 60.0], "prompt_vs_llama_twin");
    }
    assert!(sparse.get("prompt_vs_llama_cpp").is_none());
}

/// With several files run by llama.cpp, each row's twin is the llama.cpp file of its shape and
/// weight type: a Q8_0 PowerInfer file against the Q8_0 dense file, an F16 one against the F16.
#[cfg(unix)]
#[test]
fn bench_decode_pairs_each_file_with_the_llama_run_of_its_twin() {
    use std::os::unix::fs::PermissionsExt;
    let q8 = synth();
    let dir = tempfile::tempdir().unwrap();
    let (f16_sparse, f16_dense) = (
        dir.path().join("f.powerinfer.gguf"),
        dir.path().join("f.gguf"),
    );
    cli::synth(
        &f16_sparse,
        &[
            "--shape",
            "tiny",
            "--type",
            "f16",
            "--seed",
            "3",
            "--dense-out",
            s(&f16_dense),
        ],
    );
    // llama.cpp's speed names the file it ran: 100 tok/s for the Q8_0 file, 400 for the F16.
    let fake = dir.path().join("llama-bench");
    std::fs::write(
        &fake,
        format!(
            "#!/bin/sh\ncase \"$*\" in *{q8}*) ts=100 ;; *{f16}*) ts=400 ;; *) ts=1 ;; esac\n\
             echo \"[{{\\\"n_prompt\\\": 0, \\\"n_gen\\\": 2, \\\"avg_ts\\\": $ts}}]\"\n",
            q8 = s(&q8.dense),
            f16 = s(&f16_dense)
        ),
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let rows = &bench_decode(
        &[&q8.sparse, &f16_sparse, &f16_dense, &q8.dense],
        "2",
        "2",
        &["--sparse-only", "--llama-bench", s(&fake)],
    );
    assert_eq!(rows.len(), 4, "{rows:?}");
    for (r, model, llama) in [
        (&rows[0], &q8.sparse, 100.0),
        (&rows[1], &f16_sparse, 400.0),
        (&rows[2], &f16_dense, 400.0),
        (&rows[3], &q8.dense, 100.0),
    ] {
        assert_eq!(r["model"].as_str(), Some(s(model)));
        let tps = r["decode_tps"].as_f64().unwrap();
        let twin = r["vs_llama_twin"]
            .as_f64()
            .unwrap_or_else(|| panic!("no twin in {r}"));
        assert!((twin - tps / llama).abs() <= 1e-9 * twin, "{r}");
    }
    assert!(rows[0].get("vs_llama_cpp").is_none());
    assert_eq!(rows[2]["llama_cpp_tps"].as_f64(), Some(400.0));
    assert_eq!(rows[3]["llama_cpp_tps"].as_f64(), Some(100.0));
    // This llama-bench printed no prompt test: no prompt comparison, our prompt speed still.
    for r in rows {
        assert!(r.get("llama_cpp_prompt_tps").is_none() && r.get("prompt_vs_llama_twin").is_none());
        assert!(r["prompt_tps"].as_f64().unwrap() > 0.0, "{r}");
    }
}

#[test]
fn run_profile_reports_every_operation() {
    let f = synth();
    let base = [
        "run",
        "-m",
        s(&f.sparse),
        "-n",
        "5",
        "-t",
        "2",
        "--temp",
        "0",
        "--json",
    ];
    let plain: Json = serde_json::from_slice(&powerinfer(&base).stdout).unwrap();
    let mut args = base.to_vec();
    args.push("--profile");
    let prof: Json = serde_json::from_slice(&powerinfer(&args).stdout).unwrap();
    assert_eq!(
        plain["tokens"], prof["tokens"],
        "--profile changed the tokens"
    );
    assert!(plain.get("profile").is_none());
    let rows = prof["profile"].as_array().unwrap();
    let ops: Vec<&str> = rows.iter().map(|r| r["op"].as_str().unwrap()).collect();
    assert_eq!(
        ops,
        [
            "norm",
            "qkv",
            "attention",
            "attn_output",
            "predictor",
            "ffn_up_gate",
            "ffn_down",
            "device",
            "device_wait",
            "output_head",
            "other",
            "total"
        ]
    );
    let f64_of = |r: &Json, k: &str| r[k].as_f64().unwrap();
    let (ops_rows, total) = rows.split_at(rows.len() - 1);
    for k in ["ms_per_token", "mb_per_token"] {
        let sum: f64 = ops_rows.iter().map(|r| f64_of(r, k)).sum();
        let t = f64_of(&total[0], k);
        assert!((sum - t).abs() <= 1e-9 * t.max(1.0), "{k}: {sum} vs {t}");
    }
    for r in ops_rows {
        let op = r["op"].as_str().unwrap();
        let reads = !matches!(op, "norm" | "other" | "device" | "device_wait");
        assert_eq!(f64_of(r, "mb_per_token") > 0.0, reads, "{op}");
        assert!(f64_of(r, "bandwidth_gbps") > 0.0);
    }
    // The prompt's own profile: every operation timed, the parts summing to the total, over
    // the prompt's tokens.
    let pp = prof["prompt_profile"].as_array().unwrap();
    assert!(plain.get("prompt_profile").is_none());
    let (pp_ops, pp_total) = pp.split_at(pp.len() - 1);
    assert_eq!(pp_ops.len(), ops.len() - 1);
    let pp_sum: f64 = pp_ops.iter().map(|r| f64_of(r, "ms")).sum();
    let pp_ms = f64_of(&pp_total[0], "ms");
    assert!(
        pp_ms > 0.0 && (pp_sum - pp_ms).abs() <= 1e-9 * pp_ms,
        "{pp_sum} vs {pp_ms}"
    );
    assert_eq!(pp_total[0]["tokens"], prof["prompt_tokens"]);
    for op in ["qkv", "attention", "ffn_up_gate", "ffn_down"] {
        let r = pp_ops.iter().find(|r| r["op"] == op).unwrap();
        assert!(f64_of(r, "ms") > 0.0, "{op}: {r}");
    }
    // How the weights' memory reads, beside the profile.
    assert!(f64_of(&prof, "weights_read_gbps") > 0.0);
    assert!(plain.get("weights_read_gbps").is_none());
    // The table on stderr.
    let mut args = base[..base.len() - 1].to_vec();
    args.push("--profile");
    let err = String::from_utf8(powerinfer(&args).stderr).unwrap();
    // Five tokens: the first from the prompt's logits, four decode steps (none is spent on
    // the last token, which stays with the session).
    assert!(err.contains("decode profile: 4 tokens"), "{err}");
    assert!(err.contains("prompt profile: "), "{err}");
    assert!(
        err.contains("ffn_up_gate") && err.contains("output_head"),
        "{err}"
    );
    assert!(
        err.contains("weights: ") && err.contains(" GB/s ("),
        "{err}"
    );
}

/// The built-in demo (no `-m`: the README's main command), written into a fresh cache
/// directory, with `--profile --json`: both runs' profiles, the speed ratio.
#[test]
fn demo_runs_and_profiles_both_modes() {
    let cache = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_powerinfer"))
        .args([
            "run",
            "-n",
            "3",
            "-t",
            "2",
            "--temp",
            "0",
            "--profile",
            "--json",
        ])
        .env("XDG_CACHE_HOME", cache.path())
        .output()
        .expect("run powerinfer");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("SYNTHETIC"), "{err}");
    let v: Json = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["sparse_speedup"].as_f64().unwrap() > 0.0);
    assert!(v["ffn_density"].as_f64().unwrap() < 0.5);
    for key in ["profile", "dense_profile"] {
        let rows = v[key].as_array().unwrap();
        assert_eq!(rows.len(), 12, "{key}");
        assert_eq!(rows[11]["op"], "total", "{key}");
        assert!(rows[11]["mb_per_token"].as_f64().unwrap() > 0.0, "{key}");
    }
    // The sparse run reads its predictor; the dense twin has none.
    let predictor_mb = |key: &str| {
        v[key].as_array().unwrap()[4]["mb_per_token"]
            .as_f64()
            .unwrap()
    };
    assert!(predictor_mb("profile") > 0.0);
    assert_eq!(predictor_mb("dense_profile"), 0.0);
}

/// The llama.cpp-style generation flags of `powerinfer run`: `-f` reads the prompt from a file
/// (same tokens as `-p`), `--stop` ends the text early, the penalties change what greedy
/// decoding picks (a huge presence penalty over the whole context forbids any repeat), `-b`
/// sets the prompt block and `--ignore-eos` is accepted.
#[test]
fn run_generation_flags() {
    let f = synth();
    let dir = tempfile::tempdir().unwrap();
    let prompt = "Once upon a time there was";
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, prompt).unwrap();
    let run = |extra: &[&str]| -> Json {
        let mut args = vec![
            "run",
            "-m",
            s(&f.sparse),
            "-n",
            "12",
            "--temp",
            "0",
            "--json",
        ];
        args.extend_from_slice(extra);
        serde_json::from_slice(&powerinfer(&args).stdout).unwrap()
    };
    let ids = |j: &Json| -> Vec<u64> {
        j["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect()
    };
    let base = run(&["-p", prompt]);
    let from_file = run(&["-f", s(&file)]);
    assert_eq!(ids(&base), ids(&from_file));
    assert_eq!(base["prompt_tokens"], from_file["prompt_tokens"]);
    assert_eq!(ids(&base).len(), 12);

    // Stop at the first piece of the greedy text (two characters from its second half) that
    // occurs only there: fewer tokens, the same ones.
    let text = base["text"].as_str().unwrap().to_string();
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let stop = (chars.len() / 2..chars.len().saturating_sub(1))
        .map(|k| (chars[k].0, format!("{}{}", chars[k].1, chars[k + 1].1)))
        .find(|(at, piece)| text.find(piece.as_str()) == Some(*at))
        .map(|(_, piece)| piece)
        .expect("a piece of the text that occurs once");
    let stopped = run(&["-p", prompt, "--stop", &stop]);
    let got = ids(&stopped);
    assert!(got.len() < 12, "--stop {stop:?} did not stop: {got:?}");
    assert_eq!(got[..], ids(&base)[..got.len()]);

    // No token of the last 64 (prompt and generated) may come again.
    let distinct = ids(&run(&[
        "-p",
        prompt,
        "--presence-penalty",
        "1e9",
        "--repeat-last-n",
        "64",
    ]));
    let mut seen = std::collections::HashSet::new();
    assert!(distinct.iter().all(|t| seen.insert(*t)), "{distinct:?}");
    // The same penalty over no tokens changes nothing.
    let off = run(&[
        "-p",
        prompt,
        "--presence-penalty",
        "1e9",
        "--repeat-last-n",
        "0",
    ]);
    assert_eq!(ids(&off), ids(&base));

    let small_blocks = run(&["-p", prompt, "-b", "1", "--ignore-eos"]);
    assert_eq!(small_blocks["prompt_tokens"], base["prompt_tokens"]);
    assert_eq!(ids(&small_blocks).len(), 12);

    // A prompt file that is not there fails before the model loads.
    let out = Command::new(env!("CARGO_BIN_EXE_powerinfer"))
        .args([
            "run",
            "-m",
            s(&f.sparse),
            "-f",
            s(&dir.path().join("none.txt")),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read the prompt file"));
}

/// Sampling values outside their range are refused before anything loads, with the flag named
/// and clap's usage exit code.
#[test]
fn out_of_range_sampling_values_are_refused() {
    for (flag, value) in [
        ("--top-p", "2"),
        ("--top-p", "0"),
        ("--min-p", "-3"),
        ("--min-p", "1.5"),
        ("--repeat-penalty", "0"),
        ("--temp", "nan"),
        ("--typical", "0"),
        ("--xtc-probability", "2"),
        ("--mirostat", "3"),
        ("--mirostat-lr", "-1"),
        ("--logit-bias", "abc"),
        ("--logit-bias", "5+nan"),
        ("--dry-multiplier", "-1"),
        ("--dry-penalty-last-n", "-2"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_powerinfer"))
            .args(["run", "-m", "no-such-file.gguf", flag, value])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}: {err}");
        assert!(err.contains(flag), "{flag} {value}: {err}");
    }
}

/// `bench schedule` on the tiny model: four schedules, the cost model's prediction and the
/// topic-shift rows, as JSON (the synthetic two-topic model goes to a temporary cache folder).
#[test]
fn bench_schedule_reports_schedules_prediction_and_topics() {
    let f = synth();
    let cache = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_powerinfer"))
        .env("XDG_CACHE_HOME", cache.path())
        .args([
            "bench",
            "schedule",
            "-m",
            s(&f.sparse),
            "-n",
            "16",
            "--rounds",
            "1",
            "--sim-bandwidth",
            "0.5",
            "--topic-tokens",
            "16",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Json = serde_json::from_slice(&out.stdout).unwrap();
    let schedules = v["schedules"].as_array().unwrap();
    let names: Vec<&str> = schedules
        .iter()
        .map(|s| s["schedule"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["static", "balanced", "calibrated", "+attention"]);
    for s in schedules {
        assert!(s["tps"].as_f64().unwrap() > 0.0, "{s}");
    }
    // The attention split's KV mirror comes out of the same budget first: it may leave no
    // room for neurons, so only the other three must hold some.
    for s in &schedules[..3] {
        assert!(s["held"].as_u64().unwrap() > 0, "{s}");
    }
    // The static split never moves; the balanced one computes part of the held rows on the CPU
    // (a device at 0.5 GB/s is far slower than the CPU on this model).
    assert_eq!(schedules[0]["rebalances"].as_u64(), Some(0));
    assert_eq!(schedules[0]["enabled"], schedules[0]["held"]);
    assert!(schedules[1]["rebalances"].as_u64().unwrap() > 0);
    assert!(schedules[1]["enabled"].as_u64() < schedules[1]["held"].as_u64());
    assert!(v["prediction"]["static_tps"].as_f64().unwrap() > 0.0);
    assert!(
        v["prediction"]["balanced_tps"].as_f64().unwrap()
            >= v["prediction"]["static_tps"].as_f64().unwrap()
    );
    let rows = v["topic_shift"]["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    assert!(rows
        .iter()
        .all(|r| (0.0..=1.0).contains(&r["recall"].as_f64().unwrap())));
}

/// DRY breaks the loop greedy decoding of the tiny model falls into: without it some token
/// pair repeats many times in 60 tokens; with it the longest repeat of the end is penalized and
/// the text changes.
#[test]
fn dry_breaks_greedy_loops() {
    let f = synth();
    let run = |extra: &[&str]| -> Vec<u64> {
        let mut args = vec![
            "run",
            "-m",
            s(&f.sparse),
            "-p",
            "hello",
            "-n",
            "60",
            "--temp",
            "0",
            "--ignore-eos",
            "--json",
        ];
        args.extend_from_slice(extra);
        let j: Json = serde_json::from_slice(&powerinfer(&args).stdout).unwrap();
        j["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect()
    };
    // The most frequent pair of consecutive tokens, and how often it occurs.
    let top_pair = |ids: &[u64]| {
        let mut pairs: Vec<(u64, u64)> = ids.windows(2).map(|w| (w[0], w[1])).collect();
        pairs.sort_unstable();
        pairs
            .chunk_by(|a, b| a == b)
            .map(|r| r.len())
            .max()
            .unwrap_or(0)
    };
    let plain = run(&[]);
    let dry = run(&["--dry-multiplier", "2", "--dry-allowed-length", "1"]);
    assert!(top_pair(&plain) >= 5, "{plain:?}");
    assert_ne!(dry, plain);
    assert!(
        top_pair(&dry) < top_pair(&plain),
        "{dry:?} against {plain:?}"
    );
}

/// `run --gpu sim --json --profile`: the device object says what the device charged per token
/// (launches, host waits, link bytes) and the decode profile's own `device_traffic` stays within
/// the device step's bounds: everything on the device, one host wait per token and a link that
/// carries the token in and its logits out.
#[test]
fn run_json_reports_what_the_device_charged() {
    let f = synth();
    let out = powerinfer(&[
        "run",
        "-m",
        s(&f.sparse),
        "-n",
        "8",
        "-t",
        "1",
        "--temp",
        "0",
        "--gpu",
        "sim",
        "--balance",
        "off",
        "--json",
        "--profile",
    ]);
    let v: Json = serde_json::from_slice(&out.stdout).unwrap();
    let d = &v["device"];
    for k in [
        "launches_per_token",
        "syncs_per_token",
        "link_bytes_per_token",
    ] {
        assert!(d[k].as_f64().unwrap() > 0.0, "{k} in {d}");
    }
    assert_eq!(d["layers"], d["layers_total"], "{d}");
    let t = &v["device_traffic"];
    let syncs = t["syncs_per_token"].as_f64().unwrap();
    assert!(syncs > 0.0 && syncs <= 2.0, "{t}");
    let n_vocab = 512.0;
    assert!(
        t["link_bytes_per_token"].as_f64().unwrap() <= 4.0 * n_vocab + 64.0,
        "{t}"
    );
    // The profile's table has the device's line on stderr.
    let out = powerinfer(&[
        "run",
        "-m",
        s(&f.sparse),
        "-n",
        "4",
        "-t",
        "1",
        "--temp",
        "0",
        "--gpu",
        "sim",
        "--profile",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("device per token:") && err.contains("host waits"),
        "{err}"
    );
}

/// `--powerinfer` beside `--ffn-resident`: PowerInfer's `main` runs next to the CPU's sparse
/// row with no VRAM and next to each hybrid row with that row's budget (`--vram-budget` in GiB),
/// and each row compares with its own run. PowerInfer is stood in for by a script that records
/// its arguments and prints `llama_print_timings` lines (2 tokens in 20 ms, 2 runs in 10 ms).
#[cfg(unix)]
#[test]
fn bench_decode_runs_powerinfer_beside_each_hybrid_row_with_its_budget() {
    use std::os::unix::fs::PermissionsExt;
    let f = synth();
    let dir = tempfile::tempdir().unwrap();
    let args = dir.path().join("args");
    let fake = dir.path().join("main");
    std::fs::write(
        &fake,
        format!(
            "#!/bin/sh\necho \"$*\" >> {a}\n\
             echo 'llama_print_timings: prompt eval time =      20.00 ms /     2 tokens' >&2\n\
             echo 'llama_print_timings:        eval time =      10.00 ms /     2 runs' >&2\n",
            a = args.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let rows = &bench_decode(
        &[&f.sparse],
        "2",
        "2",
        &[
            "--sparse-only",
            "--gpu",
            "sim",
            "--ffn-resident",
            "0.5",
            "--powerinfer",
            s(&fake),
        ],
    );
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(rows[0]["mode"].as_str(), Some("sparse"));
    assert_eq!(rows[1]["mode"].as_str(), Some("hybrid50%"));
    let budgets: Vec<f64> = rows
        .iter()
        .map(|r| r["powerinfer_vram_budget_gib"].as_f64().unwrap())
        .collect();
    assert_eq!(budgets[0], 0.0);
    assert!(budgets[1] > 0.0, "{budgets:?}");
    // The hybrid row's budget is what the engine ran with (its device report).
    let held = rows[1]["device"]["budget_bytes"].as_f64().unwrap() / (1u64 << 30) as f64;
    assert!(
        (held - budgets[1]).abs() <= 1e-9 * held,
        "{held} vs {budgets:?}"
    );
    // One PowerInfer call per row, in order, each with its budget as printed to 4 decimals.
    let calls = std::fs::read_to_string(&args).unwrap();
    let given: Vec<f64> = calls
        .lines()
        .map(|l| {
            let v = l.split_once("--vram-budget ").unwrap().1;
            v.split_whitespace().next().unwrap().parse().unwrap()
        })
        .collect();
    assert_eq!(given.len(), 2, "{calls}");
    for (g, b) in given.iter().zip(&budgets) {
        assert!((g - b).abs() <= 5e-5, "{given:?} vs {budgets:?}");
    }
    for r in rows {
        assert_eq!(r["powerinfer_tps"].as_f64(), Some(200.0), "{r}");
        assert_eq!(r["powerinfer_prompt_tps"].as_f64(), Some(100.0), "{r}");
        let ours = r["decode_tps"].as_f64().unwrap();
        assert!((r["vs_powerinfer"].as_f64().unwrap() - ours / 200.0).abs() <= 1e-9 * ours);
    }
}
