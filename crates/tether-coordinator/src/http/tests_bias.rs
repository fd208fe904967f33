//! `logit_bias`, `ignore_eos` and `min_tokens` over real sockets, against the coordinator
//! over an embedded worker and single-process generations with the same sampler.

use serde_json::json;
use tether_gguf::GgufFile;
use tether_model::SamplingParams;
use tether_model::tokenizer::Tokenizer;

use super::HttpOptions;
use super::test_support::{
    TEST_CTX, TestServer, engine, post, reference, reference_with, tiny_model,
};

fn tokenizer() -> Tokenizer {
    Tokenizer::from_gguf(&GgufFile::open(tiny_model()).expect("opens")).expect("tokenizer")
}

/// A token whose piece is one ASCII letter, so its text repeats exactly.
fn letter_token(t: &Tokenizer) -> (u32, String) {
    (0..t.vocab_size() as u32)
        .filter(|&id| !t.is_eog(id))
        .find_map(|id| {
            let piece = t.token_to_piece(id);
            (piece.len() == 1 && piece[0].is_ascii_alphabetic())
                .then(|| (id, String::from_utf8_lossy(&piece).into_owned()))
        })
        .expect("the tiny model has single-letter tokens")
}

fn end_token(t: &Tokenizer) -> u32 {
    *t.eog_ids()
        .first()
        .expect("the tiny model has an end token")
}

#[tokio::test]
async fn a_favored_token_wins_every_greedy_step_on_both_endpoints() {
    let t = tokenizer();
    let (id, letter) = letter_token(&t);
    let server = TestServer::start(
        engine(tiny_model(), TEST_CTX, 2).await,
        HttpOptions::default(),
    )
    .await;
    let bias = json!({ id.to_string(): 100 });
    let reply = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": "ba be bi", "max_tokens": 7, "temperature": 0, "logit_bias": bias}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let body = reply.json();
    assert_eq!(body["choices"][0]["text"], letter.repeat(7));
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    let chat = post(
        server.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                "temperature": 0, "logit_bias": bias}),
    )
    .await;
    assert_eq!(chat.status, 200, "{}", chat.body);
    assert_eq!(
        chat.json()["choices"][0]["message"]["content"],
        letter.repeat(5)
    );
    // Hot sampling over every token: the favored one still wins every draw.
    let hot = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": "ba", "max_tokens": 6, "temperature": 1.5, "top_k": 0,
                "top_p": 1, "min_p": 0, "seed": 3, "logit_bias": bias}),
    )
    .await;
    assert_eq!(hot.json()["choices"][0]["text"], letter.repeat(6));
    server.stop().await;
}

#[tokio::test]
async fn a_banned_greedy_token_never_comes_out() {
    let t = tokenizer();
    let model = tiny_model();
    let prompt = t.encode("ka ke ki", t.add_bos_default(), false);
    let (greedy_tokens, greedy_text, _) = reference(model, TEST_CTX, &prompt, 16);
    let banned = greedy_tokens[0];
    let params = SamplingParams {
        logit_bias: vec![(banned, f32::NEG_INFINITY)],
        ..SamplingParams::greedy()
    };
    let (want_tokens, want_text, ended_at_eog) =
        reference_with(model, TEST_CTX, &prompt, 16, params);
    assert!(!want_tokens.contains(&banned), "{want_tokens:?}");
    assert_ne!(want_text, greedy_text);
    let server = TestServer::start(engine(model, TEST_CTX, 2).await, HttpOptions::default()).await;
    let reply = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 16, "temperature": 0,
                "logit_bias": { banned.to_string(): -100 }}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let body = reply.json();
    assert_eq!(body["choices"][0]["text"], want_text);
    assert_eq!(body["usage"]["completion_tokens"], want_tokens.len());
    let finish = if ended_at_eog { "stop" } else { "length" };
    assert_eq!(body["choices"][0]["finish_reason"], finish);
    server.stop().await;
}

