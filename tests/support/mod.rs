//! Shared helpers of the end-to-end tests: start a real `tether worker` on a free port, run
//! `tetherctl`, attach clients as real processes, send signals, read memory.

#![allow(dead_code)]

pub mod proxy;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Path of the `tether` binary under test.
pub const TETHER: &str = env!("CARGO_BIN_EXE_tether");
/// Path of the `tetherctl` binary under test.
pub const TETHERCTL: &str = env!("CARGO_BIN_EXE_tetherctl");

/// A worker process; killed when dropped.
pub struct Worker {
    pub child: Child,
    pub addr: String,
    log: Arc<Mutex<String>>,
}

/// Reads lines of a child's output into `sink`, sending the first line matching `prefix`.
fn pump_lines(
    stream: impl std::io::Read + Send + 'static,
    sink: Arc<Mutex<String>>,
    prefix: Option<(&'static str, std::sync::mpsc::Sender<String>)>,
) {
    std::thread::spawn(move || {
        let mut prefix = prefix;
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            if let Some((p, tx)) = &prefix
                && let Some(rest) = line.strip_prefix(p)
            {
                let _ = tx.send(rest.to_string());
                prefix = None;
            }
            if let Ok(mut s) = sink.lock() {
                s.push_str(&line);
                s.push('\n');
            }
        }
    });
}

impl Worker {
    /// Starts `tether worker --listen 127.0.0.1:0 --device cpu ARGS` and waits until it
    /// listens.
    pub fn start(args: &[&str]) -> Worker {
        Worker::try_start_at("127.0.0.1:0", args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Starts `tether worker --listen LISTEN --device cpu ARGS` and waits until it listens;
    /// the error carries its log when it exits or stays silent for 20 s.
    pub fn try_start_at(listen: &str, args: &[&str]) -> Result<Worker, String> {
        let mut child = Command::new(TETHER)
            .args([
                "worker",
                "--listen",
                listen,
                "--device",
                "cpu",
                "--threads",
                "1",
            ])
            .args(args)
            .env("TETHER_LOG", "info")
            .env("NO_COLOR", "1")
            .env_remove("TETHER_ADMIN_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn tether worker");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().expect("worker stdout");
        let stderr = child.stderr.take().expect("worker stderr");
        pump_lines(
            stdout,
            Arc::clone(&log),
            Some(("tether worker listening on ", tx)),
        );
        pump_lines(stderr, Arc::clone(&log), None);
        let started = Instant::now();
        let line = loop {
            if let Ok(line) = rx.recv_timeout(Duration::from_millis(50)) {
                break line;
            }
            let exited = child.try_wait().ok().flatten().is_some();
            if exited || started.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                let _ = child.wait();
                // Lets the pumps take the last lines.
                std::thread::sleep(Duration::from_millis(50));
                return Err(format!(
                    "worker on {listen} did not start; log:\n{}",
                    log.lock().map(|l| l.clone()).unwrap_or_default()
                ));
            }
        };
        let addr = line.split_whitespace().next().expect("address").to_string();
        Ok(Worker { child, addr, log })
    }

    /// Everything the worker printed so far.
    pub fn log(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// The worker's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `tetherctl --worker ADDR --json status`.
    pub fn status(&self) -> serde_json::Value {
        tetherctl_json(&self.addr, &["status"])
    }

    /// Polls status until `pred` holds or `timeout` passes; returns the time it took.
    pub fn wait_status(
        &self,
        timeout: Duration,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> Option<Duration> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if pred(&self.status()) {
                return Some(start.elapsed());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs tetherctl with `--json` and parses its output.
pub fn tetherctl_json(addr: &str, args: &[&str]) -> serde_json::Value {
    let out = Command::new(TETHERCTL)
        .args(["--worker", addr, "--json"])
        .args(args)
        .env_remove("TETHER_ADMIN_TOKEN")
        .output()
        .expect("run tetherctl");
    assert!(
        out.status.success(),
        "tetherctl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("tetherctl prints JSON")
}

/// A `tether attach` process; killed when dropped.
pub struct Attached {
    pub child: Child,
    pub session: String,
}

impl Attached {
    /// Starts `tether attach --worker ADDR ARGS` and waits for its session id.
    pub fn start(addr: &str, args: &[&str]) -> Attached {
        let mut child = Command::new(TETHER)
            .args(["attach", "--worker", addr])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn tether attach");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        pump_lines(
            child.stdout.take().expect("stdout"),
            Arc::clone(&log),
            Some(("session ", tx)),
        );
        pump_lines(child.stderr.take().expect("stderr"), Arc::clone(&log), None);
        let session = match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(id) => id,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "attach printed no session; output:\n{}",
                    log.lock().map(|l| l.clone()).unwrap_or_default()
                );
            }
        };
        Attached { child, session }
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `signal` to process `pid`.
pub fn send_signal(pid: u32, signal: i32) {
    // SAFETY: kill(2) with a pid of a child we spawned and a valid signal number.
    let rc = unsafe { libc::kill(pid as libc::pid_t, signal) };
    assert_eq!(rc, 0, "kill({pid}, {signal}) failed");
}

/// Resident memory of process `pid` in kB (VmRSS).
pub fn rss_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("VmRSS:")?
                    .trim()
                    .strip_suffix("kB")?
                    .trim()
                    .parse()
                    .ok()
            })
        })
        .unwrap_or(0)
}

