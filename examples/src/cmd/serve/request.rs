//! The request bodies of the OpenAI routes as serde types. A field that is absent or `null` is
//! `None`; a field of the wrong kind is refused by [`read`] as a [`FieldError`] naming it
//! (`'max_tokens' must be an integer`); unknown fields are ignored, as OpenAI's servers do.
//! Ranges and the rules between fields are checked by the handlers (`api.rs`).

use serde::de::{DeserializeOwned, Deserializer, Error as _, IgnoredAny};
use serde::Deserialize;
use serde_json::{Map, Value};

/// A field of a request body that is of the wrong kind.
#[derive(Debug)]
pub struct FieldError {
    /// The field (the top-level key), when the error is about one.
    pub field: Option<String>,
    /// What is wrong, naming the field.
    pub message: String,
}

/// Reads the fields `T` from a request `body` (a JSON object); the first field of the wrong
/// kind, in the body's order, is the error.
pub fn read<'a, T: Deserialize<'a>>(body: &'a Value) -> Result<T, FieldError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let field = match e.path().iter().next() {
            Some(serde_path_to_error::Segment::Map { key }) => Some(key.clone()),
            _ => None,
        };
        let message = match &field {
            Some(f) => format!("'{f}' {}", e.inner()),
            None => e.inner().to_string(),
        };
        FieldError { field, message }
    })
}

/// An optional `T`; any other value is the error "must be `what`" (the field's name is put in
/// front by [`read`]).
fn kind<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
    what: &str,
) -> Result<Option<T>, D::Error> {
    Option::<T>::deserialize(d).map_err(|_| D::Error::custom(format_args!("must be {what}")))
}

fn integer<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    kind(d, "an integer")
}

fn number<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    kind(d, "a number")
}

fn boolean<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(kind(d, "a boolean")?.unwrap_or(false))
}

fn strings<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    Ok(
        kind::<D, OneOrMany>(d, "a string or strings")?.map_or_else(Vec::new, |s| match s {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }),
    )
}

fn string_array<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    Ok(kind(d, "an array of strings")?.unwrap_or_default())
}

fn bias_object<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Map<String, Value>>, D::Error> {
    kind(d, "an object of token ids to biases")
}

fn prompt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Prompt>, D::Error> {
    // Present but null is refused like any other wrong kind (absent: `'prompt' is required`).
    match kind::<D, Prompt>(d, PROMPT_KINDS)? {
        Some(p) => Ok(Some(p)),
        None => Err(D::Error::custom(format_args!("must be {PROMPT_KINDS}"))),
    }
}

fn message_list<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<Message>>, D::Error> {
    kind(d, "an array of messages")
}

fn logprobs<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Logprobs>, D::Error> {
    kind(d, "an integer or a boolean")
}

/// A model name; another kind of value is ignored (the request is served by the one model).
fn model_name<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(match Option::<Lenient<String>>::deserialize(d)? {
        Some(Lenient::Valid(name)) => Some(name),
        _ => None,
    })
}

/// What `prompt` may be.
pub const PROMPT_KINDS: &str = "a string, one string in an array, or an array of token ids";

/// One string or several (`stop`).
#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// A `T`, or any other JSON value, which the caller refuses with its own message.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Lenient<T> {
    /// A `T`.
    Valid(T),
    /// Something else.
    Other(IgnoredAny),
}

/// A JSON object read as `T` (serde alone also reads a struct from an array, by position).
pub struct Object<T>(pub T);

impl<'de, T: DeserializeOwned> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let map = Map::deserialize(d)?;
        T::deserialize(Value::Object(map))
            .map(Object)
            .map_err(D::Error::custom)
    }
}

