//! Sessions of a real worker process end however their client goes away, and free every
//! byte: kill -9 of the client, a silent (zombie) client, an operator's kill; malformed
//! requests get clear errors and change nothing.

mod support;

use std::time::{Duration, Instant};
use support::{Attached, TinyModel, Worker, send_signal, sessions_and_bytes, tetherctl_json};
use tether_client::{AttachOptions, ClientOptions, ErrorKind, WorkerClient};
use tether_protocol::{ForwardInput, Lease, Rows, SessionId, TokenPos, TxnId};

#[test]
fn kill_9_of_the_client_frees_its_session_within_a_second() {
    let model = TinyModel::new();
    let worker = Worker::start(&[]);
    let client = Attached::start(&worker.addr, &["--model", model.arg()]);
    let loaded = worker.wait_status(Duration::from_secs(10), |s| {
        s["session_bytes"].as_u64().unwrap_or(0) > 0
    });
    assert!(loaded.is_some(), "the attached client loads its layers");
    let held = worker.status()["session_bytes"].as_u64().unwrap_or(0);
    println!("attached client holds {held} bytes");
    let killed_at = Instant::now();
    send_signal(client.child.id(), libc::SIGKILL);
    worker
        .wait_status(Duration::from_secs(3), |s| sessions_and_bytes(s) == (0, 0))
        .expect("the session of a killed client must end");
    let latency = killed_at.elapsed();
    println!(
        "kill -9 → sessions 0 and session_bytes 0 seen by tetherctl {latency:?} after the kill"
    );
    assert!(latency < Duration::from_secs(1), "took {latency:?}");
    let status = worker.status();
    assert_eq!(status["counters"]["disconnected"], 1);
    assert!(
        worker.log().contains("reason=disconnected"),
        "{}",
        worker.log()
    );
}

#[test]
fn a_client_that_stops_heartbeating_is_reaped_within_ttl_plus_one_second() {
    let worker = Worker::start(&[]);
    let started = Instant::now();
    let zombie = Attached::start(
        &worker.addr,
        &[
            "--model",
            "unused.gguf",
            "--no-load",
            "--no-heartbeat",
            "--ttl",
            "500ms",
            "--heartbeat",
            "100ms",
        ],
    );
    let healthy = Attached::start(
        &worker.addr,
        &[
            "--model",
            "unused.gguf",
            "--no-load",
            "--ttl",
            "500ms",
            "--heartbeat",
            "100ms",
        ],
    );
    worker
        .wait_status(Duration::from_secs(3), |s| s["counters"]["reaped"] == 1)
        .expect("the zombie must be reaped");
    let latency = started.elapsed();
    println!("zombie (TTL 500 ms) reaped {latency:?} after it attached");
    assert!(latency < Duration::from_millis(1500), "took {latency:?}");
    std::thread::sleep(Duration::from_millis(700));
    let status = worker.status();
    assert_eq!(
        sessions_and_bytes(&status).0,
        1,
        "the heartbeating client stays: {status}"
    );
    assert_eq!(status["counters"]["reaped"], 1);
    assert!(worker.log().contains("reason=reaped"));
    drop((zombie, healthy));
}

