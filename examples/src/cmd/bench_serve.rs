//! `powerinfer bench serve -m MODEL [--clients 64 --requests 128 --max-tokens 32]`: a bounded
//! load test of `powerinfer serve` on the loopback address. The server is started as a child
//! process (`--parallel`, `-t` and the device flags go to it); `--clients` concurrent clients
//! send streaming chat requests until `--requests` have been made, then everything stops. It
//! reports throughput (generated tokens per second of wall time), time to first token and the
//! time between tokens (p50, p99), and every failed request.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::json;
use tokio::sync::Mutex;

/// Arguments of `powerinfer bench serve`.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// The model (the server `powerinfer serve` is started on), unless `--url` is given.
    #[command(flatten)]
    model: super::model::ModelArgs<false>,
    /// Load-test a server that is already running at this address instead (e.g. llama.cpp's
    /// `llama-server` at `http://127.0.0.1:8080`, for the same clients against it): no server
    /// is started, and `--parallel`, `-t`, `--server-args` are that server's business.
    #[arg(long)]
    url: Option<String>,
    /// Concurrent clients.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Requests in all.
    #[arg(long, default_value_t = 128)]
    requests: usize,
    /// Tokens each request generates.
    #[arg(long = "max-tokens", default_value_t = 32)]
    max_tokens: usize,
    /// The server's decoding slots.
    #[arg(long, default_value_t = 8)]
    parallel: usize,
    /// The server's threads (0: all cores).
    #[arg(short = 't', long, default_value_t = 0, value_parser = crate::cmd::whole_number)]
    threads: usize,
    /// Send this prompt to `/v1/completions` (no chat template) instead of a chat message per
    /// request: the same work as `powerinfer batched -p PROMPT`, for a like-for-like comparison.
    #[arg(long)]
    prompt: Option<String>,
    /// Extra flags for `powerinfer serve` (e.g. `--server-args=--gpu=sim`).
    #[arg(long = "server-args", allow_hyphen_values = true)]
    server_args: Vec<String>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// What one request measured.
#[derive(Default)]
struct Sample {
    ttft: Option<Duration>,
    gaps: Vec<Duration>,
    tokens: usize,
    /// Prompt tokens the server evaluated (the template's rendering), from the last chunk's
    /// usage.
    prompt_tokens: usize,
    error: Option<String>,
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i]
}

async fn one(
    client: &reqwest::Client,
    url: &str,
    i: usize,
    max_tokens: usize,
    prompt: Option<&str>,
) -> Sample {
    let (route, body) = match prompt {
        None => (
            "chat/completions",
            json!({
                "messages": [{"role": "user", "content": format!("Tell me story number {i}.")}],
                "max_tokens": max_tokens, "stream": true, "temperature": 0.7, "seed": i,
            }),
        ),
        Some(p) => (
            "completions",
            json!({
                "prompt": p, "max_tokens": max_tokens, "stream": true, "temperature": 0.7,
                "seed": i,
            }),
        ),
    };
    let start = Instant::now();
    let mut s = Sample::default();
    let resp = match client
        .post(format!("{url}/v1/{route}"))
        .json(&body)
        .send()
        .await
    {
        Ok(r) if r.status().is_success() => r,
        Ok(r) => {
            s.error = Some(format!("HTTP {}", r.status()));
            return s;
        }
        Err(e) => {
            s.error = Some(chain(&e));
            return s;
        }
    };
    let mut last = start;
    let mut buf = String::new();
    let mut stream = resp.bytes_stream();
    let mut done = false;
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                s.error = Some(chain(&e));
                return s;
            }
        };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(cut) = buf.find("\n\n") {
            let event: String = buf.drain(..cut + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(data).unwrap_or_default();
            if let Some(n) = v["usage"]["prompt_tokens"].as_u64() {
                s.prompt_tokens = n as usize;
            }
            // Chat chunks carry `delta.content`, completion chunks `text`.
            let c = &v["choices"][0];
            let has_text = c["delta"]["content"]
                .as_str()
                .or_else(|| c["text"].as_str())
                .is_some_and(|t| !t.is_empty());
            if has_text {
                let now = Instant::now();
                match s.ttft {
                    None => s.ttft = Some(now - start),
                    Some(_) => s.gaps.push(now - last),
                }
                last = now;
                s.tokens += 1;
            }
        }
    }
    if !done {
        s.error = Some("the stream ended without [DONE]".into());
    }
    s
}

/// An error with its causes, outermost first.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// The value of an unlabelled sample `name` in a Prometheus text exposition.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Starts `powerinfer serve` on `model` on a free port; returns it and its address.
fn start_server(model: &Path, a: &ServeArgs) -> Result<(Child, String), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(["serve", "-m"])
        .arg(model)
        .args(["--port", "0", "--parallel", &a.parallel.to_string()])
        .args([
            "-t",
            &a.threads.to_string(),
            "--queue",
            &a.requests.to_string(),
        ])
        .args(&a.server_args)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut lines = BufReader::new(child.stderr.take().expect("piped")).lines();
    let url = loop {
        match lines.next() {
            Some(Ok(l)) => {
                if let Some(u) = l.strip_prefix("listening on ") {
                    break u.to_string();
                }
                eprintln!("server: {l}");
            }
            _ => {
                let _ = child.kill();
                return Err("the server did not start".into());
            }
        }
    };
    std::thread::spawn(move || for _ in lines {});
    Ok((child, url))
}

