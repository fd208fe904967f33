//! End-to-end tests of the HTTP API over real sockets, against the coordinator over an
//! embedded worker.

use serde_json::json;
use tether_gguf::GgufFile;
use tether_model::tokenizer::Tokenizer;

use super::HttpOptions;
use super::template::ChatTemplate;
use super::test_support::{
    TEST_CTX, TestServer, engine, post, reference, send, stories_model, tiny_model,
};

fn tokenizer(model: &std::path::Path) -> Tokenizer {
    Tokenizer::from_gguf(&GgufFile::open(model).expect("opens")).expect("tokenizer")
}

fn prompt_tokens(model: &std::path::Path, text: &str) -> Vec<u32> {
    let t = tokenizer(model);
    t.encode(text, t.add_bos_default(), false)
}

#[tokio::test]
async fn greedy_completion_equals_single_process_generation() {
    let model = tiny_model();
    let prompt = "ba be bi bo";
    let tokens = prompt_tokens(model, prompt);
    let (want_tokens, want_text, ended_at_eog) = reference(model, TEST_CTX, &tokens, 24);
    let server = TestServer::start(engine(model, TEST_CTX, 2).await, HttpOptions::default()).await;
    let reply = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 24, "temperature": 0}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let body = reply.json();
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["choices"][0]["text"], want_text);
    let finish = if ended_at_eog { "stop" } else { "length" };
    assert_eq!(body["choices"][0]["finish_reason"], finish);
    assert_eq!(body["usage"]["prompt_tokens"], tokens.len());
    assert_eq!(body["usage"]["completion_tokens"], want_tokens.len());
    assert_eq!(
        body["usage"]["total_tokens"],
        tokens.len() + want_tokens.len()
    );

    // The same prompt as token ids gives the same text.
    let by_ids = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": tokens, "max_tokens": 24, "temperature": 0}),
    )
    .await;
    assert_eq!(by_ids.json()["choices"][0]["text"], want_text);
    server.stop().await;
}

#[tokio::test]
async fn stories_greedy_completion_equals_single_process_generation() {
    let Some(model) = stories_model() else {
        eprintln!("stories260K.gguf not present; skipped");
        return;
    };
    let file = GgufFile::open(&model).expect("opens");
    if let Err(e) = Tokenizer::from_gguf(&file) {
        // tether-model refuses this file's padding id of -1 (u32::MAX); skip until it
        // takes that as "no padding token", as llama.cpp does.
        eprintln!("stories260K.gguf tokenizer does not load ({e}); skipped");
        return;
    }
    let prompt = "Once upon a time";
    let tokens = prompt_tokens(&model, prompt);
    let (_, want_text, _) = reference(&model, TEST_CTX, &tokens, 40);
    assert!(!want_text.is_empty());
    let server = TestServer::start(engine(&model, TEST_CTX, 2).await, HttpOptions::default()).await;
    let reply = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 40, "temperature": 0.0}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["choices"][0]["text"], want_text);
    server.stop().await;
}

#[tokio::test]
async fn max_tokens_ends_with_length_and_stop_string_with_stop() {
    let model = tiny_model();
    let prompt = "ka ke ki";
    let tokens = prompt_tokens(model, prompt);
    let (want_tokens, want_text, ended_at_eog) = reference(model, TEST_CTX, &tokens, 20);
    assert!(
        !ended_at_eog && want_tokens.len() == 20,
        "the test prompt must not end early"
    );
    let server = TestServer::start(engine(model, TEST_CTX, 2).await, HttpOptions::default()).await;

    let short = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 5, "temperature": 0}),
    )
    .await
    .json();
    assert_eq!(short["choices"][0]["finish_reason"], "length");
    assert_eq!(short["usage"]["completion_tokens"], 5);
    let short_text = short["choices"][0]["text"].as_str().expect("text");
    assert!(want_text.starts_with(short_text) && short_text.len() < want_text.len());

    // A stop string from the middle of the known continuation.
    let chars: Vec<(usize, char)> = want_text.char_indices().collect();
    let from = chars[chars.len() / 2].0;
    let to = chars
        .get(chars.len() / 2 + 3)
        .map_or(want_text.len(), |c| c.0);
    let stop = &want_text[from..to];
    let cut = want_text.find(stop).expect("stop is in the text");
    let stopped = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 20, "temperature": 0, "stop": ["zzzz-never", stop]}),
    )
    .await
    .json();
    assert_eq!(stopped["choices"][0]["text"], &want_text[..cut]);
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    let generated = stopped["usage"]["completion_tokens"]
        .as_u64()
        .expect("count");
    assert!(
        generated < 20,
        "generation went on after the stop string: {generated}"
    );
    server.stop().await;
}

