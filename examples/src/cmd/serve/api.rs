//! The OpenAI-compatible handlers: request validation (OpenAI-style error bodies), sampling
//! parameters as OpenAI and llama.cpp name them, completions and chat completions, streamed as
//! server-sent events or not.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use powerinfer_engine::{ChatMessage, ChatTemplate, Engine, Finish, SamplingParams};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use super::metrics::Metrics;
use super::request::{
    self, ChatBody, CompletionBody, Content, FieldError, Lenient, Logprobs, Object, Prompt,
    Sampling,
};
use super::worker::{Command, Refused, Update};

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    /// The engine (tokenizer and hyper-parameters; the decoding thread shares it).
    pub engine: Arc<Engine>,
    /// The model's id in requests and `/v1/models`.
    pub model_id: String,
    /// To the decoding thread.
    pub commands: std::sync::mpsc::Sender<Command>,
    /// The chat template.
    pub template: Arc<ChatTemplate>,
    /// Required `Authorization: Bearer` key, if any.
    pub api_key: Option<String>,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// KV positions per sequence.
    pub ctx: usize,
}

/// An OpenAI-style error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<String>,
    code: Option<&'static str>,
}

impl ApiError {
    fn bad(message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(String::from),
            code: None,
        }
    }

    /// 401 for a wrong or missing key.
    fn unauthorized() -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "Invalid or missing API key (Authorization: Bearer ...)".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// The response, counted in `metrics`.
    pub fn respond(self, metrics: &Metrics) -> Response {
        metrics.response(self.status.as_u16());
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        });
        (self.status, Json(body)).into_response()
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn request_id(prefix: &str) -> String {
    let n = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{prefix}-{n:x}")
}

/// Whether `headers` carry the API key `state` asks for (always, without one).
fn authorized(state: &AppState, headers: &HeaderMap) -> bool {
    match &state.api_key {
        None => true,
        Some(key) => headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|k| k == key),
    }
}

/// The layer in front of the `/v1` routes: a request without the API key is answered 401
/// here, so that no handler checks it.
pub async fn require_api_key(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    if authorized(&state, request.headers()) {
        next.run(request).await
    } else {
        ApiError::unauthorized().respond(&state.metrics)
    }
}

impl From<FieldError> for ApiError {
    fn from(e: FieldError) -> ApiError {
        ApiError::bad(e.message, e.field.as_deref())
    }
}

/// The values a number field may take: from `lo` (included, or not when `lo_open`) to `hi`
/// (included).
#[derive(Clone, Copy)]
struct Span {
    lo: f64,
    lo_open: bool,
    hi: f64,
}

/// `[lo, hi]`.
const fn closed(lo: f64, hi: f64) -> Span {
    Span {
        lo,
        lo_open: false,
        hi,
    }
}

/// `(lo, hi]`.
const fn open_below(lo: f64, hi: f64) -> Span {
    Span {
        lo,
        lo_open: true,
        hi,
    }
}

impl Span {
    fn contains(self, v: f64) -> bool {
        (if self.lo_open {
            v > self.lo
        } else {
            v >= self.lo
        }) && v <= self.hi
    }
}

impl std::fmt::Display for Span {
    /// Interval notation: `[0, 2]`, `(0, 1]`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let open = if self.lo_open { '(' } else { '[' };
        write!(f, "{open}{}, {}]", self.lo, self.hi)
    }
}

/// `v` when it is within `span`, else the 400 naming `key`.
fn ranged(v: Option<f64>, key: &str, span: Span) -> Result<Option<f64>, ApiError> {
    match v {
        Some(v) if !span.contains(v) => Err(ApiError::bad(
            format!("'{key}' must be in {span}, got {v}"),
            Some(key),
        )),
        v => Ok(v),
    }
}

/// What a request asks for beyond its prompt.
struct Ask {
    params: SamplingParams,
    n: usize,
    stream: bool,
}

