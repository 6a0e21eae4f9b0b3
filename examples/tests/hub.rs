//! `-hf REPO[:FILE]`: models from the Hugging Face Hub, against a Hub played by a local server
//! in this test (file list, HEAD/GET on `resolve/`, LFS files behind a redirect with their
//! sha256, a transfer that breaks off, a wrong checksum, a private repository, missing ones).
//! No test reaches the network.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use powerinfer_cli::hub::{self, HubError, HubModel, HubOptions};
use sha2::{Digest, Sha256};

#[path = "support/cli.rs"]
mod cli;
#[path = "support/python.rs"]
mod python;

/// The commit every repository of the fake Hub is at.
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// A file of the fake Hub.
struct HubFile {
    content: Vec<u8>,
    /// Stored in LFS: served from `/cdn/SHA256` behind a redirect, with `X-Linked-Etag`.
    lfs: bool,
    /// The sha256 published for it, when not its own (a corrupt upload).
    published_sha: Option<String>,
    /// Transfers of it that break off halfway before one completes.
    breaks: AtomicUsize,
}

impl HubFile {
    fn new(content: Vec<u8>, lfs: bool) -> HubFile {
        HubFile {
            content,
            lfs,
            published_sha: None,
            breaks: AtomicUsize::new(0),
        }
    }

    fn sha256(&self) -> String {
        hex(&Sha256::digest(&self.content))
    }

    /// The ETag: the published sha256 of an LFS file, a git-like id of a small one.
    fn etag(&self) -> String {
        match (&self.published_sha, self.lfs) {
            (Some(s), _) => s.clone(),
            (None, true) => self.sha256(),
            (None, false) => self.sha256()[..40].to_string(),
        }
    }
}

/// One request the fake Hub received.
#[derive(Clone, Debug)]
struct Seen {
    method: String,
    path: String,
    range: Option<String>,
    auth: Option<String>,
}

