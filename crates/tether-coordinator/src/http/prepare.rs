//! Request bodies to engine requests: prompt tokens, length limits and sampling, checked
//! before anything reaches the engine.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use tether_model::SamplingParams;

use super::AppState;
use super::error::ApiError;
use super::template::{CHATML_END, ChatMessage};
use super::types::{ChatRequest, CommonParams, CompletionRequest, MessageContent, Prompt};

/// OpenAI's default `max_tokens` for completions.
const COMPLETION_DEFAULT_MAX_TOKENS: usize = 16;

/// Most stop strings per request.
const MAX_STOPS: usize = 16;

/// A request ready for the engine.
#[derive(Clone, Debug)]
pub(super) struct Prepared {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// How to sample.
    pub sampling: SamplingParams,
    /// Stop strings.
    pub stops: Vec<String>,
    /// Reply with server-sent events.
    pub stream: bool,
    /// Send `usage` in a last chunk when streaming.
    pub include_usage: bool,
}

/// A `/v1/completions` request.
pub(super) fn completion(state: &AppState, req: CompletionRequest) -> Result<Prepared, ApiError> {
    let tokenizer = &state.tokenizer;
    let prompt = match req.prompt {
        Prompt::Text(text) => tokenizer.encode(&text, tokenizer.add_bos_default(), false),
        Prompt::Tokens(ids) => ids,
        Prompt::Texts(mut texts) if texts.len() == 1 => {
            let text = texts.pop().unwrap_or_default();
            tokenizer.encode(&text, tokenizer.add_bos_default(), false)
        }
        Prompt::TokenLists(mut lists) if lists.len() == 1 => lists.pop().unwrap_or_default(),
        Prompt::Texts(_) | Prompt::TokenLists(_) => {
            return Err(ApiError::invalid_param(
                "prompt",
                "only one prompt per request is supported; send a string or one list of token ids",
            ));
        }
    };
    finish(
        state,
        "prompt",
        prompt,
        &req.common,
        req.common.max_tokens,
        COMPLETION_DEFAULT_MAX_TOKENS,
        Vec::new(),
    )
}

/// A `/v1/chat/completions` request: the conversation rendered with the chat template.
pub(super) fn chat(state: &AppState, req: ChatRequest) -> Result<Prepared, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "`messages` is empty; send at least one message",
        ));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.into_iter().enumerate() {
        let content = match m.content {
            None => String::new(),
            Some(MessageContent::Text(t)) => t,
            Some(MessageContent::Parts(parts)) => {
                let mut text = String::new();
                for part in parts {
                    match (part.kind.as_str(), part.text) {
                        ("text", Some(t)) => text.push_str(&t),
                        (kind, _) => {
                            return Err(ApiError::invalid_param(
                                &format!("messages[{i}].content"),
                                format!(
                                    "content part of type '{kind}' is not supported; only text parts with a `text` field are"
                                ),
                            ));
                        }
                    }
                }
                text
            }
        };
        messages.push(ChatMessage {
            role: m.role,
            content,
        });
    }
    let rendered = state.template.render(&messages).map_err(|e| {
        if e.is_server_fault() {
            ApiError::internal(e.to_string()).with_code("chat_template_budget")
        } else {
            ApiError::invalid_param("messages", e.to_string())
        }
    })?;
    let tokenizer = &state.tokenizer;
    let bos_text = state.template.bos_token();
    let template_added_bos = !bos_text.is_empty() && rendered.starts_with(bos_text);
    let prompt = tokenizer.encode(
        &rendered,
        tokenizer.add_bos_default() && !template_added_bos,
        true,
    );
    // Models without a template of their own may not know ChatML's end marker as a token,
    // and would then write it out as text.
    let mut extra_stops = Vec::new();
    if state.template.is_chatml_fallback() && tokenizer.token_id(CHATML_END).is_none() {
        extra_stops.push(CHATML_END.to_owned());
    }
    let max_tokens = req.max_completion_tokens.or(req.common.max_tokens);
    finish(
        state,
        "messages",
        prompt,
        &req.common,
        max_tokens,
        state.opts.max_tokens_limit,
        extra_stops,
    )
}

