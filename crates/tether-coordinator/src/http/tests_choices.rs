//! Several choices per request (`n`), over a real socket and the production engine.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::HttpOptions;
use super::test_support::{
    TEST_CTX, TestEngine, TestServer, engine_with, open_stream, post, send, tiny_model,
};
use crate::api::Generation;

/// An engine serving `parallel` sequences at once.
async fn parallel_engine(parallel: usize) -> Arc<TestEngine> {
    engine_with(tiny_model(), TEST_CTX, 4, 1 << 30, |c| {
        c.parallel = parallel
    })
    .await
}

fn texts(reply: &Value) -> Vec<String> {
    let choices = reply["choices"].as_array().expect("choices");
    choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_eq!(c["index"], i, "choices come in index order: {reply}");
            c["text"]
                .as_str()
                .or_else(|| c["message"]["content"].as_str())
                .expect("text")
                .to_owned()
        })
        .collect()
}

fn parse_chunks(data: &[String]) -> Vec<Value> {
    assert_eq!(
        data.iter().filter(|d| d.as_str() == "[DONE]").count(),
        1,
        "[DONE] once"
    );
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("not JSON ({e}): {d}")))
        .collect()
}

/// The streamed text and finish reasons of each of `n` choices.
fn streamed(chunks: &[Value], n: usize) -> (Vec<String>, Vec<Vec<String>>) {
    let mut text = vec![String::new(); n];
    let mut finishes = vec![Vec::new(); n];
    for chunk in chunks {
        for c in chunk["choices"].as_array().expect("choices") {
            let i = c["index"].as_u64().expect("index") as usize;
            assert!(i < n, "index {i} of {n} choices");
            let piece = c["text"]
                .as_str()
                .or_else(|| c["delta"]["content"].as_str());
            text[i].push_str(piece.unwrap_or(""));
            if let Some(f) = c["finish_reason"].as_str() {
                finishes[i].push(f.to_owned());
            }
        }
    }
    (text, finishes)
}

#[tokio::test]
async fn greedy_choices_equal_each_other_and_one_choice_whole_and_streamed() {
    let server = TestServer::start(parallel_engine(3).await, HttpOptions::default()).await;
    let one = json!({"prompt": "ba be bi bo", "max_tokens": 12, "temperature": 0});
    let single = post(server.addr, "/v1/completions", &one).await.json();
    let expected = texts(&single).remove(0);
    let mut three = one.clone();
    three["n"] = json!(3);
    let reply = post(server.addr, "/v1/completions", &three).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let whole = reply.json();
    assert_eq!(texts(&whole), vec![expected.clone(); 3]);
    let usage = &whole["usage"];
    let generated = single["usage"]["completion_tokens"]
        .as_u64()
        .expect("count");
    assert_eq!(usage["prompt_tokens"], single["usage"]["prompt_tokens"]);
    assert_eq!(usage["completion_tokens"], 3 * generated);
    assert_eq!(
        usage["total_tokens"],
        single["usage"]["prompt_tokens"].as_u64().expect("count") + 3 * generated
    );

    three["stream"] = json!(true);
    three["stream_options"] = json!({"include_usage": true});
    let reply = post(server.addr, "/v1/completions", &three).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let chunks = parse_chunks(&reply.sse_data());
    let (text, finishes) = streamed(&chunks, 3);
    assert_eq!(text, vec![expected; 3]);
    let finish = single["choices"][0]["finish_reason"]
        .as_str()
        .expect("finish");
    assert_eq!(
        finishes,
        vec![vec![finish.to_owned()]; 3],
        "one finish each"
    );
    let usage_chunks: Vec<&Value> = chunks.iter().filter(|c| !c["usage"].is_null()).collect();
    assert_eq!(usage_chunks.len(), 1, "one usage chunk");
    assert_eq!(usage_chunks[0]["usage"], *usage);
    assert_eq!(chunks.last().expect("chunk")["choices"], json!([]));

    let chat = json!({"messages": [{"role": "user", "content": "ba"}], "max_tokens": 8,
                      "temperature": 0});
    let single = post(server.addr, "/v1/chat/completions", &chat)
        .await
        .json();
    let mut three = chat.clone();
    three["n"] = json!(3);
    let whole = post(server.addr, "/v1/chat/completions", &three)
        .await
        .json();
    assert_eq!(texts(&whole), vec![texts(&single).remove(0); 3]);
    three["stream"] = json!(true);
    let chunks = parse_chunks(
        &post(server.addr, "/v1/chat/completions", &three)
            .await
            .sse_data(),
    );
    let roles = chunks
        .iter()
        .filter(|c| c["choices"][0]["delta"]["role"] == "assistant")
        .map(|c| c["choices"][0]["index"].as_u64().expect("index"))
        .collect::<Vec<_>>();
    assert_eq!(roles, vec![0, 1, 2], "a role chunk per choice, first");
    assert_eq!(streamed(&chunks, 3).0, texts(&whole));
    server.stop().await;
}