#[tokio::test]
async fn chat_completion_uses_the_template_and_generates_like_the_generator() {
    let model = tiny_model();
    let tok = tokenizer(model);
    let template = ChatTemplate::new(None, "<s>", "</s>").expect("chatml");
    let rendered = template
        .render(&[super::template::ChatMessage {
            role: "user".into(),
            content: "ba be".into(),
            ..Default::default()
        }])
        .expect("renders");
    let tokens = tok.encode(&rendered, tok.add_bos_default(), true);
    let (_, want_text, _) = reference(model, TEST_CTX, &tokens, 12);
    let server = TestServer::start(engine(model, TEST_CTX, 2).await, HttpOptions::default()).await;
    let reply = post(
        server.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "ba be"}]}],
                "max_completion_tokens": 12, "temperature": 0}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let body = reply.json();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert_eq!(body["usage"]["prompt_tokens"], tokens.len());
    let want = want_text.split("<|im_end|>").next().unwrap_or("");
    assert_eq!(body["choices"][0]["message"]["content"], want);

    let bad_part = post(
        server.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
    )
    .await;
    assert_eq!(bad_part.status, 400);
    assert_eq!(bad_part.json()["error"]["param"], "messages[0].content");
    server.stop().await;
}

#[tokio::test]
async fn client_errors_get_openai_error_shapes() {
    let model = tiny_model();
    let server = TestServer::start(engine(model, TEST_CTX, 2).await, HttpOptions::default()).await;
    let bad_json = send(
        server.addr,
        "POST",
        "/v1/completions",
        &[],
        Some("{not json"),
    )
    .await;
    assert_eq!(bad_json.status, 400);
    let e = bad_json.json();
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert!(
        e["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty())
    );
    assert!(e["error"].get("param").is_some() && e["error"].get("code").is_some());

    let missing = post(server.addr, "/v1/completions", &json!({"max_tokens": 2})).await;
    assert_eq!(missing.status, 400);
    assert!(missing.body.contains("prompt"), "{}", missing.body);

    let too_long = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": vec![5u32; TEST_CTX + 1], "max_tokens": 2}),
    )
    .await;
    assert_eq!(too_long.status, 400);
    assert_eq!(too_long.json()["error"]["code"], "context_length_exceeded");

    let bad_token = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": [1, 999_999]}),
    )
    .await;
    assert_eq!(bad_token.status, 400);
    let bad_temp = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": "x", "temperature": -2}),
    )
    .await;
    assert_eq!(bad_temp.json()["error"]["param"], "temperature");
    let empty_chat = post(
        server.addr,
        "/v1/chat/completions",
        &json!({"messages": []}),
    )
    .await;
    assert_eq!(empty_chat.status, 400);
    let unknown = send(server.addr, "GET", "/v2/nothing", &[], None).await;
    assert_eq!(unknown.status, 404);
    assert!(unknown.json()["error"]["message"].is_string());

    // Unknown fields are ignored.
    let extra = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": "ba", "max_tokens": 1, "logit_bias": {}, "user": "u"}),
    )
    .await;
    assert_eq!(extra.status, 200, "{}", extra.body);
    server.stop().await;
}

