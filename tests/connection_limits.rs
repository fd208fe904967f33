//! `tether serve` against clients that hold connections: idle sockets beyond the cap,
//! headers or bodies trickled a byte at a time, a body declared a terabyte long. Each is
//! answered or closed within its limit while `/health` keeps answering. A flood of gRPC
//! connections leaves a worker's memory where it was once it has drained.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};
use support::{Serve, TinyModel, Worker, http_deadline, rss_kb};

/// The tests count descriptors and time closings on a small machine: one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serve(model: &TinyModel, extra: &[&str]) -> Serve {
    let mut args = vec!["--model", model.arg(), "--device", "cpu", "--threads", "1"];
    args.extend_from_slice(extra);
    Serve::start(&args)
}

fn open_descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// Waits until the server closes `sock` (a read returns 0 or fails), up to `limit`.
fn closed_within(sock: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        let left = limit.checked_sub(start.elapsed())?;
        sock.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .ok()?;
        match sock.read(&mut buf) {
            Ok(0) => return Some(start.elapsed()),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return None;
            }
            Err(_) => return Some(start.elapsed()),
        }
    }
}

#[test]
fn idle_connections_beyond_the_cap_cost_nothing_and_health_answers() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let model = TinyModel::new();
    // The header timeout is long enough that the first 16 still hold their slots when
    // /health comes, however slowly a loaded machine opens the 300 sockets.
    let serve = serve(
        &model,
        &["--max-connections", "16", "--header-timeout", "5s"],
    );
    assert!(
        serve.log_contains(" loaded:", Duration::from_secs(20)),
        "log:\n{}",
        serve.log()
    );
    let pid = serve.child.id();
    let before = open_descriptors(pid);
    let opened = Instant::now();
    let mut idle: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(&serve.addr).expect("connect"))
        .collect();
    // Until the server has accepted (and refused) them all, its descriptors stop changing
    // and its answers to those over the cap (200 ms each at most) are done.
    std::thread::sleep(Duration::from_millis(600));
    let mut during = open_descriptors(pid);
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(100));
        let now = open_descriptors(pid);
        if now == during {
            break;
        }
        during = now;
    }
    assert!(
        during <= before + 16 + 64 + 4,
        "300 idle connections took the server from {before} to {during} descriptors"
    );
    assert!(
        opened.elapsed() < Duration::from_secs(4),
        "opening 300 sockets took {:?}: the first would time out before /health is asked",
        opened.elapsed()
    );
    // Over the cap: refused at once with 503, not left hanging.
    let started = Instant::now();
    let (status, body) = http_deadline(&serve.addr, "GET", "/health", None, Duration::from_secs(2))
        .unwrap_or_else(|e| panic!("/health over the cap: {e}; log:\n{}", serve.log()));
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("too many open connections"), "{body}");
    assert!(started.elapsed() < Duration::from_secs(1));
    // Those over the cap were answered and closed; the rest are closed at the header
    // timeout, and /health answers again.
    let mut held = 0;
    for s in &mut idle {
        if closed_within(s, Duration::from_millis(50)).is_none() {
            held += 1;
        }
    }
    assert!(
        held <= 16,
        "{held} idle connections open beyond the cap of 16"
    );
    let all_closed = opened + Duration::from_secs(9);
    for s in &mut idle {
        let left = all_closed.saturating_duration_since(Instant::now());
        assert!(
            closed_within(s, left).is_some(),
            "an idle connection outlived the 5 s header timeout"
        );
    }
    drop(idle);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match http_deadline(&serve.addr, "GET", "/health", None, Duration::from_secs(2)) {
            Ok((200, _)) => break,
            other if Instant::now() > deadline => {
                panic!("/health after the flood: {other:?}; log:\n{}", serve.log())
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

#[test]
fn trickled_headers_are_cut_at_the_header_timeout() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let model = TinyModel::new();
    let serve = serve(&model, &["--header-timeout", "1s"]);
    let mut sock = TcpStream::connect(&serve.addr).expect("connect");
    sock.write_all(b"GET /health HTTP/1.1\r\n").expect("write");
    let start = Instant::now();
    let mut cut = None;
    for _ in 0..40 {
        std::thread::sleep(Duration::from_millis(200));
        if sock.write_all(b"X-Slow: a\r\n").is_err() {
            cut = Some(start.elapsed());
            break;
        }
        if let Some(after) = closed_within(&mut sock, Duration::from_millis(1)) {
            cut = Some(start.elapsed() + after);
            break;
        }
    }
    let cut = cut.expect("a connection trickling headers stayed open for 8 s");
    assert!(cut < Duration::from_secs(4), "cut after {cut:?}");
}

#[test]
fn a_body_declared_too_large_is_refused_before_it_is_read() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let model = TinyModel::new();
    let serve = serve(&model, &[]);
    let mut sock = TcpStream::connect(&serve.addr).expect("connect");
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: 1000000000000\r\n\r\n{{\"prompt\":",
        serve.addr
    );
    sock.write_all(head.as_bytes()).expect("write");
    sock.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    let mut answer = vec![0u8; 4096];
    let n = sock
        .read(&mut answer)
        .unwrap_or_else(|e| panic!("no answer to a 1 TB body: {e}"));
    let text = String::from_utf8_lossy(&answer[..n]);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("--max-body-bytes"), "{text}");
}

