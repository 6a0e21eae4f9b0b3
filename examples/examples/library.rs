use powerinfer_engine::{Engine, EngineOptions, SamplingParams};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or("model.powerinfer.gguf".into());
    let engine = Engine::load(&path, EngineOptions::default())?;
    let mut session = engine.session();
    let mut generated = 0;
    for token in session.generate("Once upon a time", SamplingParams::greedy(16)) {
        print!("{}", token?.text);
        generated += 1;
    }
    let speed = session.stats().decode_tps();
    println!("\n{generated} tokens generated, {speed:.1} tokens/s");
    Ok(())
}