/// `status["sessions"]` and `status["session_bytes"]`.
pub fn sessions_and_bytes(status: &serde_json::Value) -> (u64, u64) {
    (
        status["sessions"].as_u64().unwrap_or(u64::MAX),
        status["session_bytes"].as_u64().unwrap_or(u64::MAX),
    )
}

/// A model file for loading tests: the shared stories260K when present.
pub fn model_path() -> std::path::PathBuf {
    std::path::PathBuf::from("/work/shared/models/stories260K.gguf")
}

/// A synthetic tiny model (f32; llama unless asked) in a temporary directory, removed on
/// drop.
pub struct TinyModel {
    pub dir: std::path::PathBuf,
    pub path: std::path::PathBuf,
}

impl TinyModel {
    /// Writes the model.
    pub fn new() -> TinyModel {
        Self::of(tether_model::SynthShape::Tiny)
    }

    /// Writes a tiny model of `shape` (f32).
    pub fn of(shape: tether_model::SynthShape) -> TinyModel {
        let dir = std::env::temp_dir().join(format!(
            "tether-e2e-{}-{}",
            std::process::id(),
            rand_suffix()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("tiny.gguf");
        tether_model::synthesize(&path, shape, tether_gguf::GgmlType::F32, 11)
            .expect("synthesize tiny model");
        TinyModel { dir, path }
    }

    /// The path as a string argument.
    pub fn arg(&self) -> &str {
        self.path.to_str().expect("utf-8 temp path")
    }
}

impl Drop for TinyModel {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// Tensor bytes straight from a GGUF file.
pub struct GgufSource(pub tether_gguf::GgufFile);

impl tether_client::TensorSource for GgufSource {
    fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        self.0.tensor(name).map(|t| self.0.tensor_data(t))
    }
}

/// A single-threaded runtime for a test's client calls.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Attach options for client `name`: heartbeats every 200 ms, a 5 s lease.
pub fn attach_options(name: &str) -> tether_client::AttachOptions {
    tether_client::AttachOptions {
        client_name: name.into(),
        lease: tether_protocol::Lease {
            heartbeat_interval: Duration::from_millis(200),
            ttl: Duration::from_secs(5),
        },
        heartbeat: true,
    }
}

/// A session attached with `options`, serving every layer of `model` for `ctx` cells
/// (`full_load`), committed; returns it and the bytes it reserved.
pub async fn committed_session(
    client: &tether_client::WorkerClient,
    options: tether_client::AttachOptions,
    model: &std::path::Path,
    ctx: usize,
) -> (tether_client::Session, u64) {
    let session = client.attach(options).await.expect("attach");
    let (load, source, _) = full_load(model, ctx);
    let txn = load.txn;
    let reserved = client
        .prepare(session.id(), load, source)
        .await
        .expect("prepare");
    client.commit(session.id(), txn).await.expect("commit");
    (session, reserved)
}

/// A Prepare of every layer of `model` (with embedding and head), and its tensor source.
pub fn full_load(
    model: &std::path::Path,
    ctx: usize,
) -> (
    tether_client::LoadRequest,
    std::sync::Arc<dyn tether_client::TensorSource>,
    usize,
) {
    let file = tether_gguf::GgufFile::open(model).expect("open model");
    let cfg = tether_model::ModelConfig::from_gguf(&file).expect("model config");
    let spec = tether_model::StageSpec {
        first_layer: 0,
        last_layer: cfg.n_layer,
        has_embed: true,
        has_head: true,
        ctx_per_seq: ctx,
        n_seq: 1,
        ubatch: 8,
        cache_k: tether_gguf::GgmlType::F16,
        cache_v: tether_gguf::GgmlType::F16,
    };
    let tensors = tether_model::required_tensors(&cfg, &spec, file.tensors())
        .expect("required tensors")
        .into_iter()
        .map(|s| s.name)
        .collect();
    let bytes = std::fs::read(model).expect("read model");
    let request = tether_client::LoadRequest {
        txn: tether_protocol::TxnId::new_random(),
        gguf_header: bytes[..file.data_offset() as usize].to_vec(),
        gguf_file_bytes: bytes.len() as u64,
        spec: tether_protocol::BlockSpec {
            first_layer: spec.first_layer,
            last_layer: spec.last_layer,
            has_embed: true,
            has_head: true,
            ctx_per_seq: ctx,
            n_seq: 1,
            ubatch: 8,
            cache_k: tether_gguf::GgmlType::F16,
            cache_v: tether_gguf::GgmlType::F16,
        },
        tensors,
        decision_timeout: None,
        chunk_bytes: 64 << 10,
        local_path: None,
    };
    (request, std::sync::Arc::new(GgufSource(file)), cfg.n_embd)
}

/// A `tether serve` process; killed when dropped.
pub struct Serve {
    pub child: Child,
    /// `host:port` of its HTTP API.
    pub addr: String,
    log: Arc<Mutex<String>>,
}

impl Serve {
    /// Starts `tether serve --listen 127.0.0.1:0 ARGS` and waits until it listens.
    pub fn start(args: &[&str]) -> Serve {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut serve = Serve::launch(args, Some(tx));
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(addr) => {
                serve.addr = addr.trim().to_string();
                serve
            }
            Err(_) => panic!("serve did not start; log:\n{}", serve.log()),
        }
    }

    /// Starts `tether serve --listen 127.0.0.1:0 ARGS` without waiting for it to listen.
    pub fn spawn(args: &[&str]) -> Serve {
        Serve::launch(args, None)
    }

    fn launch(args: &[&str], listening: Option<std::sync::mpsc::Sender<String>>) -> Serve {
        let mut child = Command::new(TETHER)
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(args)
            .env("TETHER_LOG", "info")
            .env("NO_COLOR", "1")
            .env_remove("TETHER_ADMIN_TOKEN")
            .env_remove("TETHER_API_KEY")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn tether serve");
        let log = Arc::new(Mutex::new(String::new()));
        let stdout = child.stdout.take().expect("serve stdout");
        let stderr = child.stderr.take().expect("serve stderr");
        pump_lines(
            stdout,
            Arc::clone(&log),
            listening.map(|tx| ("tether serve listening on http://", tx)),
        );
        pump_lines(stderr, Arc::clone(&log), None);
        Serve {
            child,
            addr: String::new(),
            log,
        }
    }

    /// Everything the process printed so far.
    pub fn log(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Waits up to `timeout` for `needle` in the log: the lines a process printed just
    /// before it exited may still be on their way through the pipe.
    pub fn log_contains(&self, needle: &str, timeout: Duration) -> bool {
        let start = Instant::now();
        while !self.log().contains(needle) {
            if start.elapsed() >= timeout {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }

    /// The HTTP address from its "listening" line, once it printed one.
    pub fn listening_addr(&self) -> Option<String> {
        let log = self.log();
        let rest = log.split("tether serve listening on http://").nth(1)?;
        rest.split_whitespace().next().map(str::to_string)
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        wait_exit(&mut self.child, timeout)
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `child` until it exits or `timeout` passes.
pub fn wait_exit(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if start.elapsed() >= timeout {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether process `pid` still exists (and is not a zombie).
pub fn process_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // The state follows the parenthesised command name.
            let after = s.rsplit_once(')')?.1;
            after.split_whitespace().next().map(|st| st != "Z")
        })
        .unwrap_or(false)
}

/// Sends one HTTP/1.1 request with `Connection: close` and writes it; returns the stream.
pub fn http_send(addr: &str, method: &str, path: &str, body: Option<&str>) -> std::net::TcpStream {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to serve");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("read timeout");
    let body = body.unwrap_or("");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).expect("write request");
    stream
}

/// Reads the status line and headers; returns the status code and whether the body is
/// chunked.
pub fn http_read_head(reader: &mut impl BufRead) -> (u16, bool) {
    let mut line = String::new();
    reader.read_line(&mut line).expect("status line");
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut chunked = false;
    loop {
        line.clear();
        reader.read_line(&mut line).expect("header line");
        let header = line.trim_end();
        if header.is_empty() {
            return (status, chunked);
        }
        let lower = header.to_ascii_lowercase();
        if lower.starts_with("transfer-encoding:") && lower.contains("chunked") {
            chunked = true;
        }
    }
}

/// Reads the rest of a body, undoing chunked transfer encoding.
pub fn http_read_body(reader: &mut impl BufRead, chunked: bool) -> String {
    let mut body = Vec::new();
    if !chunked {
        reader.read_to_end(&mut body).expect("read body");
        return String::from_utf8_lossy(&body).into_owned();
    }
    loop {
        let mut size = String::new();
        reader.read_line(&mut size).expect("chunk size");
        let size = usize::from_str_radix(size.trim().split(';').next().unwrap_or(""), 16)
            .unwrap_or_else(|_| panic!("bad chunk size {size:?}"));
        if size == 0 {
            return String::from_utf8_lossy(&body).into_owned();
        }
        let start = body.len();
        body.resize(start + size, 0);
        reader.read_exact(&mut body[start..]).expect("chunk data");
        let mut crlf = [0u8; 2];
        reader.read_exact(&mut crlf).expect("chunk end");
    }
}

/// One whole HTTP request: the status and the body.
pub fn http(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let mut reader = BufReader::new(http_send(addr, method, path, body));
    let (status, chunked) = http_read_head(&mut reader);
    (status, http_read_body(&mut reader, chunked))
}

/// `GET path`, expecting 200 and JSON.
pub fn http_json(addr: &str, path: &str) -> serde_json::Value {
    let (status, body) = http(addr, "GET", path, None);
    assert_eq!(status, 200, "GET {path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path} is not JSON ({e}): {body}"))
}

/// One HTTP request that never panics and never waits past `deadline` in all: the status
/// and body, or what went wrong (connect, write, a read that timed out).
pub fn http_deadline(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    deadline: Duration,
) -> Result<(u16, String), String> {
    use std::io::{Read, Write};
    let start = Instant::now();
    let sock: std::net::SocketAddr = addr.parse().map_err(|e| format!("address {addr}: {e}"))?;
    let mut stream = std::net::TcpStream::connect_timeout(&sock, deadline)
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let body = body.unwrap_or("");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream
        .set_write_timeout(Some(deadline))
        .and_then(|()| stream.write_all(request.as_bytes()))
        .map_err(|e| format!("write {method} {path}: {e}"))?;
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let left = deadline.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Err(format!("{method} {path} hung past {deadline:?}"));
        }
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| format!("read timeout: {e}"))?;
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(format!("{method} {path} hung past {deadline:?}"));
            }
            Err(e) if raw.is_empty() => return Err(format!("{method} {path}: {e}")),
            Err(_) => break,
        }
    }
    let mut reader = BufReader::new(raw.as_slice());
    let mut line = String::new();
    let _ = reader.read_line(&mut line);
    let Some(status) = line.split_whitespace().nth(1).and_then(|s| s.parse().ok()) else {
        return Err(format!("{method} {path}: bad status line {line:?}"));
    };
    let mut chunked = false;
    loop {
        line.clear();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line.trim_end().is_empty() {
            break;
        }
        let lower = line.to_ascii_lowercase();
        chunked |= lower.starts_with("transfer-encoding:") && lower.contains("chunked");
    }
    let mut rest = Vec::new();
    let _ = reader.read_to_end(&mut rest);
    let text = if chunked {
        std::panic::catch_unwind(|| http_read_body(&mut rest.as_slice(), true))
            .map_err(|_| format!("{method} {path}: truncated chunked body"))?
    } else {
        String::from_utf8_lossy(&rest).into_owned()
    };
    Ok((status, text))
}

