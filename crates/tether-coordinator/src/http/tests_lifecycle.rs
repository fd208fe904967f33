//! Model changes without a restart over real HTTP, a real coordinator and an embedded cpu
//! worker: swapping under load, failed loads, unloading, one change at a time, and the
//! worker's memory throughout.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use super::HttpOptions;
use super::test_support::{
    Reply, TEST_CTX, TestEngine, TestServer, engine, engine_with, other_tiny_model, post,
    reference, send, test_dir, tiny_model,
};

const PROMPT: [u32; 4] = [1, 7, 12, 30];
const TOKENS: usize = 24;

fn completion() -> Value {
    json!({"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0})
}

/// What a completion of [`PROMPT`] says on `model` alone.
fn expected_text(model: &std::path::Path) -> String {
    reference(model, TEST_CTX, &PROMPT, TOKENS).1
}

fn text(reply: &Reply) -> String {
    assert_eq!(reply.status, 200, "{}", reply.body);
    reply.json()["choices"][0]["text"]
        .as_str()
        .expect("text")
        .to_string()
}

fn stem(path: &std::path::Path) -> String {
    path.file_stem()
        .expect("a file name")
        .to_string_lossy()
        .into_owned()
}

/// Bytes the plan in force reserves on the (only) worker.
fn plan_bytes(engine: &TestEngine) -> u64 {
    engine
        .plan()
        .expect("a model is placed")
        .assignments
        .iter()
        .map(|a| a.bytes.total_bytes)
        .sum()
}

/// Samples the worker's session bytes until stopped; returns the most seen.
fn watch_memory(engine: &Arc<TestEngine>) -> (Arc<AtomicBool>, tokio::task::JoinHandle<u64>) {
    let stop = Arc::new(AtomicBool::new(false));
    let engine = Arc::clone(engine);
    let stopped = Arc::clone(&stop);
    let task = tokio::spawn(async move {
        let most = AtomicU64::new(0);
        while !stopped.load(Ordering::Relaxed) {
            most.fetch_max(engine.worker().status().session_bytes, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        most.load(Ordering::Relaxed)
    });
    (stop, task)
}

async fn load(server: &TestServer, body: Value) -> Reply {
    post(server.addr, "/v1/admin/model", &body).await
}

#[tokio::test]
async fn swap_under_load_loses_no_admitted_request_and_serves_the_new_model() {
    let (a, b) = (tiny_model(), other_tiny_model());
    let (text_a, text_b) = (expected_text(a), expected_text(b));
    assert_ne!(text_a, text_b, "the two models must answer differently");
    let engine = engine(a, TEST_CTX, 16).await;
    let plan_a = plan_bytes(&engine);
    let server = TestServer::start_with_admin(Arc::clone(&engine), HttpOptions::default()).await;
    let (stop_watch, memory) = watch_memory(&engine);

    // Clients asking again and again while the model changes under them.
    let swapped = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let swapped = Arc::clone(&swapped);
            let addr = server.addr;
            tokio::spawn(async move {
                let mut replies = Vec::new();
                loop {
                    let after_swap = swapped.load(Ordering::SeqCst);
                    let mut body = completion();
                    body["stream"] = json!(true);
                    replies.push((after_swap, post(addr, "/v1/completions", &body).await));
                    if after_swap {
                        return replies;
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let swap = load(&server, json!({"path": b})).await;
    swapped.store(true, Ordering::SeqCst);
    assert_eq!(swap.status, 200, "{}", swap.body);
    assert_eq!(swap.json()["model"], json!(stem(b)));
    assert_eq!(swap.json()["previous"], json!(stem(a)));
    assert_eq!(swap.json()["outage"], json!(false));

    let (mut on_a, mut on_b) = (0, 0);
    for client in clients {
        for (after_swap, reply) in client.await.expect("client task") {
            assert!(
                reply.status == 200 || reply.status == 503,
                "{} {}",
                reply.status,
                reply.body
            );
            if reply.status == 503 {
                // Only a request prepared for the old model and submitted after the switch.
                assert!(reply.body.contains("replaced"), "{}", reply.body);
                continue;
            }
            let streamed: String = reply
                .sse_data()
                .iter()
                .filter(|d| d.as_str() != "[DONE]")
                .filter_map(|d| serde_json::from_str::<Value>(d).ok())
                .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
                .collect();
            if streamed == text_a && !after_swap {
                on_a += 1;
            } else {
                assert_eq!(streamed, text_b, "after the swap: {after_swap}");
                on_b += 1;
            }
        }
    }
    assert!(on_a > 0 && on_b > 0, "served on a: {on_a}, on b: {on_b}");

    let plan_b = plan_bytes(&engine);
    stop_watch.store(true, Ordering::Relaxed);
    let most = memory.await.expect("memory watch");
    assert!(
        most <= plan_a + plan_b,
        "the worker held {most} bytes; the plans allow {plan_a} + {plan_b}"
    );
    assert_eq!(engine.worker().status().session_bytes, plan_b);
    let models = send(server.addr, "GET", "/v1/models", &[], None)
        .await
        .json();
    assert_eq!(models["data"][0]["id"], json!(stem(b)));
    let named = json!({"model": stem(b), "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0});
    assert_eq!(
        text(&post(server.addr, "/v1/completions", &named).await),
        text_b
    );
    let old = json!({"model": stem(a), "prompt": PROMPT, "max_tokens": 2});
    assert_eq!(post(server.addr, "/v1/completions", &old).await.status, 404);
    server.stop().await;
}

#[tokio::test]
async fn a_failed_load_leaves_the_old_model_serving() {
    let a = tiny_model();
    let text_a = expected_text(a);
    let probe = engine(a, TEST_CTX, 2).await;
    let plan = plan_bytes(&probe);
    drop(probe);
    // Room for one model and a half: a second copy does not fit beside the first.
    let engine = engine_with(a, TEST_CTX, 2, plan + plan / 2, |_| {}).await;
    let server = TestServer::start_with_admin(Arc::clone(&engine), HttpOptions::default()).await;
    let corrupt = test_dir().join("corrupt.gguf");
    std::fs::write(&corrupt, b"GGUF\x03\x00\x00\x00not a model").expect("writing");

    let missing = load(&server, json!({"path": "/nonexistent/model.gguf"})).await;
    assert_eq!(missing.status, 400, "{}", missing.body);
    assert_eq!(missing.json()["error"]["code"], "model_file_unreadable");
    let garbage = load(&server, json!({"path": corrupt})).await;
    assert_eq!(garbage.status, 400, "{}", garbage.body);
    let unknown = load(&server, json!({"path": a, "unload_frist": true})).await;
    assert_eq!(unknown.status, 400, "{}", unknown.body);
    assert!(unknown.body.contains("unload_frist"), "{}", unknown.body);
    let too_big = load(&server, json!({"path": other_tiny_model()})).await;
    assert_eq!(too_big.status, 507, "{}", too_big.body);
    let message = too_big.json()["error"]["message"].to_string();
    assert!(
        message.contains("keeps serving") && message.contains("unload_first"),
        "{message}"
    );

    let health = send(server.addr, "GET", "/health", &[], None).await;
    assert_eq!(health.status, 200);
    assert_eq!(health.json()["model"], json!(stem(a)));
    assert_eq!(
        text(&post(server.addr, "/v1/completions", &completion()).await),
        text_a
    );
    assert_eq!(engine.worker().status().session_bytes, plan);

    // With unload_first the swap happens, one model at a time.
    let (stop_watch, memory) = watch_memory(&engine);
    let swap = load(
        &server,
        json!({"path": other_tiny_model(), "unload_first": true}),
    )
    .await;
    assert_eq!(swap.status, 200, "{}", swap.body);
    assert_eq!(swap.json()["outage"], json!(true));
    stop_watch.store(true, Ordering::Relaxed);
    assert!(memory.await.expect("memory watch") <= plan);
    let reply = post(server.addr, "/v1/completions", &completion()).await;
    assert_eq!(text(&reply), expected_text(other_tiny_model()));
    server.stop().await;
}

#[tokio::test]
async fn unload_refuses_requests_until_a_load_and_changes_run_one_at_a_time() {
    let a = tiny_model();
    let engine = engine_with(a, TEST_CTX, 2, 1 << 30, |c| {
        // Every load waits before Commit, so a second change surely meets the first.
        c.load.pause_before_commit = Some(Duration::from_millis(300));
    })
    .await;
    let server = TestServer::start_with_admin(Arc::clone(&engine), HttpOptions::default()).await;

    let unload = send(server.addr, "DELETE", "/v1/admin/model", &[], None).await;
    assert_eq!(unload.status, 200, "{}", unload.body);
    assert_eq!(engine.worker().status().session_bytes, 0);
    assert_eq!(engine.worker().status().sessions, 0);
    let refused = post(server.addr, "/v1/completions", &completion()).await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert!(
        refused.body.contains("no model is loaded"),
        "{}",
        refused.body
    );
    let health = send(server.addr, "GET", "/health", &[], None).await;
    assert_eq!(health.status, 503);
    let models = send(server.addr, "GET", "/v1/models", &[], None)
        .await
        .json();
    assert_eq!(models["data"], json!([]));
    let again = send(server.addr, "DELETE", "/v1/admin/model", &[], None).await;
    assert_eq!(again.status, 409, "{}", again.body);

    // `{}` loads the last model's file again; a second change meanwhile is refused.
    let (first, second) = tokio::join!(load(&server, json!({})), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        load(&server, json!({"path": other_tiny_model()})).await
    });
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(second.status, 409, "{}", second.body);
    assert_eq!(second.json()["error"]["code"], "model_change_running");
    let reply = post(server.addr, "/v1/completions", &completion()).await;
    assert_eq!(text(&reply), expected_text(a));
    assert_eq!(engine.worker().status().session_bytes, plan_bytes(&engine));
    server.stop().await;
}
