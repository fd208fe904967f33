//! A worker started with `--token` serves only clients that carry it: without it or with a
//! wrong one every data-plane call is UNAUTHENTICATED and nothing is opened or reserved;
//! with it sessions load and serve, and `tether run` / `tether serve` with `--worker-token`
//! generate end to end.
//! All against real `tether worker` processes.

mod support;

use std::process::{Command, Output};
use std::time::Duration;
use support::{
    Serve, TETHER, TETHERCTL, TinyModel, Worker, full_load, http, http_json, sessions_and_bytes,
};
use tether_client::{AttachOptions, ClientOptions, ErrorKind, Health, WorkerClient, check_health};
use tether_protocol::{BearerToken, ForwardInput, ForwardOutput, Lease, Rows, TokenPos};

const TOKEN: &str = "worker-auth-test-7f3c9e";

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn options(token: Option<&str>) -> ClientOptions {
    ClientOptions {
        token: BearerToken::parse(token).expect("token"),
        ..ClientOptions::default()
    }
}

/// `tetherctl --worker ADDR --json ARGS`, with TETHER_WORKER_TOKEN set to `token` when given.
fn tetherctl(addr: &str, token: Option<&str>, args: &[&str]) -> Output {
    let mut cmd = Command::new(TETHERCTL);
    cmd.args(["--worker", addr, "--json"])
        .args(args)
        .env_remove("TETHER_ADMIN_TOKEN")
        .env_remove("TETHER_WORKER_TOKEN");
    if let Some(t) = token {
        cmd.env("TETHER_WORKER_TOKEN", t);
    }
    cmd.output().expect("run tetherctl")
}