#[test]
fn tetherctl_lists_kills_drains_and_undrains() {
    let worker = Worker::start(&[]);
    let client = Attached::start(&worker.addr, &["--model", "unused.gguf", "--no-load"]);
    let sessions = tetherctl_json(&worker.addr, &["sessions"]);
    assert_eq!(
        sessions[0]["session_id"],
        client.session.as_str(),
        "{sessions}"
    );
    let killed = tetherctl_json(&worker.addr, &["kill", &client.session]);
    assert_eq!(killed["bytes_freed"], 0);
    worker
        .wait_status(Duration::from_secs(2), |s| {
            s["counters"]["killed"] == 1 && s["sessions"] == 0
        })
        .expect("killed");
    tetherctl_json(&worker.addr, &["drain"]);
    assert_eq!(worker.status()["draining"], true);
    let out = std::process::Command::new(support::TETHER)
        .args([
            "attach",
            "--worker",
            &worker.addr,
            "--model",
            "unused.gguf",
            "--no-load",
        ])
        .output()
        .expect("run attach");
    assert!(
        !out.status.success(),
        "a draining worker refuses new sessions"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("draining"));
    let undrained = tetherctl_json(&worker.addr, &["undrain"]);
    assert_eq!(undrained["was_draining"], true, "{undrained}");
    assert_eq!(worker.status()["draining"], false);
    // Attaching works again.
    let again = Attached::start(&worker.addr, &["--model", "unused.gguf", "--no-load"]);
    assert_eq!(worker.status()["sessions"], 1);
    drop(again);
}

#[test]
fn tetherctl_watch_shows_the_status_again_until_interrupted() {
    let worker = Worker::start(&[]);
    let mut watch = std::process::Command::new(support::TETHERCTL)
        .args([
            "--worker",
            &worker.addr,
            "--json",
            "--watch",
            "0.2",
            "status",
        ])
        .env_remove("TETHER_ADMIN_TOKEN")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run tetherctl --watch");
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        watch.try_wait().expect("poll").is_none(),
        "--watch keeps running"
    );
    watch.kill().expect("interrupting it");
    let out = watch.wait_with_output().expect("its output");
    let shown: Vec<serde_json::Value> = serde_json::Deserializer::from_slice(&out.stdout)
        .into_iter()
        .collect::<Result<_, _>>()
        .expect("a JSON status per refresh");
    assert!(
        shown.len() >= 3,
        "{} refreshes in 1.5 s at 0.2 s",
        shown.len()
    );
    assert!(shown.iter().all(|s| s["sessions"] == 0), "{shown:?}");
    let refused = std::process::Command::new(support::TETHERCTL)
        .args(["--worker", &worker.addr, "--watch", "0.01", "status"])
        .output()
        .expect("run tetherctl");
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("at least 0.1"));
}

#[test]
fn admin_calls_need_the_token_when_one_is_set() {
    let worker = Worker::start(&["--admin-token", "s3cret"]);
    let run = |token: Option<&str>| {
        let mut cmd = std::process::Command::new(support::TETHERCTL);
        cmd.args(["--worker", &worker.addr, "--json", "status"])
            .env_remove("TETHER_ADMIN_TOKEN");
        if let Some(t) = token {
            cmd.env("TETHER_ADMIN_TOKEN", t);
        }
        cmd.output().expect("run tetherctl")
    };
    let denied = run(None);
    assert!(!denied.status.success());
    assert!(
        String::from_utf8_lossy(&denied.stderr).contains("Unauthenticated"),
        "{}",
        String::from_utf8_lossy(&denied.stderr)
    );
    assert!(!run(Some("wrong")).status.success());
    assert!(run(Some("s3cret")).status.success());
}

