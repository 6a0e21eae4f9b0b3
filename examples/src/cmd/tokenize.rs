//! `powerinfer tokenize -m FILE [--no-bos] [--no-parse-special] [--pieces] TEXT`: the token
//! ids of TEXT under the tokenizer stored in a GGUF file, space-separated on one line.

use powerinfer_engine::tokenizer::Tokenizer;
use powerinfer_gguf::GgufFile;

/// Arguments of `powerinfer tokenize`.
#[derive(clap::Args)]
pub struct Args {
    /// The model.
    #[command(flatten)]
    pub model: super::model::ModelArgs,
    /// Do not add the BOS (or EOS) token that the vocabulary asks for.
    #[arg(long)]
    pub no_bos: bool,
    /// Tokenize control-token texts such as `<s>` as plain text instead of as those tokens.
    #[arg(long)]
    pub no_parse_special: bool,
    /// Print one `id<TAB>piece` line per token instead of the ids on one line.
    #[arg(long)]
    pub pieces: bool,
    /// The text to tokenize.
    pub text: String,
}

/// Runs `powerinfer tokenize`.
pub fn run(args: Args) -> Result<(), String> {
    let model = args.model.path()?;
    let file = GgufFile::open(&model).map_err(|e| super::file_error(&model, e))?;
    let tok = Tokenizer::from_gguf(&file).map_err(|e| super::file_error(&model, e))?;
    let ids = tok.encode(&args.text, !args.no_bos, !args.no_parse_special);
    if args.pieces {
        for &id in &ids {
            let piece = tok.token_to_piece(id, true).map_err(|e| e.to_string())?;
            println!("{id}\t{}", escape(piece));
        }
    } else {
        let line: Vec<String> = ids.iter().map(u32::to_string).collect();
        println!("{}", line.join(" "));
    }
    Ok(())
}

/// `bytes` quoted, with valid UTF-8 shown as text (escaped like a Rust string) and other bytes
/// as `\xNN` (a piece can be part of a multi-byte char).
fn escape(bytes: &[u8]) -> String {
    let mut out = String::from("\"");
    for chunk in bytes.utf8_chunks() {
        out.extend(chunk.valid().escape_debug());
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out.push('"');
    out
}
