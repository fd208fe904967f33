//! The `tether serve` that `bench --serve` measures: this same binary started as a child
//! process, so requests take exactly the path they take in production (the HTTP server,
//! the coordinator, embedded workers over gRPC and data links), and the bench's client
//! threads are not part of the server's process.

use anyhow::{Context, Result, bail};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Lines of the server's output kept for the error when it fails to start.
const KEPT_LINES: usize = 40;
/// What the server prints once the model serves.
const LISTENING: &str = "tether serve listening on ";

/// A running `tether serve`; stopped with SIGTERM (then SIGKILL) when dropped.
pub(crate) struct SpawnedServe {
    child: Child,
    /// Its base URL.
    pub(crate) url: String,
}

impl SpawnedServe {
    /// Starts `tether serve --listen 127.0.0.1:0 ARGS` and waits up to `timeout` for it to
    /// serve.
    pub(crate) fn start(args: &[String], timeout: Duration) -> Result<SpawnedServe> {
        let exe = std::env::current_exe().context("finding the tether binary")?;
        let mut command = Command::new(exe);
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            // A bench killed outright must not leave its server (and GPU memory) behind.
            // SAFETY: prctl is async-signal-safe and touches only the child being set up.
            unsafe {
                command.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                    Ok(())
                });
            }
        }
        let mut child = command
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(args)
            // The bench's clients send no key: the server must not ask for one.
            .env_remove("TETHER_API_KEY")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting tether serve")?;
        let kept = Arc::new(Mutex::new(VecDeque::new()));
        let (tx, rx) = mpsc::channel();
        if let Some(out) = child.stdout.take() {
            keep_lines(out, Arc::clone(&kept), Some(tx));
        }
        if let Some(err) = child.stderr.take() {
            keep_lines(err, Arc::clone(&kept), None);
        }
        let started = Instant::now();
        let mut serve = SpawnedServe {
            child,
            url: String::new(),
        };
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(url) => {
                    serve.url = url;
                    return Ok(serve);
                }
                Err(mpsc::RecvTimeoutError::Timeout) if started.elapsed() < timeout => {
                    if let Ok(Some(status)) = serve.child.try_wait() {
                        bail!(
                            "tether serve exited ({status}) before serving:\n{}",
                            tail(&kept)
                        );
                    }
                }
                Err(_) => bail!(
                    "tether serve did not serve within {timeout:?}:\n{}",
                    tail(&kept)
                ),
            }
        }
    }
}

impl Drop for SpawnedServe {
    fn drop(&mut self) {
        // SIGTERM lets it close every worker session; SIGKILL only if it hangs.
        // SAFETY: kill(2) on our own child's pid, which we have not reaped yet.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Keeps the last lines of `stream` in `kept`; sends the URL of the "listening" line.
fn keep_lines(
    stream: impl std::io::Read + Send + 'static,
    kept: Arc<Mutex<VecDeque<String>>>,
    listening: Option<mpsc::Sender<String>>,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            if let (Some(tx), Some(rest)) = (&listening, line.strip_prefix(LISTENING)) {
                let _ = tx.send(rest.trim().to_string());
            }
            if let Ok(mut k) = kept.lock() {
                if k.len() == KEPT_LINES {
                    k.pop_front();
                }
                k.push_back(line);
            }
        }
    });
}

fn tail(kept: &Mutex<VecDeque<String>>) -> String {
    kept.lock()
        .map(|k| k.iter().cloned().collect::<Vec<_>>().join("\n"))
        .unwrap_or_default()
}