/// Sampling parameters of `body` for a prompt of `prompt_len` tokens.
fn ask(state: &AppState, body: &Value, prompt_len: usize) -> Result<Ask, ApiError> {
    let r: Sampling = request::read(body)?;
    let logprobs = match (r.logprobs.and_then(Logprobs::asked), r.top_logprobs) {
        (Some(v), _) => Some(("logprobs", v)),
        (None, Some(n)) => Some(("top_logprobs", n.to_string())),
        (None, None) => None,
    };
    if let Some((key, value)) = logprobs {
        return Err(ApiError::bad(
            format!("log probabilities are not supported by this server ('{key}': {value})"),
            Some(key),
        ));
    }
    if let Some(m) = &r.model {
        if *m != state.model_id {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!(
                    "The model '{m}' does not exist; this server serves '{}'",
                    state.model_id
                ),
                kind: "invalid_request_error",
                param: Some("model".into()),
                code: Some("model_not_found"),
            });
        }
    }
    if prompt_len == 0 {
        return Err(ApiError::bad("the prompt has no tokens", Some("prompt")));
    }
    if prompt_len >= state.ctx {
        return Err(ApiError::bad(
            format!(
                "the prompt has {prompt_len} tokens; the context holds {} (one is needed to \
                 generate)",
                state.ctx
            ),
            Some("prompt"),
        ));
    }
    let room = state.ctx - prompt_len;
    let max_tokens = match r.max_tokens.or(r.max_completion_tokens) {
        None => room,
        Some(n) if n <= 0 => {
            return Err(ApiError::bad(
                format!("'max_tokens' must be at least 1, got {n}"),
                Some("max_tokens"),
            ))
        }
        Some(n) if n as u64 > room as u64 => {
            return Err(ApiError::bad(
                format!(
                "'max_tokens' {n} and the prompt's {prompt_len} tokens exceed the context of {}",
                state.ctx
            ),
                Some("max_tokens"),
            ))
        }
        Some(n) => n as usize,
    };
    let n = match r.n {
        None => 1,
        Some(n) if (1..=8).contains(&n) => n as usize,
        Some(n) => {
            return Err(ApiError::bad(
                format!("'n' must be 1 to 8, got {n}"),
                Some("n"),
            ))
        }
    };
    if r.stream && n > 1 {
        return Err(ApiError::bad("'n' > 1 cannot be streamed", Some("n")));
    }
    let temperature = ranged(r.temperature, "temperature", closed(0.0, 2.0))?;
    let top_p = ranged(r.top_p, "top_p", open_below(0.0, 1.0))?;
    let min_p = ranged(r.min_p, "min_p", closed(0.0, 1.0))?;
    let presence = ranged(r.presence_penalty, "presence_penalty", closed(-2.0, 2.0))?;
    let frequency = ranged(r.frequency_penalty, "frequency_penalty", closed(-2.0, 2.0))?;
    let repeat = ranged(r.repeat_penalty, "repeat_penalty", closed(0.0, 10.0))?;
    let typical = ranged(r.typical_p, "typical_p", open_below(0.0, 1.0))?;
    let xtc_probability = ranged(r.xtc_probability, "xtc_probability", closed(0.0, 1.0))?;
    let xtc_threshold = ranged(r.xtc_threshold, "xtc_threshold", closed(0.0, 1.0))?;
    let mirostat = match r.mirostat {
        Some(m) if !(0..=2).contains(&m) => {
            return Err(ApiError::bad(
                "'mirostat' must be 0, 1 or 2",
                Some("mirostat"),
            ))
        }
        m => m,
    };
    let mirostat_tau = ranged(r.mirostat_tau, "mirostat_tau", open_below(0.0, 100.0))?;
    let dry_multiplier = ranged(r.dry_multiplier, "dry_multiplier", closed(0.0, 100.0))?;
    let dry_base = ranged(r.dry_base, "dry_base", closed(1.0, 100.0))?;
    let dry_allowed_length = match r.dry_allowed_length {
        Some(n) if n < 0 => {
            return Err(ApiError::bad(
                "'dry_allowed_length' must be 0 or more",
                Some("dry_allowed_length"),
            ))
        }
        n => n,
    };
    let dry_last_n = match r.dry_penalty_last_n {
        Some(n) if n < -1 => {
            return Err(ApiError::bad(
                "'dry_penalty_last_n' must be -1 (all), 0 (off) or more",
                Some("dry_penalty_last_n"),
            ))
        }
        n => n,
    };
    let dry_on = dry_multiplier.is_some_and(|m| m > 0.0);
    let dry_breaker_ids = if dry_on {
        crate::cmd::run::dry_breaker_tokens(&state.engine, &r.dry_sequence_breakers)
    } else {
        Vec::new()
    };
    let mirostat_eta = ranged(r.mirostat_eta, "mirostat_eta", open_below(0.0, 10.0))?;
    let n_vocab = state.engine.model().hparams().n_vocab;
    let logit_bias = r
        .logit_bias
        .iter()
        .flatten()
        .map(|(k, b)| {
            let id = k.parse::<u32>().ok().filter(|&id| (id as usize) < n_vocab);
            let bias = b.as_f64().filter(|b| (-100.0..=100.0).contains(b));
            match (id, bias) {
                (Some(id), Some(b)) => Ok((id, b as f32)),
                _ => Err(ApiError::bad(
                    format!(
                        "'logit_bias' maps token ids (below {n_vocab}) to numbers in \
                         [-100, 100]: {k}"
                    ),
                    Some("logit_bias"),
                )),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let top_k = match r.top_k {
        Some(k) if k < 0 => return Err(ApiError::bad("'top_k' must be 0 or more", Some("top_k"))),
        k => k,
    };
    let seed = r.seed.map(|s| s as u64).unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let params = SamplingParams::default().with(|p| {
        p.temperature = temperature.map_or(p.temperature, |v| v as f32);
        p.top_p = top_p.map_or(p.top_p, |v| v as f32);
        p.min_p = min_p.map_or(p.min_p, |v| v as f32);
        p.presence_penalty = presence.map_or(0.0, |v| v as f32);
        p.frequency_penalty = frequency.map_or(0.0, |v| v as f32);
        p.repeat_penalty = repeat.map_or(1.0, |v| v as f32);
        p.top_k = top_k.map_or(p.top_k, |k| k as usize);
        p.seed = seed;
        p.max_tokens = max_tokens;
        p.stop = r.stop;
        p.typical_p = typical.map_or(1.0, |v| v as f32);
        p.xtc_probability = xtc_probability.map_or(0.0, |v| v as f32);
        p.xtc_threshold = xtc_threshold.map_or(p.xtc_threshold, |v| v as f32);
        p.mirostat = mirostat.map_or(0, |m| m as u8);
        p.mirostat_tau = mirostat_tau.map_or(p.mirostat_tau, |v| v as f32);
        p.mirostat_eta = mirostat_eta.map_or(p.mirostat_eta, |v| v as f32);
        p.dry_multiplier = dry_multiplier.map_or(0.0, |v| v as f32);
        p.dry_base = dry_base.map_or(p.dry_base, |v| v as f32);
        p.dry_allowed_length = dry_allowed_length.map_or(p.dry_allowed_length, |n| n as usize);
        p.dry_penalty_last_n = match dry_last_n {
            Some(-1) | None => usize::MAX,
            Some(n) => n as usize,
        };
        p.dry_breakers = dry_breaker_ids;
        // OpenAI's -100 bans a token.
        p.logit_bias = logit_bias
            .into_iter()
            .map(|(t, b)| (t, if b <= -100.0 { f32::NEG_INFINITY } else { b }))
            .collect();
    });
    Ok(Ask {
        params,
        n,
        stream: r.stream,
    })
}

/// Starts a sequence on the decoding thread; its updates.
async fn submit(
    state: &AppState,
    tokens: Vec<u32>,
    params: SamplingParams,
) -> Result<mpsc::UnboundedReceiver<Update>, ApiError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let (reply, answer) = oneshot::channel();
    let cmd = Command::Submit {
        tokens,
        params,
        updates: tx,
        reply,
    };
    let down = || ApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        message: "the decoding thread has stopped".into(),
        kind: "server_error",
        param: None,
        code: None,
    };
    state.commands.send(cmd).map_err(|_| down())?;
    match answer.await.map_err(|_| down())? {
        Ok(_) => Ok(rx),
        Err(Refused::Busy) => Err(ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: "every decoding slot and the queue are full; retry later".into(),
            kind: "rate_limit_error",
            param: None,
            code: Some("server_busy"),
        }),
        Err(Refused::Invalid(m)) => Err(ApiError::bad(m, Some("prompt"))),
    }
}

