//! Several prompts decoded together with the powerinfer-rs engine API: one KV cache holds every
//! sequence, the prompts are evaluated side by side in one `Engine::eval` call, and each decode
//! step is one `Engine::eval` of a `Batch::decode` over all sequences that have not finished,
//! so every weight is read once per step for the whole batch.
//!
//! `cargo run --release -p powerinfer-cli --example batch -- MODEL [PROMPT]...`

use powerinfer_engine::{Batch, Engine, EngineOptions, EvalOptions, Sampler, SamplingParams};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let Some(model) = args.next() else {
        eprintln!("usage: batch MODEL [PROMPT]...");
        std::process::exit(2);
    };
    let mut prompts: Vec<String> = args.collect();
    if prompts.is_empty() {
        prompts = vec![
            "Once upon a time".into(),
            "The capital of France is".into(),
            "def fibonacci(n):".into(),
        ];
    }
    let engine = Engine::load(&model, EngineOptions::default())?;
    let tok = engine.tokenizer();
    let mut cache = engine.new_cache();
    let ids: Vec<Vec<u32>> = prompts.iter().map(|p| tok.encode(p, true, false)).collect();
    let seqs: Vec<_> = ids.iter().map(|_| cache.add_sequence()).collect();

    // All prompts in one pass: each segment's last logits pick its first token.
    let mut prompts_batch = Batch::new();
    for (&seq, tokens) in seqs.iter().zip(&ids) {
        prompts_batch.push(seq, tokens);
    }
    let outs = engine.eval(&mut cache, &prompts_batch, EvalOptions::new())?;
    let mut samplers: Vec<Sampler> = (0..seqs.len())
        .map(|i| {
            Sampler::new(SamplingParams::default().with(|p| {
                p.seed = 42 + i as u64;
            }))
        })
        .collect();
    let mut next: Vec<u32> = outs
        .into_iter()
        .zip(&mut samplers)
        .map(|(mut o, s)| s.sample(&mut o.logits))
        .collect();
    let mut generated: Vec<Vec<u32>> = vec![Vec::new(); seqs.len()];
    let mut live: Vec<usize> = (0..seqs.len()).collect();
    let max_tokens = 32;
    let t0 = std::time::Instant::now();
    let mut steps_tokens = 0;
    while !live.is_empty() {
        // Finished sequences leave the batch; the others advance by one token together.
        live.retain(|&i| !tok.is_eog(next[i]) && generated[i].len() < max_tokens);
        if live.is_empty() {
            break;
        }
        let batch: Vec<(usize, u32)> = live.iter().map(|&i| (seqs[i], next[i])).collect();
        let outs = engine.eval(&mut cache, &Batch::decode(&batch), EvalOptions::new())?;
        steps_tokens += batch.len();
        for (&i, mut out) in live.iter().zip(outs) {
            generated[i].push(next[i]);
            next[i] = samplers[i].sample(&mut out.logits);
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    for (prompt, tokens) in prompts.iter().zip(&generated) {
        // Pieces joined as they stream (a decode of the continuation alone would drop the
        // leading space of its first token).
        let mut bytes = Vec::new();
        for &t in tokens {
            bytes.extend_from_slice(tok.token_to_piece(t, false)?);
        }
        println!("{prompt}{}\n---", String::from_utf8_lossy(&bytes));
    }
    eprintln!(
        "{} sequences, {steps_tokens} tokens decoded in {secs:.2} s: {:.1} tok/s over the batch",
        seqs.len(),
        steps_tokens as f64 / secs.max(1e-9)
    );
    Ok(())
}