/// The sampling fields of a completion or chat request, as OpenAI and llama.cpp name them.
#[derive(Deserialize)]
pub struct Sampling {
    /// The model asked for (a name that is not a string is ignored).
    #[serde(default, deserialize_with = "model_name")]
    pub model: Option<String>,
    /// Tokens to generate at most.
    #[serde(default, deserialize_with = "integer")]
    pub max_tokens: Option<i64>,
    /// OpenAI's newer name of `max_tokens`.
    #[serde(default, deserialize_with = "integer")]
    pub max_completion_tokens: Option<i64>,
    /// Stop strings.
    #[serde(default, deserialize_with = "strings")]
    pub stop: Vec<String>,
    /// Completions to generate.
    #[serde(default, deserialize_with = "integer")]
    pub n: Option<i64>,
    /// Server-sent events instead of one response.
    #[serde(default, deserialize_with = "boolean")]
    pub stream: bool,
    /// Sampling temperature.
    #[serde(default, deserialize_with = "number")]
    pub temperature: Option<f64>,
    /// Nucleus sampling's probability mass.
    #[serde(default, deserialize_with = "number")]
    pub top_p: Option<f64>,
    /// llama.cpp's minimum probability relative to the best token.
    #[serde(default, deserialize_with = "number")]
    pub min_p: Option<f64>,
    /// OpenAI's presence penalty.
    #[serde(default, deserialize_with = "number")]
    pub presence_penalty: Option<f64>,
    /// OpenAI's frequency penalty.
    #[serde(default, deserialize_with = "number")]
    pub frequency_penalty: Option<f64>,
    /// llama.cpp's repetition penalty.
    #[serde(default, deserialize_with = "number")]
    pub repeat_penalty: Option<f64>,
    /// Locally typical sampling's mass.
    #[serde(default, deserialize_with = "number")]
    pub typical_p: Option<f64>,
    /// XTC: the probability of removing the top choices.
    #[serde(default, deserialize_with = "number")]
    pub xtc_probability: Option<f64>,
    /// XTC: the probability a top choice needs.
    #[serde(default, deserialize_with = "number")]
    pub xtc_threshold: Option<f64>,
    /// Mirostat version (0: off).
    #[serde(default, deserialize_with = "integer")]
    pub mirostat: Option<i64>,
    /// Mirostat's target entropy.
    #[serde(default, deserialize_with = "number")]
    pub mirostat_tau: Option<f64>,
    /// Mirostat's learning rate.
    #[serde(default, deserialize_with = "number")]
    pub mirostat_eta: Option<f64>,
    /// DRY's multiplier (0: off).
    #[serde(default, deserialize_with = "number")]
    pub dry_multiplier: Option<f64>,
    /// DRY's base.
    #[serde(default, deserialize_with = "number")]
    pub dry_base: Option<f64>,
    /// DRY's allowed repeat length.
    #[serde(default, deserialize_with = "integer")]
    pub dry_allowed_length: Option<i64>,
    /// DRY's window (-1: all, 0: off).
    #[serde(default, deserialize_with = "integer")]
    pub dry_penalty_last_n: Option<i64>,
    /// DRY's sequence breakers.
    #[serde(default, deserialize_with = "string_array")]
    pub dry_sequence_breakers: Vec<String>,
    /// OpenAI's map of token ids (as strings) to biases in [-100, 100], checked by the handler.
    #[serde(default, deserialize_with = "bias_object")]
    pub logit_bias: Option<Map<String, Value>>,
    /// Top-k (0: off).
    #[serde(default, deserialize_with = "integer")]
    pub top_k: Option<i64>,
    /// Random seed.
    #[serde(default, deserialize_with = "integer")]
    pub seed: Option<i64>,
    /// Log probabilities asked for (not supported: refused when asked).
    #[serde(default, deserialize_with = "logprobs")]
    pub logprobs: Option<Logprobs>,
    /// Chat: how many alternatives' log probabilities (not supported: refused when given).
    #[serde(default, deserialize_with = "integer")]
    pub top_logprobs: Option<i64>,
}

/// `logprobs`: a count (completions) or a switch (chat).
#[derive(Clone, Copy, Deserialize)]
#[serde(untagged)]
pub enum Logprobs {
    /// Chat: whether to return them.
    Switch(bool),
    /// Completions: how many alternatives per token.
    Count(i64),
}

impl Logprobs {
    /// The value as the request gave it, when it asks for log probabilities (`false` does
    /// not).
    pub fn asked(self) -> Option<String> {
        match self {
            Logprobs::Switch(false) => None,
            Logprobs::Switch(true) => Some("true".into()),
            Logprobs::Count(n) => Some(n.to_string()),
        }
    }
}

/// The prompt of `/v1/completions`.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// A text.
    Text(String),
    /// One text in an array.
    OneText([String; 1]),
    /// Token ids.
    Tokens(Vec<u32>),
}

/// The body of `/v1/completions` beside [`Sampling`].
#[derive(Deserialize)]
pub struct CompletionBody {
    /// The prompt (absent: `None`).
    #[serde(default, deserialize_with = "prompt")]
    pub prompt: Option<Prompt>,
}

/// The body of `/v1/chat/completions` beside [`Sampling`].
#[derive(Deserialize)]
pub struct ChatBody {
    /// The conversation, each message checked by the handler.
    #[serde(default, deserialize_with = "message_list")]
    pub messages: Option<Vec<Message>>,
}

/// One message of a chat request: an object with its fields, or something else.
pub type Message = Lenient<Object<MessageBody>>;

/// One message of a chat request as sent.
#[derive(Deserialize)]
pub struct MessageBody {
    /// Who speaks.
    #[serde(default)]
    pub role: Option<Lenient<String>>,
    /// What is said (absent or null: nothing).
    #[serde(default)]
    pub content: Option<Lenient<Content>>,
}

/// A message's content.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// A text.
    Text(String),
    /// Parts, of which only text parts are supported.
    Parts(Vec<Lenient<Object<ContentPart>>>),
}

/// A part of a message's content.
#[derive(Deserialize)]
pub struct ContentPart {
    /// The part's type (`text`).
    #[serde(rename = "type")]
    pub kind: String,
    /// Its text.
    pub text: String,
}
