//! The chaos test's cluster: two workers behind fault proxies and the `tether serve` over
//! them, with the ways the test starts, stops and inspects it.

use super::*;

pub(crate) struct Cluster {
    pub(crate) model: TinyModel,
    pub(crate) workers: [Worker; 2],
    pub(crate) proxies: [Proxy; 2],
    pub(crate) serve: Option<Serve>,
}

impl Cluster {
    pub(crate) fn serve_args(&self) -> Vec<String> {
        [
            "--model",
            self.model.arg(),
            "--worker",
            &self.proxies[0].addr,
            "--worker",
            &self.proxies[1].addr,
            "--lease-ttl",
            "1s",
            "--threads",
            "1",
            "--ctx",
            "4096",
        ]
        .map(str::to_string)
        .to_vec()
    }

    pub(crate) fn spawn_serve(&mut self) {
        let args = self.serve_args();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.serve = Some(Serve::spawn(&args));
    }

    /// Waits for the spawned serve to listen; Err when it exited or took too long.
    pub(crate) fn await_listening(&mut self, timeout: Duration) -> Result<(), String> {
        let start = Instant::now();
        let serve = self.serve.as_mut().ok_or("no serve")?;
        loop {
            if let Some(addr) = serve.listening_addr() {
                serve.addr = addr;
                return Ok(());
            }
            if let Ok(Some(status)) = serve.child.try_wait() {
                return Err(format!("serve exited {status:?}; log:\n{}", serve.log()));
            }
            if start.elapsed() > timeout {
                return Err(format!(
                    "serve not listening after {timeout:?}; log:\n{}",
                    serve.log()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub(crate) fn stop_serve(&mut self, signal: i32) {
        if let Some(mut serve) = self.serve.take() {
            // Already gone (and reaped): there is nothing to signal.
            if serve.child.try_wait().ok().flatten().is_some() {
                return;
            }
            send_signal(serve.child.id(), signal);
            if signal == libc::SIGTERM && serve.wait_exit(Duration::from_secs(15)).is_none() {
                send_signal(serve.child.id(), libc::SIGKILL);
            }
            let _ = serve.wait_exit(Duration::from_secs(5));
        }
    }

    /// Polls both workers until `want(sessions, bytes)` holds; the time it took, or None.
    pub(crate) fn wait_workers(
        &self,
        timeout: Duration,
        want: impl Fn(u64, u64) -> bool,
    ) -> Option<Duration> {
        let start = Instant::now();
        for w in &self.workers {
            w.wait_status(timeout.saturating_sub(start.elapsed()), |s| {
                let (n, b) = support::sessions_and_bytes(s);
                want(n, b)
            })?;
        }
        Some(start.elapsed())
    }

    pub(crate) fn worker_states(&self) -> String {
        self.workers
            .iter()
            .map(|w| format!("{} {:?}", w.addr, support::sessions_and_bytes(&w.status())))
            .collect::<Vec<_>>()
            .join(", ")
    }
}