/// Checks the prompt and the common fields.
fn finish(
    state: &AppState,
    prompt_param: &str,
    prompt: Vec<u32>,
    p: &CommonParams,
    max_tokens: Option<usize>,
    default_max_tokens: usize,
    mut stops: Vec<String>,
) -> Result<Prepared, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::invalid_param(
            prompt_param,
            "the prompt has no tokens; send some text",
        ));
    }
    let vocab = state.tokenizer.vocab_size();
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid_param(
            prompt_param,
            format!("token id {bad} is outside the model's vocabulary of {vocab} tokens"),
        ));
    }
    let ctx = state.model.ctx_per_seq;
    let limit = state.opts.max_prompt_tokens.map_or(ctx, |m| m.min(ctx));
    if prompt.len() > limit {
        return Err(ApiError::invalid_param(
            prompt_param,
            format!(
                "the prompt has {} tokens but at most {limit} are accepted (context {ctx}); shorten it",
                prompt.len()
            ),
        )
        .with_code("context_length_exceeded"));
    }
    if p.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid_param("n", "only n = 1 is supported"));
    }
    let max_tokens = max_tokens.unwrap_or(default_max_tokens.min(state.opts.max_tokens_limit));
    if max_tokens == 0 || max_tokens > state.opts.max_tokens_limit {
        return Err(ApiError::invalid_param(
            "max_tokens",
            format!(
                "max_tokens must be between 1 and {}; got {max_tokens}",
                state.opts.max_tokens_limit
            ),
        ));
    }
    let sampling = sampling(p)?;
    let requested = p.stop.clone().map(|s| s.into_vec()).unwrap_or_default();
    if requested.len() > MAX_STOPS {
        return Err(ApiError::invalid_param(
            "stop",
            format!(
                "{} stop strings given; at most {MAX_STOPS} are supported",
                requested.len()
            ),
        ));
    }
    stops.extend(requested);
    Ok(Prepared {
        prompt,
        max_tokens,
        sampling,
        stops,
        stream: p.stream,
        include_usage: p.stream_options.as_ref().is_some_and(|o| o.include_usage),
    })
}

/// Sampling parameters: the request's values over llama.cpp's defaults.
fn sampling(p: &CommonParams) -> Result<SamplingParams, ApiError> {
    let d = SamplingParams::default();
    let check = |name: &str, v: Option<f32>, ok: fn(f32) -> bool, what: &str| match v {
        Some(x) if !x.is_finite() || !ok(x) => Err(ApiError::invalid_param(
            name,
            format!("{name} must be {what}; got {x}"),
        )),
        _ => Ok(()),
    };
    check("temperature", p.temperature, |x| x >= 0.0, "at least 0")?;
    check(
        "top_p",
        p.top_p,
        |x| (0.0..=1.0).contains(&x),
        "between 0 and 1",
    )?;
    check(
        "min_p",
        p.min_p,
        |x| (0.0..=1.0).contains(&x),
        "between 0 and 1",
    )?;
    check("repeat_penalty", p.repeat_penalty, |x| x > 0.0, "above 0")?;
    // OpenAI's range for both.
    let openai = |x: f32| (-2.0..=2.0).contains(&x);
    check(
        "frequency_penalty",
        p.frequency_penalty,
        openai,
        "between -2 and 2",
    )?;
    check(
        "presence_penalty",
        p.presence_penalty,
        openai,
        "between -2 and 2",
    )?;
    Ok(SamplingParams {
        temperature: p.temperature.unwrap_or(d.temperature),
        top_k: p.top_k.unwrap_or(d.top_k),
        top_p: p.top_p.unwrap_or(d.top_p),
        min_p: p.min_p.unwrap_or(d.min_p),
        repeat_penalty: p.repeat_penalty.unwrap_or(d.repeat_penalty),
        repeat_last_n: p.repeat_last_n.unwrap_or(d.repeat_last_n),
        frequency_penalty: p.frequency_penalty.unwrap_or(d.frequency_penalty),
        presence_penalty: p.presence_penalty.unwrap_or(d.presence_penalty),
        seed: p.seed.unwrap_or_else(fresh_seed),
    })
}

/// A seed for requests that give none: different per request, as OpenAI's default is.
fn fresh_seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_fields_take_llama_cpp_defaults() {
        let p = CommonParams {
            temperature: Some(0.0),
            seed: Some(9),
            ..CommonParams::default()
        };
        let s = sampling(&p).expect("valid");
        let d = SamplingParams::default();
        assert_eq!(s.temperature, 0.0);
        assert_eq!(s.seed, 9);
        assert_eq!((s.top_k, s.top_p, s.min_p), (d.top_k, d.top_p, d.min_p));
        assert_eq!((s.frequency_penalty, s.presence_penalty), (0.0, 0.0));
        let penalties = CommonParams {
            frequency_penalty: Some(0.5),
            presence_penalty: Some(-0.25),
            repeat_last_n: Some(16),
            ..CommonParams::default()
        };
        let s = sampling(&penalties).expect("valid");
        assert_eq!(
            (s.frequency_penalty, s.presence_penalty, s.repeat_last_n),
            (0.5, -0.25, 16)
        );
    }

    #[test]
    fn out_of_range_sampling_is_refused_naming_the_field() {
        for p in [
            CommonParams {
                temperature: Some(-1.0),
                ..Default::default()
            },
            CommonParams {
                top_p: Some(1.5),
                ..Default::default()
            },
            CommonParams {
                min_p: Some(f32::NAN),
                ..Default::default()
            },
            CommonParams {
                repeat_penalty: Some(0.0),
                ..Default::default()
            },
            CommonParams {
                frequency_penalty: Some(2.5),
                ..Default::default()
            },
            CommonParams {
                presence_penalty: Some(f32::NEG_INFINITY),
                ..Default::default()
            },
        ] {
            let e = sampling(&p).expect_err("refused");
            assert_eq!(e.status.as_u16(), 400);
            assert!(e.param.is_some());
        }
    }

    #[test]
    fn fresh_seeds_differ() {
        assert_ne!(fresh_seed(), fresh_seed());
    }
}