#[test]
fn malformed_requests_get_clear_errors_and_change_nothing() {
    let worker = Worker::start(&["--max-message-bytes", "1M"]);
    let bystander = Attached::start(&worker.addr, &["--model", "unused.gguf", "--no-load"]);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let client = WorkerClient::connect(&worker.addr, &ClientOptions::default())
            .await
            .expect("connect");
        let options = AttachOptions {
            client_name: "malformed".into(),
            lease: Lease {
                heartbeat_interval: Duration::from_millis(200),
                ttl: Duration::from_secs(5),
            },
            heartbeat: true,
        };
        let session = client.attach(options).await.expect("attach");
        let tokens = [TokenPos { seq: 0, pos: 0 }];
        let hidden = ForwardInput::Hidden(vec![0.0; 8]);

        let err = client
            .forward(SessionId::new_random(), &tokens, &hidden, &[], Rows::Logits)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
        let err = client
            .forward(session.id(), &tokens, &hidden, &[], Rows::Logits)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
        assert!(err.to_string().contains("Commit"), "{err}");
        let err = client
            .commit(session.id(), TxnId::new_random())
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
        let err = client.kv_clear(session.id(), 0).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
        let oversized = ForwardInput::Hidden(vec![0.0; 300_000]);
        let err = client
            .forward(session.id(), &tokens, &oversized, &[], Rows::Logits)
            .await
            .unwrap_err();
        println!("oversized message: {err}");
        assert!(
            matches!(
                err.kind(),
                ErrorKind::ResourceExhausted | ErrorKind::InvalidArgument
            ),
            "{err}"
        );
        let err = client
            .forward(
                session.id(),
                &[],
                &ForwardInput::Hidden(vec![]),
                &[],
                Rows::Logits,
            )
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
        // The session survives all of that.
        assert!(session.end().is_none());
        let end = session.close().await;
        assert_eq!(end.reason, tether_protocol::EndReason::Closed);
    });
    let status = worker.status();
    assert_eq!(
        sessions_and_bytes(&status),
        (1, 0),
        "only the bystander is left: {status}"
    );
    assert_eq!(status["counters"]["closed"], 1);
    drop(bystander);
}

#[test]
fn session_limits_refuse_over_grpc_and_open_nothing() {
    let worker = Worker::start(&["--max-sessions", "2", "--max-sessions-per-client", "1"]);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let client = WorkerClient::connect(&worker.addr, &ClientOptions::default())
            .await
            .expect("connect");
        let options = |name: &str| AttachOptions {
            client_name: name.into(),
            lease: Lease {
                heartbeat_interval: Duration::from_millis(200),
                ttl: Duration::from_secs(5),
            },
            heartbeat: true,
        };
        let _first = client.attach(options("same")).await.expect("first session");
        let Err(err) = client.attach(options("same")).await else {
            panic!("a second session of one client was admitted");
        };
        assert_eq!(err.kind(), ErrorKind::ResourceExhausted, "{err}");
        assert!(err.to_string().contains("per-client"), "{err}");
        let _other = client
            .attach(options("other"))
            .await
            .expect("another client");
        let Err(err) = client.attach(options("third")).await else {
            panic!("a third session was admitted past --max-sessions 2");
        };
        assert_eq!(err.kind(), ErrorKind::ResourceExhausted, "{err}");
        let status = tetherctl_json(&worker.addr, &["status"]);
        assert_eq!(sessions_and_bytes(&status).0, 2, "refusals opened nothing");
    });
}

/// A coordinator's runtime saturated by request work (here: its only thread blocked for
/// four TTLs) must not stop its heartbeats: the session lives on a thread of its own.
#[test]
fn a_client_whose_runtime_is_blocked_keeps_its_lease() {
    let worker = Worker::start(&[]);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let ttl = Duration::from_millis(500);
    let session = runtime.block_on(async {
        let client = WorkerClient::connect(&worker.addr, &ClientOptions::default())
            .await
            .expect("connect");
        client
            .attach(AttachOptions {
                client_name: "blocked-runtime".into(),
                lease: Lease {
                    heartbeat_interval: Duration::from_millis(100),
                    ttl,
                },
                heartbeat: true,
            })
            .await
            .expect("attach")
    });
    // Outside `block_on` the runtime runs nothing at all: every task spawned on it stands
    // still, as it would behind CPU-bound request handlers.
    std::thread::sleep(ttl * 4);
    let status = worker.status();
    assert_eq!(
        status["counters"]["reaped"],
        0,
        "the lease lapsed while the client's runtime was busy: {status}\n{}",
        worker.log()
    );
    assert_eq!(status["sessions"], 1, "{status}");
    assert!(session.end().is_none(), "{:?}", session.end());
    let end = runtime.block_on(session.close());
    assert_eq!(end.reason, tether_protocol::EndReason::Closed);
}
