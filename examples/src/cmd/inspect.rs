//! `powerinfer inspect FILE [--json]`.

use std::path::PathBuf;

/// Arguments of `powerinfer inspect`.
#[derive(clap::Args)]
pub struct Args {
    /// The GGUF or PowerInfer file.
    pub file: PathBuf,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Runs `powerinfer inspect`.
pub fn run(args: Args) -> Result<(), String> {
    Err(format!(
        "{}: reading files is not implemented yet",
        args.file.display()
    ))
}
