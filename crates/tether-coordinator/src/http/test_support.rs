//! Helpers for the HTTP tests: models, the production engine over an embedded worker, a
//! server on a free port, and a small HTTP/1.1 client over a raw socket (so tests can also
//! hang up mid-stream).

use std::net::SocketAddr;
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use tether_client::ClientOptions;
use tether_compute::CpuBackend;
use tether_gguf::{GgmlType, GgufFile};
use tether_model::tokenizer::Tokenizer;
use tether_model::{Generator, Sampler, SamplingParams, SynthShape};
use tether_worker::embedded::{LocalOptions, LocalWorkers};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::admin::admin_router;
use super::{ConnLimits, HttpOptions, router, serve};
use crate::{Coordinator, CoordinatorConfig, ModelFile};

/// Context of the test engines.
pub const TEST_CTX: usize = 256;

/// A synthetic tiny llama, written once per test process.
pub fn tiny_model() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| synthesize_tiny("tiny-q8_0.gguf", 7))
}

/// A second tiny llama of the same shape with other weights (another seed), for model
/// changes whose outputs must differ.
pub fn other_tiny_model() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| synthesize_tiny("other-tiny-q8_0.gguf", 11))
}

fn synthesize_tiny(name: &str, seed: u64) -> PathBuf {
    let path = test_dir().join(name);
    tether_model::synthesize(&path, SynthShape::Tiny, GgmlType::Q8_0, seed)
        .expect("synthesizing the tiny model");
    path
}

/// This test process's directory for files it writes.
pub fn test_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tether-http-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir is writable");
    dir
}

/// `stories260K.gguf` from the test data, when present.
pub fn stories_model() -> Option<PathBuf> {
    tether_test_data::stories260k()
}

/// The engine `tether serve` runs: a coordinator that loads the model by two-phase commit
/// over an embedded cpu worker reached by gRPC, and schedules requests onto it.
pub struct TestEngine {
    coordinator: Arc<Coordinator>,
    // Declared after the coordinator, so it is dropped after it: the coordinator's sessions
    // end on a live worker.
    workers: LocalWorkers,
}

impl TestEngine {
    /// The embedded worker.
    pub fn worker(&self) -> &tether_worker::embedded::LocalWorker {
        &self.workers.workers[0]
    }

    /// The secret the worker's admin calls take.
    pub fn worker_token(&self) -> String {
        self.workers.token().expose().to_string()
    }
}

impl Deref for TestEngine {
    type Target = Coordinator;

    fn deref(&self) -> &Coordinator {
        &self.coordinator
    }
}

/// The production engine over `model` with one sequence slot of `ctx` cells and `queue`
/// requests waiting for it (at least one: the coordinator's queue cannot be empty).
pub async fn engine(model: &Path, ctx: usize, queue: usize) -> Arc<TestEngine> {
    engine_with(model, ctx, queue, 1 << 30, |_| {}).await
}

/// [`engine`] over a worker that admits at most `max_memory` bytes, with `configure`
/// applied to the coordinator's settings.
pub async fn engine_with(
    model: &Path,
    ctx: usize,
    queue: usize,
    max_memory: u64,
    configure: impl FnOnce(&mut CoordinatorConfig),
) -> Arc<TestEngine> {
    let options = LocalOptions {
        threads: Some(1),
        max_memory: Some(max_memory),
        gpus: Vec::new(),
        ..LocalOptions::default()
    };
    let workers = LocalWorkers::start(1, &options)
        .await
        .expect("starting an embedded worker");
    let file = ModelFile::open(model).expect("opening the test model");
    let mut config = CoordinatorConfig::new(&file, workers.addrs());
    config.client = ClientOptions::with_token(workers.token().clone());
    config.ctx_per_seq = ctx;
    config.parallel = 1;
    config.ubatch = 32;
    config.queue_depth = queue.max(1);
    configure(&mut config);
    let coordinator = Coordinator::start(file, config)
        .await
        .expect("loading the test model over the worker");
    Arc::new(TestEngine {
        coordinator: Arc::new(coordinator),
        workers,
    })
}

/// What a plain single-process generation of `prompt` gives: the tokens, the text and
/// whether it stopped at an end-of-generation token.
pub fn reference(model: &Path, ctx: usize, prompt: &[u32], n: usize) -> (Vec<u32>, String, bool) {
    reference_with(model, ctx, prompt, n, SamplingParams::greedy())
}