/// OpenAI's name for how a sequence ended.
fn finish_reason(f: &Finish) -> &'static str {
    match f {
        Finish::Length | Finish::ContextFull => "length",
        _ => "stop",
    }
}

/// A finished sequence's text, cut before its stop string.
fn cut_at_stop(text: &str, f: &Finish) -> String {
    match f {
        Finish::Stop(s) => text
            .find(s.as_str())
            .map_or(text, |i| &text[..i])
            .to_string(),
        _ => text.to_string(),
    }
}

/// Collects a whole sequence: text, finish, prompt and generated token counts.
async fn collect(
    mut rx: mpsc::UnboundedReceiver<Update>,
) -> Result<(String, Finish, usize, usize), ApiError> {
    let mut text = String::new();
    while let Some(u) = rx.recv().await {
        match u {
            Update::Text(t) => text.push_str(&t),
            Update::Done {
                reason: Finish::Error(e),
                ..
            } => {
                return Err(ApiError {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    message: e,
                    kind: "server_error",
                    param: None,
                    code: None,
                })
            }
            Update::Done {
                reason,
                prompt_tokens,
                generated,
            } => {
                let text = cut_at_stop(&text, &reason);
                return Ok((text, reason, prompt_tokens, generated));
            }
        }
    }
    Err(ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: "the sequence ended without a result".into(),
        kind: "server_error",
        param: None,
        code: None,
    })
}