/// The fake Hub: repositories of files, a private one, and what it was asked.
#[derive(Default)]
struct FakeHub {
    repos: HashMap<String, Vec<(String, HubFile)>>,
    /// Repositories that need `Authorization: Bearer secret`.
    private: Vec<String>,
    seen: Mutex<Vec<Seen>>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl FakeHub {
    fn add(&mut self, repo: &str, path: &str, file: HubFile) {
        self.repos
            .entry(repo.into())
            .or_default()
            .push((path.into(), file));
    }

    fn file(&self, repo: &str, path: &str) -> Option<&HubFile> {
        self.repos
            .get(repo)?
            .iter()
            .find(|(p, _)| p == path)
            .map(|(_, f)| f)
    }

    fn by_sha(&self, sha: &str) -> Option<&HubFile> {
        self.repos
            .values()
            .flatten()
            .map(|(_, f)| f)
            .find(|f| f.lfs && f.etag() == sha)
    }

    fn log(&self, method: &Method, path: &str, h: &HeaderMap) {
        let text = |k: &str| h.get(k).and_then(|v| v.to_str().ok()).map(String::from);
        self.seen.lock().unwrap().push(Seen {
            method: method.to_string(),
            path: path.into(),
            range: text("range"),
            auth: text("authorization"),
        });
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// 401 for a private repository asked without the token.
    fn refuse(&self, repo: &str, h: &HeaderMap) -> Option<Response> {
        let authorized = h
            .get("authorization")
            .is_some_and(|v| v.as_bytes() == b"Bearer secret");
        (self.private.iter().any(|p| p == repo) && !authorized).then(|| {
            (
                StatusCode::UNAUTHORIZED,
                [("x-error-code", "RepoNotFound")],
                "Invalid credentials",
            )
                .into_response()
        })
    }
}

fn not_found(what: &str) -> Response {
    (
        StatusCode::NOT_FOUND,
        [("x-error-code", what.to_string())],
        "",
    )
        .into_response()
}

async fn tree(
    State(hub): State<Arc<FakeHub>>,
    UrlPath((owner, name)): UrlPath<(String, String)>,
    method: Method,
    h: HeaderMap,
) -> Response {
    let repo = format!("{owner}/{name}");
    hub.log(&method, &format!("/api/models/{repo}/tree/main"), &h);
    if let Some(r) = hub.refuse(&repo, &h) {
        return r;
    }
    let Some(files) = hub.repos.get(&repo) else {
        return not_found("RepoNotFound");
    };
    let mut list: Vec<serde_json::Value> = files
        .iter()
        .map(|(p, f)| {
            let mut e = serde_json::json!({"type": "file", "oid": f.etag(), "size": f.content.len(),
                                           "path": p});
            if f.lfs {
                e["lfs"] = serde_json::json!({"oid": f.etag(), "size": f.content.len(),
                                               "pointerSize": 130});
            }
            e
        })
        .collect();
    list.push(
        serde_json::json!({"type": "directory", "oid": "x", "size": 0, "path": "activation"}),
    );
    axum::Json(list).into_response()
}

async fn resolve(
    State(hub): State<Arc<FakeHub>>,
    UrlPath((owner, name, rev, path)): UrlPath<(String, String, String, String)>,
    method: Method,
    h: HeaderMap,
) -> Response {
    let repo = format!("{owner}/{name}");
    hub.log(&method, &format!("/{repo}/resolve/{rev}/{path}"), &h);
    if let Some(r) = hub.refuse(&repo, &h) {
        return r;
    }
    if rev != "main" && rev != COMMIT {
        return not_found("RevisionNotFound");
    }
    let Some(f) = hub.file(&repo, &path) else {
        return not_found("EntryNotFound");
    };
    let size = f.content.len().to_string();
    if f.lfs {
        // Another host (the same server by another name), as the Hub's storage is: clients
        // take the metadata from this answer and send no token there.
        let host = h.get("host").and_then(|v| v.to_str().ok()).unwrap_or("");
        let storage = host.replace("127.0.0.1", "localhost");
        return (
            StatusCode::FOUND,
            [
                ("location", format!("http://{storage}/cdn/{}", f.etag())),
                ("x-repo-commit", COMMIT.into()),
                ("x-linked-etag", format!("\"{}\"", f.etag())),
                ("x-linked-size", size),
                ("etag", "\"not-the-content\"".into()),
            ],
        )
            .into_response();
    }
    let headers = [
        ("x-repo-commit", COMMIT.to_string()),
        ("etag", format!("\"{}\"", f.etag())),
        ("content-length", size),
    ];
    if method == Method::HEAD {
        return (StatusCode::OK, headers).into_response();
    }
    (StatusCode::OK, headers, f.content.clone()).into_response()
}

async fn cdn(
    State(hub): State<Arc<FakeHub>>,
    UrlPath(sha): UrlPath<String>,
    method: Method,
    h: HeaderMap,
) -> Response {
    hub.log(&method, &format!("/cdn/{sha}"), &h);
    let Some(f) = hub.by_sha(&sha) else {
        return not_found("EntryNotFound");
    };
    let start = h
        .get("range")
        .and_then(|v| v.to_str().ok())
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse::<usize>().ok())
        .filter(|&n| n < f.content.len());
    let (status, body) = match start {
        Some(n) => (StatusCode::PARTIAL_CONTENT, f.content[n..].to_vec()),
        None => (StatusCode::OK, f.content.clone()),
    };
    let len = body.len();
    let mut headers = vec![("content-length", len.to_string())];
    if let Some(n) = start {
        headers.push((
            "content-range",
            format!("bytes {n}-{}/{}", f.content.len() - 1, f.content.len()),
        ));
    }
    let breaks_now = f
        .breaks
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| b.checked_sub(1))
        .is_ok();
    let body = if breaks_now {
        // Half the bytes (given time to leave), then the connection drops.
        use futures_util::StreamExt;
        let half = Bytes::from(body[..len / 2].to_vec());
        let first = futures_util::stream::iter([Ok::<_, std::io::Error>(half)]);
        let drop = futures_util::stream::once(async {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            Err(std::io::Error::other("connection dropped"))
        });
        Body::from_stream(first.chain(drop))
    } else {
        Body::from(body)
    };
    let mut r = (status, body).into_response();
    for (k, v) in headers {
        r.headers_mut().insert(k, v.parse().unwrap());
    }
    r
}

