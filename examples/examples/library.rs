use powerinfer_engine::{Engine, EngineOptions, SamplingParams};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or("model.powerinfer.gguf".into());
    let engine = Engine::load(&path, EngineOptions::default())?;
    let mut session = engine.session();
    for token in session.generate("Once upon a time", SamplingParams::greedy(16)) {
        print!("{}", token?.text);
    }
    let stats = session.stats();
    println!(
        "\n{} tokens, {:.1} tokens/s",
        stats.decode_tokens,
        stats.decode_tps()
    );
    Ok(())
}
