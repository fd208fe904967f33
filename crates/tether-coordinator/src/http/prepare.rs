//! Request bodies to engine requests: prompt tokens, length limits and sampling, checked
//! before anything reaches the engine.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use tether_model::SamplingParams;

use super::AppState;
use super::error::ApiError;
use super::messages::template_messages;
use super::template::CHATML_END;
use super::tools::{self, Tools};
use super::types::{ChatRequest, CommonParams, CompletionRequest, Prompt};
use crate::api::MAX_LOGPROBS;
use crate::constraint::GrammarSpec;

/// OpenAI's default `max_tokens` for completions.
const COMPLETION_DEFAULT_MAX_TOKENS: usize = 16;

/// Most stop strings per request.
const MAX_STOPS: usize = 16;

/// Most `logit_bias` entries per request: each one widens the candidates a worker sends
/// (or, when positive, makes it send every logit), and is looked up every step.
const MAX_LOGIT_BIASES: usize = 1024;

/// Most `stop_token_ids` per request: each is compared with every sampled token.
const MAX_STOP_TOKENS: usize = 64;

/// The largest bias magnitude; OpenAI's range. At -100 a token is banned outright.
const BIAS_LIMIT: f64 = 100.0;

/// Most choices per request (`n`): each is a sequence of its own.
pub(super) const MAX_CHOICES: usize = 16;

/// A request ready for the engine.
#[derive(Clone, Debug)]
pub(super) struct Prepared {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Choices to generate from the prompt (`n`), 1..=[`MAX_CHOICES`].
    pub n: usize,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// How to sample.
    pub sampling: SamplingParams,
    /// Stop strings.
    pub stops: Vec<String>,
    /// Generated tokens whose text is not searched for stop strings (`min_tokens`).
    pub min_tokens: usize,
    /// Token ids that end generation as an end-of-generation token does.
    pub stop_tokens: Vec<u32>,
    /// Reply with server-sent events.
    pub stream: bool,
    /// Send `usage` in a last chunk when streaming.
    pub include_usage: bool,
    /// Alternatives to report with each generated token's log-probability, if asked.
    pub logprobs: Option<usize>,
    /// The prompt's text to return before the completion (`echo`), and whether its tokens
    /// are scored.
    pub echo: Option<String>,
    /// The grammar the output follows (`response_format`, `grammar`, `json_schema`, a
    /// forced tool call).
    pub constraint: Option<crate::constraint::Constraint>,
    /// The tools whose calls are looked for in the output.
    pub tools: Option<Tools>,
    /// Control tokens whose text the output keeps (the markers of those calls).
    pub shown_tokens: Vec<u32>,
}

/// The checks of the fields that ask for log-probabilities, the prompt back and choices.
#[derive(Clone, Debug, Default)]
struct Extras {
    logprobs: Option<usize>,
    /// The grammar a forced tool call follows.
    forced: Option<GrammarSpec>,
    echo: bool,
}

/// A `/v1/completions` request.
pub(super) fn completion(state: &AppState, req: CompletionRequest) -> Result<Prepared, ApiError> {
    let tokenizer = &state.tokenizer;
    let logprobs = checked_logprobs("logprobs", req.logprobs)?;
    let n = req.common.n.unwrap_or(1);
    if req.best_of.is_some_and(|b| b != n) {
        return Err(ApiError::invalid_param(
            "best_of",
            format!(
                "only best_of equal to n ({n}) is supported (every candidate is returned); \
                 leave it out"
            ),
        ));
    }
    let mut text = None;
    let prompt = match req.prompt {
        Prompt::Text(t) => {
            let ids = tokenizer.encode(&t, tokenizer.add_bos_default(), false);
            text = Some(t);
            ids
        }
        Prompt::Tokens(ids) => ids,
        Prompt::Texts(mut texts) if texts.len() == 1 => {
            let t = texts.pop().unwrap_or_default();
            let ids = tokenizer.encode(&t, tokenizer.add_bos_default(), false);
            text = Some(t);
            ids
        }
        Prompt::TokenLists(mut lists) if lists.len() == 1 => lists.pop().unwrap_or_default(),
        Prompt::Texts(_) | Prompt::TokenLists(_) => {
            return Err(ApiError::invalid_param(
                "prompt",
                "only one prompt per request is supported; send a string or one list of token ids",
            ));
        }
    };
    let echo = req.echo.unwrap_or(false);
    let echo_text = echo.then(|| text.unwrap_or_else(|| tokenizer.decode(&prompt)));
    let extras = Extras {
        logprobs,
        echo,
        forced: None,
    };
    let mut prepared = finish(
        state,
        ("prompt", prompt),
        &req.common,
        req.common.max_tokens,
        COMPLETION_DEFAULT_MAX_TOKENS,
        Vec::new(),
        extras,
    )?;
    prepared.echo = echo_text;
    Ok(prepared)
}

