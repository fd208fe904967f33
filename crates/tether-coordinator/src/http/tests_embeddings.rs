//! `/v1/embeddings` over real sockets: vectors equal the pooled, normalized output-norm
//! rows of the same prompt run through the model in this process, for each pooling, over
//! prompts longer than a batch, beside generation; and bad bodies refused by field.

use std::path::Path;
use std::sync::Arc;

use base64::Engine as _;
use serde_json::{Value, json};
use tether_compute::CpuBackend;
use tether_gguf::{GgmlType, GgufFile};
use tether_model::tokenizer::Tokenizer;
use tether_model::{BatchToken, StageSpec, load_stage_from_file};

use super::HttpOptions;
use super::test_support::{TEST_CTX, TestServer, engine, engine_with, post, reference, tiny_model};
use crate::api::Pooling;

/// The rows an embedding pools: every position's hidden state after the output norm,
/// from the whole model in this process, one batch.
fn normed_rows(model: &Path, ids: &[u32]) -> Vec<Vec<f32>> {
    let file = GgufFile::open(model).expect("model opens");
    let n_layer = tether_model::ModelConfig::from_gguf(&file)
        .expect("config")
        .n_layer;
    let spec = StageSpec {
        first_layer: 0,
        last_layer: n_layer,
        has_embed: true,
        has_head: true,
        ctx_per_seq: TEST_CTX,
        n_seq: 1,
        cached_seqs: 0,
        ubatch: ids.len(),
        cache_k: GgmlType::F16,
        cache_v: GgmlType::F16,
    };
    let backend = Arc::new(CpuBackend::new(Some(1)).expect("cpu backend"));
    let mut stage = load_stage_from_file(backend, &file, spec).expect("stage");
    let e = stage.config().n_embd;
    let toks: Vec<BatchToken> = (0..ids.len() as u32)
        .map(|pos| BatchToken { seq: 0, pos })
        .collect();
    let mut h = vec![0.0; ids.len() * e];
    stage.embed(ids, &mut h).expect("embed");
    stage.forward(&toks, &mut h).expect("forward");
    let mut normed = vec![0.0; ids.len() * e];
    stage
        .output_normed(&h, ids.len(), &mut normed)
        .expect("normed");
    normed.chunks(e).map(<[f32]>::to_vec).collect()
}

fn expected(model: &Path, ids: &[u32], pooling: Pooling) -> Vec<f32> {
    let rows = normed_rows(model, ids);
    let pooled: Vec<f64> = match pooling {
        Pooling::Mean => (0..rows[0].len())
            .map(|d| rows.iter().map(|r| f64::from(r[d])).sum::<f64>() / rows.len() as f64)
            .collect(),
        Pooling::Cls => rows[0].iter().map(|&x| f64::from(x)).collect(),
        Pooling::Last => rows[rows.len() - 1].iter().map(|&x| f64::from(x)).collect(),
    };
    let norm = pooled.iter().map(|x| x * x).sum::<f64>().sqrt();
    pooled.iter().map(|x| (x / norm) as f32).collect()
}

fn vector(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| x.as_f64().expect("a number") as f32)
        .collect()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: width");
    let err = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(err < 2e-3, "{what}: largest difference {err}");
}

fn tokens(model: &Path, text: &str) -> Vec<u32> {
    let t = Tokenizer::from_gguf(&GgufFile::open(model).expect("opens")).expect("tokenizer");
    t.encode(text, t.add_bos_default(), false)
}

/// A text of more than one batch (32 tokens) of the test engine.
fn long_text() -> String {
    "ba be bi bo bu ".repeat(3)
}