#[tokio::test]
async fn seeded_choices_differ_and_a_repeated_request_repeats_them() {
    let server = TestServer::start(parallel_engine(3).await, HttpOptions::default()).await;
    let request = json!({"prompt": "ka ke", "max_tokens": 16, "temperature": 1.5,
                         "top_k": 0, "seed": 42, "n": 3});
    let first = texts(&post(server.addr, "/v1/completions", &request).await.json());
    assert!(
        first[0] != first[1] && first[1] != first[2] && first[0] != first[2],
        "choices of one seed differ: {first:?}"
    );
    let again = texts(&post(server.addr, "/v1/completions", &request).await.json());
    assert_eq!(first, again, "the same seed repeats every choice");
    let mut streamed_request = request.clone();
    streamed_request["stream"] = json!(true);
    let reply = post(server.addr, "/v1/completions", &streamed_request).await;
    assert_eq!(streamed(&parse_chunks(&reply.sse_data()), 3).0, first);
    server.stop().await;
}

#[tokio::test]
async fn a_stop_string_ends_one_choice_while_the_others_go_on() {
    let server = TestServer::start(parallel_engine(2).await, HttpOptions::default()).await;
    let request = json!({"prompt": "ka ke", "max_tokens": 16, "temperature": 1.5,
                         "top_k": 0, "seed": 7, "n": 2, "ignore_eos": true});
    let whole = post(server.addr, "/v1/completions", &request).await.json();
    let free = texts(&whole);
    // Three characters of choice 0's text (from its fifth on) that choice 1's lacks.
    let chars: Vec<usize> = free[0].char_indices().map(|(i, _)| i).collect();
    let stop = (4..chars.len().saturating_sub(3))
        .map(|k| &free[0][chars[k]..chars[k + 3]])
        .find(|s| !free[1].contains(s))
        .unwrap_or_else(|| panic!("no stop string found in {free:?}"))
        .to_owned();
    let cut = free[0].find(&stop).expect("in the text");
    let mut stopped_request = request.clone();
    stopped_request["stop"] = json!(stop);
    let stopped = post(server.addr, "/v1/completions", &stopped_request)
        .await
        .json();
    assert_eq!(
        texts(&stopped),
        vec![free[0][..cut].to_owned(), free[1].clone()]
    );
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    assert_eq!(stopped["choices"][1]["finish_reason"], "length");
    let (before, after) = (
        whole["usage"]["completion_tokens"].as_u64().expect("count"),
        stopped["usage"]["completion_tokens"]
            .as_u64()
            .expect("count"),
    );
    assert!(
        after < before,
        "the stopped choice generated less: {after} vs {before}"
    );

    stopped_request["stream"] = json!(true);
    let reply = post(server.addr, "/v1/completions", &stopped_request).await;
    let (text, finishes) = streamed(&parse_chunks(&reply.sse_data()), 2);
    assert_eq!(text, texts(&stopped));
    assert_eq!(
        finishes,
        vec![vec!["stop".to_owned()], vec!["length".to_owned()]]
    );
    server.stop().await;
}

#[tokio::test]
async fn every_choice_carries_the_echo_and_its_own_logprobs() {
    let server = TestServer::start(parallel_engine(2).await, HttpOptions::default()).await;
    let single = json!({"prompt": "ka ke ki", "max_tokens": 5, "temperature": 0,
                        "logprobs": 2, "echo": true});
    let one = post(server.addr, "/v1/completions", &single).await.json();
    let mut request = single.clone();
    request["n"] = json!(2);
    let two = post(server.addr, "/v1/completions", &request).await.json();
    for i in 0..2 {
        let choice = &two["choices"][i];
        assert_eq!(choice["text"], one["choices"][0]["text"], "{two}");
        assert!(
            choice["text"]
                .as_str()
                .is_some_and(|t| t.starts_with("ka ke ki"))
        );
        assert_eq!(choice["logprobs"], one["choices"][0]["logprobs"], "{two}");
    }
    assert_eq!(two["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"]);
    request["stream"] = json!(true);
    let reply = post(server.addr, "/v1/completions", &request).await;
    let (text, _) = streamed(&parse_chunks(&reply.sse_data()), 2);
    assert_eq!(
        text,
        vec![one["choices"][0]["text"].as_str().expect("text"); 2]
    );
    server.stop().await;
}

