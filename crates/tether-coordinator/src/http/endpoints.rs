//! `POST /v1/completions` and `POST /v1/chat/completions`, whole or streamed as
//! server-sent events.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::error::ApiError;
use super::heavy::HEAVY_BODY_BYTES;
use super::logprobs;
use super::prepare::{self, Prepared};
use super::run::{Run, RunEvent};
use super::strict::{self, Endpoint};
use super::tools::{ToolCall, Tools};
use super::{AppState, SharedState};
use crate::api::FinishReason;
use tether_model::tokenizer::Tokenizer;

/// The finish reason of a reply that calls tools.
const TOOL_CALLS: &str = "tool_calls";

/// Which of the two endpoints a reply is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// `POST /v1/completions`.
pub(super) async fn completions(
    State(state): State<SharedState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let started = Instant::now();
    let prepared = match body {
        Ok(bytes) if bytes.len() < HEAVY_BODY_BYTES && !constrains(&bytes) => {
            strict::parse_body(Ok(bytes), Endpoint::Completion, &state.model_id)
                .and_then(|req| prepare::completion(&state, req))
        }
        body => {
            let work = move |state: &AppState| {
                strict::parse_body(body, Endpoint::Completion, &state.model_id)
                    .and_then(|req| prepare::completion(state, req))
            };
            state.heavy.run(Arc::clone(&state), work).await
        }
    };
    respond(&state, Kind::Completion, prepared, started).await
}

/// Whether a body may ask for constrained output, whose grammar is compiled (and the
/// first time, the vocabulary indexed) while it is prepared: then it is heavy work.
fn constrains(body: &[u8]) -> bool {
    [&b"grammar"[..], b"json_schema", b"response_format"]
        .iter()
        .any(|key| body.windows(key.len()).any(|w| w == *key))
}

/// `POST /v1/chat/completions`.
pub(super) async fn chat_completions(
    State(state): State<SharedState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let started = Instant::now();
    // The model's template may loop as long as its budget allows: always heavy.
    let work = move |state: &AppState| {
        strict::parse_body(body, Endpoint::Chat, &state.model_id)
            .and_then(|req| prepare::chat(state, req))
    };
    let prepared = state.heavy.run(Arc::clone(&state), work).await;
    respond(&state, Kind::Chat, prepared, started).await
}

