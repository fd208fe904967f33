//! `tether serve` as a real process, and waiting for processes.

use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{TETHER, pump_lines};

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
        let mut serve = Serve::launch("127.0.0.1:0", args, Some(tx));
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
        Serve::launch("127.0.0.1:0", args, None)
    }

    /// Starts `tether serve --listen LISTEN ARGS` without waiting for it to listen.
    pub fn spawn_at(listen: &str, args: &[&str]) -> Serve {
        Serve::launch(listen, args, None)
    }

    fn launch(
        listen: &str,
        args: &[&str],
        listening: Option<std::sync::mpsc::Sender<String>>,
    ) -> Serve {
        let mut child = Command::new(TETHER)
            .args(["serve", "--listen", listen])
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

    /// The HTTP address from its "bound" line (printed before the model loads), waiting
    /// up to `timeout` for it.
    pub fn wait_bound(&self, timeout: Duration) -> Option<String> {
        let needle = "tether serve bound http://";
        if !self.log_contains(needle, timeout) {
            return None;
        }
        let log = self.log();
        let rest = log.split(needle).nth(1)?;
        rest.split(';').next().map(str::to_string)
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