/// Serves `hub` on a free loopback port from a thread of its own; its address.
fn serve(hub: Arc<FakeHub>) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let app = Router::new()
                .route("/api/models/{owner}/{name}/tree/main", get(tree))
                .route("/{owner}/{name}/resolve/{rev}/{*path}", get(resolve))
                .route("/cdn/{sha}", get(cdn))
                .with_state(hub);
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    url
}

/// A Hub with `owner/model` (a real tiny PowerInfer model, its dense twin and its statistics
/// in LFS, a small README), `owner/two` (two PowerInfer files), `owner/private`,
/// `owner/corrupt` (a published sha256 that is not the file's) and `owner/flaky` (a file whose
/// first transfer breaks off).
fn fake_hub() -> (FakeHub, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let (model, dense) = cli::tiny_with_twin(dir.path(), "3");
    let read = |p: &Path| std::fs::read(p).unwrap();
    let mut hub = FakeHub::default();
    hub.add(
        "owner/model",
        "README.md",
        HubFile::new(b"# a model\n".to_vec(), false),
    );
    hub.add(
        "owner/model",
        "m.powerinfer.gguf",
        HubFile::new(read(&model), true),
    );
    hub.add("owner/model", "m.gguf", HubFile::new(read(&dense), true));
    for l in 0..2 {
        let name = format!("activation/activation_{l}.pt");
        hub.add(
            "owner/model",
            &name,
            HubFile::new(read(&dir.path().join(&name)), true),
        );
    }
    hub.add(
        "owner/two",
        "a.powerinfer.gguf",
        HubFile::new(vec![1; 100], true),
    );
    hub.add(
        "owner/two",
        "a.q4.powerinfer.gguf",
        HubFile::new(vec![2; 100], true),
    );
    hub.add("owner/private", "p.gguf", HubFile::new(vec![3; 64], true));
    hub.private.push("owner/private".into());
    let mut corrupt = HubFile::new(vec![4; 5000], true);
    corrupt.published_sha = Some(hex(&Sha256::digest(b"other bytes")));
    hub.add("owner/corrupt", "c.gguf", corrupt);
    let flaky = HubFile::new((0..200_000u32).map(|i| (i % 251) as u8).collect(), true);
    flaky.breaks.store(1, Ordering::SeqCst);
    hub.add("owner/flaky", "f.gguf", flaky);
    (hub, dir)
}

fn options(url: &str, cache: &Path) -> HubOptions {
    HubOptions {
        endpoint: url.into(),
        token: None,
        offline: false,
        cache_dir: cache.into(),
    }
}

fn fetch(spec: &str, o: &HubOptions) -> Result<PathBuf, HubError> {
    let m: HubModel = spec.parse().unwrap();
    hub::fetch_blocking(&m, o, &mut |_, _| {})
}

