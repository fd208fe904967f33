//! `tether serve --worker-dns`: workers found through a DNS name. `localhost:PORT` stands in
//! for a Kubernetes headless Service: it resolves without a DNS server, and the worker that
//! appears behind it later is the pod that became ready.

mod support;

use std::time::{Duration, Instant};
use support::{Serve, TinyModel, Worker, http, http_json};

/// A port nothing listens on now (bound, then released).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local address").port()
}

/// Polls `/health` until it answers `want` or `timeout` passes; returns the last answer.
fn wait_health(serve: &Serve, want: u16, timeout: Duration) -> (u16, String) {
    let start = Instant::now();
    loop {
        let (status, body) = http(&serve.addr, "GET", "/health", None);
        if status == want || start.elapsed() > timeout {
            return (status, body);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn serve_waits_for_a_worker_behind_the_name_then_loads_and_serves() {
    let model = TinyModel::new();
    let port = free_port();
    let name = format!("localhost:{port}");
    let serve = Serve::start(&[
        "--model",
        model.arg(),
        "--worker-dns",
        &name,
        "--dns-refresh",
        "200ms",
        "--lease-ttl",
        "1s",
    ]);

    let (status, body) = http(&serve.addr, "GET", "/health", None);
    assert_eq!(
        status,
        503,
        "no worker listens yet: {body}; log:\n{}",
        serve.log()
    );
    let prompt =
        serde_json::json!({"prompt": [1, 17, 42], "max_tokens": 4, "temperature": 0.0}).to_string();
    let (status, body) = http(&serve.addr, "POST", "/v1/completions", Some(&prompt));
    assert_eq!(status, 503, "a completion before any worker: {body}");

    let worker =
        Worker::try_start_at(&format!("127.0.0.1:{port}"), &[]).unwrap_or_else(|e| panic!("{e}"));
    // The coordinator retries every 3 s; the load itself takes well under a second.
    let (status, body) = wait_health(&serve, 200, Duration::from_secs(30));
    assert_eq!(
        status,
        200,
        "not ready 30 s after the worker started: {body}; serve log:\n{}\nworker log:\n{}",
        serve.log(),
        worker.log()
    );

    let (status, body) = http(&serve.addr, "POST", "/v1/completions", Some(&prompt));
    assert_eq!(status, 200, "{body}");
    let reply: serde_json::Value = serde_json::from_str(&body).expect("JSON completion");
    assert_eq!(
        reply["usage"]["completion_tokens"].as_u64(),
        Some(4),
        "{reply}"
    );
    let placement = http_json(&serve.addr, "/v1/admin/model")["placement"].to_string();
    assert!(
        placement.contains(&format!("127.0.0.1:{port}")),
        "the model sits on the resolved worker: {placement}"
    );
}

#[test]
fn a_worker_dns_name_without_a_port_is_refused_at_start() {
    let model = TinyModel::new();
    let mut serve = Serve::spawn(&["--model", model.arg(), "--worker-dns", "tether-workers"]);
    let status = serve
        .wait_exit(Duration::from_secs(30))
        .unwrap_or_else(|| panic!("serve kept running; log:\n{}", serve.log()));
    assert!(!status.success());
    // Lets the output pumps take the last lines.
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        serve.log().contains("needs a port"),
        "the error says what is wrong; log:\n{}",
        serve.log()
    );
}
