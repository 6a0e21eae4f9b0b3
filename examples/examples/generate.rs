//! Generates text with the powerinfer-rs engine API.
//!
//! `cargo run --release -p powerinfer-cli --example generate -- MODEL [PROMPT]`

use powerinfer_engine::sampling::SamplingParams;
use powerinfer_engine::{Engine, EngineOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let Some(model) = args.next() else {
        eprintln!("usage: generate MODEL [PROMPT]");
        std::process::exit(2);
    };
    let prompt = args.next().unwrap_or_else(|| "Once upon a time".into());
    let engine = Engine::load(&model, EngineOptions::default())?;
    let mut session = engine.session();
    let params = SamplingParams::default().with(|p| {
        p.max_tokens = 32;
        p.seed = 42;
    });
    for token in session.generate(&prompt, params) {
        print!("{}", token?.text);
    }
    println!();
    let s = session.stats();
    eprintln!(
        "prompt {:.1} tok/s, decode {:.1} tok/s, FFN density {:.3}",
        s.prompt_tps(),
        s.decode_tps(),
        s.ffn_density()
    );
    Ok(())
}
