//! `tether serve` binds its port before it loads: a busy port fails at once, and while the
//! model loads `/health` answers 503 `loading` with the bytes per worker and every other
//! path 503 `model_loading`, until the model serves.

mod support;

use std::time::{Duration, Instant};
use support::{Serve, TinyModel, Worker, http};

#[test]
fn a_busy_port_fails_before_anything_loads() {
    let model = TinyModel::new();
    let worker = Worker::start(&[]);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a port");
    let addr = taken.local_addr().expect("its address").to_string();
    let started = Instant::now();
    // A load would pause 60 s before Commit: an exit well before shows the bind came first.
    let mut serve = support::Serve::spawn_at(
        &addr,
        &[
            "--model",
            model.arg(),
            "--worker",
            &worker.addr,
            "--debug-pause-before-commit",
            "60s",
        ],
    );
    let status = serve
        .wait_exit(Duration::from_secs(30))
        .unwrap_or_else(|| panic!("serve on a busy port did not exit; log:\n{}", serve.log()));
    assert!(!status.success(), "log:\n{}", serve.log());
    assert!(started.elapsed() < Duration::from_secs(30));
    let log = serve.log();
    assert!(log.contains(&format!("binding {addr}")), "log:\n{log}");
    assert!(!log.contains("tether serve bound"), "log:\n{log}");
    let status = worker.status();
    assert_eq!(
        status["counters"]["opened"].as_u64(),
        Some(0),
        "no session was opened on the worker: {status}"
    );
}

#[test]
fn health_says_loading_with_progress_until_the_model_serves() {
    let model = TinyModel::new();
    let worker = Worker::start(&[]);
    let serve = Serve::spawn(&[
        "--model",
        model.arg(),
        "--worker",
        &worker.addr,
        "--threads",
        "1",
        "--debug-pause-before-commit",
        "3s",
    ]);
    let addr = serve
        .wait_bound(Duration::from_secs(30))
        .unwrap_or_else(|| panic!("serve printed no bound line; log:\n{}", serve.log()));
    // Every byte is prepared before the pause: wait for the progress to show them.
    let deadline = Instant::now() + Duration::from_secs(30);
    let loading = loop {
        let (status, body) = http(&addr, "GET", "/health", None);
        assert_eq!(status, 503, "GET /health while loading: {body}");
        let json: serde_json::Value = serde_json::from_str(&body).expect("health JSON");
        assert_eq!(json["status"], "loading", "{json}");
        let p = &json["progress"];
        if p["bytes_total"].as_u64().unwrap_or(0) > 0 && p["bytes_loaded"] == p["bytes_total"] {
            break json;
        }
        assert!(Instant::now() < deadline, "no progress: {json}");
        std::thread::sleep(Duration::from_millis(20));
    };
    let workers = loading["progress"]["workers"].as_array().expect("workers");
    assert_eq!(workers.len(), 1, "{loading}");
    assert_eq!(workers[0]["worker"], worker.addr.as_str(), "{loading}");
    let (status, body) = http(
        &addr,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt":"hi","max_tokens":1}"#),
    );
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("model_loading"), "{body}");
    assert!(
        serve.log_contains("tether serve listening on", Duration::from_secs(30)),
        "the model never served; log:\n{}",
        serve.log()
    );
    let (status, body) = http(&addr, "GET", "/health", None);
    assert_eq!(status, 200, "{body}");
    let (status, body) = http(
        &addr,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt":"hi","max_tokens":1}"#),
    );
    assert_eq!(status, 200, "{body}");
}