/// The repository's model file and its statistics land in the Hub's cache layout; a second
/// fetch asks nothing but the metadata; offline, the cache answers without a request.
#[test]
fn a_model_and_its_statistics_land_in_the_hub_cache() {
    let (fake, _files) = fake_hub();
    let want = fake.file("owner/model", "m.powerinfer.gguf").unwrap();
    let (sha, bytes) = (want.sha256(), want.content.clone());
    let hub = Arc::new(fake);
    let url = serve(hub.clone());
    let cache = tempfile::tempdir().unwrap();
    let o = options(&url, cache.path());
    let mut reported = 0;
    let m: HubModel = "owner/model".parse().unwrap();
    let path = hub::fetch_blocking(&m, &o, &mut |n, _| reported += n).unwrap();
    // The PowerInfer file is chosen over the dense one; its statistics sit beside it.
    let repo = cache.path().join("models--owner--model");
    let snapshot = repo.join("snapshots").join(COMMIT);
    assert_eq!(path, snapshot.join("m.powerinfer.gguf"));
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    assert_eq!(
        std::fs::read_link(&path).unwrap(),
        Path::new("../../blobs").join(&sha)
    );
    assert_eq!(std::fs::read(repo.join("blobs").join(&sha)).unwrap(), bytes);
    assert_eq!(
        std::fs::read_to_string(repo.join("refs/main")).unwrap(),
        COMMIT
    );
    for l in 0..2 {
        let stats = snapshot.join(format!("activation/activation_{l}.pt"));
        let link = std::fs::read_link(&stats).unwrap();
        assert!(link.starts_with("../../../blobs"), "{link:?}");
        assert!(std::fs::metadata(&stats).unwrap().len() > 0);
    }
    assert!(
        !snapshot.join("m.gguf").exists(),
        "only the chosen model file"
    );
    assert!(!snapshot.join("README.md").exists());
    let got = hub.seen();
    assert!(got.iter().all(|s| s.auth.is_none()), "{got:?}");
    // Metadata by HEAD; the bytes of LFS files from where the redirect points.
    assert!(
        got.iter()
            .filter(|s| s.path.contains("/resolve/"))
            .all(|s| s.method == "HEAD"),
        "{got:?}"
    );
    let downloads = |seen: &[Seen]| seen.iter().filter(|s| s.path.starts_with("/cdn/")).count();
    assert_eq!(downloads(&got), 3, "{got:?}");
    let total: u64 = [
        "m.powerinfer.gguf",
        "activation/activation_0.pt",
        "activation/activation_1.pt",
    ]
    .iter()
    .map(|p| std::fs::metadata(snapshot.join(p)).unwrap().len())
    .sum();
    assert_eq!(reported, total);

    // Again: nothing downloaded.
    assert_eq!(fetch("owner/model", &o).unwrap(), path);
    assert_eq!(downloads(&hub.seen()), 3);
    // Offline: the cache, no request; a repository it lacks is a clear error.
    let before = hub.seen().len();
    let offline = HubOptions {
        offline: true,
        ..o.clone()
    };
    assert_eq!(fetch("owner/model", &offline).unwrap(), path);
    assert_eq!(
        fetch("owner/model:m.powerinfer.gguf", &offline).unwrap(),
        path
    );
    let err = fetch("owner/two", &offline).unwrap_err().to_string();
    assert!(
        err.contains("owner/two is not in the cache") && err.contains("HF_HUB_OFFLINE"),
        "{err}"
    );
    assert!(matches!(
        fetch("owner/model:m.gguf", &offline),
        Err(HubError::NotCached { .. })
    ));
    assert_eq!(hub.seen().len(), before, "offline made a request");
    // A file named explicitly.
    let dense = fetch("owner/model:m.gguf", &o).unwrap();
    assert_eq!(dense, snapshot.join("m.gguf"));
}

/// No file named and several model files: the error lists them; a file or repository that
/// is not there is a clear error.
#[test]
fn ambiguous_and_missing_models_are_said() {
    let (fake, _files) = fake_hub();
    let url = serve(Arc::new(fake));
    let cache = tempfile::tempdir().unwrap();
    let o = options(&url, cache.path());
    let err = fetch("owner/two", &o).unwrap_err().to_string();
    assert!(
        err.contains("a.powerinfer.gguf, a.q4.powerinfer.gguf") && err.contains("owner/two:FILE"),
        "{err}"
    );
    assert!(matches!(
        fetch("owner/two:nope.gguf", &o),
        Err(HubError::NotFound { .. })
    ));
    let err = fetch("owner/nothing", &o).unwrap_err();
    assert!(matches!(err, HubError::NotFound { .. }), "{err}");
    assert!(err.to_string().contains("owner/nothing"), "{err}");
    // Nothing was written for them.
    assert!(!cache.path().join("models--owner--two/snapshots").exists());
}

/// A private repository: 401 without the token, which the error says to set; with it, the
/// token goes to the Hub as `Authorization: Bearer`.
#[test]
fn a_private_repository_needs_the_token() {
    let (fake, _files) = fake_hub();
    let hub = Arc::new(fake);
    let url = serve(hub.clone());
    let cache = tempfile::tempdir().unwrap();
    let mut o = options(&url, cache.path());
    let err = fetch("owner/private", &o).unwrap_err();
    assert!(
        matches!(err, HubError::Refused { status: 401, .. })
            && err.to_string().contains("HF_TOKEN"),
        "{err}"
    );
    o.token = Some("wrong".into());
    let err = fetch("owner/private", &o).unwrap_err().to_string();
    assert!(err.contains("not accepted"), "{err}");
    o.token = Some("secret".into());
    let path = fetch("owner/private", &o).unwrap();
    assert_eq!(std::fs::read(path).unwrap(), vec![3; 64]);
    let seen = hub.seen();
    // Not to the storage host the Hub redirects to.
    assert!(
        seen.iter()
            .filter(|s| s.path.starts_with("/cdn/"))
            .all(|s| s.auth.is_none()),
        "{seen:?}"
    );
    let hub_requests: Vec<&Seen> = seen
        .iter()
        .filter(|s| !s.path.starts_with("/cdn/"))
        .collect();
    assert!(
        hub_requests
            .iter()
            .rev()
            .take(2)
            .all(|s| s.auth.as_deref() == Some("Bearer secret")),
        "{seen:?}"
    );
}