/// The streamed text of one sequence: pieces held back while they could begin a stop string,
/// then cut before it; the last item carries the finish and the token counts.
fn text_stream(
    rx: mpsc::UnboundedReceiver<Update>,
    stops: Vec<String>,
) -> impl Stream<Item = (String, Option<(Finish, usize, usize)>)> {
    stream::unfold(
        (rx, String::new(), false),
        move |(mut rx, mut held, done)| {
            let stops = stops.clone();
            async move {
                if done {
                    return None;
                }
                loop {
                    match rx.recv().await {
                        Some(Update::Text(t)) => {
                            held.push_str(&t);
                            // Keep what could be the start of a stop string.
                            let keep = stops
                                .iter()
                                .filter(|s| !s.is_empty())
                                .flat_map(|s| {
                                    (1..s.len())
                                        .filter(|&k| s.is_char_boundary(k))
                                        .filter(|&k| held.ends_with(&s[..k]))
                                })
                                .max()
                                .unwrap_or(0);
                            let cut = held.len() - keep;
                            if cut > 0 {
                                let out: String = held.drain(..cut).collect();
                                return Some(((out, None), (rx, held, false)));
                            }
                        }
                        Some(Update::Done {
                            reason,
                            prompt_tokens,
                            generated,
                        }) => {
                            let out = cut_at_stop(&held, &reason);
                            return Some((
                                (out, Some((reason, prompt_tokens, generated))),
                                (rx, String::new(), true),
                            ));
                        }
                        None => return None,
                    }
                }
            }
        },
    )
}

fn usage(prompt: usize, generated: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated})
}

/// The JSON body of a request, or a 400.
fn body_json(bytes: &Bytes) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad(format!("the body is not valid JSON: {e}"), None))?;
    if !v.is_object() {
        return Err(ApiError::bad("the body must be a JSON object", None));
    }
    Ok(v)
}

