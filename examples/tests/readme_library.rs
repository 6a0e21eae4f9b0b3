//! The README's "Use it as a library" program is `examples/library.rs` exactly, and it runs:
//! it loads a synthetic model, generates and prints its speed.

use std::path::{Path, PathBuf};
use std::process::Command;

use powerinfer_cli::synth::{self, Shape, SynthConfig, SynthOutputs};
use powerinfer_engine::{Engine, EngineOptions, SamplingParams};

/// The first ```rust block after the heading `## Use it as a library` in the README.
fn readme_program() -> String {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .expect("README.md");
    let section = readme
        .split_once("## Use it as a library")
        .expect("the README has a library section")
        .1;
    let code = section.split_once("```rust\n").expect("a rust block").1;
    code.split_once("```")
        .expect("the block ends")
        .0
        .to_string()
}

/// `target/<profile>/examples/library`, built by `cargo test` beside this test's binary.
fn example_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    profile_dir
        .join("examples")
        .join(format!("library{}", std::env::consts::EXE_SUFFIX))
}

#[test]
fn readme_program_is_the_example_and_runs() {
    let file =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/library.rs"))
            .unwrap();
    assert_eq!(
        readme_program(),
        file,
        "README.md and examples/library.rs differ"
    );
    assert!(
        file.lines().count() <= 25,
        "the library program stays short"
    );

    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.powerinfer.gguf");
    let cfg = SynthConfig::new(Shape::preset("tiny").unwrap());
    let out = SynthOutputs {
        model: model.clone(),
        dense: None,
        activation_dir: None,
        predictor_dir: None,
    };
    synth::synthesize(&cfg, &out, &mut |_, _| {}).unwrap();
    let bin = example_binary();
    assert!(
        bin.exists(),
        "{} not built (cargo test builds examples)",
        bin.display()
    );
    let run = Command::new(&bin).arg(&model).output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let last = stdout.lines().last().unwrap_or("");
    let (n, rest) = last
        .split_once(" tokens generated, ")
        .expect("a count and speed line");
    let tps = rest.strip_suffix(" tokens/s").expect("tokens/s");
    // The count is of the tokens generated (the first comes from the prompt's evaluation,
    // not from a decode step): the same generation in this process yields as many.
    let engine = Engine::load(&model, EngineOptions::default()).unwrap();
    let mut session = engine.session();
    let want = session
        .generate("Once upon a time", SamplingParams::greedy(16))
        .count();
    assert!(want > 1, "{want}");
    assert_eq!(n.parse::<usize>().ok(), Some(want), "last line: {last:?}");
    assert!(
        tps.parse::<f64>().is_ok_and(|v| v >= 0.0),
        "last line: {last:?}"
    );
}

/// The README gives the `Cargo.toml` line that makes the program above build: the engine from
/// this workspace's repository.
#[test]
fn readme_says_how_to_depend_on_the_engine() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let repository = manifest
        .lines()
        .find_map(|l| l.strip_prefix("repository = "))
        .expect("the workspace's repository")
        .trim();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let section = readme
        .split_once("## Use it as a library")
        .expect("the README has a library section")
        .1;
    let toml = section.split_once("```toml\n").expect("a toml block").1;
    let toml = toml.split_once("```").expect("the block ends").0;
    assert!(toml.starts_with("[dependencies]\n"), "{toml}");
    assert!(
        toml.contains(&format!("powerinfer-engine = {{ git = {repository} }}")),
        "{toml}"
    );
}
