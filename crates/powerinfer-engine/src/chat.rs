//! Chat templates: a conversation turned into the prompt text a chat model was trained on.
//!
//! The template is the model's own (`tokenizer.chat_template` in the GGUF metadata), a named
//! one (llama.cpp's names: `chatml`, `llama2`, `mistral`, `zephyr`, `vicuna`, `gemma`,
//! `llama3`), or one given by the caller, rendered by a Jinja engine (`minijinja`) set up as
//! Hugging Face's `apply_chat_template` sets up `jinja2`: `trim_blocks`, `lstrip_blocks`, loop
//! controls, `raise_exception`, the `tojson` filter, and Python's string methods
//! (`.strip()`, `.startswith()`, ...). A model without a template gets ChatML
//! (`<|im_start|>role\ncontent<|im_end|>\n`), as llama.cpp's default.

use minijinja::{Environment, Error, ErrorKind, Value};

use crate::error::{EngineError, Result};
use crate::tokenizer::Tokenizer;

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// Its text.
    pub content: String,
}

impl ChatMessage {
    /// A message of `role` saying `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// ChatML, the template of models that carry none.
pub const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The templates known by name (llama.cpp's names for them).
const NAMED: &[(&str, &str)] = &[
    ("chatml", CHATML),
    (
        "llama2",
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}",
    ),
    (
        "mistral",
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}",
    ),
    (
        "zephyr",
        "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}",
    ),
    (
        "vicuna",
        "{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}{% elif message['role'] == 'user' %}{{ 'USER: ' + message['content'] + '\\n' }}{% elif message['role'] == 'assistant' %}{{ 'ASSISTANT: ' + message['content'] + eos_token + '\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}",
    ),
    (
        "gemma",
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}",
    ),
    (
        "llama3",
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
    ),
];

/// A chat template ready to render (see the [module docs](self)).
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

/// `raise_exception(message)`: the templates' way to refuse a conversation.
fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

impl ChatTemplate {
    /// The template named `name` (llama.cpp's names), if known.
    pub fn named(name: &str) -> Option<&'static str> {
        NAMED.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
    }

    /// Every name [`named`](Self::named) knows.
    pub fn names() -> impl Iterator<Item = &'static str> {
        NAMED.iter().map(|(n, _)| *n)
    }

    /// A template from its Jinja `source`, with the tokens `{{ bos_token }}` and
    /// `{{ eos_token }}` stand for.
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| EngineError::Invalid(format!("chat template syntax: {e}")))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| EngineError::Invalid(format!("chat template: {e}")))?;
        Ok(ChatTemplate {
            env,
            bos: bos.to_string(),
            eos: eos.to_string(),
        })
    }

    /// The template of a model: `source` when given (a template name or Jinja text), else
    /// its `tokenizer.chat_template`, else [`CHATML`]; `{{ bos_token }}`/`{{ eos_token }}` from
    /// its vocabulary.
    pub fn for_model(
        tokenizer: &Tokenizer,
        file_template: Option<&str>,
        source: Option<&str>,
    ) -> Result<ChatTemplate> {
        let text = |id: Option<u32>| {
            id.and_then(|t| tokenizer.token_text(t))
                .unwrap_or("")
                .to_string()
        };
        let (bos, eos) = (text(tokenizer.bos()), text(tokenizer.eos()));
        let src = match source {
            Some(s) => ChatTemplate::named(s).unwrap_or(s),
            None => file_template.unwrap_or(CHATML),
        };
        ChatTemplate::new(src, &bos, &eos)
    }

    /// The BOS text the template may start with.
    pub fn bos_token(&self) -> &str {
        &self.bos
    }

    /// The prompt of `messages`; `add_generation_prompt`: end with the start of the
    /// assistant's turn. A conversation the template refuses (`raise_exception`) is an error
    /// carrying the template's message.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let msgs: Vec<Value> = messages
            .iter()
            .map(|m| {
                let fields: std::collections::BTreeMap<String, String> = [
                    ("role".to_string(), m.role.clone()),
                    ("content".to_string(), m.content.clone()),
                ]
                .into();
                Value::from(fields)
            })
            .collect();
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| EngineError::Invalid(format!("chat template: {e}")))?;
        t.render(minijinja::context! {
            messages => msgs,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.as_str(),
            eos_token => self.eos.as_str(),
        })
        .map_err(|e| EngineError::Invalid(format!("chat template: {e}")))
    }
}
