//! Models from the Hugging Face Hub: `-hf REPO[:FILE]` fetches a repository's model file and
//! its `activation/` statistics into the Hub's own cache, so that files `huggingface-cli`
//! fetched are found here and the files fetched here are found by it.
//!
//! The cache is `huggingface_hub`'s layout: under the cache folder, `models--OWNER--NAME/`
//! holds `blobs/ETAG` (the bytes, named by their ETag: the sha256 of an LFS file),
//! `snapshots/COMMIT/PATH` (a relative symbolic link to the blob; a copy where links are not
//! available) and `refs/main` (the commit `main` pointed to). A download in progress is
//! `blobs/ETAG.incomplete`; it is resumed with an HTTP `Range` request, by a later run or
//! when the connection drops. The sha256 the Hub publishes for an LFS file
//! (`X-Linked-Etag`) is checked against the bytes received; a file that does not match is
//! removed and refused.
//!
//! Nothing here reads the environment: [`HubOptions`] says where the Hub and the cache are,
//! the token, and whether to stay offline; [`HubOptions::from_env`] is how the `powerinfer`
//! command fills it (`HF_ENDPOINT`, `HF_TOKEN`, `HF_HUB_OFFLINE`, `HF_HUB_CACHE`, `HF_HOME`,
//! as `huggingface_hub` reads them).

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use reqwest::header::{HeaderMap, AUTHORIZATION, CONTENT_LENGTH, ETAG, LOCATION, RANGE};
use reqwest::StatusCode;
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// Where the Hub is, who asks, and where its files are kept.
#[derive(Clone, Debug)]
pub struct HubOptions {
    /// The Hub's address (`https://huggingface.co`).
    pub endpoint: String,
    /// An access token, sent as `Authorization: Bearer` to the Hub (private and gated
    /// repositories).
    pub token: Option<String>,
    /// Use only what the cache holds; no request is made.
    pub offline: bool,
    /// The cache folder (`~/.cache/huggingface/hub`).
    pub cache_dir: PathBuf,
}

/// The Hub's address when `HF_ENDPOINT` does not give one.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

impl HubOptions {
    /// The options `huggingface_hub` takes from the environment: `HF_ENDPOINT`; `HF_TOKEN`,
    /// else the token file (`HF_TOKEN_PATH`, else `$HF_HOME/token`); `HF_HUB_OFFLINE` (`1`,
    /// `ON`, `YES` or `TRUE`); the cache `HF_HUB_CACHE`, else `$HF_HOME/hub`, where `HF_HOME`
    /// defaults to `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`.
    pub fn from_env() -> HubOptions {
        let var = crate::env::var;
        let home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            crate::env::cache_home()
                .unwrap_or_else(std::env::temp_dir)
                .join("huggingface")
        });
        let token = var("HF_TOKEN").or_else(|| {
            let file = var("HF_TOKEN_PATH").map_or_else(|| home.join("token"), PathBuf::from);
            std::fs::read_to_string(file)
                .ok()
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
        });
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            ["1", "ON", "YES", "TRUE"].contains(&v.trim().to_ascii_uppercase().as_str())
        });
        HubOptions {
            endpoint: var("HF_ENDPOINT").unwrap_or_else(|| DEFAULT_ENDPOINT.into()),
            token,
            offline,
            cache_dir: var("HF_HUB_CACHE")
                .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
                .map_or_else(|| home.join("hub"), PathBuf::from),
        }
    }
}

/// A model on the Hub: `OWNER/NAME`, and the file in it (`None`: chosen from its file list, see
/// [`choose_model_file`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubModel {
    /// `OWNER/NAME`.
    pub repo: String,
    /// The model file's path in the repository.
    pub file: Option<String>,
}

impl FromStr for HubModel {
    type Err = String;

    /// `OWNER/NAME` or `OWNER/NAME:FILE`.
    fn from_str(s: &str) -> Result<HubModel, String> {
        let (repo, file) = match s.split_once(':') {
            Some((r, f)) => (r, Some(f)),
            None => (s, None),
        };
        let part_ok = |p: &str| {
            !p.is_empty()
                && p.len() <= 96
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                && !p.starts_with(['.', '-'])
                && !p.ends_with('.')
                && !p.contains("..")
        };
        match repo.split_once('/') {
            Some((owner, name)) if part_ok(owner) && part_ok(name) => {}
            _ => {
                return Err(format!(
                    "`{s}`: expected OWNER/NAME or OWNER/NAME:FILE (e.g. \
                     PowerInfer/ReluLLaMA-7B-PowerInfer-GGUF)"
                ))
            }
        }
        let file = match file {
            Some(f) if safe_relative_path(f) => Some(f.to_string()),
            Some(f) => return Err(format!("`{f}`: not a file path inside a repository")),
            None => None,
        };
        Ok(HubModel {
            repo: repo.to_string(),
            file,
        })
    }
}

