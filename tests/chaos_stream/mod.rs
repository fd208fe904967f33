//! A long streamed completion the chaos test keeps in flight while it injects a fault.

use super::*;

/// A streamed completion read on its own thread until it ends, stalls, or is told to stop.
pub(crate) struct Stream {
    stop: Arc<AtomicBool>,
    /// Events received so far.
    events: Arc<AtomicU64>,
    reader: std::thread::JoinHandle<Result<&'static str, String>>,
}

impl Stream {
    /// Starts a long streamed completion and waits for its first text.
    pub(crate) fn start(addr: &str) -> Result<Stream, String> {
        let body = serde_json::json!({
            "prompt": [1, 5, 6], "max_tokens": 3000, "temperature": 0.0, "stream": true,
        })
        .to_string();
        let sock = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
        let mut tcp = std::net::TcpStream::connect_timeout(&sock, Duration::from_secs(5))
            .map_err(|e| format!("connect: {e}"))?;
        tcp.set_read_timeout(Some(STREAM_STALL))
            .map_err(|e| e.to_string())?;
        write!(
            tcp,
            "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .map_err(|e| format!("write: {e}"))?;
        let mut reader = BufReader::new(tcp);
        let mut line = String::new();
        while !line.contains("\"text\"") {
            line.clear();
            match reader.read_line(&mut line) {
                Ok(0) => return Err("stream ended before its first token".into()),
                Ok(_) => {}
                Err(e) => return Err(format!("no first token within {STREAM_STALL:?}: {e}")),
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let events = Arc::new(AtomicU64::new(1));
        let count = Arc::clone(&events);
        let reader = std::thread::spawn(move || {
            let mut line = String::new();
            loop {
                if flag.load(Ordering::SeqCst) {
                    return Ok("still running");
                }
                line.clear();
                match reader.read_line(&mut line) {
                    Ok(0) => return Ok("cut"),
                    Ok(_) if line.contains("[DONE]") => return Ok("done"),
                    Ok(_) => {
                        if line.starts_with("data: ") {
                            count.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    Err(e) => return Err(format!("stream stalled past {STREAM_STALL:?}: {e}")),
                }
            }
        });
        Ok(Stream {
            stop,
            events,
            reader,
        })
    }

    /// Lets the stream run for `settle` more (it must end or keep delivering), then stops
    /// reading, so the client goes away if it still runs; says how it ended.
    pub(crate) fn finish(self, settle: Duration) -> Result<String, String> {
        let before = self.events.load(Ordering::SeqCst);
        let start = Instant::now();
        while !self.reader.is_finished() && start.elapsed() < settle {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.stop.store(true, Ordering::SeqCst);
        let ended = self
            .reader
            .join()
            .unwrap_or_else(|_| Err("reader panicked".into()))?;
        let after = self.events.load(Ordering::SeqCst);
        Ok(format!(
            "{ended}, {after} events ({} while settling)",
            after - before
        ))
    }
}
