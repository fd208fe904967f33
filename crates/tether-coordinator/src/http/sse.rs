//! Streamed replies: server-sent events of every choice of a request, interleaved as their
//! tokens come, each choice ending with its own finish reason, then the usage (when asked)
//! and `[DONE]` once.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::choices::{Choices, Tagged};
use super::logprobs;
use super::run::RunEvent;
use super::shape::{Kind, Shape, TOOL_CALLS, usage};
use super::tools::Tools;

/// What a stream's reply is made of besides its events.
pub(super) struct Reply {
    pub shape: Shape,
    /// Send `usage` in a last chunk.
    pub include_usage: bool,
    /// The prompt's text, sent first in every choice (`echo`).
    pub echo: Option<String>,
    /// Whether the echoed prompt is scored: it then waits for its scores.
    pub scored_echo: bool,
    /// The tools whose calls are looked for.
    pub tools: Option<Tools>,
}

fn frame(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

/// What one choice's stream still has to send.
#[derive(Default)]
struct ChoiceStream {
    /// The prompt's text, until it is sent (`echo`).
    echo: Option<String>,
    /// Tokens whose log-probabilities go with the next chunk.
    scored: Vec<logprobs::Entry>,
    /// Where the next reported token's text starts in the choice's text.
    offset: usize,
    /// With tools, the text is held back until the end, when it is sent as text or calls.
    held: String,
    ended: bool,
}

/// What the event stream still has to send.
struct SseState {
    choices: Choices,
    shape: Shape,
    frames: VecDeque<Bytes>,
    include_usage: bool,
    ended: bool,
    tools: Option<Tools>,
    streams: Vec<ChoiceStream>,
    prompt_tokens: usize,
    /// Generated tokens of every choice that has ended.
    completion_tokens: usize,
}

impl SseState {
    /// A chunk of choice `i` with `text`, carrying the log-probabilities gathered since
    /// its last one.
    fn text_chunk(&mut self, i: usize, text: Option<&str>, finish: Option<&str>) {
        let s = &mut self.streams[i];
        let logprobs = self.shape.logprobs(&s.scored, &mut s.offset);
        s.scored.clear();
        let chunk = self.shape.chunk(i, text, finish, logprobs);
        self.frames.push_back(frame(&chunk));
    }

    /// Turns one event (or error) of a choice into frames; `None`: every run is over.
    fn push(&mut self, event: Option<Tagged>) {
        let Some((i, event)) = event else {
            self.ended = true;
            return;
        };
        match event {
            Ok(RunEvent::Text(t)) if self.tools.is_some() => self.streams[i].held.push_str(&t),
            Ok(RunEvent::Text(t)) => self.text_chunk(i, Some(&t), None),
            Ok(RunEvent::LogProb(scored)) => {
                self.streams[i].scored.push((scored.token, Some(scored)));
            }
            Ok(RunEvent::Prompt(prompt)) => {
                self.streams[i].scored = prompt;
                let echo = self.streams[i].echo.take().unwrap_or_default();
                self.text_chunk(i, Some(&echo), None);
            }
            Ok(RunEvent::End {
                finish,
                prompt_tokens,
                completion_tokens,
            }) => {
                self.end_choice(i, finish.as_str());
                self.prompt_tokens = prompt_tokens;
                self.completion_tokens += completion_tokens;
                if self.streams.iter().all(|s| s.ended) {
                    if self.include_usage {
                        let usage = usage(self.prompt_tokens, self.completion_tokens);
                        let chunk = self.shape.usage_chunk(usage);
                        self.frames.push_back(frame(&chunk));
                    }
                    self.frames
                        .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                    self.ended = true;
                }
            }
            Err(e) => {
                self.frames.push_back(frame(&e.body()));
                self.ended = true;
            }
        }
    }

    /// The last chunks of choice `i`: its held text or tool calls, the scores not sent
    /// yet, and its finish reason.
    fn end_choice(&mut self, i: usize, finish: &str) {
        let held = std::mem::take(&mut self.streams[i].held);
        let mut finish = finish;
        match self.tools.as_ref().and_then(|t| t.parse(&held)) {
            Some((content, calls)) => {
                if let Some(content) = content {
                    self.text_chunk(i, Some(&content), None);
                }
                let chunk = self.shape.tool_calls_chunk(i, &calls);
                self.frames.push_back(frame(&chunk));
                finish = TOOL_CALLS;
            }
            None if !held.is_empty() => self.text_chunk(i, Some(&held), None),
            None => {}
        }
        if !self.streams[i].scored.is_empty() {
            // Tokens whose text a stop string cut, or still held back.
            self.text_chunk(i, Some(""), None);
        }
        let chunk = self.shape.chunk(i, None, Some(finish), Value::Null);
        self.frames.push_back(frame(&chunk));
        self.streams[i].ended = true;
    }

    async fn next_frame(&mut self) -> Option<Bytes> {
        loop {
            if let Some(f) = self.frames.pop_front() {
                return Some(f);
            }
            if self.ended {
                return None;
            }
            let event = self.choices.next().await;
            self.push(event);
        }
    }
}

/// A `text/event-stream` reply starting with `first`; dropping the body (the client left)
/// drops every choice's run, which cancels them all.
pub(super) fn response(choices: Choices, reply: Reply, first: Tagged) -> Response {
    let Reply {
        shape,
        include_usage,
        echo,
        scored_echo,
        tools,
    } = reply;
    let streams = (0..choices.count())
        .map(|_| ChoiceStream {
            echo: echo.clone(),
            ..ChoiceStream::default()
        })
        .collect();
    let mut state = SseState {
        choices,
        shape,
        frames: VecDeque::new(),
        include_usage,
        ended: false,
        tools,
        streams,
        prompt_tokens: 0,
        completion_tokens: 0,
    };
    for i in 0..state.streams.len() {
        if state.shape.kind == Kind::Chat {
            let chunk = state.shape.role_chunk(i);
            state.frames.push_back(frame(&chunk));
        }
        // The prompt goes first; scored, it waits for its scores.
        if !scored_echo && let Some(echo) = state.streams[i].echo.take() {
            state.text_chunk(i, Some(&echo), None);
        }
    }
    state.push(Some(first));
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