#[tokio::test]
async fn ignore_eos_and_min_tokens_keep_going_past_a_favored_end_token() {
    let t = tokenizer();
    let eog = end_token(&t);
    let server = TestServer::start(
        engine(tiny_model(), TEST_CTX, 2).await,
        HttpOptions::default(),
    )
    .await;
    let addr = server.addr;
    let ask = async |extra: serde_json::Value| {
        let mut body = json!({"prompt": "ba be", "max_tokens": 9, "temperature": 0,
                              "logit_bias": { eog.to_string(): 100 }});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        post(addr, "/v1/completions", &body).await
    };
    let ends = ask(json!({})).await.json();
    assert_eq!(ends["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        ends["usage"]["completion_tokens"], 0,
        "the end token comes first"
    );
    let ignored = ask(json!({"ignore_eos": true})).await;
    assert_eq!(ignored.status, 200, "{}", ignored.body);
    let ignored = ignored.json();
    assert_eq!(ignored["choices"][0]["finish_reason"], "length");
    assert_eq!(ignored["usage"]["completion_tokens"], 9);
    let held = ask(json!({"min_tokens": 4})).await.json();
    assert_eq!(held["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        held["usage"]["completion_tokens"], 4,
        "ends at the first allowed end token"
    );
    let too_many = ask(json!({"min_tokens": 10})).await;
    assert_eq!(too_many.status, 400);
    assert_eq!(too_many.json()["error"]["param"], "min_tokens");
    server.stop().await;
}

#[tokio::test]
async fn min_tokens_holds_back_stop_strings_and_bad_biases_are_400() {
    let t = tokenizer();
    let (id, letter) = letter_token(&t);
    let server = TestServer::start(
        engine(tiny_model(), TEST_CTX, 2).await,
        HttpOptions::default(),
    )
    .await;
    let body = |min_tokens: usize| {
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
               "temperature": 0, "logit_bias": { id.to_string(): 100 }, "stop": letter,
               "min_tokens": min_tokens})
    };
    let at_once = post(server.addr, "/v1/chat/completions", &body(0))
        .await
        .json();
    assert_eq!(at_once["choices"][0]["message"]["content"], "");
    assert_eq!(at_once["choices"][0]["finish_reason"], "stop");
    let later = post(server.addr, "/v1/chat/completions", &body(3))
        .await
        .json();
    assert_eq!(later["choices"][0]["message"]["content"], letter.repeat(3));
    assert_eq!(later["choices"][0]["finish_reason"], "stop");
    assert_eq!(later["usage"]["completion_tokens"], 4);
    let vocab = t.vocab_size();
    for bias in [
        json!({ vocab.to_string(): 1 }),
        json!({"1": 101}),
        json!({"x": 1}),
        json!([1]),
    ] {
        let reply = post(
            server.addr,
            "/v1/completions",
            &json!({"prompt": "ba", "logit_bias": bias}),
        )
        .await;
        assert_eq!(reply.status, 400, "{bias}");
        assert_eq!(reply.json()["error"]["param"], "logit_bias", "{bias}");
    }
    server.stop().await;
}

#[tokio::test]
async fn stop_token_ids_end_like_an_end_token_and_wait_for_min_tokens() {
    let t = tokenizer();
    let (id, _) = letter_token(&t);
    let server = TestServer::start(
        engine(tiny_model(), TEST_CTX, 2).await,
        HttpOptions::default(),
    )
    .await;
    let body = |min_tokens: usize, ids: serde_json::Value| {
        json!({"prompt": "ba be", "max_tokens": 8, "temperature": 0,
               "logit_bias": { id.to_string(): 100 }, "stop_token_ids": ids,
               "min_tokens": min_tokens})
    };
    let at_once = post(server.addr, "/v1/completions", &body(0, json!([id]))).await;
    assert_eq!(at_once.status, 200, "{}", at_once.body);
    let at_once = at_once.json();
    assert_eq!(
        at_once["choices"][0]["text"], "",
        "the stop token is not sent"
    );
    assert_eq!(at_once["choices"][0]["finish_reason"], "stop");
    assert_eq!(at_once["usage"]["completion_tokens"], 0);
    let later = post(server.addr, "/v1/completions", &body(3, json!([id])))
        .await
        .json();
    assert_eq!(later["choices"][0]["finish_reason"], "stop");
    assert_eq!(later["usage"]["completion_tokens"], 3);
    let outside = post(
        server.addr,
        "/v1/completions",
        &body(0, json!([t.vocab_size()])),
    )
    .await;
    assert_eq!(outside.status, 400);
    assert_eq!(outside.json()["error"]["param"], "stop_token_ids");
    server.stop().await;
}
