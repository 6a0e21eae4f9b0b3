//! `powerinfer serve` as a process on a tiny synthetic model: the OpenAI routes, bad input and
//! load (4xx bodies, 401, 429, disconnects), outputs independent of load, the official `openai`
//! Python client, the chat page in headless Chromium, and two replicas behind nginx.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

#[path = "support/cli.rs"]
mod cli;
#[path = "support/python.rs"]
mod python;
use python::python_with;

/// A running server, killed when dropped.
struct Server {
    child: Child,
    url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(model: &Path, extra: &[&str]) -> Server {
    let mut args = vec![
        "serve",
        "-m",
        model.to_str().unwrap(),
        "--port",
        "0",
        "-t",
        "1",
    ];
    // Defaults the caller did not set.
    for (flag, value) in [("--gpu", "none"), ("-c", "512")] {
        if !extra.contains(&flag) {
            args.extend([flag, value]);
        }
    }
    args.extend(extra);
    let mut child = Command::new(env!("CARGO_BIN_EXE_powerinfer"))
        .args(&args)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let url = loop {
        let line = lines
            .next()
            .expect("the server printed its address")
            .unwrap();
        if let Some(u) = line.strip_prefix("listening on ") {
            break u.to_string();
        }
    };
    // Keep draining stderr so the server never blocks on it.
    std::thread::spawn(move || for _ in lines {});
    Server { child, url }
}

struct Files {
    _dir: tempfile::TempDir,
    model: PathBuf,
}

fn model() -> Files {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.powerinfer.gguf");
    cli::synth(
        &model,
        &["--shape", "tiny", "--type", "q8_0", "--seed", "11"],
    );
    Files { _dir: dir, model }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

async fn post(url: &str, path: &str, body: &str) -> (u16, Value) {
    let r = client()
        .post(format!("{url}{path}"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// A greedy completion's text.
async fn greedy(url: &str, prompt: &str, n: u32) -> String {
    let body = json!({"prompt": prompt, "max_tokens": n, "temperature": 0}).to_string();
    let (s, v) = post(url, "/v1/completions", &body).await;
    assert_eq!(s, 200, "{v}");
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

/// Request bodies with one bad field: (route, bodies, the field named, the whole message).
type Malformed = (
    &'static str,
    &'static [&'static str],
    &'static str,
    &'static str,
);

/// Request bodies with one bad field, each with the 400 it gets.
const MALFORMED: &[Malformed] = &[
    (
        C,
        &[r#"{"max_tokens": 4}"#],
        "prompt",
        "'prompt' is required",
    ),
    (
        C,
        &[
            r#"{"prompt": null}"#,
            r#"{"prompt": ["a", "b"]}"#,
            r#"{"prompt": [1, -2]}"#,
            r#"{"prompt": [1, 4294967296]}"#,
        ],
        "prompt",
        "'prompt' must be a string, one string in an array, or an array of token ids",
    ),
    (
        C,
        &[r#"{"prompt": "hi", "temperature": "hot"}"#],
        "temperature",
        "'temperature' must be a number",
    ),
    (
        C,
        &[r#"{"prompt": "hi", "max_completion_tokens": 1.5}"#],
        "max_completion_tokens",
        "'max_completion_tokens' must be an integer",
    ),
    (
        C,
        &[r#"{"prompt": "hi", "n": 9}"#],
        "n",
        "'n' must be 1 to 8, got 9",
    ),
    (
        C,
        &[r#"{"prompt": "hi", "n": 2, "stream": true}"#],
        "n",
        "'n' > 1 cannot be streamed",
    ),
    (
        C,
        &[r#"{"prompt": "hi", "stream": "yes"}"#],
        "stream",
        "'stream' must be a boolean",
    ),
    (
        C,
        &[
            r#"{"prompt": "hi", "stop": ["a", 1]}"#,
            r#"{"prompt": "hi", "stop": 5}"#,
        ],
        "stop",
        "'stop' must be a string or strings",
    ),
    (
        C,
        &[r#"{"prompt": "hi", "seed": "x"}"#],
        "seed",
        "'seed' must be an integer",
    ),
    (
        C,
        &[r#"{"prompt": "hi", "top_k": -1}"#],
        "top_k",
        "'top_k' must be 0 or more",
    ),
    (
        C,
        &[r#"{"prompt": "hi", "min_p": 1.5}"#],
        "min_p",
        "'min_p' must be in [0, 1], got 1.5",
    ),
    (
        C,
        &[r#"{"prompt": "hi", "dry_penalty_last_n": -2}"#],
        "dry_penalty_last_n",
        "'dry_penalty_last_n' must be -1 (all), 0 (off) or more",
    ),
    (
        C,
        &[r#"{"prompt": "hi", "logit_bias": [1]}"#],
        "logit_bias",
        "'logit_bias' must be an object of token ids to biases",
    ),
    (
        C,
        &[r#"{"prompt": "hi", "logit_bias": {"5": "up"}}"#],
        "logit_bias",
        "'logit_bias' maps token ids (below 512) to numbers in [-100, 100]: 5",
    ),
    (
        C,
        &[r#"{"prompt": "hi", "logit_bias": {"99999": 1}}"#],
        "logit_bias",
        "'logit_bias' maps token ids (below 512) to numbers in [-100, 100]: 99999",
    ),
    (
        C,
        &[
            r#"{"prompt": "hi", "top_p": 2}"#,
            r#"{"prompt": "hi", "top_p": 0}"#,
        ],
        "top_p",
        "",
    ),
    (
        C,
        &[r#"{"prompt": "hi", "logprobs": 5}"#],
        "logprobs",
        "log probabilities are not supported by this server ('logprobs': 5)",
    ),
    (
        CHAT,
        &[r#"{"messages": [{"role": "user", "content": "hi"}], "logprobs": true}"#],
        "logprobs",
        "log probabilities are not supported by this server ('logprobs': true)",
    ),
    (
        CHAT,
        &[r#"{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}"#],
        "top_logprobs",
        "log probabilities are not supported by this server ('top_logprobs': 2)",
    ),
    (
        CHAT,
        &[r#"{"messages": [{"role": "wizard", "content": "hi"}]}"#],
        "messages",
        "a message's 'role' is one of system, user, assistant, tool, not 'wizard'",
    ),
    (
        CHAT,
        &[r#"{"messages": "hi"}"#, r#"{"max_tokens": 2}"#],
        "messages",
        "'messages' must be an array of messages",
    ),
    (
        CHAT,
        &[
            r#"{"messages": [5]}"#,
            r#"{"messages": [["user", "hi"]]}"#,
            r#"{"messages": [{"role": 1, "content": "hi"}]}"#,
        ],
        "messages",
        "every message needs a 'role' string",
    ),
    (
        CHAT,
        &[r#"{"messages": [{"role": "user", "content": 5}]}"#],
        "messages",
        "a message's 'content' must be a string or text parts",
    ),
    (
        CHAT,
        &[r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]}"#],
        "messages",
        "only text content parts are supported",
    ),
    (
        CHAT,
        &[r#"{"messages": [{"role": "user", "content": "hi"}], "temperature": []}"#],
        "temperature",
        "'temperature' must be a number",
    ),
    (
        CHAT,
        &[r#"{"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 3}"#],
        "presence_penalty",
        "'presence_penalty' must be in [-2, 2], got 3",
    ),
];

/// The completions route.
const C: &str = "/v1/completions";
/// The chat route.
const CHAT: &str = "/v1/chat/completions";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_bad_input_and_load() {
    let f = model();
    let s = serve(&f.model, &["--parallel", "4"]);
    let url = s.url.clone();
    let health: Value = client()
        .get(format!("{url}/health"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(health["status"], "ok");

    // Bad input: a 4xx with an OpenAI-style error body.
    let cases = [
        ("{not json", 400, None),
        (r#"[1, 2]"#, 400, None),
        (r#"{"prompt": 5}"#, 400, Some("prompt")),
        (
            r#"{"prompt": "hi", "max_tokens": "ten"}"#,
            400,
            Some("max_tokens"),
        ),
        (
            r#"{"prompt": "hi", "max_tokens": 0}"#,
            400,
            Some("max_tokens"),
        ),
        (
            r#"{"prompt": "hi", "max_tokens": 100000}"#,
            400,
            Some("max_tokens"),
        ),
        (
            r#"{"prompt": "hi", "temperature": 7}"#,
            400,
            Some("temperature"),
        ),
        (r#"{"prompt": "hi", "mirostat": 3}"#, 400, Some("mirostat")),
        (
            r#"{"prompt": "hi", "dry_base": 0.5}"#,
            400,
            Some("dry_base"),
        ),
        (
            r#"{"prompt": "hi", "dry_sequence_breakers": 5}"#,
            400,
            Some("dry_sequence_breakers"),
        ),
        (
            r#"{"prompt": "hi", "typical_p": 0}"#,
            400,
            Some("typical_p"),
        ),
        (
            r#"{"prompt": "hi", "logit_bias": {"x": 1}}"#,
            400,
            Some("logit_bias"),
        ),
        (
            r#"{"prompt": "hi", "logit_bias": {"5": 300}}"#,
            400,
            Some("logit_bias"),
        ),
        (r#"{"prompt": "hi", "model": "other"}"#, 404, Some("model")),
    ];
    for (body, status, param) in cases {
        let (s, v) = post(&url, "/v1/completions", body).await;
        assert_eq!(s, status, "{body}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{v}"
        );
        assert_eq!(v["error"]["param"].as_str(), param, "{body}: {v}");
    }
    let long = "word ".repeat(600);
    let (s, v) = post(
        &url,
        "/v1/completions",
        &json!({"prompt": long}).to_string(),
    )
    .await;
    assert_eq!(s, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("context"),
        "{v}"
    );
    let (s, v) = post(&url, "/v1/chat/completions", r#"{"messages": []}"#).await;
    assert_eq!(s, 400, "{v}");
    // Fields of the wrong kind or out of range: a 400 that names the field, in `param` and in
    // the message.
    for &(path, bodies, param, message) in MALFORMED {
        for body in bodies {
            let (s, v) = post(&url, path, body).await;
            assert_eq!(s, 400, "{body}: {v}");
            assert_eq!(v["error"]["param"].as_str(), Some(param), "{body}: {v}");
            if message.is_empty() {
                // Said per body below.
                assert!(v["error"]["message"].is_string(), "{body}: {v}");
            } else {
                assert_eq!(v["error"]["message"], message, "{body}: {v}");
            }
            assert_eq!(v["error"]["type"], "invalid_request_error", "{body}: {v}");
        }
    }
    // An open range is written as one, not with the smallest double.
    for (body, says) in [
        (
            r#"{"prompt": "hi", "top_p": 2}"#,
            "'top_p' must be in (0, 1], got 2",
        ),
        (
            r#"{"prompt": "hi", "top_p": 0}"#,
            "'top_p' must be in (0, 1], got 0",
        ),
        (
            r#"{"prompt": "hi", "mirostat_eta": 0}"#,
            "'mirostat_eta' must be in (0, 10], got 0",
        ),
    ] {
        let (_, v) = post(&url, "/v1/completions", body).await;
        assert_eq!(v["error"]["message"], says, "{body}: {v}");
    }
    // `false` asks for no log probabilities.
    let (s, v) = post(
        &url,
        "/v1/chat/completions",
        r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": false}"#,
    )
    .await;
    assert_eq!(s, 200, "{v}");
    // A route asked with the wrong method: 405 with an OpenAI-style error body.
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let r = client().get(format!("{url}{path}")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 405, "{path}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "method_not_allowed", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("GET"),
            "{v}"
        );
    }
    // Unknown fields are ignored, and so is a model name that is not a string.
    let (s, v) = post(
        &url,
        "/v1/completions",
        r#"{"prompt": "hi", "max_tokens": 2, "user": "me", "echo": false, "model": 5,
            "suffix": {"x": [1]}}"#,
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = post(
        &url,
        "/v1/chat/completions",
        r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}],
            "name": "me"}], "max_tokens": 2, "user": "me"}"#,
    )
    .await;
    assert_eq!(s, 200, "{v}");
    // The other samplers are taken.
    let (s, v) = post(
        &url,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 4, "mirostat": 2, "typical_p": 0.9,
                "xtc_probability": 0.5, "logit_bias": {"5": -100, "7": 2.5},
                "dry_multiplier": 0.8, "dry_sequence_breakers": ["\n", "."]})
        .to_string(),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let (s, _) = post(&url, "/v1/nothing", "{}").await;
    assert_eq!(s, 404);

    // A greedy request's text is the same alone and among 8 concurrent ones.
    let prompts: Vec<String> = (0..8).map(|i| format!("story number {i}")).collect();
    let mut alone = Vec::new();
    for p in &prompts {
        alone.push(greedy(&url, p, 12).await);
    }
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (u, p) = (url.clone(), p.clone());
            tokio::spawn(async move { greedy(&u, &p, 12).await })
        })
        .collect();
    for (h, want) in handles.into_iter().zip(&alone) {
        assert_eq!(&h.await.unwrap(), want);
    }

    let metrics = client()
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for key in [
        "powerinfer_requests_total{status=\"200\"}",
        "powerinfer_requests_total{status=\"400\"}",
        "powerinfer_generated_tokens_total",
        "powerinfer_queue_length",
        "powerinfer_live_sequences",
        "powerinfer_ffn_density",
        "powerinfer_tokens_per_second",
    ] {
        assert!(metrics.contains(key), "{key} missing:\n{metrics}");
    }
    // The decoding thread's account: batches evaluated, with at least one sequence each and
    // never more than the slots.
    let value = |name: &str| -> f64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} missing:\n{metrics}"))
    };
    assert!(value("powerinfer_steps_total") > 0.0);
    assert!(value("powerinfer_step_seconds_total") > 0.0);
    let busy = value("powerinfer_busy_slots_per_step");
    assert!((1.0..=4.0).contains(&busy), "{busy}");
    assert!(value("powerinfer_tokens_per_step") >= busy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_queue_bound_and_disconnects() {
    let f = model();
    let s = serve(
        &f.model,
        &["--parallel", "1", "--queue", "1", "--api-key", "secret"],
    );
    let url = s.url.clone();
    let body = json!({"prompt": "hello", "max_tokens": 4}).to_string();
    // Every /v1 route needs the key (a wrong one too is refused); the others do not.
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let v1 = [
        ("/v1/models", None),
        (
            "/v1/completions",
            Some(json!({"prompt": "hi", "max_tokens": 2})),
        ),
        ("/v1/chat/completions", Some(chat)),
    ];
    for (path, body) in &v1 {
        for key in [None, Some("wrong"), Some("secret")] {
            let mut r = match body {
                None => client().get(format!("{url}{path}")),
                Some(b) => client().post(format!("{url}{path}")).json(b),
            };
            if let Some(k) = key {
                r = r.bearer_auth(k);
            }
            let r = r.send().await.unwrap();
            let status = r.status().as_u16();
            let v: Value = r.json().await.unwrap();
            if key == Some("secret") {
                assert_eq!(status, 200, "{path}: {v}");
            } else {
                assert_eq!(status, 401, "{path} with {key:?}: {v}");
                assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
            }
        }
    }
    for path in ["/health", "/metrics", "/"] {
        let r = client().get(format!("{url}{path}")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200, "{path}");
    }
    let (status, v) = post(&url, "/v1/nothing", "{}").await;
    assert_eq!(status, 404, "{v}");
    let authed = |body: String| {
        let url = url.clone();
        async move {
            let r = client()
                .post(format!("{url}/v1/completions"))
                .bearer_auth("secret")
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r)
        }
    };
    let (st, _) = authed(body.clone()).await;
    assert_eq!(st, 200);

    // One slot and one queue place: of 5 long requests at once, some get 429.
    let long = json!({"prompt": "go", "max_tokens": 400, "temperature": 0}).to_string();
    let tasks: Vec<_> = (0..5).map(|_| tokio::spawn(authed(long.clone()))).collect();
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap().0);
    }
    assert!(statuses.contains(&429), "{statuses:?}");
    assert!(statuses.contains(&200), "{statuses:?}");

    // A streaming client that goes away frees the slot: the next request runs at once.
    let stream_body =
        json!({"prompt": "go", "max_tokens": 450, "stream": true, "temperature": 0}).to_string();
    let (st, mut r) = authed(stream_body).await;
    assert_eq!(st, 200);
    let first = r.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).starts_with("data: "));
    drop(r);
    let t0 = std::time::Instant::now();
    let (st, _) = authed(json!({"prompt": "next", "max_tokens": 2}).to_string()).await;
    assert_eq!(st, 200);
    assert!(t0.elapsed() < Duration::from_secs(20));
    let metrics = client()
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("powerinfer_cancelled_total 1"),
        "{metrics}"
    );
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/py")
        .join(name)
}

#[test]
fn the_openai_python_client_works() {
    let Some(py) = python_with("openai") else {
        return;
    };
    let f = model();
    let s = serve(&f.model, &["--parallel", "2"]);
    let out = Command::new(py)
        .arg(script("openai_client.py"))
        .args([&s.url, "m.powerinfer.gguf"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["unknown_model"], "NotFoundError");
}

#[test]
fn the_chat_page_streams_in_headless_chromium() {
    let have =
        Path::new("/usr/bin/chromium").exists() && Path::new("/usr/bin/chromedriver").exists();
    if !have {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI installs chromium and chromium-driver (.ci/run)"
        );
        println!("skipped: no /usr/bin/chromium and /usr/bin/chromedriver");
        return;
    }
    let Some(py) = python_with("selenium") else {
        return;
    };
    let f = model();
    // A slow simulated device makes the stream last long enough to watch it grow.
    let s = serve(
        &f.model,
        &["--gpu", "sim", "--sim-bandwidth", "0.05", "-c", "1024"],
    );
    let out = Command::new(py)
        .arg(script("chat_page.py"))
        .arg(&s.url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two replicas behind nginx (deploy/nginx.conf): the `openai` client goes through nginx, one
/// replica is stopped mid-run, and every request still succeeds.
#[test]
fn replicas_behind_nginx_survive_one_stopping() {
    let nginx = Path::new("/usr/sbin/nginx");
    if !nginx.exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI installs nginx (.ci/run)"
        );
        println!("skipped: no /usr/sbin/nginx");
        return;
    }
    let Some(py) = python_with("openai") else {
        return;
    };
    let f = model();
    let mut a = serve(&f.model, &["--alias", "m"]);
    let b = serve(&f.model, &["--alias", "m"]);
    let port = |s: &Server| s.url.rsplit(':').next().unwrap().to_string();
    let prefix = tempfile::tempdir().unwrap();
    for d in ["client_body", "proxy", "fastcgi", "uwsgi", "scgi"] {
        std::fs::create_dir_all(prefix.path().join(d)).unwrap();
    }
    let front = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let upstreams: String = [&a, &b]
        .iter()
        .map(|s| {
            format!(
                "        server 127.0.0.1:{} max_fails=1 fail_timeout=10s;\n",
                port(s)
            )
        })
        .collect();
    let template =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/nginx.conf"))
            .unwrap();
    let conf = template
        .replace("@PORT@", &front.to_string())
        .replace("@PREFIX@", prefix.path().to_str().unwrap())
        .replace("@UPSTREAMS@", upstreams.trim_end());
    let conf_path = prefix.path().join("nginx.conf");
    std::fs::write(&conf_path, conf).unwrap();
    let mut proxy = Command::new(nginx)
        .arg("-p")
        .arg(prefix.path())
        .arg("-c")
        .arg(&conf_path)
        .args(["-g", "daemon off;"])
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{front}");
    // Until nginx answers.
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", front)).is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut client = Command::new(py)
        .arg(script("through_proxy.py"))
        .args([&url, "m", "24"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(client.stdout.take().unwrap()).lines();
    let mut results = Vec::new();
    for line in lines.by_ref() {
        results.push(line.unwrap());
        if results.len() == 8 {
            // One replica goes away mid-run.
            let _ = a.child.kill();
            let _ = a.child.wait();
        }
    }
    client.wait().unwrap();
    let _ = proxy.kill();
    let _ = proxy.wait();
    drop(b);
    assert_eq!(results.len(), 24, "{results:?}");
    let failed: Vec<&String> = results.iter().filter(|l| !l.starts_with("ok")).collect();
    assert!(failed.is_empty(), "{failed:?}");
}

/// `bench serve`: a bounded load test against a server it starts; every request succeeds, the
/// prompt tokens the server evaluated are counted beside the generated ones.
#[test]
fn bench_serve_reports_throughput_and_latency() {
    let f = model();
    let out = Command::new(env!("CARGO_BIN_EXE_powerinfer"))
        .args(["bench", "serve", "-m"])
        .arg(&f.model)
        .args([
            "--clients",
            "4",
            "--requests",
            "8",
            "--max-tokens",
            "4",
            "--parallel",
            "2",
            "-t",
            "1",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["failed"], 0, "{v}");
    assert_eq!(v["requests"], 8, "{v}");
    let tokens = v["tokens"].as_u64().unwrap();
    assert!(tokens > 0 && tokens <= 32, "{v}");
    assert!(v["prompt_tokens"].as_u64().unwrap() >= 8, "{v}");
    assert!(
        v["evaluated_tokens_per_second"].as_f64().unwrap()
            > v["tokens_per_second"].as_f64().unwrap(),
        "{v}"
    );
    assert!(v["ttft_ms_p99"].as_f64().unwrap() >= v["ttft_ms_p50"].as_f64().unwrap());
    // `--prompt`: the same prompt to /v1/completions (as `batched -p`).
    let out = Command::new(env!("CARGO_BIN_EXE_powerinfer"))
        .args(["bench", "serve", "-m"])
        .arg(&f.model)
        .args([
            "--clients",
            "2",
            "--requests",
            "4",
            "--max-tokens",
            "3",
            "--parallel",
            "2",
            "-t",
            "1",
            "--prompt",
            "hello there",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["failed"], 0, "{v}");
    assert!(v["tokens"].as_u64().unwrap() > 0, "{v}");
    // Every request evaluates the same prompt.
    assert_eq!(v["prompt_tokens"].as_u64().unwrap() % 4, 0, "{v}");
}