/// [`reference`] with the sampler of `params`.
pub fn reference_with(
    model: &Path,
    ctx: usize,
    prompt: &[u32],
    n: usize,
    params: SamplingParams,
) -> (Vec<u32>, String, bool) {
    let file = GgufFile::open(model).expect("model opens");
    let tokenizer = Tokenizer::from_gguf(&file).expect("tokenizer");
    let backend = Arc::new(CpuBackend::new(Some(1)).expect("cpu backend"));
    let mut generator = Generator::from_file(backend, &file, ctx, 32).expect("generator");
    let eog: Vec<u32> = (0..tokenizer.vocab_size() as u32)
        .filter(|&t| tokenizer.is_eog(t))
        .collect();
    let mut sampler = Sampler::new(params);
    let (tokens, why) = generator
        .generate(prompt, n, &mut sampler, &eog, |_| true)
        .expect("generation");
    let bytes: Vec<u8> = tokens
        .iter()
        .flat_map(|&t| tokenizer.token_to_piece(t))
        .collect();
    let ended_at_eog = why == tether_model::StopReason::EndOfGeneration;
    (
        tokens,
        String::from_utf8_lossy(&bytes).into_owned(),
        ended_at_eog,
    )
}

/// A server on a free port of 127.0.0.1, stopped when dropped.
pub struct TestServer {
    /// Where it listens.
    pub addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
    /// Kept so the worker lives as long as the server.
    _engine: Arc<TestEngine>,
}

impl TestServer {
    /// Serves `engine` with `opts`.
    pub async fn start(engine: Arc<TestEngine>, opts: HttpOptions) -> TestServer {
        let app = router(Arc::clone(&engine.coordinator) as _, opts);
        Self::start_router(engine, app).await
    }

    /// Serves `engine` with `opts` and the admin routes, as `tether serve` does.
    pub async fn start_with_admin(engine: Arc<TestEngine>, opts: HttpOptions) -> TestServer {
        let admin = admin_router(
            Arc::clone(&engine.coordinator),
            opts.api_key.clone(),
            Some(engine.worker_token()),
        );
        let app = router(Arc::clone(&engine.coordinator) as _, opts).merge(admin);
        Self::start_router(engine, app).await
    }

    async fn start_router(engine: Arc<TestEngine>, app: axum::Router) -> TestServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding a free port");
        let addr = listener.local_addr().expect("local address");
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, app, ConnLimits::default(), async move {
            let _ = rx.await;
        }));
        TestServer {
            addr,
            shutdown: Some(tx),
            task: Some(task),
            _engine: engine,
        }
    }

    /// Stops the server and waits for it.
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            let result = task.await.expect("server task");
            result.expect("server ends cleanly");
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// A reply.
#[derive(Debug)]
pub struct Reply {
    /// The status code.
    pub status: u16,
    /// Headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// The body (de-chunked).
    pub body: String,
}

impl Reply {
    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.body))
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The `data:` payloads of an event stream.
    pub fn sse_data(&self) -> Vec<String> {
        self.body
            .split("\n\n")
            .filter_map(|event| event.strip_prefix("data: "))
            .map(str::to_owned)
            .collect()
    }
}

/// The request's bytes.
pub fn request_bytes(
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Vec<u8> {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n");
    for (name, value) in headers {
        req.push_str(&format!("{name}: {value}\r\n"));
    }
    if let Some(body) = body {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    req.push_str("\r\n");
    req.push_str(body.unwrap_or(""));
    req.into_bytes()
}

/// Sends one request and reads the whole reply.
pub async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Reply {
    let mut stream = TcpStream::connect(addr).await.expect("connecting");
    stream
        .write_all(&request_bytes(method, path, headers, body))
        .await
        .expect("writing the request");
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .await
        .expect("reading the reply");
    parse_reply(&raw)
}

/// `POST path` with `body` asking for a stream, read until its first event: the open
/// connection, and what was read (the status line on).
pub async fn open_stream(addr: SocketAddr, path: &str, body: &str) -> (TcpStream, String) {
    let mut stream = TcpStream::connect(addr).await.expect("connecting");
    stream
        .write_all(&request_bytes("POST", path, &[], Some(body)))
        .await
        .expect("writing the request");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: {") {
        let n = stream.read(&mut buf).await.expect("reading the reply");
        assert!(
            n > 0,
            "the stream ended early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    (stream, String::from_utf8_lossy(&seen).into_owned())
}

/// `POST path` with a JSON body.
pub async fn post(addr: SocketAddr, path: &str, body: &serde_json::Value) -> Reply {
    send(addr, "POST", path, &[], Some(&body.to_string())).await
}

/// Splits a raw HTTP/1.1 reply.
pub fn parse_reply(raw: &[u8]) -> Reply {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n").expect("reply has a head");
    let mut lines = head.split("\r\n");
    let status_line = lines.next().expect("status line");
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status code");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_owned()
    };
    Reply {
        status,
        headers,
        body,
    }
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}
