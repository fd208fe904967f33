//! `logprobs`, `top_logprobs` and `echo` over real sockets, against the production engine
//! over an embedded worker: every reported log-probability equals the log-softmax of the
//! logits a single-process model computes for the same tokens.

use std::sync::Arc;

use serde_json::{Value, json};
use tether_compute::CpuBackend;
use tether_gguf::GgufFile;
use tether_model::tokenizer::Tokenizer;
use tether_model::{Generator, SamplingParams};

use crate::api::Generation;

use super::HttpOptions;
use super::template::{ChatMessage, ChatTemplate, TemplateBudget};
use super::test_support::{
    TEST_CTX, TestServer, engine, post, reference, reference_with, tiny_model,
};

fn tokenizer() -> Tokenizer {
    Tokenizer::from_gguf(&GgufFile::open(tiny_model()).expect("opens")).expect("tokenizer")
}

/// `log_softmax(logits after tokens[..p])[tokens[p]]` for every p from 1, in f64, with the
/// whole row's distribution: `(logprob of the token, every log-probability of the row)`.
fn log_softmax_rows(tokens: &[u32]) -> Vec<(f64, Vec<f64>)> {
    let file = GgufFile::open(tiny_model()).expect("model opens");
    let backend = Arc::new(CpuBackend::new(Some(1)).expect("cpu backend"));
    let mut generator = Generator::from_file(backend, &file, TEST_CTX, 32).expect("generator");
    let logits = generator
        .eval_logits(&tokens[..tokens.len() - 1])
        .expect("logits");
    let v = logits.len() / (tokens.len() - 1);
    logits
        .chunks(v)
        .zip(&tokens[1..])
        .map(|(row, &next)| {
            let max = row
                .iter()
                .fold(f64::NEG_INFINITY, |m, &l| m.max(f64::from(l)));
            let sum: f64 = row.iter().map(|&l| (f64::from(l) - max).exp()).sum();
            let lse = max + sum.ln();
            let all: Vec<f64> = row.iter().map(|&l| f64::from(l) - lse).collect();
            (all[next as usize], all)
        })
        .collect()
}

fn close(got: &Value, want: f64, what: &str) {
    let got = got
        .as_f64()
        .unwrap_or_else(|| panic!("{what}: {got} is no number"));
    assert!((got - want).abs() < 2e-3, "{what}: {got} against {want}");
}

/// The completions API's `top_logprobs` entry: at most `n` alternatives, each one a token's
/// log-probability in the reference row, the most likely first, summing to at most 1.
fn check_top(top: &Value, n: usize, row: &[f64], t: &Tokenizer, what: &str) {
    let top = top.as_object().unwrap_or_else(|| panic!("{what}: {top}"));
    assert!(!top.is_empty() && top.len() <= n, "{what}: {top:?}");
    let mut best: Vec<f64> = row.to_vec();
    best.sort_by(|a, b| b.total_cmp(a));
    let mass: f64 = top.values().filter_map(Value::as_f64).map(f64::exp).sum();
    assert!(
        mass <= 1.0 + 1e-6,
        "{what}: the alternatives' probabilities sum to {mass}"
    );
    for (text, lp) in top {
        let lp = lp.as_f64().expect("a number");
        let named = (0..row.len() as u32).any(|id| {
            String::from_utf8_lossy(&t.token_to_piece(id)) == *text
                && (row[id as usize] - lp).abs() < 2e-3
        });
        assert!(
            named,
            "{what}: `{text}` at {lp} is no token of the row at that value"
        );
        assert!(
            lp >= best[n.min(best.len()) - 1] - 2e-3,
            "{what}: `{text}` is not among the {n} best"
        );
    }
}

