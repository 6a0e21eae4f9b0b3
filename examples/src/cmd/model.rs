//! The model a subcommand works on: `-m FILE`, or `-hf REPO[:FILE]` (llama.cpp's flag), a
//! model fetched from the Hugging Face Hub into its cache (`crate::hub`) with the
//! repository's `activation/` statistics beside it.

use std::path::PathBuf;

use crate::hub::{self, HubModel, HubOptions};

/// `-m FILE` or `-hf REPO[:FILE]`, one of the two; with `REQUIRED`, one must be given (clap
/// says so, exit status 2).
#[derive(clap::Args, Clone, Debug)]
#[group(multiple = false, required = REQUIRED)]
pub struct ModelArgs<const REQUIRED: bool = true> {
    /// Model file.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// A model on the Hugging Face Hub: OWNER/NAME (its `*.powerinfer.gguf`, else its only
    /// `*.gguf`) or OWNER/NAME:FILE, fetched with its `activation/` statistics into the Hub's
    /// cache (HF_HOME, HF_HUB_CACHE; HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE=1 as
    /// huggingface_hub reads them); resumed when interrupted.
    #[arg(long = "hf-repo", visible_alias = "hf", value_name = "REPO[:FILE]")]
    pub hf_repo: Option<HubModel>,
}

impl<const REQUIRED: bool> ModelArgs<REQUIRED> {
    /// The model file, fetched first for `-hf`; `None` when neither flag is given.
    pub fn path_if_given(&self) -> Result<Option<PathBuf>, String> {
        match (&self.model, &self.hf_repo) {
            (Some(p), _) => Ok(Some(p.clone())),
            (None, Some(m)) => fetch(m, &HubOptions::from_env()).map(Some),
            (None, None) => Ok(None),
        }
    }

    /// The model file, fetched first for `-hf`.
    pub fn path(&self) -> Result<PathBuf, String> {
        self.path_if_given()?
            .ok_or_else(|| "no model: give -m FILE or -hf REPO[:FILE]".into())
    }
}

/// Fetches `model` with `options`, a progress bar on stderr when it is a terminal.
pub fn fetch(model: &HubModel, options: &HubOptions) -> Result<PathBuf, String> {
    let bar = super::progress::bytes_bar(&model.repo);
    let path = hub::fetch_blocking(model, options, &mut super::progress::callback(&bar));
    bar.finish_and_clear();
    let path = path.map_err(|e| e.to_string())?;
    eprintln!("model: {}", path.display());
    Ok(path)
}
