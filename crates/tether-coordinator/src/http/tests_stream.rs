//! Streaming tests: server-sent events, and clients that hang up mid-stream.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::HttpOptions;
use super::test_support::{
    TEST_CTX, TestServer, engine, open_stream, post, reference, request_bytes, tiny_model,
};
use crate::api::Generation;

fn parse_chunks(data: &[String]) -> Vec<Value> {
    data.iter()
        .filter(|d| d.as_str() != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("chunk is not JSON ({e}): {d}")))
        .collect()
}

#[tokio::test]
async fn streamed_completion_concatenates_to_the_whole_reply() {
    let model = tiny_model();
    let server = TestServer::start(engine(model, TEST_CTX, 2).await, HttpOptions::default()).await;
    let request = json!({"prompt": "ba be bi", "max_tokens": 20, "temperature": 0});
    let whole = post(server.addr, "/v1/completions", &request).await.json();

    let mut streamed_request = request.clone();
    streamed_request["stream"] = json!(true);
    streamed_request["stream_options"] = json!({"include_usage": true});
    let reply = post(server.addr, "/v1/completions", &streamed_request).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("content-type"), Some("text/event-stream"));
    let data = reply.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks = parse_chunks(&data);
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, whole["choices"][0]["text"].as_str().expect("text"));
    let finishes: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finishes, vec![&whole["choices"][0]["finish_reason"]]);
    let usage = &chunks.last().expect("usage chunk")["usage"];
    assert_eq!(usage, &whole["usage"]);
    assert!(chunks.iter().all(|c| c["id"] == chunks[0]["id"]));
    server.stop().await;
}

#[tokio::test]
async fn streamed_chat_sends_role_then_content_then_finish() {
    let model = tiny_model();
    let server = TestServer::start(engine(model, TEST_CTX, 2).await, HttpOptions::default()).await;
    let request = json!({"messages": [{"role": "system", "content": "be"}, {"role": "user", "content": "ba"}],
                         "max_tokens": 10, "temperature": 0});
    let whole = post(server.addr, "/v1/chat/completions", &request)
        .await
        .json();
    let mut streamed_request = request.clone();
    streamed_request["stream"] = json!(true);
    let reply = post(server.addr, "/v1/chat/completions", &streamed_request).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let data = reply.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks = parse_chunks(&data);
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks[1..]
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(
        content,
        whole["choices"][0]["message"]["content"]
            .as_str()
            .expect("content")
    );
    let last = chunks.last().expect("finish chunk");
    assert_eq!(
        last["choices"][0]["finish_reason"],
        whole["choices"][0]["finish_reason"]
    );
    assert_eq!(last["choices"][0]["delta"], json!({}));
    server.stop().await;
}

#[tokio::test]
async fn streamed_stop_string_ends_the_stream_with_stop() {
    let model = tiny_model();
    let server = TestServer::start(engine(model, TEST_CTX, 2).await, HttpOptions::default()).await;
    let request = json!({"prompt": "ka ke ki", "max_tokens": 20, "temperature": 0});
    let whole = post(server.addr, "/v1/completions", &request).await.json();
    let text = whole["choices"][0]["text"]
        .as_str()
        .expect("text")
        .to_owned();
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    assert!(
        chars.len() > 8,
        "continuation too short to pick a stop string: {text:?}"
    );
    let stop = &text[chars[4].0..chars[7].0];
    let cut = text.find(stop).expect("stop is in the text");
    let mut streamed_request = request.clone();
    streamed_request["stream"] = json!(true);
    streamed_request["stop"] = json!(stop);
    let chunks = parse_chunks(
        &post(server.addr, "/v1/completions", &streamed_request)
            .await
            .sse_data(),
    );
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, &text[..cut]);
    assert_eq!(
        chunks.last().expect("chunk")["choices"][0]["finish_reason"],
        "stop"
    );
    server.stop().await;
}

#[tokio::test]
async fn client_hanging_up_mid_stream_frees_the_engine() {
    let model = tiny_model();
    let ctx = 2048;
    let prompt = [1u32, 300];
    // Before the engine starts: this long generation blocks the test's thread, which also
    // runs the engine's worker.
    let (_, _, ended_at_eog) = reference(model, ctx, &prompt, ctx - 8);
    assert!(
        !ended_at_eog,
        "the test prompt must generate to max_tokens when left alone"
    );
    // One slot: the next request runs only once the cancelled one gave it back.
    let engine = engine(model, ctx, 0).await;
    let server = TestServer::start(engine.clone(), HttpOptions::default()).await;
    let long = json!({"prompt": prompt, "max_tokens": ctx - 8, "temperature": 0, "stream": true})
        .to_string();
    let (stream, seen) = open_stream(server.addr, "/v1/completions", &long).await;
    assert!(seen.starts_with("HTTP/1.1 200"));
    drop(stream);

    let started = Instant::now();
    while engine.stats().running != 0 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the engine still generates for a client that left"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let generated = engine.stats().generated_tokens;
    eprintln!("cancelled after {generated} tokens");
    assert!(
        (generated as usize) < ctx - 8,
        "the request ran to its end ({generated} tokens) instead of being cancelled"
    );
    let next = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": "ba", "max_tokens": 2, "temperature": 0}),
    )
    .await;
    assert_eq!(next.status, 200, "{}", next.body);
    server.stop().await;
}

#[tokio::test]
async fn client_hanging_up_on_a_whole_reply_cancels_the_request() {
    let model = tiny_model();
    let ctx = 2048;
    let engine = engine(model, ctx, 0).await;
    let server = TestServer::start(engine.clone(), HttpOptions::default()).await;
    // The prompt the streaming test above checks to run to max_tokens when left alone.
    let long = json!({"prompt": [1, 300], "max_tokens": ctx - 8, "temperature": 0}).to_string();
    let mut stream = TcpStream::connect(server.addr).await.expect("connects");
    stream
        .write_all(&request_bytes("POST", "/v1/completions", &[], Some(&long)))
        .await
        .expect("sends");
    let started = Instant::now();
    while engine.stats().generated_tokens < 5 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "generation never started"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    drop(stream);
    while engine.stats().running != 0 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the engine still generates for a client that left"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let generated = engine.stats().generated_tokens;
    assert!(
        (generated as usize) < ctx - 8,
        "ran to the end: {generated} tokens"
    );
    server.stop().await;
}
