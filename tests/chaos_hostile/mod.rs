//! The chaos suite's hostile-clients phase: bursts of clients that hold connections, trickle
//! headers and bodies, declare huge bodies, send oversized prompts or garbage, and drop
//! streams midway — against a serving cluster, while `/health` must keep answering within
//! a second and the model must stay loaded (no reap, no reload).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::support::http_deadline;

/// One kind of hostile client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Hostile {
    /// Connects and says nothing.
    Idle,
    /// Sends a request head a byte at a time.
    TrickleHead,
    /// Sends a body a byte at a time.
    TrickleBody,
    /// Declares a 1 TB body.
    HugeBody,
    /// A prompt of ~1.9 MB: tokenized, then refused as too long.
    OversizedPrompt,
    /// Random bytes instead of HTTP.
    Garbage,
    /// Starts a streamed completion and hangs up after the first bytes.
    DroppedStream,
}

pub const KINDS: [Hostile; 7] = [
    Hostile::Idle,
    Hostile::TrickleHead,
    Hostile::TrickleBody,
    Hostile::HugeBody,
    Hostile::OversizedPrompt,
    Hostile::Garbage,
    Hostile::DroppedStream,
];

/// How long the clients of a burst keep at it.
const BURST: Duration = Duration::from_secs(3);

fn connect(addr: &str) -> Option<TcpStream> {
    let sock = TcpStream::connect(addr).ok()?;
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .ok()?;
    sock.set_write_timeout(Some(Duration::from_secs(1))).ok()?;
    Some(sock)
}

/// Runs `count` clients of `kind` against `addr` until `stop` (or [`BURST`]) passes.
fn spawn_clients(
    kind: Hostile,
    count: usize,
    addr: &str,
    seed: u64,
    stop: &Arc<AtomicBool>,
) -> Vec<JoinHandle<()>> {
    (0..count)
        .map(|i| {
            let (addr, stop) = (addr.to_string(), Arc::clone(stop));
            let seed = seed.wrapping_add(i as u64);
            std::thread::spawn(move || one_client(kind, &addr, seed, &stop))
        })
        .collect()
}

fn one_client(kind: Hostile, addr: &str, seed: u64, stop: &AtomicBool) {
    let start = Instant::now();
    let going = || !stop.load(Ordering::Relaxed) && start.elapsed() < BURST;
    match kind {
        Hostile::Idle => {
            let _held = connect(addr);
            while going() {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Hostile::TrickleHead | Hostile::TrickleBody => {
            let Some(mut sock) = connect(addr) else {
                return;
            };
            let head = if kind == Hostile::TrickleBody {
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
            } else {
                ""
            };
            if sock.write_all(head.as_bytes()).is_err() {
                return;
            }
            let drip = b"GET /health HTTP/1.1\r\nX-a: b";
            let mut i = 0;
            while going() {
                let byte = if kind == Hostile::TrickleBody {
                    b' '
                } else {
                    drip[i % drip.len()]
                };
                if sock.write_all(&[byte]).is_err() {
                    return;
                }
                i += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Hostile::HugeBody => {
            let Some(mut sock) = connect(addr) else {
                return;
            };
            let _ = sock.write_all(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                  Content-Length: 1000000000000\r\n\r\n{\"prompt\":\"",
            );
            let mut buf = [0u8; 512];
            let _ = sock.read(&mut buf);
        }
        Hostile::OversizedPrompt => {
            let text = "Once upon a time there was a tiny model. ".repeat(1_900_000 / 41);
            let body = serde_json::json!({ "prompt": text, "max_tokens": 1 }).to_string();
            let _ = http_deadline(
                addr,
                "POST",
                "/v1/completions",
                Some(&body),
                Duration::from_secs(60),
            );
        }
        Hostile::Garbage => {
            let Some(mut sock) = connect(addr) else {
                return;
            };
            let mut x = seed | 1;
            let junk: Vec<u8> = (0..4096)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let _ = sock.write_all(&junk);
            let mut buf = [0u8; 512];
            let _ = sock.read(&mut buf);
        }
        Hostile::DroppedStream => {
            let Some(mut sock) = connect(addr) else {
                return;
            };
            let body = r#"{"prompt":"Once upon a time","max_tokens":64,"stream":true}"#;
            let req = format!(
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\n\r\n{body}",
                body.len()
            );
            if sock.write_all(req.as_bytes()).is_ok() {
                let mut buf = [0u8; 64];
                let _ = sock.read(&mut buf);
            }
        }
    }
}

/// What a burst did to the server.
pub struct Burst {
    /// Health probes made while the clients ran.
    pub probes: usize,
    /// The slowest of them.
    pub slowest: Duration,
}

/// A burst of every kind of hostile client (a seeded number of each) against `addr`, while
/// `/health` is probed: every probe must answer 200 within a second.
pub fn burst(addr: &str, seed: u64) -> Result<Burst, String> {
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for (k, kind) in KINDS.iter().enumerate() {
        let count = match kind {
            Hostile::Idle => 200,
            Hostile::OversizedPrompt => 6,
            _ => 4 + (seed >> (4 * k)) as usize % 12,
        };
        clients.extend(spawn_clients(*kind, count, addr, seed, &stop));
    }
    let (mut probes, mut slowest) = (0, Duration::ZERO);
    let mut failure = None;
    while clients.iter().any(|c| !c.is_finished()) {
        let start = Instant::now();
        match http_deadline(addr, "GET", "/health", None, Duration::from_secs(1)) {
            Ok((200, _)) => {
                slowest = slowest.max(start.elapsed());
                probes += 1;
            }
            other => {
                failure = Some(format!(
                    "/health under hostile clients after {probes} probes: {other:?}"
                ));
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.join();
    }
    match failure {
        Some(f) => Err(f),
        None => Ok(Burst { probes, slowest }),
    }
}
