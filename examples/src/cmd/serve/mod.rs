//! `powerinfer serve`: an OpenAI-compatible HTTP server (axum on tokio) with a chat page.
//!
//! - `POST /v1/completions`, `POST /v1/chat/completions`: streamed as server-sent events or
//!   not; OpenAI's sampling parameters plus llama.cpp's `top_k`, `min_p`, `repeat_penalty`;
//!   `usage` in every response; chat prompts rendered by the model's chat template.
//! - `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text), `GET /` (the chat page).
//!
//! Requests share decode steps (continuous batching, `powerinfer_engine::Scheduler`) on one
//! decoding thread: `--parallel` sequences at once, up to `--queue` more waiting, then 429.
//! A client that disconnects frees its slot before the next step. With `--api-key`, the `/v1`
//! routes need `Authorization: Bearer KEY` (else 401).

mod api;
mod metrics;
mod request;
mod worker;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, Method, StatusCode, Uri};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{middleware, Json, Router};
use powerinfer_engine::SchedulerOptions;
use serde_json::json;

use api::AppState;
use metrics::Metrics;

/// Arguments of `powerinfer serve`.
#[derive(clap::Args)]
pub struct Args {
    /// The model.
    #[command(flatten)]
    pub model: super::model::ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0: any free one; the chosen one is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Sequences decoded together.
    #[arg(long = "parallel", alias = "np", default_value_t = 4)]
    parallel: usize,
    /// Requests waiting for a slot beyond `--parallel`, before 429.
    #[arg(long = "queue", default_value_t = 64)]
    queue: usize,
    /// Context size per sequence (0: the model's).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 2048, value_parser = crate::cmd::whole_number)]
    ctx_size: usize,
    /// Threads (0: all cores).
    #[arg(short = 't', long, default_value_t = 0, value_parser = crate::cmd::whole_number)]
    threads: usize,
    /// Prompt tokens evaluated per step, over all waiting prompts.
    #[arg(short = 'b', long = "batch-size", default_value_t = 64)]
    batch_size: usize,
    /// Required API key (`Authorization: Bearer KEY`) for the `/v1` routes.
    #[arg(long = "api-key")]
    api_key: Option<String>,
    /// The model id in requests and `/v1/models` (default: the file's name).
    #[arg(long = "alias")]
    alias: Option<String>,
    /// Chat template: a file of Jinja text, or a name (chatml, llama2, mistral, zephyr,
    /// vicuna, gemma, llama3); default: the model's, else ChatML.
    #[arg(long = "chat-template")]
    chat_template: Option<String>,
    /// Predictor threshold (default: as `powerinfer run`).
    #[arg(long)]
    sparse_threshold: Option<f32>,
    /// The device beside the CPU.
    #[command(flatten)]
    device: super::device::DeviceArgs,
    /// The KV cache's types.
    #[command(flatten)]
    cache: super::CacheTypes,
}

/// The chat page.
const PAGE: &str = include_str!("chat.html");

async fn health(State(state): State<AppState>) -> Response {
    state.metrics.response(200);
    Json(json!({"status": "ok"})).into_response()
}

async fn metrics_text(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}

async fn page() -> Html<&'static str> {
    Html(PAGE)
}

/// An OpenAI-style error body with `status`, `message` and `code`, counted in the metrics.
fn route_error(state: &AppState, status: StatusCode, message: &str, code: &str) -> Response {
    let e = json!({"error": {"message": message, "type": "invalid_request_error",
                             "param": null, "code": code}});
    state.metrics.response(status.as_u16());
    (status, Json(e)).into_response()
}

async fn not_found(State(state): State<AppState>) -> Response {
    route_error(&state, StatusCode::NOT_FOUND, "no such route", "not_found")
}

async fn method_not_allowed(State(state): State<AppState>, method: Method, uri: Uri) -> Response {
    let message = format!("{method} is not allowed on {}", uri.path());
    route_error(
        &state,
        StatusCode::METHOD_NOT_ALLOWED,
        &message,
        "method_not_allowed",
    )
}

/// The server's routes over `state`.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .merge(
            Router::new()
                .route("/v1/models", get(api::models))
                .route("/v1/completions", post(api::completions))
                .route("/v1/chat/completions", post(api::chat_completions))
                .route_layer(middleware::from_fn_with_state(
                    state.clone(),
                    api::require_api_key,
                )),
        )
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// Runs `powerinfer serve`.
pub fn run(a: Args) -> Result<(), String> {
    if a.parallel == 0 {
        return Err("--parallel 0: at least one sequence".into());
    }
    // Before the model loads, so that a misspelt name fails at once.
    let template_source = super::chat::template_source(a.chat_template.as_deref())?;
    let mut o = super::engine_options(a.threads, a.sparse_threshold);
    a.device.apply(&mut o)?;
    a.cache.apply(&mut o)?;
    // Every sequence decoded at once keeps its KV rows on a device.
    o.device.kv_sequences = a.parallel;
    o.ctx_len = a.ctx_size;
    o.batch = a.batch_size.max(1);
    let model = a.model.path()?;
    let engine = Arc::new(super::load_engine(&model, o)?);
    for line in super::device::describe(&engine) {
        eprintln!("{line}");
    }
    let template = engine
        .chat_template(template_source.as_deref())
        .map_err(|e| e.to_string())?;
    let model_id = a.alias.clone().unwrap_or_else(|| {
        model
            .file_name()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned())
    });
    let metrics = Arc::new(Metrics::default());
    let (tx, rx) = std::sync::mpsc::channel();
    let sched = {
        let mut s = SchedulerOptions::default();
        s.max_sequences = a.parallel;
        s.prefill_chunk = a.batch_size.max(1);
        s.context_shift = false;
        s
    };
    let worker = {
        let (engine, metrics, queue) = (engine.clone(), metrics.clone(), a.queue);
        std::thread::Builder::new()
            .name("powerinfer-decode".into())
            .spawn(move || worker::run(engine, sched, queue, rx, metrics))
            .map_err(|e| e.to_string())?
    };
    let state = AppState {
        ctx: engine.ctx_len(),
        engine,
        model_id,
        commands: tx,
        template: Arc::new(template),
        api_key: a.api_key.clone(),
        metrics,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let addr = format!("{}:{}", a.host, a.port);
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|e| format!("{addr}: {e}"))?;
        let local: SocketAddr = listener.local_addr().map_err(|e| e.to_string())?;
        eprintln!("listening on http://{local}");
        axum::serve(listener, router(state))
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
            .map_err(|e| e.to_string())
    })?;
    drop(worker);
    Ok(())
}