/// A file whose bytes do not have the published sha256 is refused and removed: no blob, no
/// partial file, no snapshot link.
#[test]
fn a_wrong_checksum_is_refused_and_leaves_nothing() {
    let (fake, _files) = fake_hub();
    let url = serve(Arc::new(fake));
    let cache = tempfile::tempdir().unwrap();
    let o = options(&url, cache.path());
    let err = fetch("owner/corrupt", &o).unwrap_err();
    assert!(matches!(err, HubError::Checksum { .. }), "{err}");
    assert!(err.to_string().contains("sha256"), "{err}");
    let blobs = cache.path().join("models--owner--corrupt/blobs");
    assert_eq!(std::fs::read_dir(&blobs).unwrap().count(), 0);
    assert!(!cache
        .path()
        .join("models--owner--corrupt/snapshots")
        .exists());
}

/// A transfer that breaks off is resumed with a `Range` request from where it stopped, in the
/// same run; a partial file left by an earlier run is resumed too; both end with the right
/// bytes (the sha256 covers the part kept and the part received).
#[test]
fn broken_transfers_are_resumed_with_range_requests() {
    let (fake, _files) = fake_hub();
    let f = fake.file("owner/flaky", "f.gguf").unwrap();
    let (content, sha) = (f.content.clone(), f.sha256());
    let hub = Arc::new(fake);
    let url = serve(hub.clone());
    let cache = tempfile::tempdir().unwrap();
    let o = options(&url, cache.path());
    let path = fetch("owner/flaky", &o).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), content);
    let gets: Vec<Seen> = hub
        .seen()
        .into_iter()
        .filter(|s| s.path.starts_with("/cdn/"))
        .collect();
    assert_eq!(gets.len(), 2, "{gets:?}");
    assert_eq!(gets[0].range, None);
    let from: usize = gets[1]
        .range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{gets:?}"));
    assert!(from > 0 && from < content.len(), "{from}");

    // An earlier run left the first 1234 bytes.
    let cache = tempfile::tempdir().unwrap();
    let blobs = cache.path().join("models--owner--flaky/blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::write(blobs.join(format!("{sha}.incomplete")), &content[..1234]).unwrap();
    let before = hub.seen().len();
    let path = fetch("owner/flaky", &options(&url, cache.path())).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), content);
    let last = hub.seen()[before..]
        .iter()
        .filter(|s| s.path.starts_with("/cdn/"))
        .map(|s| s.range.clone())
        .collect::<Vec<_>>();
    assert_eq!(last, [Some("bytes=1234-".to_string())]);
    assert!(!blobs.join(format!("{sha}.incomplete")).exists());
}

