//! `tether serve` over two real `tether worker` processes: what it generates matches a
//! single-process run, and however the coordinator goes away (SIGKILL between Prepare and
//! Commit, SIGKILL mid-generation, SIGTERM) or fails to load, the workers free every
//! session and stay up.

mod support;

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};
use support::{
    Serve, TinyModel, Worker, completion_body, http, http_deadline, http_json, http_read_head,
    http_send, process_alive, reference, send_signal, sessions_and_bytes,
};

/// The lease the coordinator asks for in the crash tests.
const LEASE_TTL: Duration = Duration::from_secs(1);

fn two_workers() -> (Worker, Worker) {
    (Worker::start(&[]), Worker::start(&[]))
}

/// `serve --model M --worker A --worker B --lease-ttl 1s EXTRA`.
fn serve_args<'a>(model: &'a TinyModel, a: &'a Worker, b: &'a Worker) -> Vec<&'a str> {
    vec![
        "--model",
        model.arg(),
        "--worker",
        &a.addr,
        "--worker",
        &b.addr,
        "--lease-ttl",
        "1s",
        "--threads",
        "1",
    ]
}

/// Waits until both workers hold no session and no session bytes; returns how long it took.
fn wait_all_freed(workers: [&Worker; 2], timeout: Duration) -> Duration {
    let start = Instant::now();
    for w in workers {
        let left = timeout.saturating_sub(start.elapsed());
        if w.wait_status(left, |s| sessions_and_bytes(s) == (0, 0))
            .is_none()
        {
            panic!(
                "worker {} still holds sessions {:?} {:?} after the coordinator went away; log:\n{}",
                w.addr,
                sessions_and_bytes(&w.status()),
                start.elapsed(),
                w.log()
            );
        }
    }
    start.elapsed()
}

fn assert_alive(workers: [&Worker; 2]) {
    for w in workers {
        assert!(
            process_alive(w.pid()),
            "worker {} died; log:\n{}",
            w.addr,
            w.log()
        );
    }
}

/// What a streamed completion delivered.
#[derive(Debug, Default)]
struct Streamed {
    text: String,
    /// Events that carried a choice.
    events: usize,
    /// The last `finish_reason` that was not null.
    finish: Option<String>,
    /// Whether `[DONE]` ended it.
    done: bool,
}

fn read_stream(reader: &mut impl BufRead) -> Streamed {
    let mut out = Streamed::default();
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return out;
        }
        let Some(data) = line.trim_end().strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            out.done = true;
            return out;
        }
        let event: serde_json::Value =
            serde_json::from_str(data).unwrap_or_else(|e| panic!("bad event {data:?}: {e}"));
        let choice = &event["choices"][0];
        out.events += 1;
        out.text.push_str(choice["text"].as_str().unwrap_or(""));
        if let Some(f) = choice["finish_reason"].as_str() {
            out.finish = Some(f.to_string());
        }
    }
}

/// Gemma 2 and 3 (sliding windows split across the workers, post-norms, tied and scaled
/// embedding on the first worker and head on the last), Phi-3 (fused tensors each worker
/// loads as parts) and the MoE models (router and stacked experts on each worker) served by
/// two workers generate what one process does.
#[test]
fn two_workers_serve_gemma_phi3_and_moe_as_a_single_process_runs_them() {
    use tether_model::SynthShape;
    for shape in [
        SynthShape::TinyGemma3,
        SynthShape::TinyGemma2,
        SynthShape::TinyPhi3,
        SynthShape::TinyQwen3Moe,
        SynthShape::TinyMixtral,
    ] {
        let model = TinyModel::of(shape);
        let (a, b) = two_workers();
        let serve = Serve::start(&serve_args(&model, &a, &b));
        // Ten prompt tokens and sixteen more: past the tiny Gemmas' windows of 8.
        let prompt = [1u32, 17, 42, 99, 7, 300, 12, 45, 260, 5];
        let n = 16;
        let (ref_tokens, ref_text) = reference(&model, &prompt, n);
        let (status, body) = http(
            &serve.addr,
            "POST",
            "/v1/completions",
            Some(&completion_body(&prompt, n, false)),
        );
        assert_eq!(status, 200, "{}: {body}", shape.name());
        let reply: serde_json::Value = serde_json::from_str(&body).expect("JSON completion");
        assert_eq!(
            reply["choices"][0]["text"].as_str(),
            Some(ref_text.as_str()),
            "{}: {reply}",
            shape.name()
        );
        assert_eq!(
            reply["usage"]["completion_tokens"].as_u64(),
            Some(ref_tokens.len() as u64),
            "{}: {reply}",
            shape.name()
        );
        let placement = http_json(&serve.addr, "/v1/admin/model")["placement"].clone();
        let placement = placement.as_array().expect("placement list");
        assert_eq!(placement.len(), 2, "{}: {placement:?}", shape.name());
    }
}

