//! `powerinfer run -cnv`: a conversation in the terminal (llama.cpp's conversation mode).
//!
//! Each line read is a user message; the whole conversation is rendered by the chat template
//! and only the part the KV cache does not hold yet is evaluated (the cache is rewound to the
//! longest prefix it shares with the new rendering). The answer streams to stdout. Ctrl-C while
//! an answer is generated stops that answer; at the prompt it ends the program; so does the end
//! of input.

use std::io::BufRead;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use powerinfer_engine::{ChatMessage, ChatTemplate, Engine, SamplingParams};

/// What a `--chat-template` value (of `run -cnv` and `serve`) gives the engine: the Jinja text
/// of a file, or the name of a known template; `None`: the model's own. Anything else is
/// refused, so that a misspelt name is not taken as a template of its own.
pub fn template_source(arg: Option<&str>) -> Result<Option<String>, String> {
    match arg {
        None => Ok(None),
        Some(t) if std::path::Path::new(t).is_file() => std::fs::read_to_string(t)
            .map(Some)
            .map_err(|e| super::file_error(t, e)),
        Some(t) if ChatTemplate::named(t).is_some() => Ok(Some(t.to_string())),
        Some(t) => Err(format!(
            "--chat-template {t}: neither a file nor a known name ({})",
            ChatTemplate::names().collect::<Vec<_>>().join(", ")
        )),
    }
}

/// Runs the conversation of `powerinfer run -cnv` with the chat template `source` (see
/// [`template_source`]), an optional system message, the sampling `params` and the context
/// shift's `keep` (`None`: no shift).
pub fn run(
    engine: &Engine,
    system_prompt: Option<&str>,
    params: SamplingParams,
    context_shift: Option<usize>,
    source: Option<String>,
) -> Result<(), String> {
    let template = engine
        .chat_template(source.as_deref())
        .map_err(|e| e.to_string())?;
    let generating = Arc::new(AtomicBool::new(false));
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let (g, i) = (generating.clone(), interrupted.clone());
        ctrlc::set_handler(move || {
            if g.load(Ordering::SeqCst) {
                i.store(true, Ordering::SeqCst);
            } else {
                eprintln!();
                std::process::exit(130);
            }
        })
        .map_err(|e| format!("Ctrl-C handler: {e}"))?;
    }
    let mut messages: Vec<ChatMessage> = system_prompt
        .iter()
        .map(|s| ChatMessage::new("system", *s))
        .collect();
    let mut session = engine.session();
    session.set_context_shift(context_shift);
    // The tokens the session's cache holds, in order.
    let mut held: Vec<u32> = Vec::new();
    let mut generated = 0;
    let stdin = std::io::stdin();
    let out = super::terminal::ModelText::stdout();
    let bos = template.bos_token().to_string();
    eprintln!("== chat: type a message and press Enter; Ctrl-C stops an answer, Ctrl-D ends ==");
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin
            .lock()
            .read_line(&mut line)
            .map_err(|e| e.to_string())?
            == 0
        {
            break;
        }
        let text = line.trim_end_matches(['\n', '\r']);
        if text.is_empty() {
            continue;
        }
        messages.push(ChatMessage::new("user", text));
        let rendered = template
            .render(&messages, true)
            .map_err(|e| e.to_string())?;
        let add_bos = bos.is_empty() || !rendered.starts_with(&bos);
        let tokens = engine.tokenizer().encode(&rendered, add_bos, true);
        // Reuse what the cache already holds of this rendering.
        let common = held
            .iter()
            .zip(&tokens)
            .take_while(|(a, b)| a == b)
            .count()
            .min(tokens.len() - 1);
        session.truncate(common).map_err(|e| e.to_string())?;
        held.truncate(common);
        let new = tokens[common..].to_vec();
        held.extend_from_slice(&new);
        interrupted.store(false, Ordering::SeqCst);
        generating.store(true, Ordering::SeqCst);
        let mut answer = String::new();
        let mut result = Ok(());
        for tok in session.generate_tokens(new, params.clone()) {
            if interrupted.load(Ordering::SeqCst) {
                break;
            }
            match tok {
                Ok(t) => {
                    out.write(&t.text);
                    answer.push_str(&t.text);
                    held.push(t.id);
                    generated += 1;
                }
                Err(e) => {
                    result = Err(e.to_string());
                    break;
                }
            }
        }
        generating.store(false, Ordering::SeqCst);
        out.write("\n");
        if interrupted.load(Ordering::SeqCst) {
            eprintln!("[stopped]");
        }
        result?;
        messages.push(ChatMessage::new("assistant", answer));
    }
    let st = session.stats();
    eprintln!(
        "{} turns: {} prompt tokens evaluated ({:.1} tokens/s), {generated} tokens generated \
         ({} decode runs, {:.1} tokens/s)",
        messages.iter().filter(|m| m.role == "user").count(),
        st.prompt_tokens,
        st.prompt_tps(),
        st.decode_tokens,
        st.decode_tps()
    );
    Ok(())
}