/// The cache is huggingface_hub's own: it finds the files fetched here
/// (`try_to_load_from_cache`, `scan_cache_dir`), and what its `hf_hub_download` fetched from
/// the same Hub is found here offline.
#[test]
fn huggingface_hub_and_this_share_the_cache() {
    let Some(py) = python::python_with("huggingface_hub") else {
        return;
    };
    let (fake, _files) = fake_hub();
    let url = serve(Arc::new(fake));
    let cache = tempfile::tempdir().unwrap();
    let o = options(&url, cache.path());
    let ours = fetch("owner/model", &o).unwrap();
    let script = r#"
import json, sys
from huggingface_hub import try_to_load_from_cache, scan_cache_dir
cache = sys.argv[1]
found = try_to_load_from_cache("owner/model", "m.powerinfer.gguf", cache_dir=cache)
stats = try_to_load_from_cache("owner/model", "activation/activation_1.pt", cache_dir=cache)
info = scan_cache_dir(cache)
repos = [{"id": r.repo_id, "files": sorted(f.file_name for rev in r.revisions for f in rev.files),
          "refs": sorted(r.refs)} for r in info.repos]
print(json.dumps({"found": found, "stats": stats, "repos": repos,
                  "warnings": [str(w) for w in info.warnings]}))
"#;
    let out = Command::new(&py)
        .args(["-c", script])
        .arg(cache.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["found"], ours.to_str().unwrap(), "{v}");
    assert!(
        v["stats"]
            .as_str()
            .is_some_and(|s| s.ends_with("activation_1.pt")),
        "{v}"
    );
    assert_eq!(v["warnings"], serde_json::json!([]), "{v}");
    assert_eq!(
        v["repos"],
        serde_json::json!([{"id": "owner/model", "refs": ["main"],
            "files": ["activation_0.pt", "activation_1.pt", "m.powerinfer.gguf"]}]),
        "{v}"
    );

    // The other way: huggingface_hub downloads, this finds it offline.
    let theirs = tempfile::tempdir().unwrap();
    let script = r#"
import sys
from huggingface_hub import hf_hub_download
for f in ["m.powerinfer.gguf", "activation/activation_0.pt"]:
    print(hf_hub_download("owner/model", f, cache_dir=sys.argv[1]))
"#;
    let out = Command::new(&py)
        .args(["-c", script])
        .arg(theirs.path())
        .env("HF_ENDPOINT", &url)
        .env("HF_HUB_DISABLE_TELEMETRY", "1")
        .env_remove("HF_TOKEN")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let downloaded = String::from_utf8_lossy(&out.stdout);
    let offline = HubOptions {
        offline: true,
        ..options(&url, theirs.path())
    };
    let found = fetch("owner/model", &offline).unwrap();
    assert_eq!(
        found.to_str().unwrap(),
        downloaded.lines().next().unwrap(),
        "{downloaded}"
    );
    assert_eq!(
        std::fs::read(&found).unwrap(),
        std::fs::read(&ours).unwrap()
    );
}

/// `powerinfer run -hf` and `plan -hf` as a user runs them: HF_ENDPOINT and HF_HOME from the
/// environment, the model fetched with its statistics (plan places neurons from them), then
/// HF_HUB_OFFLINE=1 runs from the cache and refuses what it lacks.
#[test]
fn run_and_plan_take_a_model_from_the_hub() {
    let (fake, _files) = fake_hub();
    let url = serve(Arc::new(fake));
    let home = tempfile::tempdir().unwrap();
    let powerinfer = |args: &[&str], offline: bool| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_powerinfer"));
        c.args(args)
            .env("HF_ENDPOINT", &url)
            .env("HF_HOME", home.path())
            .env_remove("HF_HUB_CACHE")
            .env_remove("HF_TOKEN")
            .stdin(Stdio::null());
        if offline {
            c.env("HF_HUB_OFFLINE", "1");
        } else {
            c.env_remove("HF_HUB_OFFLINE");
        }
        c.output().unwrap()
    };
    let o = powerinfer(
        &[
            "run",
            "-hf",
            "owner/model",
            "-n",
            "3",
            "--temp",
            "0",
            "--gpu",
            "none",
            "-t",
            "1",
        ],
        false,
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let snapshot = home
        .path()
        .join("hub/models--owner--model/snapshots")
        .join(COMMIT);
    assert!(
        err.contains(&format!(
            "model: {}",
            snapshot.join("m.powerinfer.gguf").display()
        )),
        "{err}"
    );
    assert!(!o.stdout.is_empty());
    let o = powerinfer(
        &[
            "plan",
            "--hf-repo",
            "owner/model",
            "--vram-budget",
            "0.005",
            "--json",
        ],
        true,
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains("no activation statistics"), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["layers"][0]["gpu_neurons"].as_u64().unwrap() > 0, "{v}");
    let o = powerinfer(&["run", "-hf", "owner/two", "-n", "1"], true);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("HF_HUB_OFFLINE"), "{err}");
    // -m and -hf are one or the other; serve needs one of them.
    let o = powerinfer(&["serve", "-m", "x.gguf", "-hf", "owner/model"], true);
    assert_eq!(o.status.code(), Some(2));
    let o = powerinfer(&["serve"], true);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--model") && err.contains("--hf-repo"),
        "{err}"
    );
}