/// Why a model could not be fetched.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HubError {
    /// The Hub refused the request for want of (valid) credentials.
    #[error("{repo}: the Hub answered {status}: {message}")]
    Refused {
        /// The repository.
        repo: String,
        /// 401 or 403.
        status: u16,
        /// What to do about it.
        message: String,
    },
    /// No such repository or file.
    #[error("{what}: not found on the Hub ({url})")]
    NotFound {
        /// The repository or file.
        what: String,
        /// What was asked.
        url: String,
    },
    /// Another HTTP error.
    #[error("{url}: the Hub answered {status}{}", detail(.message))]
    Http {
        /// What was asked.
        url: String,
        /// The status.
        status: u16,
        /// The Hub's message, if any.
        message: String,
    },
    /// The request failed (connection, timeout).
    #[error("{url}: {source}")]
    Request {
        /// What was asked.
        url: String,
        /// Why.
        source: reqwest::Error,
    },
    /// An answer that does not fit the Hub's protocol.
    #[error("{url}: {message}")]
    BadResponse {
        /// What was asked.
        url: String,
        /// What was wrong.
        message: String,
    },
    /// No file was named and the repository has no single model file to take.
    #[error("{repo}: {message}")]
    Choose {
        /// The repository.
        repo: String,
        /// The candidates, or that there are none.
        message: String,
    },
    /// The bytes received are not those the Hub published.
    #[error(
        "{path}: sha256 {got} is not the {expected} the Hub publishes; the download was removed"
    )]
    Checksum {
        /// The file in the repository.
        path: String,
        /// The Hub's sha256.
        expected: String,
        /// Of the bytes received.
        got: String,
    },
    /// The transfer kept breaking off.
    #[error(
        "{path}: the transfer broke off at {have} of {size} bytes ({cause}); run again to \
         resume it"
    )]
    Interrupted {
        /// The file in the repository.
        path: String,
        /// Bytes kept (`.incomplete`).
        have: u64,
        /// The file's size.
        size: u64,
        /// The last break.
        cause: String,
    },
    /// Offline, and the cache does not hold what is asked.
    #[error("{what} is not in the cache {cache} and HF_HUB_OFFLINE is set (no download)")]
    NotCached {
        /// The repository or file.
        what: String,
        /// The cache folder.
        cache: PathBuf,
    },
    /// A file-system error.
    #[error("{}: {source}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