/// A number of alternatives to report (`param` names it), at most OpenAI's 20.
fn checked_logprobs(param: &str, n: Option<usize>) -> Result<Option<usize>, ApiError> {
    match n {
        Some(n) if n > MAX_LOGPROBS => Err(ApiError::invalid_param(
            param,
            format!("{param} must be between 0 and {MAX_LOGPROBS}; got {n}"),
        )),
        n => Ok(n),
    }
}

/// A `/v1/chat/completions` request: the conversation rendered with the chat template.
pub(super) fn chat(state: &AppState, req: ChatRequest) -> Result<Prepared, ApiError> {
    let chat_template = state.model.chat_template.as_deref();
    let tools = tools::tools(
        chat_template,
        req.tools.as_deref(),
        req.tool_choice.as_ref(),
    )?;
    let messages = template_messages(req.messages, tools::template_format(chat_template))?;
    let listed = tools.as_ref().map(|t| &t.listed);
    let rendered = state
        .template
        .render_with_tools(&messages, listed)
        .map_err(|e| {
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
    let top = checked_logprobs("top_logprobs", req.top_logprobs)?;
    let logprobs = match (req.logprobs.unwrap_or(false), top) {
        (true, top) => Some(top.unwrap_or(0)),
        (false, Some(_)) => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                "top_logprobs needs \"logprobs\": true",
            ));
        }
        (false, None) => None,
    };
    let extras = Extras {
        logprobs,
        echo: false,
        forced: tools.as_ref().and_then(|t| t.forced(tokenizer)),
    };
    let mut prepared = finish(
        state,
        ("messages", prompt),
        &req.common,
        max_tokens,
        state.opts.max_tokens_limit,
        extra_stops,
        extras,
    )?;
    prepared.tools = tools.filter(Tools::parses_calls);
    if let Some(t) = &prepared.tools {
        prepared.shown_tokens = t.shown_tokens(tokenizer);
    }
    Ok(prepared)
}

/// Checks the prompt (and the request field it came from, for errors) and the common
/// fields.
fn finish(
    state: &AppState,
    (prompt_param, prompt): (&str, Vec<u32>),
    p: &CommonParams,
    max_tokens: Option<usize>,
    default_max_tokens: usize,
    mut stops: Vec<String>,
    extras: Extras,
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
    let n = choices(p.n, state.engine.parallel())?;
    let max_tokens = max_tokens.unwrap_or(default_max_tokens.min(state.opts.max_tokens_limit));
    // With `echo`, no new token is the scoring use: the prompt (and its log-probabilities).
    let least = usize::from(!extras.echo);
    if max_tokens < least || max_tokens > state.opts.max_tokens_limit {
        return Err(ApiError::invalid_param(
            "max_tokens",
            format!(
                "max_tokens must be between {least} and {}; got {max_tokens}",
                state.opts.max_tokens_limit
            ),
        ));
    }
    let mut sampling = sampling(p)?;
    let vocab = state.tokenizer.vocab_size();
    let eog = state.tokenizer.eog_ids();
    sampling.logit_bias = logit_bias(p, vocab, &eog)?;
    let min_tokens = p.min_tokens.unwrap_or(0);
    if min_tokens > max_tokens {
        return Err(ApiError::invalid_param(
            "min_tokens",
            format!("min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})"),
        ));
    }
    let stop_tokens = stop_token_ids(p, vocab)?;
    if min_tokens > 0 {
        // vLLM holds the request's stop tokens back too; `ignore_eos` leaves them be.
        let mut held_back = eog;
        held_back.extend(&stop_tokens);
        held_back.sort_unstable();
        held_back.dedup();
        sampling.held_back = held_back;
        sampling.min_tokens = min_tokens;
    }
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
    let constraint = super::structured::constraint(state, p, extras.forced)?;
    Ok(Prepared {
        prompt,
        n,
        max_tokens,
        sampling,
        stops,
        min_tokens,
        stop_tokens,
        stream: p.stream,
        include_usage: p.stream_options.as_ref().is_some_and(|o| o.include_usage),
        logprobs: extras.logprobs,
        echo: None,
        constraint,
        tools: None,
        shown_tokens: Vec::new(),
    })
}

