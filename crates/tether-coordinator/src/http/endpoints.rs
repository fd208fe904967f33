//! `POST /v1/completions` and `POST /v1/chat/completions`, whole or streamed as
//! server-sent events.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};

use super::choices::Choices;
use super::error::ApiError;
use super::heavy::HEAVY_BODY_BYTES;
use super::logprobs;
use super::prepare::{self, Prepared};
use super::run::{Run, RunEvent};
use super::shape::{Kind, Shape, usage};
use super::sse;
use super::strict::{self, Endpoint};
use super::{AppState, SharedState};
use crate::api::FinishReason;

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
    let scored_echo = echo.is_some() && logprobs;
    let tools = prepared.tools.clone();
    let mut choices = Choices::new(Run::start_choices(state, prepared, started)?);
    let shape = Shape::new(
        kind,
        &state.model_id,
        Arc::clone(&state.tokenizer),
        logprobs,
    );
    // Waiting for the first event lets errors found before any token (a full queue, a
    // prompt the engine refuses) keep their HTTP status even when streaming.
    let first = next_event(&mut choices)
        .await?
        .ok_or_else(|| ApiError::internal("the request ended without a reply"))?;
    if stream {
        let reply = sse::Reply {
            shape,
            include_usage,
            echo,
            scored_echo,
            tools,
        };
        return Ok(sse::response(choices, reply, (first.0, Ok(first.1))));
    }
    let mut replies: Vec<Whole> = (0..choices.count())
        .map(|_| Whole {
            text: echo.clone().unwrap_or_default(),
            entries: Vec::new(),
            end: None,
        })
        .collect();
    let mut prompt_tokens = 0;
    let mut next = Some(first);
    while let Some((i, event)) = next {
        let reply = &mut replies[i];
        match event {
            RunEvent::Text(t) => reply.text.push_str(&t),
            RunEvent::LogProb(scored) => reply.entries.push((scored.token, Some(scored))),
            // The prompt's scores come first of all.
            RunEvent::Prompt(prompt) => reply.entries = prompt,
            RunEvent::End {
                finish,
                prompt_tokens: prompt,
                completion_tokens,
            } => {
                reply.end = Some((finish, completion_tokens));
                prompt_tokens = prompt;
            }
        }
        next = next_event(&mut choices).await?;
    }
    let mut completion_tokens = 0;
    let mut bodies = Vec::with_capacity(replies.len());
    for (i, reply) in replies.iter().enumerate() {
        let (finish, generated) = reply
            .end
            .ok_or_else(|| ApiError::internal("a choice ended without a reply"))?;
        completion_tokens += generated;
        let logprobs = shape.logprobs(&reply.entries, &mut 0);
        bodies.push(shape.choice(i, &reply.text, finish, logprobs, tools.as_ref()));
    }
    let body = shape.whole(bodies, usage(prompt_tokens, completion_tokens));
    Ok(axum::Json(body).into_response())
}

/// One choice of a non-streamed reply, as its events come.
struct Whole {
    text: String,
    entries: Vec<logprobs::Entry>,
    /// Why it ended and how many tokens it generated, once it has.
    end: Option<(FinishReason, usize)>,
}

/// The next event of any choice, an error of one failing the whole request; `None` once
/// every choice has ended.
async fn next_event(choices: &mut Choices) -> Result<Option<(usize, RunEvent)>, ApiError> {
    match choices.next().await {
        Some((i, Ok(event))) => Ok(Some((i, event))),
        Some((_, Err(e))) => Err(e),
        None => Ok(None),
    }
}
