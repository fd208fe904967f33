//! `tether serve` over two real `tether worker` processes: what it generates matches a
//! single-process run. How the workers fare when the coordinator goes away or fails to load
//! is in `serve_e2e_shutdown/`.

mod serve_e2e_shutdown;
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

/// `n` choices through real processes: every greedy choice is the single-process text, on a
/// model whose later choices copy the first one's prompt cells and on one whose
/// sliding-window ring keeps them from being copied (each choice then prefills).
#[test]
fn each_of_several_choices_over_two_workers_matches_a_single_process_run() {
    use tether_model::SynthShape;
    for model in [TinyModel::new(), TinyModel::of(SynthShape::TinyGemma3)] {
        let (a, b) = two_workers();
        let mut args = serve_args(&model, &a, &b);
        args.extend(["--parallel", "3"]);
        let serve = Serve::start(&args);
        // 40 tokens: one whole block of 32 is shared.
        let prompt: Vec<u32> = (0..40).map(|i| 3 + (i * 37 + 11) % 250).collect();
        let n = 8;
        let (_, ref_text) = reference(&model, &prompt, n);
        let body = serde_json::json!({"prompt": prompt, "max_tokens": n, "temperature": 0,
                                      "repeat_penalty": 1.0, "n": 3});
        let (status, body) = http(
            &serve.addr,
            "POST",
            "/v1/completions",
            Some(&body.to_string()),
        );
        assert_eq!(status, 200, "{body}");
        let reply: serde_json::Value = serde_json::from_str(&body).expect("JSON completion");
        let texts: Vec<&str> = reply["choices"]
            .as_array()
            .expect("choices")
            .iter()
            .map(|c| c["text"].as_str().expect("text"))
            .collect();
        assert_eq!(texts, vec![ref_text.as_str(); 3], "{reply}");
    }
}

#[test]
fn serve_over_two_workers_matches_a_single_process_run() {
    let model = TinyModel::new();
    let (a, b) = two_workers();
    let serve = Serve::start(&serve_args(&model, &a, &b));
    // After the load the coordinator asked whether hidden states can go GPU to GPU: cpu
    // workers lend no memory, so they go through the host, and the log says why. (The log's
    // stderr, read by a thread of its own, may come after the listening line.)
    const FALLBACK: &str = "hidden states go through the host between these workers";
    assert!(
        serve.log_contains(FALLBACK, Duration::from_secs(10)),
        "no hand-off probe was logged; log:\n{}",
        serve.log()
    );
    let log = serve.log();
    let fallback = log
        .lines()
        .find(|l| l.contains(FALLBACK))
        .unwrap_or_else(|| panic!("the probe's line went missing; log:\n{log}"));
    assert!(fallback.contains("lends no device memory"), "{fallback}");
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