/// The JSON body, or a 400 that says what is wrong with it (a field this server does not
/// implement, an unknown model, a value of the wrong kind).
async fn respond(
    state: &SharedState,
    kind: Kind,
    prepared: Result<Prepared, ApiError>,
    started: Instant,
) -> Response {
    match generate(state, kind, prepared, started).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

async fn generate(
    state: &SharedState,
    kind: Kind,
    prepared: Result<Prepared, ApiError>,
    started: Instant,
) -> Result<Response, ApiError> {
    let prepared = prepared?;
    let (stream, include_usage) = (prepared.stream, prepared.include_usage);
    let echo = prepared.echo.clone();
    let logprobs = prepared.logprobs.is_some();
    let tools = prepared.tools.clone();
    let mut run = Run::start(state, prepared, started)?;
    let shape = Shape::new(
        kind,
        &state.model_id,
        Arc::clone(&state.tokenizer),
        logprobs,
    );
    // Waiting for the first event lets errors found before any token (a full queue, a
    // prompt the engine refuses) keep their HTTP status even when streaming.
    let first = match run.next().await {
        Some(Ok(event)) => event,
        Some(Err(e)) => return Err(e),
        None => return Err(ApiError::internal("the request ended without a reply")),
    };
    if stream {
        return Ok(sse_response(run, shape, first, include_usage, echo, tools));
    }
    let mut text = echo.unwrap_or_default();
    let mut entries = Vec::new();
    let mut event = first;
    loop {
        match event {
            RunEvent::Text(t) => text.push_str(&t),
            RunEvent::LogProb(scored) => entries.push((scored.token, Some(scored))),
            // The prompt's scores come first of all.
            RunEvent::Prompt(prompt) => entries = prompt,
            RunEvent::End {
                finish,
                prompt_tokens,
                completion_tokens,
            } => {
                let logprobs = shape.logprobs(&entries, &mut 0);
                let usage = usage(prompt_tokens, completion_tokens);
                let mut body = shape.whole(&text, finish, usage, logprobs);
                if let Some((content, calls)) = tools.and_then(|t| t.parse(&text)) {
                    let calls: Vec<Value> = calls.iter().map(ToolCall::to_json).collect();
                    let choice = &mut body["choices"][0];
                    choice["message"] =
                        json!({"role": "assistant", "content": content, "tool_calls": calls});
                    choice["finish_reason"] = json!(TOOL_CALLS);
                }
                return Ok(axum::Json(body).into_response());
            }
        }
        event = match run.next().await {
            Some(Ok(e)) => e,
            Some(Err(e)) => return Err(e),
            None => return Err(ApiError::internal("the request ended without a reply")),
        };
    }
}

fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// Builds reply bodies of one response.
struct Shape {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<Tokenizer>,
    /// Whether the request asked for log-probabilities.
    logprobs: bool,
}

impl Shape {
    fn new(kind: Kind, model: &str, tokenizer: Arc<Tokenizer>, logprobs: bool) -> Self {
        let prefix = match kind {
            Kind::Completion => "cmpl",
            Kind::Chat => "chatcmpl",
        };
        Self {
            kind,
            id: format!("{prefix}-{}", uuid::Uuid::new_v4().simple()),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            model: model.to_owned(),
            tokenizer,
            logprobs,
        }
    }

    /// A choice's `logprobs` for `entries` (text offsets from `offset` on, for
    /// completions): null unless the request asked for them.
    fn logprobs(&self, entries: &[logprobs::Entry], offset: &mut usize) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        match self.kind {
            Kind::Completion => logprobs::completion(&self.tokenizer, entries, offset),
            Kind::Chat => {
                // The chat API reports generated tokens only, each of which has its scores.
                let scored: Vec<_> = entries.iter().filter_map(|e| e.1.clone()).collect();
                logprobs::chat(&self.tokenizer, &scored)
            }
        }
    }

    fn object(&self, choice: Value, object: &str) -> Value {
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }

    /// The non-streamed reply.
    fn whole(&self, text: &str, finish: FinishReason, usage: Value, logprobs: Value) -> Value {
        let mut body = match self.kind {
            Kind::Completion => self.object(
                json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish.as_str()}),
                "text_completion",
            ),
            Kind::Chat => self.object(
                json!({
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs,
                    "finish_reason": finish.as_str(),
                }),
                "chat.completion",
            ),
        };
        body["usage"] = usage;
        body
    }

    /// A streamed chunk with `text` (chat: as `delta.content`), the `logprobs` of its
    /// tokens, and maybe the finish reason.
    fn chunk(&self, text: Option<&str>, finish: Option<&str>, logprobs: Value) -> Value {
        match self.kind {
            Kind::Completion => self.object(
                json!({"index": 0, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish}),
                "text_completion",
            ),
            Kind::Chat => {
                let delta = match text {
                    Some(t) => json!({"content": t}),
                    None => json!({}),
                };
                self.object(
                    json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}),
                    "chat.completion.chunk",
                )
            }
        }
    }

    /// A chat chunk with tool calls (each whole, with its index) as `delta.tool_calls`.
    fn tool_calls_chunk(&self, calls: &[ToolCall]) -> Value {
        let calls: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(i, call)| {
                let mut call = call.to_json();
                call["index"] = json!(i);
                call
            })
            .collect();
        self.object(
            json!({"index": 0, "delta": {"tool_calls": calls}, "logprobs": null, "finish_reason": null}),
            "chat.completion.chunk",
        )
    }

    /// The chat stream's opening chunk, naming the role.
    fn role_chunk(&self) -> Value {
        self.object(
            json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}),
            "chat.completion.chunk",
        )
    }

    /// The chunk with usage only, sent last when the client asked for it.
    fn usage_chunk(&self, usage: Value) -> Value {
        let object = match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        })
    }
}

