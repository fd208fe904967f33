//! Shared helpers of the end-to-end tests: start a real `tether worker` on a free port, run
//! `tetherctl`, attach clients as real processes, send signals, read memory.

// Each test binary uses some of the helpers.
#![allow(dead_code, unused_imports)]

mod http;
mod metrics;
mod model;
pub mod proxy;
mod serve;
mod session;

pub use http::*;
pub use metrics::*;
pub use model::*;
pub use serve::*;
pub use session::*;

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