/// `n`, checked against [`MAX_CHOICES`] and the sequences the engine serves at once
/// (`parallel`): a request's choices are admitted together, so more than that could never
/// start.
fn choices(n: Option<usize>, parallel: usize) -> Result<usize, ApiError> {
    let n = n.unwrap_or(1);
    if n == 0 || n > MAX_CHOICES {
        return Err(ApiError::invalid_param(
            "n",
            format!("n must be between 1 and {MAX_CHOICES}; got {n}"),
        ));
    }
    if n > parallel {
        return Err(ApiError::invalid_param(
            "n",
            format!(
                "n = {n} choices need {n} sequence slots, but this server runs {parallel} at \
                 once (--parallel {parallel}); ask for at most {parallel}"
            ),
        ));
    }
    Ok(n)
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
        ..d
    })
}

/// `logit_bias` as the sampler takes it: sorted by token id, -100 as a ban (`-inf`), and
/// with `ignore_eos` every end-of-generation token of `eog` banned too (as llama.cpp's
/// server does), so generation runs to `max_tokens` or a stop string.
fn logit_bias(p: &CommonParams, vocab: usize, eog: &[u32]) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |what: String| ApiError::invalid_param("logit_bias", format!("logit_bias: {what}"));
    let given = p.logit_bias.as_ref().map_or(0, |m| m.len());
    if given > MAX_LOGIT_BIASES {
        return Err(bad(format!(
            "{given} entries given; at most {MAX_LOGIT_BIASES} are supported"
        )));
    }
    let mut biases = Vec::with_capacity(given + eog.len());
    for (key, value) in p.logit_bias.iter().flatten() {
        // Digits only: `u32::from_str` would also take "+5".
        let id = key
            .bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| key.parse::<u32>().ok())
            .flatten()
            .ok_or_else(|| bad(format!("key `{key}` is not a token id")))?;
        if id as usize >= vocab {
            return Err(bad(format!(
                "token id {id} is outside the model's vocabulary of {vocab} tokens"
            )));
        }
        let bias = value.as_f64().filter(|b| b.is_finite()).ok_or_else(|| {
            bad(format!(
                "the bias of token {id} must be a number; got {value}"
            ))
        })?;
        if !(-BIAS_LIMIT..=BIAS_LIMIT).contains(&bias) {
            return Err(bad(format!(
                "the bias of token {id} must be between -100 and 100; got {bias}"
            )));
        }
        let bias = if bias <= -BIAS_LIMIT {
            f32::NEG_INFINITY
        } else {
            bias as f32
        };
        biases.push((id, bias));
    }
    if p.ignore_eos == Some(true) {
        biases.extend(eog.iter().map(|&id| (id, f32::NEG_INFINITY)));
    }
    // A ban wins over any other entry for the same token ("05" and "5" are one token).
    biases.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
    biases.dedup_by_key(|b| b.0);
    let banned = biases.iter().filter(|b| b.1 == f32::NEG_INFINITY).count();
    if banned >= vocab {
        return Err(bad(format!(
            "every one of the {vocab} tokens is banned; leave some to generate"
        )));
    }
    Ok(biases)
}

