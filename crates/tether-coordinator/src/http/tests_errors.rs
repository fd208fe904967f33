//! Engine failures as HTTP replies, against a scripted engine.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use tether_gguf::GgufFile;
use tether_model::tokenizer::Tokenizer;
use tokio::sync::mpsc;

use super::test_support::{post, send, tiny_model};
use super::{ConnLimits, HttpOptions, router, serve};
use crate::api::{
    EngineStats, FinishReason, GenError, GenEvent, GenRequest, Generation, Health, ModelInfo,
};

/// What the scripted engine does with every request.
#[derive(Clone)]
enum Script {
    /// Refuses it.
    Refuse(GenError),
    /// Accepts it and never answers.
    Silent,
    /// Sends these tokens, then the error or (if none) a `Done`.
    Tokens(Vec<u32>, Option<GenError>),
    /// Sends these tokens and hangs up without a `Done`.
    HangUp(Vec<u32>),
}

struct ScriptedEngine {
    tokenizer: Arc<Tokenizer>,
    health: Health,
    script: Script,
    /// Senders of silent requests, kept so their receivers stay open.
    held: Mutex<Vec<mpsc::Sender<Result<GenEvent, GenError>>>>,
}

impl Generation for ScriptedEngine {
    fn model(&self) -> ModelInfo {
        ModelInfo {
            id: "scripted".into(),
            ctx_per_seq: 64,
            n_embd: 8,
            created: 1,
            chat_template: None,
            pooling: None,
        }
    }

    fn tokenizer(&self) -> Arc<Tokenizer> {
        Arc::clone(&self.tokenizer)
    }

    fn health(&self) -> Health {
        self.health.clone()
    }

    fn stats(&self) -> EngineStats {
        EngineStats::default()
    }

    fn submit(
        &self,
        req: GenRequest,
    ) -> Result<mpsc::Receiver<Result<GenEvent, GenError>>, GenError> {
        let (tx, rx) = mpsc::channel(64);
        match &self.script {
            Script::Refuse(e) => return Err(e.clone()),
            Script::Silent => {
                if let Ok(mut held) = self.held.lock() {
                    held.push(tx);
                }
            }
            Script::Tokens(tokens, error) => {
                for &t in tokens {
                    let _ = tx.try_send(Ok(GenEvent::Token(t)));
                }
                let end = match error {
                    Some(e) => Err(e.clone()),
                    None => Ok(GenEvent::Done {
                        finish: FinishReason::Length,
                        prompt_tokens: req.prompt.len(),
                        completion_tokens: tokens.len(),
                    }),
                };
                let _ = tx.try_send(end);
            }
            Script::HangUp(tokens) => {
                for &t in tokens {
                    let _ = tx.try_send(Ok(GenEvent::Token(t)));
                }
            }
        }
        Ok(rx)
    }
}

/// A server over a scripted engine; stops when the returned sender is dropped.
async fn start(
    script: Script,
    health: Health,
    opts: HttpOptions,
) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let tokenizer =
        Tokenizer::from_gguf(&GgufFile::open(tiny_model()).expect("opens")).expect("tokenizer");
    let engine = Arc::new(ScriptedEngine {
        tokenizer: Arc::new(tokenizer),
        health,
        script,
        held: Mutex::new(Vec::new()),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("binds");
    let addr = listener.local_addr().expect("address");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(
        listener,
        router(engine, opts),
        ConnLimits::default(),
        async move {
            let _ = rx.await;
        },
    ));
    (addr, tx)
}

fn completion(stream: bool) -> serde_json::Value {
    json!({"prompt": "ba be", "max_tokens": 8, "stream": stream})
}