#[tokio::test]
async fn n_out_of_range_or_over_parallel_is_refused_naming_n() {
    let server = TestServer::start(parallel_engine(2).await, HttpOptions::default()).await;
    for (n, says) in [
        (json!(17), "between 1 and 16"),
        (json!(0), "between 1 and 16"),
        (json!(3), "--parallel 2"),
    ] {
        for path in ["/v1/completions", "/v1/chat/completions"] {
            let body = json!({"prompt": "ba", "messages": [{"role": "user", "content": "ba"}],
                              "n": n, "max_tokens": 2});
            let mut body = body.as_object().expect("object").clone();
            body.remove(if path.contains("chat") {
                "prompt"
            } else {
                "messages"
            });
            let reply = post(server.addr, path, &Value::Object(body)).await;
            assert_eq!(reply.status, 400, "{path} n={n}: {}", reply.body);
            let error = &reply.json()["error"];
            assert_eq!(error["param"], "n", "{}", reply.body);
            let message = error["message"].as_str().expect("message");
            assert!(message.contains(says), "{message}");
        }
    }
    let negative = json!({"prompt": "ba", "n": -1});
    let reply = post(server.addr, "/v1/completions", &negative).await;
    assert_eq!(reply.status, 400, "{}", reply.body);
    assert!(reply.body.contains("\"n\""), "{}", reply.body);
    let best_of = json!({"prompt": "ba", "n": 2, "best_of": 3});
    let reply = post(server.addr, "/v1/completions", &best_of).await;
    assert_eq!(reply.json()["error"]["param"], "best_of", "{}", reply.body);
    let best_of = json!({"prompt": "ba", "n": 2, "best_of": 2, "max_tokens": 2});
    let reply = post(server.addr, "/v1/completions", &best_of).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["choices"].as_array().map(Vec::len), Some(2));
    server.stop().await;
}

#[tokio::test]
async fn a_dropped_stream_frees_the_slot_of_every_choice() {
    let engine = parallel_engine(3).await;
    let server = TestServer::start(engine.clone(), HttpOptions::default()).await;
    let long = json!({"prompt": [1, 300], "max_tokens": TEST_CTX - 8, "temperature": 0,
                      "ignore_eos": true, "stream": true, "n": 3})
    .to_string();
    let (stream, _) = open_stream(server.addr, "/v1/completions", &long).await;
    assert_eq!(engine.stats().running, 3, "every choice runs");
    drop(stream);
    let started = Instant::now();
    while engine.stats().running != 0 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "choices still run for a client that left"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!((engine.stats().generated_tokens as usize) < 3 * (TEST_CTX - 8));
    // Needs all three slots back.
    let next = json!({"prompt": "ba", "max_tokens": 2, "temperature": 0, "n": 3});
    let reply = post(server.addr, "/v1/completions", &next).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(texts(&reply.json()).len(), 3);
    server.stop().await;
}

fn prefix_hits(metrics: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("tether_engine_prefix_cache_hit_tokens_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no prefix hit counter in {metrics}"))
}

#[tokio::test]
async fn later_choices_copy_the_prompt_of_the_first_instead_of_prefilling_it() {
    let server = TestServer::start(parallel_engine(3).await, HttpOptions::default()).await;
    // 75 tokens: the 74 before the last are shared (the partly filled last block copied
    // on write), after 3 micro-batches of prefill for the first choice.
    let prompt: Vec<u32> = (0..75).map(|i| 5 + (i * 7) % 200).collect();
    let before = prefix_hits(&send(server.addr, "GET", "/metrics", &[], None).await.body);
    let request = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "n": 3});
    let reply = post(server.addr, "/v1/completions", &request).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let choices = texts(&reply.json());
    let after = prefix_hits(&send(server.addr, "GET", "/metrics", &[], None).await.body);
    assert_eq!(
        after - before,
        2 * 74,
        "choices 1 and 2 reuse 74 prompt tokens each"
    );
    // The copied cells give what a prefill gives.
    let single = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0});
    let single = texts(&post(server.addr, "/v1/completions", &single).await.json());
    assert_eq!(choices, vec![single[0].clone(); 3]);
    server.stop().await;
}

#[tokio::test]
async fn choices_wait_together_for_enough_slots_never_starting_in_part() {
    let ctx = 2048;
    let engine = engine_with(tiny_model(), ctx, 4, 1 << 30, |c| c.parallel = 2).await;
    let server = TestServer::start(engine.clone(), HttpOptions::default()).await;
    // One slot taken by a long stream.
    let long = json!({"prompt": [1, 300], "max_tokens": ctx - 8, "temperature": 0,
                      "ignore_eos": true, "stream": true})
    .to_string();
    let (stream, _) = open_stream(server.addr, "/v1/completions", &long).await;
    let addr = server.addr;
    let pair = tokio::spawn(async move {
        let body = json!({"prompt": "ba", "max_tokens": 3, "temperature": 0, "n": 2});
        post(addr, "/v1/completions", &body).await
    });
    // The free slot is not given to one of the two choices.
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(
            engine.stats().running,
            1,
            "a request of two started in part"
        );
    }
    assert!(!pair.is_finished());
    // The waiting request counts as queued, though the scheduler holds it off the queue.
    assert_eq!(engine.stats().queued, 1, "the request of two is queued");
    drop(stream);
    let reply = tokio::time::timeout(Duration::from_secs(20), pair)
        .await
        .expect("served once the slots are free")
        .expect("the task ran");
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(texts(&reply.json()).len(), 2);
    server.stop().await;
}