/// `stop_token_ids`, checked against the vocabulary and [`MAX_STOP_TOKENS`].
fn stop_token_ids(p: &CommonParams, vocab: usize) -> Result<Vec<u32>, ApiError> {
    let ids = p.stop_token_ids.clone().unwrap_or_default();
    let bad =
        |what: String| ApiError::invalid_param("stop_token_ids", format!("stop_token_ids: {what}"));
    if ids.len() > MAX_STOP_TOKENS {
        return Err(bad(format!(
            "{} ids given; at most {MAX_STOP_TOKENS} are supported",
            ids.len()
        )));
    }
    if let Some(id) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(bad(format!(
            "token id {id} is outside the model's vocabulary of {vocab} tokens"
        )));
    }
    Ok(ids)
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

    fn biases(json: &str, ignore_eos: bool) -> Result<Vec<(u32, f32)>, ApiError> {
        let p = CommonParams {
            logit_bias: serde_json::from_str(json).expect("test JSON"),
            ignore_eos: Some(ignore_eos),
            ..CommonParams::default()
        };
        logit_bias(&p, 100, &[2, 50])
    }

    #[test]
    fn logit_bias_is_sorted_with_bans_and_ignore_eos_bans_the_end_tokens() {
        let b = biases(r#"{"7":2.5,"3":-100,"50":100}"#, false).expect("valid");
        assert_eq!(b, vec![(3, f32::NEG_INFINITY), (7, 2.5), (50, 100.0)]);
        let b = biases(r#"{"50":100,"9":-1}"#, true).expect("valid");
        assert_eq!(
            b,
            vec![(2, f32::NEG_INFINITY), (9, -1.0), (50, f32::NEG_INFINITY)],
            "ignore_eos wins over a favoring bias"
        );
        assert_eq!(biases("null", false).expect("none"), vec![]);
        assert_eq!(
            biases(r#"{"05":-100,"5":3}"#, false).expect("one token"),
            vec![(5, f32::NEG_INFINITY)]
        );
    }

    #[test]
    fn bad_logit_biases_are_refused_naming_the_field() {
        for (json, says) in [
            (r#"{"abc":1}"#, "not a token id"),
            (r#"{"+5":1}"#, "not a token id"),
            (r#"{"-1":1}"#, "not a token id"),
            (r#"{"100":1}"#, "outside the model's vocabulary"),
            (r#"{"5":100.5}"#, "between -100 and 100"),
            (r#"{"5":"high"}"#, "must be a number"),
            (r#"{"5":null}"#, "must be a number"),
        ] {
            let e = biases(json, false).expect_err(json);
            assert_eq!(e.param.as_deref(), Some("logit_bias"), "{json}");
            assert!(e.message.contains(says), "{json}: {}", e.message);
        }
        let many: serde_json::Map<String, serde_json::Value> = (0..1025)
            .map(|i| (i.to_string(), serde_json::Value::from(1)))
            .collect();
        let p = CommonParams {
            logit_bias: Some(many),
            ..CommonParams::default()
        };
        let e = logit_bias(&p, 5000, &[]).expect_err("too many");
        assert!(e.message.contains("1024"), "{}", e.message);
        let all: String = (0..100)
            .map(|i| format!(r#""{i}":-100"#))
            .collect::<Vec<_>>()
            .join(",");
        let e = biases(&format!("{{{all}}}"), false).expect_err("everything banned");
        assert!(e.message.contains("every one"), "{}", e.message);
    }

    #[test]
    fn n_is_checked_against_the_limit_and_parallel() {
        assert_eq!(choices(None, 1).expect("default"), 1);
        assert_eq!(choices(Some(4), 4).expect("fits"), 4);
        for (n, parallel, says) in [
            (0, 4, "between 1 and 16"),
            (17, 32, "between 1 and 16"),
            (5, 4, "--parallel 4"),
        ] {
            let e = choices(Some(n), parallel).expect_err("refused");
            assert_eq!(e.param.as_deref(), Some("n"));
            assert!(e.message.contains(says), "{}", e.message);
        }
    }

    #[test]
    fn fresh_seeds_differ() {
        assert_ne!(fresh_seed(), fresh_seed());
    }
}