#[tokio::test]
async fn refusals_keep_their_status_streaming_or_not() {
    let cases = [
        (GenError::Busy("full".into()), 429, "rate_limit_error"),
        (
            GenError::Unavailable("worker gone".into()),
            503,
            "server_error",
        ),
        (
            GenError::InvalidRequest("nope".into()),
            400,
            "invalid_request_error",
        ),
        (GenError::Internal("bug".into()), 500, "server_error"),
    ];
    for (error, status, kind) in cases {
        let (addr, _stop) = start(
            Script::Refuse(error.clone()),
            Health::Ready,
            HttpOptions::default(),
        )
        .await;
        for stream in [false, true] {
            let reply = post(addr, "/v1/completions", &completion(stream)).await;
            assert_eq!(reply.status, status, "{error:?} stream={stream}");
            let body = reply.json();
            assert_eq!(body["error"]["type"], kind);
            assert_eq!(body["error"]["message"], error.to_string());
        }
        let busy_or_down = status == 429 || status == 503;
        let reply = post(addr, "/v1/completions", &completion(false)).await;
        assert_eq!(reply.header("retry-after").is_some(), busy_or_down);
    }
}

#[tokio::test]
async fn a_silent_engine_times_out_with_504() {
    let opts = HttpOptions {
        request_timeout: Duration::from_millis(200),
        ..HttpOptions::default()
    };
    let (addr, _stop) = start(Script::Silent, Health::Ready, opts).await;
    for stream in [false, true] {
        let reply = post(addr, "/v1/completions", &completion(stream)).await;
        assert_eq!(reply.status, 504, "stream={stream}: {}", reply.body);
        assert_eq!(reply.json()["error"]["code"], "timeout");
    }
}

#[tokio::test]
async fn errors_after_tokens_end_the_stream_with_an_error_event() {
    let tokens = vec![300, 301, 302];
    let (addr, _stop) = start(
        Script::Tokens(tokens, Some(GenError::Unavailable("worker lost".into()))),
        Health::Ready,
        HttpOptions::default(),
    )
    .await;
    let whole = post(addr, "/v1/completions", &completion(false)).await;
    assert_eq!(whole.status, 503);
    let streamed = post(addr, "/v1/completions", &completion(true)).await;
    assert_eq!(streamed.status, 200);
    let data = streamed.sse_data();
    let last: serde_json::Value = serde_json::from_str(data.last().expect("events")).expect("json");
    assert_eq!(last["error"]["message"], "worker lost");
    assert!(!data.iter().any(|d| d == "[DONE]"));
}

#[tokio::test]
async fn an_engine_hanging_up_without_done_is_a_500() {
    let (addr, _stop) = start(
        Script::HangUp(vec![300]),
        Health::Ready,
        HttpOptions::default(),
    )
    .await;
    let reply = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(reply.status, 500, "{}", reply.body);
}

#[tokio::test]
async fn scripted_tokens_are_detokenized_with_usage() {
    let tok = Tokenizer::from_gguf(&GgufFile::open(tiny_model()).expect("opens")).expect("tok");
    let tokens = vec![300, 301, 302];
    let want: Vec<u8> = tokens.iter().flat_map(|&t| tok.token_to_piece(t)).collect();
    let (addr, _stop) = start(
        Script::Tokens(tokens, None),
        Health::Ready,
        HttpOptions::default(),
    )
    .await;
    let body = post(addr, "/v1/completions", &completion(false))
        .await
        .json();
    assert_eq!(
        body["choices"][0]["text"],
        String::from_utf8_lossy(&want).as_ref()
    );
    assert_eq!(body["usage"]["completion_tokens"], 3);
    assert_eq!(body["model"], "scripted");
}

#[tokio::test]
async fn health_reports_why_the_engine_does_not_serve() {
    let (addr, _stop) = start(
        Script::Silent,
        Health::Unavailable("loading layers".into()),
        HttpOptions::default(),
    )
    .await;
    let reply = send(addr, "GET", "/health", &[], None).await;
    assert_eq!(reply.status, 503);
    assert_eq!(reply.json()["reason"], "loading layers");
}