fn frame(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

/// What the event stream still has to send.
struct SseState {
    run: Run,
    shape: Shape,
    frames: VecDeque<Bytes>,
    include_usage: bool,
    ended: bool,
    /// The prompt's text, until it is sent (`echo`).
    echo: Option<String>,
    /// Tokens whose log-probabilities go with the next chunk.
    scored: Vec<logprobs::Entry>,
    /// Where the next reported token's text starts in the choice's text.
    offset: usize,
    /// The tools whose calls are looked for: the text is then held back until the end,
    /// when it is sent as text or as calls.
    tools: Option<Tools>,
    /// The text held back.
    held: String,
}

impl SseState {
    /// A chunk of `text` carrying the log-probabilities gathered since the last one.
    fn text_chunk(&mut self, text: Option<&str>, finish: Option<&str>) {
        let logprobs = self.shape.logprobs(&self.scored, &mut self.offset);
        self.scored.clear();
        let chunk = self.shape.chunk(text, finish, logprobs);
        self.frames.push_back(frame(&chunk));
    }

    /// Turns one run event (or error) into frames.
    fn push(&mut self, event: Option<Result<RunEvent, ApiError>>) {
        match event {
            Some(Ok(RunEvent::Text(t))) if self.tools.is_some() => self.held.push_str(&t),
            Some(Ok(RunEvent::Text(t))) => self.text_chunk(Some(&t), None),
            Some(Ok(RunEvent::LogProb(scored))) => self.scored.push((scored.token, Some(scored))),
            Some(Ok(RunEvent::Prompt(prompt))) => {
                self.scored = prompt;
                let echo = self.echo.take().unwrap_or_default();
                self.text_chunk(Some(&echo), None);
            }
            Some(Ok(RunEvent::End {
                finish,
                prompt_tokens,
                completion_tokens,
            })) => {
                let held = std::mem::take(&mut self.held);
                let mut finish = finish.as_str();
                match self.tools.as_ref().and_then(|t| t.parse(&held)) {
                    Some((content, calls)) => {
                        if let Some(content) = content {
                            self.text_chunk(Some(&content), None);
                        }
                        let chunk = self.shape.tool_calls_chunk(&calls);
                        self.frames.push_back(frame(&chunk));
                        finish = TOOL_CALLS;
                    }
                    None if !held.is_empty() => self.text_chunk(Some(&held), None),
                    None => {}
                }
                if !self.scored.is_empty() {
                    // Tokens whose text a stop string cut, or still held back.
                    self.text_chunk(Some(""), None);
                }
                let chunk = self.shape.chunk(None, Some(finish), Value::Null);
                self.frames.push_back(frame(&chunk));
                if self.include_usage {
                    let chunk = self
                        .shape
                        .usage_chunk(usage(prompt_tokens, completion_tokens));
                    self.frames.push_back(frame(&chunk));
                }
                self.frames
                    .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                self.ended = true;
            }
            Some(Err(e)) => {
                self.frames.push_back(frame(&e.body()));
                self.ended = true;
            }
            None => self.ended = true,
        }
    }

    async fn next_frame(&mut self) -> Option<Bytes> {
        loop {
            if let Some(f) = self.frames.pop_front() {
                return Some(f);
            }
            if self.ended {
                return None;
            }
            let event = self.run.next().await;
            self.push(event);
        }
    }
}

/// A `text/event-stream` reply; dropping the body (the client left) drops the run, which
/// cancels the request.
fn sse_response(
    run: Run,
    shape: Shape,
    first: RunEvent,
    include_usage: bool,
    echo: Option<String>,
    tools: Option<Tools>,
) -> Response {
    let mut state = SseState {
        run,
        shape,
        frames: VecDeque::new(),
        include_usage,
        ended: false,
        echo,
        scored: Vec::new(),
        offset: 0,
        tools,
        held: String::new(),
    };
    if state.shape.kind == Kind::Chat {
        let chunk = state.shape.role_chunk();
        state.frames.push_back(frame(&chunk));
    }
    // The prompt goes first; scored, it waits for its scores (the first event then).
    if !matches!(first, RunEvent::Prompt(_))
        && let Some(echo) = state.echo.take()
    {
        state.text_chunk(Some(&echo), None);
    }
    state.push(Some(Ok(first)));
    let body = futures::stream::unfold(state, |mut state| async move {
        let frame = state.next_frame().await?;
        Some((Ok::<_, Infallible>(frame), state))
    });
    let mut response = Body::from_stream(body).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}