fn detail(message: &str) -> String {
    if message.is_empty() {
        String::new()
    } else {
        format!(": {message}")
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> HubError + '_ {
    move |source| HubError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A relative path with no `..`, no empty or `.` parts and no backslash: safe to join under a
/// folder (names come from the command line and from the Hub's answers).
fn safe_relative_path(p: &str) -> bool {
    !p.is_empty()
        && !p.starts_with('/')
        && !p.contains('\\')
        && !p.contains('\0')
        && p.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
}

/// A commit id: 40 hexadecimal digits.
fn is_commit(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// An ETag usable as a blob's file name (the Hub's are hexadecimal digests).
fn is_blob_name(s: &str) -> bool {
    (8..=128).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// A sha256 in hexadecimal.
fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The model file to take from a repository's files when none is named: its
/// `*.powerinfer.gguf`, else its `*.gguf`, when there is exactly one; otherwise the error lists
/// the candidates.
pub fn choose_model_file(repo: &str, files: &[String]) -> Result<String, HubError> {
    let ends = |f: &String, tail: &str| f.to_ascii_lowercase().ends_with(tail);
    let powerinfer: Vec<&String> = files
        .iter()
        .filter(|f| ends(f, ".powerinfer.gguf"))
        .collect();
    let candidates = if powerinfer.is_empty() {
        files.iter().filter(|f| ends(f, ".gguf")).collect()
    } else {
        powerinfer
    };
    match candidates[..] {
        [one] => Ok(one.clone()),
        [] => Err(HubError::Choose {
            repo: repo.into(),
            message: "no *.gguf model file in the repository".into(),
        }),
        _ => Err(HubError::Choose {
            repo: repo.into(),
            message: format!(
                "several model files; name one as {repo}:FILE: {}",
                candidates
                    .iter()
                    .map(|c| c.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }),
    }
}

/// The folder of `repo` in the cache (`models--OWNER--NAME`).
pub fn repo_folder(cache_dir: &Path, repo: &str) -> PathBuf {
    cache_dir.join(format!("models--{}", repo.replace('/', "--")))
}

/// The statistics folder (`activation/`) beside `model_file` in a repository.
fn activation_prefix(model_file: &str) -> String {
    match model_file.rsplit_once('/') {
        Some((dir, _)) => format!("{dir}/activation/"),
        None => "activation/".into(),
    }
}

/// Fetches `model`'s file and the `activation/` statistics beside it into the cache (what is
/// already there is not fetched again), reporting `(bytes just received, file size)` to
/// `progress`; returns the model file's path in the cache's snapshot. Offline, only the cache
/// is looked at.
pub async fn fetch(
    model: &HubModel,
    options: &HubOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<PathBuf, HubError> {
    if options.offline {
        return cached(model, options);
    }
    let hub = Hub::new(options)?;
    let files = hub.list(&model.repo).await?;
    let names: Vec<String> = files.iter().map(|f| f.path.clone()).collect();
    let file = match &model.file {
        Some(f) if names.contains(f) => f.clone(),
        Some(f) => {
            return Err(HubError::NotFound {
                what: format!("{}:{f}", model.repo),
                url: format!("{}/{}/tree/main", options.endpoint, model.repo),
            })
        }
        None => choose_model_file(&model.repo, &names)?,
    };
    // `main` is resolved once, by the model file; the statistics come from the same commit.
    let commit = hub.download(&model.repo, "main", &file, progress).await?;
    let prefix = activation_prefix(&file);
    for stats in names.iter().filter(|n| n.starts_with(&prefix)) {
        hub.download(&model.repo, &commit, stats, progress).await?;
    }
    let folder = repo_folder(&options.cache_dir, &model.repo);
    let refs = folder.join("refs");
    std::fs::create_dir_all(&refs).map_err(io(&refs))?;
    let main = refs.join("main");
    std::fs::write(&main, &commit).map_err(io(&main))?;
    Ok(folder.join("snapshots").join(&commit).join(&file))
}

/// [`fetch`] for callers without an async runtime (the `powerinfer` command).
pub fn fetch_blocking(
    model: &HubModel,
    options: &HubOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<PathBuf, HubError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(io(Path::new("tokio runtime")))?;
    runtime.block_on(fetch(model, options, progress))
}

/// The model file of `model` in the cache, as `refs/main` points to it.
fn cached(model: &HubModel, options: &HubOptions) -> Result<PathBuf, HubError> {
    let not_cached = |what: String| HubError::NotCached {
        what,
        cache: options.cache_dir.clone(),
    };
    let folder = repo_folder(&options.cache_dir, &model.repo);
    let commit = std::fs::read_to_string(folder.join("refs").join("main"))
        .map(|c| c.trim().to_string())
        .ok()
        .filter(|c| is_commit(c))
        .ok_or_else(|| not_cached(model.repo.clone()))?;
    let snapshot = folder.join("snapshots").join(commit);
    let file = match &model.file {
        Some(f) => f.clone(),
        None => {
            let mut files = Vec::new();
            list_files(&snapshot, "", &mut files);
            choose_model_file(&model.repo, &files)?
        }
    };
    let path = snapshot.join(&file);
    if path.is_file() {
        Ok(path)
    } else {
        Err(not_cached(format!("{}:{file}", model.repo)))
    }
}

/// The files under `dir` as paths relative to it (`prefix` in front), sorted.
fn list_files(dir: &Path, prefix: &str, out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = entries.flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = format!("{prefix}{}", e.file_name().to_string_lossy());
        if e.path().is_dir() {
            list_files(&e.path(), &format!("{name}/"), out);
        } else {
            out.push(name);
        }
    }
}

/// A file of a repository's listing.
#[derive(Deserialize)]
struct TreeEntry {
    #[serde(rename = "type")]
    kind: String,
    path: String,
}

/// What the Hub says of a file before it is downloaded.
struct FileMeta {
    commit: String,
    etag: String,
    size: u64,
    /// The sha256 of an LFS file.
    sha256: Option<String>,
    /// Where its bytes are (the CDN for an LFS file).
    url: String,
}

/// Transfers that break off are resumed this many times in a row without progress.
const RESUME_ATTEMPTS: u32 = 5;

/// HTTP requests to one Hub.
struct Hub<'a> {
    options: &'a HubOptions,
    /// For the metadata: redirects are read, not followed.
    meta: reqwest::Client,
    /// For the bytes: redirects followed (CDNs).
    bytes: reqwest::Client,
}

impl<'a> Hub<'a> {
    fn new(options: &'a HubOptions) -> Result<Hub<'a>, HubError> {
        let build = |redirects: reqwest::redirect::Policy| {
            reqwest::Client::builder()
                .user_agent(concat!("powerinfer-rs/", env!("CARGO_PKG_VERSION")))
                .redirect(redirects)
                .connect_timeout(Duration::from_secs(20))
                .read_timeout(Duration::from_secs(60))
                .build()
                .map_err(|source| HubError::Request {
                    url: options.endpoint.clone(),
                    source,
                })
        };
        Ok(Hub {
            options,
            meta: build(reqwest::redirect::Policy::none())?,
            bytes: build(reqwest::redirect::Policy::limited(10))?,
        })
    }

    fn endpoint(&self) -> &str {
        self.options.endpoint.trim_end_matches('/')
    }

    /// `request` with the token, when `url` is on the Hub itself (not a CDN it points to).
    fn authorized(&self, request: reqwest::RequestBuilder, url: &str) -> reqwest::RequestBuilder {
        match &self.options.token {
            Some(t) if url.starts_with(self.endpoint()) => {
                request.header(AUTHORIZATION, format!("Bearer {t}"))
            }
            _ => request,
        }
    }

    /// Sends `request` for `url`, with the token where it belongs.
    async fn send(
        &self,
        request: reqwest::RequestBuilder,
        url: &str,
    ) -> Result<reqwest::Response, HubError> {
        self.authorized(request, url)
            .send()
            .await
            .map_err(|source| HubError::Request {
                url: url.into(),
                source,
            })
    }

    /// The error for a failed answer about `what` in `repo`.
    fn refusal(
        &self,
        repo: &str,
        what: &str,
        url: &str,
        status: StatusCode,
        h: &HeaderMap,
    ) -> HubError {
        let message = h
            .get("x-error-message")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        match status.as_u16() {
            401 | 403 => HubError::Refused {
                repo: repo.into(),
                status: status.as_u16(),
                message: match (&self.options.token, status.as_u16()) {
                    (None, _) => "the repository is private or gated; set HF_TOKEN to an \
                                  access token that may read it"
                        .into(),
                    (Some(_), 401) => "the token (HF_TOKEN) was not accepted".into(),
                    (Some(_), _) => "the token may not read this repository (a gated one: \
                                     accept its conditions on its page)"
                        .into(),
                },
            },
            404 => HubError::NotFound {
                what: what.into(),
                url: url.into(),
            },
            s => HubError::Http {
                url: url.into(),
                status: s,
                message,
            },
        }
    }

    /// The files of `repo` at `main`, every page of the listing.
    async fn list(&self, repo: &str) -> Result<Vec<TreeEntry>, HubError> {
        let mut url = format!(
            "{}/api/models/{repo}/tree/main?recursive=true",
            self.endpoint()
        );
        let mut files = Vec::new();
        for _ in 0..10_000 {
            // A renamed repository's listing is redirected; the token stays on the Hub.
            let r = self.send(self.bytes.get(&url), &url).await?;
            if !r.status().is_success() {
                return Err(self.refusal(repo, repo, &url, r.status(), r.headers()));
            }
            let next = next_page(r.headers(), self.endpoint());
            let page: Vec<TreeEntry> = r.json().await.map_err(|e| HubError::BadResponse {
                url: url.clone(),
                message: format!("not a file list: {e}"),
            })?;
            files.extend(
                page.into_iter()
                    .filter(|e| e.kind == "file" && safe_relative_path(&e.path)),
            );
            match next {
                Some(n) => url = n,
                None => return Ok(files),
            }
        }
        Err(HubError::BadResponse {
            url,
            message: "the file list does not end".into(),
        })
    }

    /// What the Hub says of `path` at `revision` (a HEAD request; redirects within the Hub
    /// followed, the one to an LFS file's bytes read).
    async fn meta(&self, repo: &str, revision: &str, path: &str) -> Result<FileMeta, HubError> {
        let mut url = format!("{}/{repo}/resolve/{revision}/{path}", self.endpoint());
        for _ in 0..5 {
            let head = self.meta.head(&url).header("accept-encoding", "identity");
            let r = self.send(head, &url).await?;
            let (status, h) = (r.status(), r.headers());
            if !(status.is_success() || status.is_redirection()) {
                return Err(self.refusal(repo, &format!("{repo}:{path}"), &url, status, h));
            }
            let text = |name: &str| {
                h.get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string)
            };
            let location = text(LOCATION.as_str())
                .map(|l| join_url(&url, &l))
                .transpose()
                .map_err(|message| HubError::BadResponse {
                    url: url.clone(),
                    message,
                })?;
            let linked = text("x-linked-etag");
            if status.is_redirection() && linked.is_none() {
                // A renamed repository: ask again where it points.
                url = location.ok_or_else(|| HubError::BadResponse {
                    url: url.clone(),
                    message: "a redirection without Location".into(),
                })?;
                continue;
            }
            let bad = |message: &str| HubError::BadResponse {
                url: url.clone(),
                message: message.into(),
            };
            let commit = text("x-repo-commit")
                .filter(|c| is_commit(c))
                .ok_or_else(|| bad("no commit id (X-Repo-Commit)"))?;
            let etag = linked
                .clone()
                .or_else(|| text(ETAG.as_str()))
                .map(|e| normalize_etag(&e))
                .filter(|e| is_blob_name(e))
                .ok_or_else(|| bad("no usable ETag"))?;
            let size = text("x-linked-size")
                .or_else(|| text(CONTENT_LENGTH.as_str()))
                .and_then(|s| s.trim().parse::<u64>().ok())
                .ok_or_else(|| bad("no size (X-Linked-Size or Content-Length)"))?;
            let sha256 = linked.map(|l| normalize_etag(&l)).filter(|e| is_sha256(e));
            let download = match (status.is_redirection(), location) {
                (true, Some(l)) => l,
                (true, None) => return Err(bad("a redirection without Location")),
                (false, _) => url.clone(),
            };
            return Ok(FileMeta {
                commit,
                etag,
                size,
                sha256: sha256.map(|s| s.to_ascii_lowercase()),
                url: download,
            });
        }
        Err(HubError::BadResponse {
            url,
            message: "too many redirections".into(),
        })
    }

    /// Makes `path` of `repo` at `revision` present in the cache (blob and snapshot link),
    /// downloading what the blob lacks; returns the commit it belongs to.
    async fn download(
        &self,
        repo: &str,
        revision: &str,
        path: &str,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<String, HubError> {
        let meta = self.meta(repo, revision, path).await?;
        let folder = repo_folder(&self.options.cache_dir, repo);
        let blobs = folder.join("blobs");
        std::fs::create_dir_all(&blobs).map_err(io(&blobs))?;
        let blob = blobs.join(&meta.etag);
        let complete = std::fs::metadata(&blob).is_ok_and(|m| m.len() == meta.size);
        if !complete {
            let partial = blobs.join(format!("{}.incomplete", meta.etag));
            self.transfer(path, &meta, &partial, progress).await?;
            std::fs::rename(&partial, &blob).map_err(io(&blob))?;
        } else {
            progress(meta.size, meta.size);
        }
        let link = folder.join("snapshots").join(&meta.commit).join(path);
        link_snapshot(&blob, &link)?;
        Ok(meta.commit)
    }

    /// Downloads `meta`'s bytes into `partial`, resuming from what it holds, and checks an LFS
    /// file's sha256 (a file that does not match is removed).
    async fn transfer(
        &self,
        path: &str,
        meta: &FileMeta,
        partial: &Path,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<(), HubError> {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(partial)
            .map_err(io(partial))?;
        let mut have = file.metadata().map_err(io(partial))?.len();
        if have > meta.size {
            file.set_len(0).map_err(io(partial))?;
            have = 0;
        }
        // The sha256 of the bytes kept so far, then of each piece as it arrives.
        let mut hash = Sha256::new();
        if meta.sha256.is_some() && have > 0 {
            hash_prefix(&mut file, have, &mut hash).map_err(io(partial))?;
        }
        progress(have, meta.size);
        let mut failures = 0;
        while have < meta.size {
            let mut request = self.authorized(self.bytes.get(&meta.url), &meta.url);
            if have > 0 {
                request = request.header(RANGE, format!("bytes={have}-"));
            }
            let before = have;
            let outcome = async {
                let mut r = request.send().await?;
                match r.status() {
                    StatusCode::PARTIAL_CONTENT if have > 0 => {}
                    s if s.is_success() => {
                        // The whole file (a server that ignores ranges): start again.
                        if have > 0 {
                            file.set_len(0)
                                .map_err(io(partial))
                                .map_err(Broken::Fatal)?;
                            hash = Sha256::new();
                            have = 0;
                        }
                    }
                    s => return Err(Broken::Status(s)),
                }
                while let Some(piece) = r.chunk().await? {
                    let room = (meta.size - have) as usize;
                    let piece = &piece[..piece.len().min(room)];
                    file.write_all(piece)
                        .map_err(io(partial))
                        .map_err(Broken::Fatal)?;
                    hash.update(piece);
                    have += piece.len() as u64;
                    progress(piece.len() as u64, meta.size);
                }
                Ok(())
            }
            .await;
            let cause = match outcome {
                Ok(()) if have == meta.size => continue,
                Ok(()) => "the server ended the transfer early".to_string(),
                Err(Broken::Transfer(e)) => e.to_string(),
                Err(Broken::Status(s)) => {
                    return Err(HubError::Http {
                        url: meta.url.clone(),
                        status: s.as_u16(),
                        message: String::new(),
                    })
                }
                Err(Broken::Fatal(e)) => return Err(e),
            };
            failures = if have > before { 1 } else { failures + 1 };
            if failures > RESUME_ATTEMPTS {
                return Err(HubError::Interrupted {
                    path: path.into(),
                    have,
                    size: meta.size,
                    cause,
                });
            }
        }
        file.flush().map_err(io(partial))?;
        drop(file);
        if let Some(expected) = &meta.sha256 {
            let got = hex(&hash.finalize());
            if &got != expected {
                let _ = std::fs::remove_file(partial);
                return Err(HubError::Checksum {
                    path: path.into(),
                    expected: expected.clone(),
                    got,
                });
            }
        }
        Ok(())
    }
}

/// How one attempt at a transfer ended badly.
enum Broken {
    /// The connection broke (resumed).
    Transfer(reqwest::Error),
    /// The server refused (not resumed).
    Status(StatusCode),
    /// The cache could not be written.
    Fatal(HubError),
}

impl From<reqwest::Error> for Broken {
    fn from(e: reqwest::Error) -> Broken {
        Broken::Transfer(e)
    }
}

/// Feeds the first `n` bytes of `file` to `hash`.
fn hash_prefix(file: &mut std::fs::File, n: u64, hash: &mut Sha256) -> std::io::Result<()> {
    file.seek(SeekFrom::Start(0))?;
    let mut left = n;
    let mut buf = vec![0u8; 1 << 20];
    while left > 0 {
        let want = buf.len().min(left as usize);
        let got = file.read(&mut buf[..want])?;
        if got == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        hash.update(&buf[..got]);
        left -= got as u64;
    }
    file.seek(SeekFrom::End(0))?;
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An ETag without its weak marker and quotes.
fn normalize_etag(e: &str) -> String {
    e.trim()
        .trim_start_matches("W/")
        .trim_matches('"')
        .to_string()
}

/// `location` resolved against `base` (absolute, or a path on `base`'s host).
fn join_url(base: &str, location: &str) -> Result<String, String> {
    if location.starts_with("http://") || location.starts_with("https://") {
        return Ok(location.to_string());
    }
    if let Some(path) = location.strip_prefix('/') {
        let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
        let host_end = base[scheme_end..]
            .find('/')
            .map_or(base.len(), |i| scheme_end + i);
        return Ok(format!("{}/{path}", &base[..host_end]));
    }
    Err(format!("a Location the client cannot follow: {location}"))
}

/// The `rel="next"` page of a `Link` header, on the Hub.
fn next_page(h: &HeaderMap, endpoint: &str) -> Option<String> {
    let link = h.get("link")?.to_str().ok()?;
    link.split(',').find_map(|part| {
        let (target, params) = part.split_once(';')?;
        if !params.contains("rel=\"next\"") {
            return None;
        }
        let target = target.trim().strip_prefix('<')?.strip_suffix('>')?;
        join_url(endpoint, target)
            .ok()
            .filter(|u| u.starts_with(endpoint))
    })
}

/// Points the snapshot path `link` at `blob` (a relative symbolic link, as huggingface_hub
/// makes them; a copy where the system has no links).
fn link_snapshot(blob: &Path, link: &Path) -> Result<(), HubError> {
    let parent = link.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io(parent))?;
    if std::fs::symlink_metadata(link).is_ok() {
        std::fs::remove_file(link).map_err(io(link))?;
    }
    #[cfg(unix)]
    {
        // snapshots/COMMIT/a/b -> ../../../blobs/ETAG: up from the link's folder to the
        // repository folder, then into blobs/.
        let snapshot_depth = link
            .strip_prefix(
                blob.parent()
                    .and_then(Path::parent)
                    .unwrap_or(Path::new("")),
            )
            .map_or(2, |rel| rel.components().count().saturating_sub(1));
        let mut target = PathBuf::new();
        for _ in 0..snapshot_depth {
            target.push("..");
        }
        target.push("blobs");
        target.push(blob.file_name().unwrap_or_default());
        std::os::unix::fs::symlink(&target, link).map_err(io(link))
    }
    #[cfg(not(unix))]
    {
        std::fs::copy(blob, link).map(|_| ()).map_err(io(link))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_are_checked() {
        let m: HubModel = "PowerInfer/ReluLLaMA-7B-PowerInfer-GGUF".parse().unwrap();
        assert_eq!(m.file, None);
        let m: HubModel = "o/n:sub/x.powerinfer.gguf".parse().unwrap();
        assert_eq!(
            (m.repo.as_str(), m.file.as_deref()),
            ("o/n", Some("sub/x.powerinfer.gguf"))
        );
        for bad in [
            "",
            "name",
            "/n",
            "o/",
            "o/n/x",
            "o/../n",
            "../o/n",
            "o/n:",
            "o/n:../x.gguf",
            "o/n:/etc/x",
            "o/n:a//b",
            "o n/x",
            "o/n:a\\b",
        ] {
            assert!(bad.parse::<HubModel>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn the_model_file_is_chosen_or_the_candidates_listed() {
        let files = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let pick = |v: &[&str]| choose_model_file("o/n", &files(v)).map_err(|e| e.to_string());
        assert_eq!(
            pick(&[
                "README.md",
                "m.gguf",
                "m.powerinfer.gguf",
                "activation/activation_0.pt"
            ]),
            Ok("m.powerinfer.gguf".into())
        );
        assert_eq!(pick(&["a.txt", "dense.gguf"]), Ok("dense.gguf".into()));
        let err = pick(&["x.powerinfer.gguf", "x.q4.powerinfer.gguf", "d.gguf"]).unwrap_err();
        assert!(
            err.contains("x.powerinfer.gguf, x.q4.powerinfer.gguf") && !err.contains("d.gguf"),
            "{err}"
        );
        assert!(pick(&["README.md"]).unwrap_err().contains("no *.gguf"));
    }

    #[test]
    fn locations_and_pages_are_resolved_on_the_hub() {
        assert_eq!(
            join_url("http://127.0.0.1:9/o/n/resolve/main/x", "/cdn/abc").unwrap(),
            "http://127.0.0.1:9/cdn/abc"
        );
        assert_eq!(
            join_url("http://h/x", "https://cdn.example/y").unwrap(),
            "https://cdn.example/y"
        );
        assert!(join_url("http://h/x", "y").is_err());
        let mut h = HeaderMap::new();
        h.insert(
            "link",
            "</api/models/o/n/tree/main?cursor=2>; rel=\"next\""
                .parse()
                .unwrap(),
        );
        assert_eq!(
            next_page(&h, "http://h").as_deref(),
            Some("http://h/api/models/o/n/tree/main?cursor=2")
        );
        h.insert(
            "link",
            "<https://elsewhere/x>; rel=\"next\"".parse().unwrap(),
        );
        assert_eq!(next_page(&h, "http://h"), None);
        assert_eq!(normalize_etag("W/\"abc123\""), "abc123");
    }
}