#[tokio::test]
async fn completion_logprobs_with_echo_equal_the_models_log_softmax() {
    let t = tokenizer();
    let prompt_text = "ba be bi bo";
    let prompt = t.encode(prompt_text, t.add_bos_default(), false);
    let (generated, text, _) = reference(tiny_model(), TEST_CTX, &prompt, 6);
    let all: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
    let want = log_softmax_rows(&all);
    let server = TestServer::start(
        engine(tiny_model(), TEST_CTX, 2).await,
        HttpOptions::default(),
    )
    .await;
    let reply = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": prompt_text, "max_tokens": 6, "temperature": 0, "logprobs": 3, "echo": true}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let body = reply.json();
    let choice = &body["choices"][0];
    assert_eq!(choice["text"], format!("{prompt_text}{text}"));
    let lp = &choice["logprobs"];
    let tokens = lp["tokens"].as_array().expect("tokens");
    assert_eq!(tokens.len(), all.len(), "{lp}");
    assert_eq!(
        lp["token_logprobs"][0],
        Value::Null,
        "nothing precedes the first token"
    );
    assert_eq!(lp["top_logprobs"][0], Value::Null);
    let mut offset = 0;
    for (p, &id) in all.iter().enumerate() {
        let piece = t.token_to_piece(id);
        assert_eq!(
            tokens[p],
            String::from_utf8_lossy(&piece).as_ref(),
            "token {p}"
        );
        assert_eq!(lp["text_offset"][p], offset, "token {p}");
        offset += piece.len();
        if p == 0 {
            continue;
        }
        let (logprob, row) = &want[p - 1];
        close(&lp["token_logprobs"][p], *logprob, &format!("token {p}"));
        check_top(&lp["top_logprobs"][p], 3, row, &t, &format!("token {p}"));
    }
    server.stop().await;
}