/// What differs between `/v1/completions` and `/v1/chat/completions` (see [`complete`]).
struct Endpoint {
    /// Prefix of the response ids.
    id_prefix: &'static str,
    /// `object` of a whole response.
    object: &'static str,
    /// `object` of a streamed chunk.
    chunk_object: &'static str,
    /// The choice of a stream's opening chunk, if it has one.
    opening: Option<fn() -> Value>,
    /// The choice of a streamed chunk: its text and, on the last, how the sequence ended.
    chunk_choice: fn(String, Option<&'static str>) -> Value,
    /// Choice `i` of a whole response: its text and how it ended.
    choice: fn(usize, String, &'static str) -> Value,
}

/// `/v1/completions`.
const COMPLETIONS: Endpoint = Endpoint {
    id_prefix: "cmpl",
    object: "text_completion",
    chunk_object: "text_completion",
    opening: None,
    chunk_choice: |text, reason| json!({"text": text, "index": 0, "logprobs": null, "finish_reason": reason}),
    choice: |i, text, reason| json!({"text": text, "index": i, "logprobs": null, "finish_reason": reason}),
};

/// `/v1/chat/completions`.
const CHAT: Endpoint = Endpoint {
    id_prefix: "chatcmpl",
    object: "chat.completion",
    chunk_object: "chat.completion.chunk",
    opening: Some(|| {
        json!({"index": 0, "delta": {"role": "assistant", "content": ""},
               "finish_reason": null})
    }),
    chunk_choice: |text, reason| {
        let delta = if text.is_empty() {
            json!({})
        } else {
            json!({"content": text})
        };
        json!({"index": 0, "delta": delta, "finish_reason": reason})
    },
    choice: |i, text, reason| {
        json!({"index": i, "message": {"role": "assistant", "content": text},
               "finish_reason": reason})
    },
};

/// A POST endpoint's response: `inner`'s response or its error.
async fn respond(
    state: &AppState,
    inner: impl Future<Output = Result<Response, ApiError>>,
) -> Response {
    match inner.await {
        Ok(r) => r,
        Err(e) => e.respond(&state.metrics),
    }
}

/// Generates for the prompt `tokens` of request `body` at endpoint `ep`: `n` whole completions,
/// or one streamed as server-sent events (each chunk with one choice, the last with the usage,
/// then `[DONE]`).
async fn complete(
    state: &AppState,
    body: &Value,
    tokens: Vec<u32>,
    ep: &'static Endpoint,
) -> Result<Response, ApiError> {
    let ask = ask(state, body, tokens.len())?;
    let id = request_id(ep.id_prefix);
    let model = state.model_id.clone();
    if ask.stream {
        let rx = submit(state, tokens, ask.params.clone()).await?;
        state.metrics.response(200);
        let chunk = move |choice: Value| {
            json!({
                "id": id, "object": ep.chunk_object, "created": now(), "model": model,
                "choices": [choice],
            })
        };
        let opening = ep
            .opening
            .map(|c| Ok::<_, Infallible>(SseEvent::default().data(chunk(c()).to_string())));
        let events = text_stream(rx, ask.params.stop.clone()).flat_map(move |(text, end)| {
            let mut out = vec![];
            let mut chunk = chunk((ep.chunk_choice)(
                text,
                end.as_ref().map(|e| finish_reason(&e.0)),
            ));
            if let Some((_, p, g)) = &end {
                chunk["usage"] = usage(*p, *g);
            }
            out.push(Ok::<_, Infallible>(
                SseEvent::default().data(chunk.to_string()),
            ));
            if end.is_some() {
                out.push(Ok(SseEvent::default().data("[DONE]")));
            }
            stream::iter(out)
        });
        return Ok(Sse::new(stream::iter(opening).chain(events))
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    let mut choices = Vec::new();
    let (mut prompt_tokens, mut generated) = (0, 0);
    let mut pending = Vec::new();
    for i in 0..ask.n {
        let params = ask.params.clone().with(|p| p.seed += i as u64);
        pending.push(submit(state, tokens.clone(), params).await?);
    }
    for (i, rx) in pending.into_iter().enumerate() {
        let (text, reason, p, g) = collect(rx).await?;
        prompt_tokens = p;
        generated += g;
        choices.push((ep.choice)(i, text, finish_reason(&reason)));
    }
    state.metrics.response(200);
    Ok(Json(json!({
        "id": id, "object": ep.object, "created": now(), "model": model,
        "choices": choices, "usage": usage(prompt_tokens, generated),
    }))
    .into_response())
}

/// `POST /v1/completions`.
pub async fn completions(State(state): State<AppState>, bytes: Bytes) -> Response {
    respond(&state, completions_inner(&state, &bytes)).await
}

async fn completions_inner(state: &AppState, bytes: &Bytes) -> Result<Response, ApiError> {
    let body = body_json(bytes)?;
    let request: CompletionBody = request::read(&body)?;
    let tok = state.engine.tokenizer();
    let tokens = match request.prompt {
        Some(Prompt::Text(s) | Prompt::OneText([s])) => tok.encode(&s, true, false),
        Some(Prompt::Tokens(t)) => t,
        None => return Err(ApiError::bad("'prompt' is required", Some("prompt"))),
    };
    complete(state, &body, tokens, &COMPLETIONS).await
}

/// The roles a chat message may have.
const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// The messages of a chat request, or the 400 saying what is wrong with them.
fn messages(body: ChatBody) -> Result<Vec<ChatMessage>, ApiError> {
    let bad = |m: &str| ApiError::bad(m, Some("messages"));
    let list = body
        .messages
        .ok_or_else(|| bad("'messages' must be an array of messages"))?;
    if list.is_empty() {
        return Err(bad("'messages' is empty"));
    }
    list.into_iter()
        .map(|m| {
            let Lenient::Valid(Object(m)) = m else {
                return Err(bad("every message needs a 'role' string"));
            };
            let Some(Lenient::Valid(role)) = m.role else {
                return Err(bad("every message needs a 'role' string"));
            };
            if !ROLES.contains(&role.as_str()) {
                return Err(bad(&format!(
                    "a message's 'role' is one of {}, not '{role}'",
                    ROLES.join(", ")
                )));
            }
            let content = match m.content {
                None => String::new(),
                Some(Lenient::Valid(Content::Text(s))) => s,
                Some(Lenient::Valid(Content::Parts(parts))) => parts
                    .into_iter()
                    .map(|p| match p {
                        Lenient::Valid(Object(p)) if p.kind == "text" => Ok(p.text),
                        _ => Err(bad("only text content parts are supported")),
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .concat(),
                Some(Lenient::Other(_)) => {
                    return Err(bad("a message's 'content' must be a string or text parts"))
                }
            };
            Ok(ChatMessage::new(role, content))
        })
        .collect()
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(state): State<AppState>, bytes: Bytes) -> Response {
    respond(&state, chat_inner(&state, &bytes)).await
}

async fn chat_inner(state: &AppState, bytes: &Bytes) -> Result<Response, ApiError> {
    let body = body_json(bytes)?;
    let msgs = messages(request::read(&body)?)?;
    let prompt = state
        .template
        .render(&msgs, true)
        .map_err(|e| ApiError::bad(e.to_string(), Some("messages")))?;
    let bos = state.template.bos_token();
    let add_bos = bos.is_empty() || !prompt.starts_with(bos);
    let tokens = state.engine.tokenizer().encode(&prompt, add_bos, true);
    complete(state, &body, tokens, &CHAT).await
}

/// `GET /v1/models`.
pub async fn models(State(state): State<AppState>) -> Response {
    state.metrics.response(200);
    Json(json!({
        "object": "list",
        "data": [{"id": state.model_id, "object": "model", "created": now(),
                  "owned_by": "powerinfer-rs"}],
    }))
    .into_response()
}