/// Greedy tokens of the whole model in this process, and their text as the API builds it
/// (the pieces concatenated).
pub fn reference(model: &TinyModel, prompt: &[u32], n: usize) -> (Vec<u32>, String) {
    use tether_model::tokenizer::Tokenizer;
    use tether_model::{Generator, Sampler, SamplingParams};
    let file = tether_gguf::GgufFile::open(&model.path).expect("open model");
    let tokenizer = Tokenizer::from_gguf(&file).expect("tokenizer");
    let backend = Arc::new(tether_compute::CpuBackend::new(Some(1)).expect("cpu backend"));
    let mut generator = Generator::from_file(backend, &file, 256, 8).expect("generator");
    let eog: Vec<u32> = (0..tokenizer.vocab_size() as u32)
        .filter(|&t| tokenizer.is_eog(t))
        .collect();
    let mut sampler = Sampler::new(SamplingParams {
        repeat_penalty: 1.0,
        ..SamplingParams::greedy()
    });
    let (tokens, _) = generator
        .generate(prompt, n, &mut sampler, &eog, |_| true)
        .expect("generate");
    let bytes: Vec<u8> = tokens
        .iter()
        .flat_map(|&t| tokenizer.token_to_piece(t))
        .collect();
    (tokens, String::from_utf8_lossy(&bytes).into_owned())
}

/// The metrics address the worker printed.
pub fn metrics_addr(worker: &Worker) -> String {
    let log = worker.log();
    log.lines()
        .find_map(|l| {
            l.strip_prefix("tether worker metrics on http://")?
                .strip_suffix("/metrics")
        })
        .unwrap_or_else(|| panic!("the worker printed no metrics address; log:\n{log}"))
        .to_string()
}

/// `GET /metrics`: the body, after checking status and content type.
pub fn scrape(addr: &str) -> String {
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to the metrics port");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    std::io::Write::write_all(&mut stream, b"GET /metrics HTTP/1.1\r\nhost: test\r\n\r\n")
        .expect("send the request");
    let mut response = String::new();
    std::io::Read::read_to_string(&mut stream, &mut response).expect("read the response");
    let (head, body) = response.split_once("\r\n\r\n").expect("a head and a body");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("content-type: text/plain"), "{head}");
    body.to_string()
}

/// The value of one series (name and labels as printed).
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// A `/v1/completions` body for greedy generation without repetition penalty.
pub fn completion_body(prompt: &[u32], max_tokens: usize, stream: bool) -> String {
    serde_json::json!({
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "repeat_penalty": 1.0,
        "stream": stream,
    })
    .to_string()
}