#[tokio::test]
async fn echo_with_no_new_tokens_scores_the_prompt() {
    let t = tokenizer();
    let prompt = t.encode("ka ke ki ko", t.add_bos_default(), false);
    let want = log_softmax_rows(&prompt);
    let server = TestServer::start(
        engine(tiny_model(), TEST_CTX, 2).await,
        HttpOptions::default(),
    )
    .await;
    for stream in [false, true] {
        let request = json!({"prompt": prompt, "max_tokens": 0, "logprobs": 0, "echo": true,
                             "stream": stream});
        let reply = post(server.addr, "/v1/completions", &request).await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        let choices: Vec<Value> = if stream {
            reply
                .sse_data()
                .iter()
                .filter(|d| d.as_str() != "[DONE]")
                .map(|d| serde_json::from_str::<Value>(d).expect("JSON")["choices"][0].clone())
                .collect()
        } else {
            let body = reply.json();
            assert_eq!(body["usage"]["completion_tokens"], 0);
            assert_eq!(body["usage"]["prompt_tokens"], prompt.len());
            vec![body["choices"][0].clone()]
        };
        let text: String = choices.iter().filter_map(|c| c["text"].as_str()).collect();
        assert_eq!(text, t.decode(&prompt), "stream {stream}");
        let logprobs: Vec<Value> = choices
            .iter()
            .filter(|c| !c["logprobs"].is_null())
            .flat_map(|c| {
                c["logprobs"]["token_logprobs"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .collect();
        assert_eq!(logprobs.len(), prompt.len(), "stream {stream}");
        assert_eq!(logprobs[0], Value::Null);
        for (p, (logprob, _)) in want.iter().enumerate() {
            close(
                &logprobs[p + 1],
                *logprob,
                &format!("prompt token {}", p + 1),
            );
        }
        assert_eq!(choices.last().expect("a chunk")["finish_reason"], "length");
    }
    // `echo` without `logprobs` returns the prompt text and no scores.
    let reply = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": "ka ke", "max_tokens": 0, "echo": true}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["choices"][0]["text"], "ka ke");
    assert_eq!(reply.json()["choices"][0]["logprobs"], Value::Null);
    server.stop().await;
}

/// Sampled tokens report the model's distribution (temperature 1, no sampling settings),
/// not the sampler's, whole and streamed, on the chat API.
#[tokio::test]
async fn chat_logprobs_of_sampled_tokens_equal_the_models_log_softmax() {
    let t = tokenizer();
    let served = engine(tiny_model(), TEST_CTX, 2).await;
    let template = ChatTemplate::for_model(&served.model(), &t, TemplateBudget::default());
    let server = TestServer::start(served, HttpOptions::default()).await;
    let messages = json!([{"role": "user", "content": "ba be"}]);
    let request = json!({"messages": messages, "max_tokens": 8, "temperature": 0.7, "top_k": 5,
                         "seed": 11, "logprobs": true, "top_logprobs": 2});
    let whole = post(server.addr, "/v1/chat/completions", &request).await;
    assert_eq!(whole.status, 200, "{}", whole.body);
    let whole = whole.json();
    let content = whole["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("content")
        .clone();
    assert_eq!(
        content.len(),
        whole["usage"]["completion_tokens"].as_u64().unwrap() as usize
    );
    let text: String = content.iter().filter_map(|e| e["token"].as_str()).collect();
    assert_eq!(whole["choices"][0]["message"]["content"], text);
    // The sampler's own tokens, to score them with the reference.
    let user = ChatMessage {
        role: "user".into(),
        content: "ba be".into(),
        ..Default::default()
    };
    let rendered = template.render(&[user]).expect("renders");
    let bos = template.bos_token();
    let template_bos = !bos.is_empty() && rendered.starts_with(bos);
    let prompt = t.encode(&rendered, t.add_bos_default() && !template_bos, true);
    let params = SamplingParams {
        temperature: 0.7,
        top_k: 5,
        seed: 11,
        ..SamplingParams::default()
    };
    let (generated, _, _) = reference_with(tiny_model(), TEST_CTX, &prompt, 8, params);
    let all: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
    let want = log_softmax_rows(&all);
    for (i, entry) in content.iter().enumerate() {
        let (logprob, row) = &want[prompt.len() - 1 + i];
        close(&entry["logprob"], *logprob, &format!("token {i}"));
        let bytes: Vec<u8> = entry["bytes"]
            .as_array()
            .expect("bytes")
            .iter()
            .map(|b| b.as_u64().expect("a byte") as u8)
            .collect();
        assert_eq!(bytes, t.token_to_piece(generated[i]), "token {i}");
        let top = entry["top_logprobs"].as_array().expect("alternatives");
        assert_eq!(top.len(), 2);
        let mut best = row.clone();
        best.sort_by(|a, b| b.total_cmp(a));
        close(
            &top[0]["logprob"],
            best[0],
            &format!("token {i}: the likeliest"),
        );
        close(
            &top[1]["logprob"],
            best[1],
            &format!("token {i}: the second"),
        );
        assert!(entry["logprob"].as_f64() <= top[0]["logprob"].as_f64().map(|b| b + 1e-6));
    }
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let reply = post(server.addr, "/v1/chat/completions", &streamed).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let chunk_entries: Vec<Value> = reply
        .sse_data()
        .iter()
        .filter(|d| d.as_str() != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).expect("JSON"))
        .filter(|c| !c["choices"][0]["logprobs"].is_null())
        .flat_map(|c| {
            c["choices"][0]["logprobs"]["content"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    // The stream's request reuses the first one's cached prompt, so its logits may differ
    // from the first's in the last bits.
    assert_eq!(
        chunk_entries.len(),
        content.len(),
        "the stream carries every entry"
    );
    for (i, (streamed, whole)) in chunk_entries.iter().zip(&content).enumerate() {
        assert_eq!(streamed["token"], whole["token"], "entry {i}");
        let whole = whole["logprob"].as_f64().expect("a number");
        close(&streamed["logprob"], whole, &format!("streamed entry {i}"));
    }
    server.stop().await;
}

#[tokio::test]
async fn fields_out_of_range_are_refused_naming_them() {
    let server = TestServer::start(
        engine(tiny_model(), TEST_CTX, 2).await,
        HttpOptions::default(),
    )
    .await;
    let messages = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (
            "/v1/completions",
            json!({"prompt": "a", "logprobs": 21}),
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "best_of": 3}),
            "best_of",
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 0}),
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "echo": true}),
            "echo",
        ),
    ];
    for (path, body, param) in cases {
        let reply = post(server.addr, path, &body).await;
        assert_eq!(reply.status, 400, "{path} {body}: {}", reply.body);
        assert_eq!(reply.json()["error"]["param"], param, "{path} {body}");
    }
    server.stop().await;
}
