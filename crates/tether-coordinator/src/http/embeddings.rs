//! `POST /v1/embeddings`: each input's prompt run through the model without generating,
//! its hidden states after the output norm pooled (the GGUF file's pooling type, or
//! `--pooling`, or the last token's for a model that names none) and L2-normalized, as
//! OpenAI's embeddings are.

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::ApiError;
use super::heavy::HEAVY_BODY_BYTES;
use super::strict::{self, Endpoint};
use super::types::Prompt;
use super::{AppState, SharedState};
use crate::api::{GenEvent, GenEvents, GenRequest, Pooling};

/// Most inputs one request may carry (OpenAI's limit).
const MAX_INPUTS: usize = 2048;

#[derive(Debug, Deserialize)]
struct EmbeddingsRequest {
    input: Prompt,
    #[serde(default)]
    encoding_format: Option<String>,
    #[serde(default)]
    dimensions: Option<usize>,
}

/// A checked request: each input's token ids, and how to shape the vectors.
struct Prepared {
    inputs: Vec<Vec<u32>>,
    base64: bool,
    dimensions: Option<usize>,
    pooling: Pooling,
}

/// `POST /v1/embeddings`.
pub(super) async fn embeddings(
    State(state): State<SharedState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let started = Instant::now();
    let prepared = match body {
        Ok(bytes) if bytes.len() < HEAVY_BODY_BYTES => prepare(&state, Ok(bytes)),
        body => {
            let work = move |state: &AppState| prepare(state, body);
            state.heavy.run(Arc::clone(&state), work).await
        }
    };
    let reply = match prepared {
        Ok(p) => embed_all(&state, p, started).await,
        Err(e) => Err(e),
    };
    match reply {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

fn prepare(state: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Prepared, ApiError> {
    let req: EmbeddingsRequest = strict::parse_body(body, Endpoint::Embeddings, &state.model_id)?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid_param(
                "encoding_format",
                format!("encoding_format {other:?} is not one of \"float\" and \"base64\""),
            ));
        }
    };
    let tokenizer = &state.tokenizer;
    // An empty text would embed the BOS token alone: refused, as OpenAI refuses it.
    let encode = |i: usize, t: &str| match t.is_empty() {
        true => Err(ApiError::invalid_param(
            &format!("input[{i}]"),
            "an input is an empty string",
        )),
        false => Ok(tokenizer.encode(t, tokenizer.add_bos_default(), false)),
    };
    let inputs: Vec<Vec<u32>> = match req.input {
        Prompt::Text(t) => vec![encode(0, &t)?],
        Prompt::Texts(texts) => texts
            .iter()
            .enumerate()
            .map(|(i, t)| encode(i, t))
            .collect::<Result<_, _>>()?,
        Prompt::Tokens(ids) => vec![ids],
        Prompt::TokenLists(lists) => lists,
    };
    if inputs.is_empty() || inputs.len() > MAX_INPUTS {
        return Err(ApiError::invalid_param(
            "input",
            format!("give 1 to {MAX_INPUTS} inputs; {} were given", inputs.len()),
        ));
    }
    let ctx = state.model.ctx_per_seq;
    let limit = state.opts.max_prompt_tokens.map_or(ctx, |m| m.min(ctx));
    let vocab = state.tokenizer.vocab_size();
    for (i, ids) in inputs.iter().enumerate() {
        let param = format!("input[{i}]");
        if ids.is_empty() {
            return Err(ApiError::invalid_param(&param, "an input has no tokens"));
        }
        if ids.len() > limit {
            return Err(ApiError::invalid_param(
                &param,
                format!(
                    "the input has {} tokens; this server embeds at most {limit}",
                    ids.len()
                ),
            ));
        }
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid_param(
                &param,
                format!("token id {bad} is outside the vocabulary ({vocab} tokens)"),
            ));
        }
    }
    let width = state.model.n_embd;
    if let Some(d) = req.dimensions
        && (d == 0 || d > width)
    {
        return Err(ApiError::invalid_param(
            "dimensions",
            format!("dimensions must be between 1 and the model's width, {width}; got {d}"),
        ));
    }
    let pooling = state
        .opts
        .pooling
        .or(state.model.pooling)
        .unwrap_or(Pooling::Last);
    Ok(Prepared {
        inputs,
        base64,
        dimensions: req.dimensions,
        pooling,
    })
}

/// Runs every input, `parallel` at a time so that a long list does not fill the queue.
async fn embed_all(state: &SharedState, p: Prepared, started: Instant) -> Result<Value, ApiError> {
    let deadline = started + state.opts.request_timeout;
    let window = state.engine.parallel().max(1);
    let mut data = Vec::with_capacity(p.inputs.len());
    let mut prompt_tokens = 0;
    for (chunk_no, chunk) in p.inputs.chunks(window).enumerate() {
        let mut running: Vec<GenEvents> = Vec::with_capacity(chunk.len());
        for ids in chunk {
            let req = GenRequest {
                deadline: Some(deadline),
                model_epoch: Some(state.epoch),
                embed: Some(p.pooling),
                ..GenRequest::greedy(ids, 0)
            };
            running.push(state.engine.submit(req)?);
        }
        for (k, events) in running.iter_mut().enumerate() {
            let index = chunk_no * window + k;
            let (vector, tokens) = receive(events, deadline).await?;
            prompt_tokens += tokens;
            let vector = shaped(vector, p.dimensions);
            let embedding = if p.base64 {
                let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(vector)
            };
            data.push(json!({"object": "embedding", "index": index, "embedding": embedding}));
        }
    }
    Ok(json!({
        "object": "list",
        "data": data,
        "model": state.model_id,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }))
}

/// One request's pooled vector and its prompt tokens.
async fn receive(events: &mut GenEvents, deadline: Instant) -> Result<(Vec<f32>, usize), ApiError> {
    let mut vector = None;
    loop {
        let event = tokio::time::timeout_at(deadline.into(), events.recv())
            .await
            .map_err(|_| {
                ApiError::timeout("the request took longer than the server's request timeout")
            })?;
        match event {
            Some(Ok(GenEvent::Embedding(v))) => vector = Some(v),
            Some(Ok(GenEvent::Done { prompt_tokens, .. })) => {
                return vector.map(|v| (v, prompt_tokens)).ok_or_else(|| {
                    ApiError::internal("the engine ended an embedding without its vector")
                });
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(e.into()),
            None => {
                return Err(ApiError::internal(
                    "the engine dropped the request before finishing it",
                ));
            }
        }
    }
}

/// The first `dimensions` values (all without), scaled to unit length: a shortened vector
/// is normalized again, as OpenAI's `dimensions` does.
fn shaped(mut v: Vec<f32>, dimensions: Option<usize>) -> Vec<f32> {
    if let Some(d) = dimensions {
        v.truncate(d);
    }
    let norm = v
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt();
    if norm > 0.0 {
        v.iter_mut()
            .for_each(|x| *x = (f64::from(*x) / norm) as f32);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::shaped;

    #[test]
    fn vectors_are_cut_then_made_unit_length() {
        let v = shaped(vec![3.0, 4.0, 12.0], None);
        let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-6);
        assert!((v[0] - 3.0 / 13.0).abs() < 1e-6);
        assert_eq!(shaped(vec![3.0, 4.0, 12.0], Some(2)), vec![0.6, 0.8]);
        assert_eq!(shaped(vec![0.0, 0.0], None), vec![0.0, 0.0]);
    }
}
