//! `/tokenize` and `/detokenize` over real sockets: the ids a completion's prompt costs,
//! both clients' field names, and bad bodies refused by field.

use serde_json::json;
use tether_gguf::GgufFile;
use tether_model::tokenizer::Tokenizer;

use super::HttpOptions;
use super::test_support::{TEST_CTX, TestServer, engine, post, tiny_model};

#[tokio::test]
async fn tokenize_gives_the_prompt_tokens_of_a_completion_and_detokenize_inverts_it() {
    let model = tiny_model();
    let t = Tokenizer::from_gguf(&GgufFile::open(model).expect("opens")).expect("tokenizer");
    let text = "ba be bi bo";
    let want = t.encode(text, t.add_bos_default(), false);
    let server = TestServer::start(engine(model, TEST_CTX, 1).await, HttpOptions::default()).await;

    let by_content = post(server.addr, "/tokenize", &json!({"content": text})).await;
    assert_eq!(by_content.status, 200, "{}", by_content.body);
    let body = by_content.json();
    assert_eq!(body["tokens"], json!(want));
    assert_eq!(body["count"], want.len());
    assert_eq!(body["max_model_len"], TEST_CTX);

    // vLLM's spelling, and the completion's own count of the same prompt.
    let by_prompt = post(server.addr, "/tokenize", &json!({"prompt": text})).await;
    assert_eq!(by_prompt.json()["tokens"], json!(want));
    let completion = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": text, "max_tokens": 1, "temperature": 0}),
    )
    .await;
    assert_eq!(completion.json()["usage"]["prompt_tokens"], want.len());

    let no_bos = post(
        server.addr,
        "/tokenize",
        &json!({"content": text, "add_special": false, "with_pieces": true}),
    )
    .await;
    let pieces = no_bos.json()["tokens"].as_array().expect("array").clone();
    let plain = t.encode(text, false, false);
    assert_eq!(pieces.len(), plain.len());
    for (p, id) in pieces.iter().zip(&plain) {
        assert_eq!(p["id"], *id);
        assert_eq!(p["piece"], t.decode(&[*id]));
    }

    let back = post(server.addr, "/detokenize", &json!({"tokens": plain})).await;
    assert_eq!(back.status, 200, "{}", back.body);
    assert_eq!(back.json()["content"], t.decode(&plain));
    assert_eq!(back.json()["prompt"], t.decode(&plain));
    server.stop().await;
}

#[tokio::test]
async fn bad_tokenize_bodies_are_refused_naming_the_field() {
    let model = tiny_model();
    let vocab = Tokenizer::from_gguf(&GgufFile::open(model).expect("opens"))
        .expect("tokenizer")
        .vocab_size();
    let server = TestServer::start(engine(model, TEST_CTX, 1).await, HttpOptions::default()).await;
    let cases = [
        ("/tokenize", json!({}), "content"),
        (
            "/tokenize",
            json!({"content": "a", "prompt": "b"}),
            "prompt",
        ),
        (
            "/tokenize",
            json!({"content": "a", "temperature": 0}),
            "temperature",
        ),
        (
            "/tokenize",
            json!({"content": "a", "add_special": true, "add_special_tokens": false}),
            "add_special_tokens",
        ),
        ("/tokenize", json!({"content": 7}), "content"),
        (
            "/tokenize",
            json!({"content": "a", "model": "other"}),
            "model",
        ),
        ("/detokenize", json!({"tokens": [1, vocab]}), "tokens[1]"),
        ("/detokenize", json!({"tokens": [-1]}), "tokens[0]"),
        ("/detokenize", json!({"tokens": [1], "echo": true}), "echo"),
    ];
    for (path, body, param) in cases {
        let reply = post(server.addr, path, &body).await;
        assert!(
            reply.status == 400 || reply.status == 404,
            "{path} {body}: {} {}",
            reply.status,
            reply.body
        );
        assert_eq!(
            reply.json()["error"]["param"],
            param,
            "{path} {body}: {}",
            reply.body
        );
    }
    server.stop().await;
}