/// Runs `powerinfer bench serve`.
pub fn run(a: ServeArgs) -> Result<(), String> {
    let model = match &a.url {
        Some(_) => None,
        None => a.model.path_if_given()?,
    };
    let (mut child, url) = match (&a.url, &model) {
        (Some(u), _) => (None, u.trim_end_matches('/').to_string()),
        (None, Some(model)) => {
            let (c, u) = start_server(model, &a)?;
            (Some(c), u)
        }
        (None, None) => return Err("give -m MODEL, -hf REPO or --url URL".into()),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let (samples, wall, metrics) = rt.block_on(async {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(600))
            // Another server may close an idle keep-alive connection just as a client reuses
            // it (llama.cpp's does: "connection closed before message completed"); against one,
            // every request opens its own connection.
            .pool_max_idle_per_host(if a.url.is_some() { 0 } else { a.clients })
            .build()
            .expect("an HTTP client");
        let next = Arc::new(Mutex::new(0usize));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let start = Instant::now();
        let tasks: Vec<_> = (0..a.clients)
            .map(|_| {
                let (client, url, next, samples) =
                    (client.clone(), url.clone(), next.clone(), samples.clone());
                let (total, max_tokens) = (a.requests, a.max_tokens);
                let prompt = a.prompt.clone();
                tokio::spawn(async move {
                    loop {
                        let i = {
                            let mut n = next.lock().await;
                            if *n >= total {
                                return;
                            }
                            *n += 1;
                            *n - 1
                        };
                        let s = one(&client, &url, i, max_tokens, prompt.as_deref()).await;
                        samples.lock().await.push(s);
                    }
                })
            })
            .collect();
        for t in tasks {
            let _ = t.await;
        }
        let wall = start.elapsed();
        let samples = std::mem::take(&mut *samples.lock().await);
        // The decoding thread's own account of the run.
        let metrics = match client.get(format!("{url}/metrics")).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        (samples, wall, metrics)
    });
    if let Some(c) = &mut child {
        let _ = c.kill();
        let _ = c.wait();
    }
    let failed: Vec<&String> = samples.iter().filter_map(|s| s.error.as_ref()).collect();
    let tokens: usize = samples.iter().map(|s| s.tokens).sum();
    let mut ttft: Vec<f64> = samples
        .iter()
        .filter_map(|s| s.ttft.map(|d| d.as_secs_f64() * 1e3))
        .collect();
    let mut gaps: Vec<f64> = samples
        .iter()
        .flat_map(|s| s.gaps.iter().map(|d| d.as_secs_f64() * 1e3))
        .collect();
    let tps = tokens as f64 / wall.as_secs_f64();
    let prompt_tokens: usize = samples.iter().map(|s| s.prompt_tokens).sum();
    // Prompt and generated tokens evaluated per second: what `batched` counts too, once.
    let evaluated = (tokens + prompt_tokens) as f64 / wall.as_secs_f64();
    let report = json!({
        "model": model.as_ref().map_or(url.clone(), |m| m.display().to_string()),
        "clients": a.clients, "requests": samples.len(), "failed": failed.len(),
        "parallel": a.parallel, "max_tokens": a.max_tokens,
        "tokens": tokens, "seconds": wall.as_secs_f64(), "tokens_per_second": tps,
        "prompt_tokens": prompt_tokens, "evaluated_tokens_per_second": evaluated,
        "ttft_ms_p50": percentile(&mut ttft, 0.5), "ttft_ms_p99": percentile(&mut ttft, 0.99),
        "token_ms_p50": percentile(&mut gaps, 0.5), "token_ms_p99": percentile(&mut gaps, 0.99),
        "steps": metric(&metrics, "powerinfer_steps_total"),
        "step_seconds": metric(&metrics, "powerinfer_step_seconds_total"),
        "busy_slots_per_step": metric(&metrics, "powerinfer_busy_slots_per_step"),
        "tokens_per_step": metric(&metrics, "powerinfer_tokens_per_step"),
    });
    if a.json {
        println!("{report}");
    } else {
        let f = |k: &str| report[k].as_f64().unwrap_or(0.0);
        println!(
            "{} requests from {} clients ({} slots): {} failed; {tokens} tokens in {:.2} s = {tps:.1} tokens/s",
            samples.len(),
            a.clients,
            a.parallel,
            failed.len(),
            wall.as_secs_f64()
        );
        println!(
            "with the {prompt_tokens} prompt tokens the server evaluated: {evaluated:.1} tokens/s"
        );
        println!(
            "time to first token: p50 {:.1} ms, p99 {:.1} ms; between tokens: p50 {:.2} ms, p99 {:.2} ms",
            f("ttft_ms_p50"),
            f("ttft_ms_p99"),
            f("token_ms_p50"),
            f("token_ms_p99")
        );
        if f("steps") > 0.0 {
            println!(
                "decoding thread: {} batches, evaluating {:.1}% of the run ({:.2} ms each), \
                 {:.2} of {} slots and {:.2} tokens per batch",
                f("steps"),
                100.0 * f("step_seconds") / wall.as_secs_f64(),
                1e3 * f("step_seconds") / f("steps"),
                f("busy_slots_per_step"),
                a.parallel,
                f("tokens_per_step")
            );
        }
        for e in failed.iter().take(5) {
            println!("failed: {e}");
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} of {} requests failed",
            failed.len(),
            samples.len()
        ))
    }
}