#[tokio::test]
async fn prompt_and_max_tokens_limits_refuse_with_the_limit_named() {
    let model = tiny_model();
    let opts = HttpOptions {
        max_prompt_tokens: Some(4),
        max_tokens_limit: 8,
        ..HttpOptions::default()
    };
    let server = TestServer::start(engine(model, TEST_CTX, 2).await, opts).await;
    let long = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": [5, 6, 7, 8, 9], "max_tokens": 2}),
    )
    .await;
    assert_eq!(long.status, 400);
    let e = long.json();
    assert_eq!(e["error"]["code"], "context_length_exceeded");
    assert!(
        e["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("at most 4")),
        "{e}"
    );
    let greedy = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": [5, 6, 7, 8], "max_tokens": 9}),
    )
    .await;
    assert_eq!(greedy.status, 400);
    assert_eq!(greedy.json()["error"]["param"], "max_tokens");
    let within = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": [5, 6, 7, 8], "max_tokens": 8}),
    )
    .await;
    assert_eq!(within.status, 200, "{}", within.body);
    server.stop().await;
}

#[tokio::test]
async fn api_key_is_required_on_v1_when_set() {
    let model = tiny_model();
    let opts = HttpOptions {
        api_key: Some("s3cret".into()),
        model_id: Some("tiny-test".into()),
        ..HttpOptions::default()
    };
    let server = TestServer::start(engine(model, TEST_CTX, 2).await, opts).await;
    let none = send(server.addr, "GET", "/v1/models", &[], None).await;
    assert_eq!(none.status, 401);
    assert_eq!(none.json()["error"]["code"], "invalid_api_key");
    let wrong = send(
        server.addr,
        "GET",
        "/v1/models",
        &[("Authorization", "Bearer s3creT")],
        None,
    )
    .await;
    assert_eq!(wrong.status, 401);
    let right = send(
        server.addr,
        "GET",
        "/v1/models",
        &[("Authorization", "Bearer s3cret")],
        None,
    )
    .await;
    assert_eq!(right.status, 200);
    assert_eq!(right.json()["data"][0]["id"], "tiny-test");
    let body = json!({"prompt": "ba", "max_tokens": 1}).to_string();
    let gen_without = send(server.addr, "POST", "/v1/completions", &[], Some(&body)).await;
    assert_eq!(gen_without.status, 401);
    // Health and metrics stay open for probes and scrapers.
    assert_eq!(
        send(server.addr, "GET", "/health", &[], None).await.status,
        200
    );
    server.stop().await;
}

#[tokio::test]
async fn health_models_and_metrics() {
    let model = tiny_model();
    let server = TestServer::start(engine(model, TEST_CTX, 2).await, HttpOptions::default()).await;
    let health = send(server.addr, "GET", "/health", &[], None).await;
    assert_eq!(
        (health.status, health.json()["status"].clone()),
        (200, json!("ok"))
    );
    let models = send(server.addr, "GET", "/v1/models", &[], None)
        .await
        .json();
    assert_eq!(models["data"][0]["id"], "tiny-q8_0");

    let count = |text: &str, line_start: &str| -> u64 {
        text.lines()
            .find(|l| l.starts_with(line_start))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let before = send(server.addr, "GET", "/metrics", &[], None).await.body;
    let ok_requests = "tether_http_requests_total{endpoint=\"/v1/completions\",code=\"200\"}";
    let reply = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": "ba be", "max_tokens": 3, "temperature": 0}),
    )
    .await
    .json();
    let _ = post(server.addr, "/v1/completions", &json!({})).await;
    let after = send(server.addr, "GET", "/metrics", &[], None).await.body;
    assert_eq!(count(&after, ok_requests), count(&before, ok_requests) + 1);
    assert_eq!(
        count(
            &after,
            "tether_http_requests_total{endpoint=\"/v1/completions\",code=\"400\"}"
        ),
        1
    );
    let generated = reply["usage"]["completion_tokens"].as_u64().expect("count");
    assert_eq!(
        count(&after, "tether_http_generated_tokens_total"),
        count(&before, "tether_http_generated_tokens_total") + generated
    );
    assert!(
        count(&after, "tether_engine_prompt_tokens_total")
            > count(&before, "tether_engine_prompt_tokens_total")
    );
    assert_eq!(count(&after, "tether_request_duration_seconds_count"), 1);
    assert!(after.contains("# TYPE tether_time_to_first_token_seconds histogram"));
    // The engine thread may still be finishing, so only the gauge's presence is certain.
    assert!(after.contains("\ntether_engine_running_requests "));
    server.stop().await;
}
