//! `POST /tokenize` and `POST /detokenize`: the model's tokenizer over HTTP, taking
//! llama-server's and vLLM's field names alike so that either's clients work.
//!
//! By default text is tokenized as `/v1/completions` tokenizes a text prompt (the model's
//! BOS rule, control-token text not parsed), so a count here is what a prompt costs.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::ApiError;
use super::heavy::HEAVY_BODY_BYTES;
use super::strict::{self, Endpoint};
use super::{AppState, SharedState};

#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    content: Option<String>,
    prompt: Option<String>,
    add_special: Option<bool>,
    add_special_tokens: Option<bool>,
    parse_special: Option<bool>,
    #[serde(default)]
    with_pieces: bool,
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    tokens: Vec<u32>,
}

/// `POST /tokenize`: `{"tokens": [...], "count": n, "max_model_len": ctx}`; with
/// `with_pieces`, each token is `{"id": id, "piece": text}`.
pub(super) async fn tokenize(
    State(state): State<SharedState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let reply = match body {
        Ok(bytes) if bytes.len() < HEAVY_BODY_BYTES => tokenize_body(&state, Ok(bytes)),
        body => {
            let work = move |state: &AppState| tokenize_body(state, body);
            state.heavy.run(Arc::clone(&state), work).await
        }
    };
    respond(reply)
}

/// `POST /detokenize`: `{"content": text, "prompt": text}` (llama-server reads the first,
/// vLLM the second).
pub(super) async fn detokenize(
    State(state): State<SharedState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let reply = match body {
        Ok(bytes) if bytes.len() < HEAVY_BODY_BYTES => detokenize_body(&state, Ok(bytes)),
        body => {
            let work = move |state: &AppState| detokenize_body(state, body);
            state.heavy.run(Arc::clone(&state), work).await
        }
    };
    respond(reply)
}

fn respond(reply: Result<Value, ApiError>) -> Response {
    match reply {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

fn tokenize_body(state: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let req: TokenizeRequest = strict::parse_body(body, Endpoint::Tokenize, &state.model_id)?;
    let text = match (req.content, req.prompt) {
        (Some(text), None) | (None, Some(text)) => text,
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid_param(
                "prompt",
                "give the text as `content` or as `prompt`, not both",
            ));
        }
        (None, None) => {
            return Err(ApiError::invalid_param(
                "content",
                "the text to tokenize is missing: give it as `content` (or `prompt`)",
            ));
        }
    };
    let add_bos = match (req.add_special, req.add_special_tokens) {
        (Some(a), Some(b)) if a != b => {
            return Err(ApiError::invalid_param(
                "add_special_tokens",
                "`add_special` and `add_special_tokens` disagree; give one",
            ));
        }
        (Some(a), _) | (None, Some(a)) => a && state.tokenizer.add_bos_default(),
        (None, None) => state.tokenizer.add_bos_default(),
    };
    let tokenizer = &state.tokenizer;
    let ids = tokenizer.encode(&text, add_bos, req.parse_special.unwrap_or(false));
    let tokens: Vec<Value> = if req.with_pieces {
        ids.iter()
            .map(|&id| json!({"id": id, "piece": tokenizer.decode(&[id])}))
            .collect()
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    Ok(json!({
        "tokens": tokens,
        "count": ids.len(),
        "max_model_len": state.model.ctx_per_seq,
    }))
}

fn detokenize_body(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Value, ApiError> {
    let req: DetokenizeRequest = strict::parse_body(body, Endpoint::Detokenize, &state.model_id)?;
    let vocab = state.tokenizer.vocab_size();
    if let Some(i) = req.tokens.iter().position(|&t| t as usize >= vocab) {
        return Err(ApiError::invalid_param(
            &format!("tokens[{i}]"),
            format!(
                "token id {} is outside the vocabulary ({vocab} tokens)",
                req.tokens[i]
            ),
        ));
    }
    let text = state.tokenizer.decode(&req.tokens);
    Ok(json!({"content": text, "prompt": text}))
}