#[test]
fn serve_over_two_workers_matches_a_single_process_run() {
    let model = TinyModel::new();
    let (a, b) = two_workers();
    let serve = Serve::start(&serve_args(&model, &a, &b));
    let prompt = [1u32, 17, 42, 99, 7];
    let n = 12;
    let (ref_tokens, ref_text) = reference(&model, &prompt, n);
    println!("reference tokens {ref_tokens:?} text {ref_text:?}");

    let (status, body) = http(
        &serve.addr,
        "POST",
        "/v1/completions",
        Some(&completion_body(&prompt, n, false)),
    );
    assert_eq!(status, 200, "{body}");
    let reply: serde_json::Value = serde_json::from_str(&body).expect("JSON completion");
    assert_eq!(
        reply["choices"][0]["text"].as_str(),
        Some(ref_text.as_str()),
        "{reply}"
    );
    assert_eq!(
        reply["usage"]["completion_tokens"].as_u64(),
        Some(ref_tokens.len() as u64),
        "{reply}"
    );

    let mut reader = BufReader::new(http_send(
        &serve.addr,
        "POST",
        "/v1/completions",
        Some(&completion_body(&prompt, n, true)),
    ));
    let (status, chunked) = http_read_head(&mut reader);
    assert_eq!(status, 200);
    let mut body = String::new();
    let _ = std::io::Read::read_to_string(&mut reader, &mut body);
    let body = if chunked {
        support::http_read_body(&mut body.as_bytes(), true)
    } else {
        body
    };
    let streamed = read_stream(&mut body.as_bytes());
    assert!(streamed.done, "the stream ends with [DONE]: {body}");
    assert_eq!(streamed.text, ref_text);
    assert_eq!(streamed.finish.as_deref(), Some("length"), "{body}");

    let (status, health) = http(&serve.addr, "GET", "/health", None);
    assert_eq!(status, 200, "{health}");
    let placement = http_json(&serve.addr, "/v1/admin/model")["placement"].clone();
    let placement = placement.as_array().expect("placement list");
    assert_eq!(placement.len(), 2, "{placement:?}");
    let layers: Vec<(u64, u64)> = placement
        .iter()
        .map(|p| {
            (
                p["first_layer"].as_u64().unwrap_or(99),
                p["last_layer"].as_u64().unwrap_or(99),
            )
        })
        .collect();
    assert_eq!(layers[0].0, 0, "{placement:?}");
    assert_eq!(layers[0].1, layers[1].0, "contiguous blocks: {placement:?}");
    assert_eq!(placement[0]["worker"], a.addr.as_str());
    assert_eq!(placement[1]["worker"], b.addr.as_str());
    let workers = http_json(&serve.addr, "/v1/admin/workers");
    let workers = workers.as_array().expect("worker list");
    assert_eq!(workers.len(), 2);
    for w in workers {
        assert_eq!(w["status"]["sessions"], 1, "{w}");
        assert!(
            w["status"]["session_bytes"].as_u64().unwrap_or(0) > 0,
            "{w}"
        );
    }

    // The coordinator's Prometheus series count what was served above: two completions
    // of `n` tokens each, both 200.
    let (status, metrics) = http(&serve.addr, "GET", "/metrics", None);
    assert_eq!(status, 200);
    let series = |name: &str| -> Option<f64> {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    };
    assert_eq!(
        series("tether_http_requests_total{endpoint=\"/v1/completions\",code=\"200\"}"),
        Some(2.0),
        "{metrics}"
    );
    assert_eq!(
        series("tether_engine_generated_tokens_total"),
        Some((2 * ref_tokens.len()) as f64),
        "{metrics}"
    );
    assert_eq!(
        series("tether_engine_running_requests"),
        Some(0.0),
        "{metrics}"
    );
}

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
    let mut reader = BufReader::new(http_send(
        &serve.addr,
        "POST",
        "/v1/completions",
        Some(&completion_body(&[1, 5, 6], max_tokens, true)),
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
        "exited before the grace: {exited:?}"
    );
    assert!(
        !rest.done,
        "the long request must be cut, not finished: {rest:?}"
    );
    wait_all_freed([&a, &b], Duration::from_millis(500));
    assert_alive([&a, &b]);
}

/// A streaming chat completion read the way OpenAI client libraries read it: an HTTP client
/// library (ureq) posting JSON and parsing `data:` lines of the SSE body until `[DONE]`.
#[test]
fn a_streaming_chat_completion_works_through_an_http_client_library() {
    let model = TinyModel::new();
    let (a, b) = two_workers();
    let serve = Serve::start(&serve_args(&model, &a, &b));
    // As a client does: the model's id from /v1/models (a name it does not serve is 404).
    let (status, models) = http_deadline(
        &serve.addr,
        "GET",
        "/v1/models",
        None,
        Duration::from_secs(10),
    )
    .expect("list models");
    assert_eq!(status, 200, "{models}");
    let models: serde_json::Value = serde_json::from_str(&models).expect("models JSON");
    let id = models["data"][0]["id"]
        .as_str()
        .expect("a model id")
        .to_string();
    let body = serde_json::json!({
        "model": id,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Say something."}]},
        ],
        "max_tokens": 8,
        "temperature": 0,
        "stream": true,
    });
    let mut reply = ureq::post(&format!("http://{}/v1/chat/completions", serve.addr))
        .header("Content-Type", "application/json")
        .send(body.to_string())
        .expect("chat completion request");
    assert_eq!(reply.status().as_u16(), 200);
    let content_type = reply
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    let reader = BufReader::new(reply.body_mut().as_reader());
    let (mut role, mut content, mut finish, mut done) = (None, String::new(), None, false);
    for line in reader.lines() {
        let line = line.expect("SSE line");
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            break;
        }
        let chunk: serde_json::Value = serde_json::from_str(data).expect("JSON chunk");
        assert_eq!(chunk["object"], "chat.completion.chunk", "{chunk}");
        let choice = &chunk["choices"][0];
        if let Some(r) = choice["delta"]["role"].as_str() {
            role = Some(r.to_string());
        }
        content.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert!(done, "the stream ends with data: [DONE]");
    assert_eq!(role.as_deref(), Some("assistant"));
    assert_eq!(finish.as_deref(), Some("length"));
    assert!(!content.is_empty(), "8 tokens of text were streamed");
}
