//! `powerinfer logits -m MODEL --tokens "1 2 3" --out FILE`: evaluates the tokens as one
//! sequence and writes the logits of every position as little-endian f32, one row of `n_vocab`
//! values per position.

use std::path::PathBuf;

/// Arguments of `powerinfer logits`.
#[derive(clap::Args)]
pub struct Args {
    /// The model.
    #[command(flatten)]
    pub model: super::model::ModelArgs,
    /// The KV cache's types.
    #[command(flatten)]
    pub cache: super::CacheTypes,
    /// Token ids, separated by spaces or commas.
    #[arg(long)]
    pub tokens: String,
    /// Output file.
    #[arg(short = 'o', long = "out")]
    pub out: PathBuf,
    /// Threads (0 = all cores).
    #[arg(short = 't', long = "threads", default_value_t = 0, value_parser = crate::cmd::whole_number)]
    pub threads: usize,
    /// Compute every FFN neuron (ignore the predictor).
    #[arg(long)]
    pub dense: bool,
    /// Predictor threshold θ.
    #[arg(long = "sparse-threshold")]
    pub sparse_threshold: Option<f32>,
}

/// Runs `powerinfer logits`.
pub fn run(args: Args) -> Result<(), String> {
    let tokens = args
        .tokens
        .split(|c: char| c.is_whitespace() || c == ',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u32>().map_err(|e| format!("token `{s}`: {e}")))
        .collect::<Result<Vec<u32>, String>>()?;
    if tokens.is_empty() {
        return Err("--tokens: no token ids".into());
    }
    let mut options = super::engine_options(args.threads, args.sparse_threshold);
    options.dense = args.dense;
    args.cache.apply(&mut options)?;
    options.ctx_len = tokens.len().max(1);
    let engine = super::load_engine(&args.model.path()?, options)?;
    let logits = engine
        .session()
        .eval_all(&tokens)
        .map_err(|e| e.to_string())?;
    let bytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(&args.out, bytes).map_err(|e| super::file_error(&args.out, e))?;
    eprintln!(
        "wrote {} rows of {} logits to {}",
        tokens.len(),
        engine.model().hparams().n_vocab,
        args.out.display()
    );
    Ok(())
}