#[test]
fn a_trickled_body_gets_408_at_the_body_timeout() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let model = TinyModel::new();
    let serve = serve(&model, &["--body-timeout", "1s"]);
    let mut sock = TcpStream::connect(&serve.addr).expect("connect");
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: 200\r\n\r\n{{",
        serve.addr
    );
    sock.write_all(head.as_bytes()).expect("write");
    let start = Instant::now();
    sock.set_read_timeout(Some(Duration::from_millis(250)))
        .expect("timeout");
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    // A byte every 250 ms: a per-read timeout of a second would never fire.
    while start.elapsed() < Duration::from_secs(6) {
        let _ = sock.write_all(b" ");
        match sock.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                answer.extend_from_slice(&buf[..n]);
                if answer.windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            Err(_) => {}
        }
    }
    let took = start.elapsed();
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 408"), "after {took:?}: {text}");
    assert!(took < Duration::from_secs(3), "408 after {took:?}");
    // The server is fine: a normal request on a new connection succeeds.
    let (status, body) = http_deadline(
        &serve.addr,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt":"Once","max_tokens":2,"temperature":0}"#),
        Duration::from_secs(20),
    )
    .expect("completion");
    assert_eq!(status, 200, "{body}");
}

/// Raises this process's soft descriptor limit to its hard one; returns the soft limit now.
fn raise_descriptor_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid rlimit of our own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 1024;
        }
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
            return lim.rlim_max;
        }
    }
    lim.rlim_cur
}

/// Opens as many connections to `addr` as the descriptor limit allows (up to 2000), each
/// sending `hello` and then nothing; checks that they grow process `pid` by 10 MiB or more
/// and that within 5 s of their closing its RSS is back within 4 MiB of where it was (or a
/// quarter of what the flood added: pages that hold a live allocation or two stay). Returns
/// that bound in kB.
fn flood_gives_its_memory_back(pid: u32, addr: &str, hello: &[u8]) -> u64 {
    let flood = (raise_descriptor_limit().saturating_sub(100) as usize).min(2000);
    assert!(flood >= 500, "only {flood} descriptors to flood with");
    std::thread::sleep(Duration::from_millis(300));
    let baseline_kb = rss_kb(pid);
    let socks: Vec<TcpStream> = (0..flood)
        .map(|_| {
            let mut s = TcpStream::connect(addr).expect("connect");
            s.write_all(hello).expect("hello");
            s
        })
        .collect();
    let since = Instant::now();
    let grown_kb = loop {
        let grown = rss_kb(pid).saturating_sub(baseline_kb);
        if grown >= 10 * 1024 || since.elapsed() > Duration::from_secs(10) {
            // The last sockets may still be getting their buffers.
            std::thread::sleep(Duration::from_millis(300));
            break grown.max(rss_kb(pid).saturating_sub(baseline_kb));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        grown_kb >= 10 * 1024,
        "{flood} connections grew the process by only {grown_kb} kB: the test measures nothing"
    );
    drop(socks);
    let dropped = Instant::now();
    let bound_kb = (4 * 1024).max(grown_kb / 4);
    loop {
        let now_kb = rss_kb(pid);
        if now_kb <= baseline_kb + bound_kb {
            println!(
                "{flood} connections: RSS {baseline_kb} kB, +{grown_kb} kB while open, {now_kb} kB after {:?}",
                dropped.elapsed()
            );
            return bound_kb;
        }
        assert!(
            dropped.elapsed() < Duration::from_secs(5),
            "5 s after {flood} connections closed the process holds {now_kb} kB, baseline {baseline_kb} kB (+{grown_kb} kB while open)"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_drained_flood_of_grpc_connections_gives_its_memory_back() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let worker = Worker::start(&["--max-connections", "4096"]);
    // The HTTP/2 preface and an empty SETTINGS frame: each connection gets its buffers
    // and then waits for more.
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    let bound_kb = flood_gives_its_memory_back(worker.pid(), &worker.addr, &hello);
    let status = worker.status();
    assert_eq!(status["sessions"], 0);
    // What the worker reports unaccounted is its RSS over its start: within the bound
    // above, plus what it grew from its start to the flood.
    assert!(
        status["unaccounted_bytes"].as_u64().unwrap_or(u64::MAX) < (bound_kb << 10) + (8 << 20),
        "{status}"
    );
}

#[test]
fn a_drained_flood_of_api_connections_gives_its_memory_back() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let model = TinyModel::new();
    let serve = serve(&model, &["--max-connections", "4096"]);
    assert!(
        serve.log_contains(" loaded:", Duration::from_secs(20)),
        "log:\n{}",
        serve.log()
    );
    // A request head cut short: each connection gets its read buffer and waits.
    let hello = b"GET /health HTTP/1.1\r\nHost: flood\r\n";
    flood_gives_its_memory_back(serve.child.id(), &serve.addr, hello);
    let (status, body) = http_deadline(&serve.addr, "GET", "/health", None, Duration::from_secs(2))
        .unwrap_or_else(|e| panic!("/health after the flood: {e}; log:\n{}", serve.log()));
    assert_eq!(status, 200, "{body}");
}