#[tokio::test]
async fn each_pooling_gives_the_normalized_pooled_rows_of_the_prompt() {
    let model = tiny_model();
    let long = long_text();
    let long_ids = tokens(model, &long);
    assert!(long_ids.len() > 32, "the prompt spans batches");
    for pooling in [Pooling::Mean, Pooling::Cls, Pooling::Last] {
        let opts = HttpOptions {
            pooling: Some(pooling),
            ..HttpOptions::default()
        };
        let server = TestServer::start(engine(model, TEST_CTX, 4).await, opts).await;
        let reply = post(
            server.addr,
            "/v1/embeddings",
            &json!({"input": [long, "ba be"], "model": "tiny-q8_0"}),
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        let body = reply.json();
        assert_eq!(body["object"], "list");
        assert_eq!(body["model"], "tiny-q8_0");
        let short_ids = tokens(model, "ba be");
        let data = body["data"].as_array().expect("data");
        assert_eq!(data.len(), 2);
        for (i, ids) in [&long_ids, &short_ids].into_iter().enumerate() {
            assert_eq!(data[i]["index"], i);
            assert_eq!(data[i]["object"], "embedding");
            let got = vector(&data[i]["embedding"]);
            let norm = got.iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!((norm - 1.0).abs() < 1e-4, "unit length, not {norm}");
            assert_close(
                &got,
                &expected(model, ids, pooling),
                &format!("{pooling:?} {i}"),
            );
        }
        let used = long_ids.len() + short_ids.len();
        assert_eq!(body["usage"]["prompt_tokens"], used);
        assert_eq!(body["usage"]["total_tokens"], used);
        server.stop().await;
    }
}

#[tokio::test]
async fn embeddings_run_beside_generation_without_changing_it() {
    let model = tiny_model();
    let engine = engine_with(model, TEST_CTX, 8, 1 << 30, |c| c.parallel = 2).await;
    let server = TestServer::start(engine, HttpOptions::default()).await;
    let prompt = tokens(model, "bo bu ba");
    let (want_tokens, _, _) = reference(model, TEST_CTX, &prompt, 24);
    let long = long_text();
    let generate =
        json!({"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": true});
    let embed =
        json!({"input": [tokens(model, &long)], "encoding_format": "base64", "dimensions": 8});
    let completion = post(server.addr, "/v1/completions", &generate);
    let embedding = post(server.addr, "/v1/embeddings", &embed);
    let (completion, embedding) = tokio::join!(completion, embedding);
    assert_eq!(completion.status, 200, "{}", completion.body);
    let text = completion.json()["choices"][0]["text"].clone();
    let t = Tokenizer::from_gguf(&GgufFile::open(model).expect("opens")).expect("tokenizer");
    assert_eq!(text, json!(t.decode(&want_tokens)));

    assert_eq!(embedding.status, 200, "{}", embedding.body);
    let b64 = embedding.json()["data"][0]["embedding"]
        .as_str()
        .expect("base64 text")
        .to_string();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .expect("valid base64");
    let got: Vec<f32> = bytes
        .chunks(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    // The default pooling of a file that names none is the last token's; `dimensions`
    // keeps the first values and normalizes them again.
    let full = expected(model, &tokens(model, &long), Pooling::Last);
    let head = &full[..8];
    let norm = head.iter().map(|x| x * x).sum::<f32>().sqrt();
    let want: Vec<f32> = head.iter().map(|x| x / norm).collect();
    assert_close(&got, &want, "base64, 8 dimensions");
    server.stop().await;
}

#[tokio::test]
async fn bad_embedding_bodies_are_refused_naming_the_field() {
    let model = tiny_model();
    let server = TestServer::start(engine(model, 16, 1).await, HttpOptions::default()).await;
    let long: Vec<u32> = vec![1; 17];
    let cases = [
        (json!({"input": ""}), 400, "input[0]"),
        (json!({"input": ["ba", []]}), 400, "input"),
        (json!({"input": [[1, 2], []]}), 400, "input[1]"),
        (json!({"input": [long]}), 400, "input[0]"),
        (json!({"input": [1, 99999]}), 400, "input[0]"),
        (json!({"input": []}), 400, "input[0]"),
        (
            json!({"input": "ba", "encoding_format": "hex"}),
            400,
            "encoding_format",
        ),
        (json!({"input": "ba", "dimensions": 0}), 400, "dimensions"),
        (
            json!({"input": "ba", "dimensions": 100000}),
            400,
            "dimensions",
        ),
        (json!({"input": "ba", "normalize": false}), 400, "normalize"),
        (json!({"input": "ba", "model": "gpt-4"}), 404, "model"),
        (json!({"input": 3.5}), 400, "input"),
    ];
    for (body, status, param) in cases {
        let reply = post(server.addr, "/v1/embeddings", &body).await;
        assert_eq!(reply.status, status, "{body}: {}", reply.body);
        assert_eq!(
            reply.json()["error"]["param"],
            param,
            "{body}: {}",
            reply.body
        );
    }
    // The server still embeds after every refusal.
    let ok = post(server.addr, "/v1/embeddings", &json!({"input": "ba be"})).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    server.stop().await;
}