fn status(addr: &str) -> serde_json::Value {
    let out = tetherctl(addr, Some(TOKEN), &["status"]);
    assert!(
        out.status.success(),
        "tetherctl status with the worker token: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("tetherctl prints JSON")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn clients_without_the_token_are_refused_and_leave_nothing_behind() {
    let worker = Worker::start(&["--token", TOKEN]);
    let rt = runtime();
    let health = rt
        .block_on(check_health(&worker.addr, "", &options(None)))
        .expect("health needs no token");
    assert_eq!(health, Health::Serving);
    for (given, what) in [(None, "no token"), (Some("wrong-token"), "a wrong token")] {
        let err = rt
            .block_on(WorkerClient::connect(&worker.addr, &options(given)))
            .err()
            .unwrap_or_else(|| panic!("a client with {what} was admitted"));
        assert_eq!(err.kind(), ErrorKind::Unauthenticated, "{what}: {err}");
        assert!(!err.to_string().contains(TOKEN), "{err}");
    }
    // A real `tether attach` process without the token fails and says what to pass.
    let attach = Command::new(TETHER)
        .args(["attach", "--worker", &worker.addr, "--model", "unused.gguf"])
        .arg("--no-load")
        .env_remove("TETHER_WORKER_TOKEN")
        .output()
        .expect("run tether attach");
    assert!(!attach.status.success(), "{}", text(&attach));
    assert!(
        text(&attach).contains("--worker-token"),
        "{}",
        text(&attach)
    );
    // Admin calls take the data token too (no --admin-token), and only it.
    let refused = tetherctl(&worker.addr, None, &["status"]);
    assert!(!refused.status.success(), "{}", text(&refused));
    let refused = tetherctl(&worker.addr, Some("wrong-token"), &["status"]);
    assert!(!refused.status.success(), "{}", text(&refused));
    let s = status(&worker.addr);
    assert_eq!(sessions_and_bytes(&s), (0, 0), "{s}");
    assert_eq!(s["counters"]["opened"], 0, "{s}");
    assert!(
        worker.log().contains("refused a call"),
        "the worker logs refusals: {}",
        worker.log()
    );
    assert!(
        !worker.log().contains(TOKEN),
        "the log must not hold the token"
    );
}

#[test]
fn the_right_token_loads_and_serves_a_session() {
    let model = TinyModel::new();
    let worker = Worker::start(&["--token", TOKEN]);
    let rt = runtime();
    rt.block_on(async {
        let client = WorkerClient::connect(&worker.addr, &options(Some(TOKEN)))
            .await
            .expect("connect with the token");
        let session = client
            .attach(AttachOptions {
                client_name: "worker-auth".into(),
                lease: Lease {
                    heartbeat_interval: Duration::from_millis(200),
                    ttl: Duration::from_secs(5),
                },
                heartbeat: true,
            })
            .await
            .expect("attach with the token");
        let (request, source, _) = full_load(&model.path, 16);
        let txn = request.txn;
        let reserved = client
            .prepare(session.id(), request, source)
            .await
            .expect("prepare");
        assert!(reserved > 0);
        client.commit(session.id(), txn).await.expect("commit");
        let out = client
            .forward(
                session.id(),
                &[TokenPos { seq: 0, pos: 0 }],
                &ForwardInput::TokenIds(vec![1]),
                &[0],
                Rows::Logits,
            )
            .await
            .expect("forward");
        let ForwardOutput::Logits(logits) = out else {
            panic!("asked for logits, got {out:?}");
        };
        assert!(!logits.is_empty() && logits.iter().all(|x| x.is_finite()));
        let held = status(&worker.addr);
        assert_eq!(held["sessions"], 1, "{held}");
        session.close().await;
    });
    let s = status(&worker.addr);
    assert_eq!(sessions_and_bytes(&s), (0, 0), "{s}");
}

fn tether_run(addr: &str, model: &TinyModel, token: Option<&str>) -> Output {
    let mut cmd = Command::new(TETHER);
    cmd.args(["run", "--model", model.arg(), "--worker", addr])
        .args(["-n", "4", "--ctx", "32", "--temp", "0", "-p", "hello"])
        .env_remove("TETHER_WORKER_TOKEN");
    if let Some(t) = token {
        cmd.args(["--worker-token", t]);
    }
    cmd.output().expect("run tether run")
}

#[test]
fn tether_run_with_the_worker_token_generates_end_to_end() {
    let model = TinyModel::new();
    let worker = Worker::start(&["--token", TOKEN]);
    let refused = tether_run(&worker.addr, &model, None);
    assert!(!refused.status.success(), "{}", text(&refused));
    assert!(
        text(&refused).contains("Unauthenticated") && text(&refused).contains("--worker-token"),
        "{}",
        text(&refused)
    );
    let ran = tether_run(&worker.addr, &model, Some(TOKEN));
    assert!(ran.status.success(), "{}", text(&ran));
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert!(stderr.contains("| generated "), "{stderr}");
    assert!(
        String::from_utf8_lossy(&ran.stdout).starts_with("hello"),
        "{}",
        text(&ran)
    );
    let s = status(&worker.addr);
    assert_eq!(sessions_and_bytes(&s), (0, 0), "{s}");
    assert_eq!(
        s["counters"]["opened"], 1,
        "only the run with the token opened a session: {s}"
    );
}

#[test]
fn tether_serve_with_the_worker_token_serves_and_reads_worker_status() {
    let model = TinyModel::new();
    let worker = Worker::start(&["--token", TOKEN]);
    let serve = Serve::start(&[
        "--model",
        model.arg(),
        "--worker",
        &worker.addr,
        "--worker-token",
        TOKEN,
        "--ctx",
        "32",
        "--parallel",
        "1",
    ]);
    let (code, health) = http(&serve.addr, "GET", "/health", None);
    assert_eq!(code, 200, "{health}");
    let body = r#"{"prompt": [1, 2], "max_tokens": 3, "temperature": 0}"#;
    let (code, reply) = http(&serve.addr, "POST", "/v1/completions", Some(body));
    assert_eq!(code, 200, "{reply}");
    // Without --admin-token, the coordinator's admin view uses the worker token too.
    let workers = http_json(&serve.addr, "/v1/admin/workers");
    let workers = workers.as_array().expect("worker list");
    assert_eq!(workers.len(), 1, "{workers:?}");
    assert_eq!(workers[0]["status"]["sessions"], 1, "{workers:?}");
    assert!(
        !serve.log().contains(TOKEN),
        "the log must not hold the token"
    );
}

/// One HTTP/1.1 request carrying `Authorization: Bearer KEY`: the status and the body.
fn http_with_key(addr: &str, path: &str, key: &str, body: Option<&str>) -> (u16, String) {
    use std::io::{BufReader, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to serve");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("read timeout");
    let (method, body) = body.map_or(("GET", ""), |b| ("POST", b));
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).expect("write request");
    let mut reader = BufReader::new(stream);
    let (status, chunked) = support::http_read_head(&mut reader);
    (status, support::http_read_body(&mut reader, chunked))
}

#[test]
fn embedded_workers_of_tether_serve_refuse_callers_without_their_secret() {
    const KEY: &str = "serve-api-key-31d0";
    let model = TinyModel::new();
    let serve = Serve::start(&[
        "--model",
        model.arg(),
        "--api-key",
        KEY,
        "--device",
        "cpu",
        "--threads",
        "1",
        "--ctx",
        "32",
        "--parallel",
        "1",
    ]);
    // The coordinator reaches its worker's admin service with the generated secret.
    let (code, workers) = http_with_key(&serve.addr, "/v1/admin/workers", KEY, None);
    assert_eq!(code, 200, "{workers}");
    let workers: serde_json::Value = serde_json::from_str(&workers).expect("JSON");
    assert_eq!(workers[0]["status"]["sessions"], 1, "{workers}");
    let worker = workers[0]["worker"].as_str().expect("worker address");
    let (code, sessions) = http_with_key(&serve.addr, "/v1/admin/sessions", KEY, None);
    assert_eq!(code, 200, "{sessions}");
    let sessions: serde_json::Value = serde_json::from_str(&sessions).expect("JSON");
    let session = sessions[0]["sessions"][0]["session_id"]
        .as_str()
        .unwrap_or_else(|| panic!("a session id in {sessions}"))
        .to_string();

    // Another local process gets nothing: no session calls (Hello, then Forward, ...), no
    // status, kill or drain, with no token, the API key, or a guess.
    let rt = runtime();
    for given in [None, Some(KEY), Some("guess")] {
        let err = rt
            .block_on(WorkerClient::connect(worker, &options(given)))
            .err()
            .unwrap_or_else(|| panic!("a session client with {given:?} was admitted"));
        assert_eq!(err.kind(), ErrorKind::Unauthenticated, "{given:?}: {err}");
        for args in [
            vec!["status"],
            vec!["kill", session.as_str()],
            vec!["drain"],
        ] {
            let refused = tetherctl(worker, given, &args);
            assert!(
                !refused.status.success(),
                "tetherctl {args:?} with {given:?}: {}",
                text(&refused)
            );
            assert!(
                text(&refused).to_lowercase().contains("token"),
                "tetherctl {args:?}: {}",
                text(&refused)
            );
        }
    }

    // Serving goes on over the same session, its forward passes on a data link that the
    // secret opened (no fallback to gRPC).
    let body = r#"{"prompt": [1, 2], "max_tokens": 3, "temperature": 0}"#;
    let (code, reply) = http_with_key(&serve.addr, "/v1/completions", KEY, Some(body));
    assert_eq!(code, 200, "{reply}");
    let (code, health) = http(&serve.addr, "GET", "/health", None);
    assert_eq!(code, 200, "{health}");
    let (_, workers) = http_with_key(&serve.addr, "/v1/admin/workers", KEY, None);
    let workers: serde_json::Value = serde_json::from_str(&workers).expect("JSON");
    let status = &workers[0]["status"];
    assert_eq!(status["sessions"], 1, "{workers}");
    assert_eq!(status["draining"], false, "{workers}");
    assert_eq!(status["counters"]["killed"], 0, "{workers}");
    assert!(!serve.log().contains("no data link"), "{}", serve.log());
}

#[test]
fn connections_that_never_begin_a_handshake_are_closed_and_tetherctl_still_connects() {
    use std::io::Read;
    const SILENT: usize = 200;
    let worker = Worker::start(&[
        "--token",
        TOKEN,
        "--handshake-timeout",
        "1s",
        "--max-connections",
        "64",
    ]);
    // Three times the cap, none of which ever sends the HTTP/2 preface.
    let mut silent: Vec<std::net::TcpStream> = (0..SILENT)
        .map(|_| std::net::TcpStream::connect(&worker.addr).expect("connect to the worker"))
        .collect();
    let started = std::time::Instant::now();
    // Each is closed: those beyond the cap at once, the others at the 1 s deadline.
    for (i, conn) in silent.iter_mut().enumerate() {
        conn.set_read_timeout(Some(Duration::from_secs(3)))
            .expect("read timeout");
        let mut buf = [0u8; 256];
        let read = loop {
            match conn.read(&mut buf) {
                Ok(n) if n > 0 => continue,
                other => break other,
            }
        };
        if let Err(e) = read {
            assert!(
                !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ),
                "silent connection {i} is still open after {:?}",
                started.elapsed()
            );
        }
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    // The operator's tool connects, and a real client serves.
    let s = status(&worker.addr);
    assert_eq!(sessions_and_bytes(&s), (0, 0), "{s}");
    let rt = runtime();
    let client = rt
        .block_on(WorkerClient::connect(&worker.addr, &options(Some(TOKEN))))
        .expect("a client with the token connects");
    drop(client);
    assert!(
        !worker.log().contains(TOKEN),
        "the log must not hold the token"
    );
}
