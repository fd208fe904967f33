//! However the coordinator goes away (SIGKILL between Prepare and Commit or mid-generation,
//! SIGSTOP, SIGTERM once or twice) or fails to load, the workers free every session and
//! stay up.

use super::*;

/// Starts serve with the pause before Commit; returns once both workers voted yes.
fn serve_paused_before_commit(model: &TinyModel, a: &Worker, b: &Worker) -> Serve {
    let mut args = serve_args(model, a, b);
    args.extend(["--debug-pause-before-commit", "30s"]);
    let mut serve = Serve::spawn(&args);
    // Both votes are in only once the coordinator says it is pausing before Commit.
    let started = Instant::now();
    while !serve.log().contains("pausing before Commit") {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "serve never reached the pause; log:\n{}",
            serve.log()
        );
        assert!(
            serve.child.try_wait().ok().flatten().is_none(),
            "serve exited early: {}",
            serve.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    for w in [a, b] {
        let s = w.status();
        assert!(
            s["sessions"] == 1 && s["session_bytes"].as_u64().unwrap_or(0) > 0,
            "worker {} holds its prepared block: {s}",
            w.addr
        );
    }
    serve
}

#[test]
fn sigkill_between_prepare_and_commit_frees_both_workers_within_ttl() {
    let model = TinyModel::new();
    let (a, b) = two_workers();
    let mut serve = serve_paused_before_commit(&model, &a, &b);
    let killed = Instant::now();
    send_signal(serve.child.id(), libc::SIGKILL);
    let _ = serve.wait_exit(Duration::from_secs(5));
    wait_all_freed([&a, &b], LEASE_TTL + Duration::from_secs(2));
    println!(
        "SIGKILL between Prepare and Commit → both workers at 0 sessions/0 bytes after {:?} (TTL {LEASE_TTL:?})",
        killed.elapsed()
    );
    assert_alive([&a, &b]);
}

#[test]
fn sigstop_between_prepare_and_commit_is_reaped_by_lease() {
    let model = TinyModel::new();
    let (a, b) = two_workers();
    let serve = serve_paused_before_commit(&model, &a, &b);
    let stopped = Instant::now();
    send_signal(serve.child.id(), libc::SIGSTOP);
    wait_all_freed([&a, &b], LEASE_TTL + Duration::from_secs(1));
    let freed = stopped.elapsed();
    println!(
        "SIGSTOP between Prepare and Commit → both workers at 0 sessions/0 bytes after {freed:?} (TTL {LEASE_TTL:?})"
    );
    assert!(freed >= LEASE_TTL / 2, "freed by the lease: {freed:?}");
    for w in [&a, &b] {
        assert_eq!(w.status()["counters"]["reaped"], 1, "{}", w.status());
    }
    assert_alive([&a, &b]);
    // Dropping `serve` sends SIGKILL, which ends a stopped process too.
}

#[test]
fn sigkill_mid_generation_frees_both_workers_within_ttl() {
    let model = TinyModel::new();
    let (a, b) = two_workers();
    let (mut serve, mut reader) = serve_with_stream_in_flight(&model, &a, &b, 4000, &[]);
    let killed = Instant::now();
    send_signal(serve.child.id(), libc::SIGKILL);
    let _ = serve.wait_exit(Duration::from_secs(5));
    let rest = read_stream(&mut reader);
    assert!(!rest.done, "the stream was cut, not finished: {rest:?}");
    wait_all_freed([&a, &b], LEASE_TTL + Duration::from_secs(2));
    println!(
        "SIGKILL mid-generation → both workers at 0 sessions/0 bytes after {:?} (TTL {LEASE_TTL:?})",
        killed.elapsed()
    );
    assert_alive([&a, &b]);
}

#[test]
fn sigterm_while_idle_exits_zero_and_closes_every_session() {
    let model = TinyModel::new();
    let (a, b) = two_workers();
    let mut serve = Serve::start(&serve_args(&model, &a, &b));
    for w in [&a, &b] {
        assert_eq!(w.status()["sessions"], 1, "{}", w.status());
    }
    let signalled = Instant::now();
    send_signal(serve.child.id(), libc::SIGTERM);
    let status = serve
        .wait_exit(Duration::from_secs(5))
        .unwrap_or_else(|| panic!("serve did not exit after SIGTERM; log:\n{}", serve.log()));
    let exited = signalled.elapsed();
    assert!(status.success(), "{status:?}; log:\n{}", serve.log());
    // A graceful exit closes the sessions itself: no lease expiry is needed.
    let freed = wait_all_freed([&a, &b], Duration::from_millis(500));
    for w in [&a, &b] {
        let c = &w.status()["counters"];
        assert_eq!(
            c["closed"], 1,
            "closed by the coordinator, not by a disconnect: {c}"
        );
    }
    println!("SIGTERM → exit 0 after {exited:?}; workers freed {freed:?} later");
    assert_alive([&a, &b]);
}

#[test]
fn a_worker_too_small_fails_the_load_and_the_other_keeps_nothing() {
    let model = TinyModel::new();
    let roomy = Worker::start(&[]);
    let small = Worker::start(&["--max-memory", "10000"]);
    let mut serve = Serve::spawn(&serve_args(&model, &roomy, &small));
    let status = serve
        .wait_exit(Duration::from_secs(20))
        .unwrap_or_else(|| panic!("serve did not give up; log:\n{}", serve.log()));
    let named = serve.log_contains(&small.addr, Duration::from_secs(5));
    let log = serve.log();
    println!("serve failed as expected:\n{log}");
    assert!(!status.success(), "{status:?}");
    assert!(
        named,
        "the error names the small worker {}: {log}",
        small.addr
    );
    wait_all_freed([&roomy, &small], Duration::from_secs(1));
    assert_alive([&roomy, &small]);
}

#[test]
fn a_frozen_coordinator_is_reaped_by_lease_and_reloads_when_it_wakes() {
    let model = TinyModel::new();
    let (a, b) = two_workers();
    let serve = Serve::start(&serve_args(&model, &a, &b));
    // SIGSTOP keeps the connections open, so only the lease (the --lease-ttl we gave, not
    // the 10 s default) can free the sessions.
    let stopped = Instant::now();
    send_signal(serve.child.id(), libc::SIGSTOP);
    let freed = wait_all_freed([&a, &b], LEASE_TTL + Duration::from_secs(1));
    let reaped_after = stopped.elapsed();
    println!(
        "SIGSTOP → both workers reaped the sessions after {reaped_after:?} (TTL {LEASE_TTL:?})"
    );
    assert!(
        freed >= LEASE_TTL / 2,
        "freed by the lease, not a disconnect: {freed:?}"
    );
    for w in [&a, &b] {
        assert_eq!(w.status()["counters"]["reaped"], 1, "{}", w.status());
    }
    send_signal(serve.child.id(), libc::SIGCONT);
    // The coordinator notices its sessions are gone and loads the model again.
    let woke = Instant::now();
    let mut last = (0, String::new());
    while woke.elapsed() < Duration::from_secs(10) {
        last = http(
            &serve.addr,
            "POST",
            "/v1/completions",
            Some(&completion_body(&[1, 2, 3], 4, false)),
        );
        if last.0 == 200 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        last.0,
        200,
        "serving again after SIGCONT: {}\n{}",
        last.1,
        serve.log()
    );
    println!("SIGCONT → serving again after {:?}", woke.elapsed());
    for w in [&a, &b] {
        assert_eq!(w.status()["sessions"], 1, "{}", w.status());
    }
}

#[test]
fn a_worker_refusing_its_prepare_aborts_the_load_on_both() {
    let model = TinyModel::new();
    let roomy = Worker::start(&[]);
    // Placement passes (memory is plenty) but the tensor chunks exceed its message limit,
    // so this worker fails in Prepare, after both sessions are open.
    let strict = Worker::start(&["--max-message-bytes", "4096"]);
    let mut serve = Serve::spawn(&serve_args(&model, &roomy, &strict));
    let status = serve
        .wait_exit(Duration::from_secs(20))
        .unwrap_or_else(|| panic!("serve did not give up; log:\n{}", serve.log()));
    let named = serve.log_contains(&strict.addr, Duration::from_secs(5));
    let log = serve.log();
    println!("serve failed as expected:\n{log}");
    assert!(!status.success(), "{status:?}");
    assert!(named, "names {}: {log}", strict.addr);
    let freed = wait_all_freed([&roomy, &strict], Duration::from_secs(1));
    println!("refused Prepare → both workers at 0 sessions/0 bytes {freed:?} after serve exited");
    // The coordinator closes both sessions itself before exiting.
    for w in [&roomy, &strict] {
        let c = &w.status()["counters"];
        assert_eq!((&c["opened"], &c["closed"]), (&1.into(), &1.into()), "{c}");
    }
    assert_alive([&roomy, &strict]);
}

/// Starts serve and a long streamed request; returns once its first text arrived.
fn serve_with_stream_in_flight(
    model: &TinyModel,
    a: &Worker,
    b: &Worker,
    max_tokens: usize,
    extra: &[&'static str],
) -> (Serve, BufReader<std::net::TcpStream>) {
    let mut args = serve_args(model, a, b);
    args.extend(["--ctx", "4096"]);
    args.extend_from_slice(extra);
    let serve = Serve::start(&args);
    // The end-of-text token ignored: the request runs its `max_tokens` however fast the
    // pipeline generates (the tiny model reached it after ~400 tokens, well inside 300 ms).
    let mut body: serde_json::Value =
        serde_json::from_str(&completion_body(&[1, 5, 6], max_tokens, true)).expect("body");
    body["ignore_eos"] = serde_json::Value::Bool(true);
    let mut reader = BufReader::new(http_send(
        &serve.addr,
        "POST",
        "/v1/completions",
        Some(&body.to_string()),
    ));
    let (status, _) = http_read_head(&mut reader);
    assert_eq!(status, 200);
    let mut line = String::new();
    while !line.contains("\"text\"") {
        line.clear();
        assert!(
            reader.read_line(&mut line).unwrap_or(0) > 0,
            "stream ended early"
        );
    }
    (serve, reader)
}

#[test]
fn sigterm_mid_generation_finishes_the_request_then_exits_zero() {
    let model = TinyModel::new();
    let (a, b) = two_workers();
    let (mut serve, mut reader) = serve_with_stream_in_flight(&model, &a, &b, 200, &[]);
    let signalled = Instant::now();
    send_signal(serve.child.id(), libc::SIGTERM);
    let status = serve
        .wait_exit(Duration::from_secs(10))
        .unwrap_or_else(|| panic!("serve did not exit after SIGTERM; log:\n{}", serve.log()));
    let exited = signalled.elapsed();
    let rest = read_stream(&mut reader);
    println!(
        "SIGTERM mid-generation → exit {status:?} after {exited:?}; the stream went on for {} events, finish {:?}, [DONE] {}",
        rest.events, rest.finish, rest.done
    );
    assert!(status.success(), "{status:?}; log:\n{}", serve.log());
    // Graceful shutdown drains: the request in flight ends normally.
    assert!(rest.done && rest.finish.is_some(), "{rest:?}");
    wait_all_freed([&a, &b], Duration::from_millis(500));
    assert_alive([&a, &b]);
}

#[test]
fn a_second_sigterm_exits_at_once_and_the_workers_free_everything() {
    let model = TinyModel::new();
    let (a, b) = two_workers();
    let (mut serve, mut reader) = serve_with_stream_in_flight(&model, &a, &b, 4000, &[]);
    send_signal(serve.child.id(), libc::SIGTERM);
    // The second signal is armed once the first is handled.
    let first = Instant::now();
    while !serve.log().contains("signal received") {
        assert!(first.elapsed() < Duration::from_secs(5), "{}", serve.log());
        std::thread::sleep(Duration::from_millis(5));
    }
    let second = Instant::now();
    send_signal(serve.child.id(), libc::SIGTERM);
    let status = serve
        .wait_exit(Duration::from_secs(2))
        .unwrap_or_else(|| panic!("a second SIGTERM must exit at once; log:\n{}", serve.log()));
    let exited = second.elapsed();
    let rest = read_stream(&mut reader);
    assert_eq!(status.code(), Some(130), "{status:?}");
    assert!(!rest.done, "the stream was cut: {rest:?}");
    let freed = wait_all_freed([&a, &b], LEASE_TTL + Duration::from_secs(1));
    println!(
        "second SIGTERM → exit 130 after {exited:?}; workers at 0 sessions/0 bytes {freed:?} later"
    );
    assert_alive([&a, &b]);
}

#[test]
fn sigterm_cuts_requests_still_running_after_the_shutdown_grace() {
    let model = TinyModel::new();
    let (a, b) = two_workers();
    let (mut serve, mut reader) =
        serve_with_stream_in_flight(&model, &a, &b, 4000, &["--shutdown-grace", "300ms"]);
    let signalled = Instant::now();
    send_signal(serve.child.id(), libc::SIGTERM);
    let status = serve
        .wait_exit(Duration::from_secs(5))
        .unwrap_or_else(|| panic!("serve outlived its shutdown grace; log:\n{}", serve.log()));
    let exited = signalled.elapsed();
    let rest = read_stream(&mut reader);
    println!(
        "SIGTERM with a 4000-token stream and --shutdown-grace 300ms → exit {status:?} after {exited:?}"
    );
    assert!(status.success(), "{status:?}; log:\n{}", serve.log());
    assert!(
        exited >= Duration::from_millis(300),
        "exited before the grace: {exited:?}; stream {rest:?}; log:\n{}",
        serve.log()
    );
    assert!(
        !rest.done,
        "the long request must be cut, not finished: {rest:?}"
    );
    wait_all_freed([&a, &b], Duration::from_millis(500));
    assert_alive([&a, &b]);
}
