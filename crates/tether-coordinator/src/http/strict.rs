//! Request bodies checked field by field before they are parsed: a field this server does
//! not implement is refused with 400 naming it, never accepted and dropped, unless its value
//! asks for nothing (`"suffix": ""`, `"n": 1`, `"tools": []`, ...). Values of the
//! wrong type name their field in words rather than in serde's.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::error::ApiError;
use super::types::CommonParams;

/// The endpoint a body is for: each accepts different fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Endpoint {
    Completion,
    Chat,
    Tokenize,
    Detokenize,
    Embeddings,
}

impl Endpoint {
    /// Whether the endpoint generates tokens and so takes the sampling fields.
    fn generates(self) -> bool {
        matches!(self, Endpoint::Completion | Endpoint::Chat)
    }
}

/// Fields both endpoints implement (OpenAI's and llama.cpp's sampling extensions).
const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repeat_penalty",
    "repeat_last_n",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "logit_bias",
    // llama.cpp's and vLLM's extensions for the end of generation.
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    // End-user identifiers for abuse monitoring: they change no output.
    "user",
    "safety_identifier",
    // Constrained output (`structured`): OpenAI's field, and llama.cpp's two.
    "response_format",
    "grammar",
    "json_schema",
];

/// Fields of one endpoint only.
fn own_fields(endpoint: Endpoint) -> &'static [&'static str] {
    match endpoint {
        Endpoint::Completion => &["prompt", "logprobs", "echo", "best_of"],
        Endpoint::Chat => &[
            "messages",
            "max_completion_tokens",
            "logprobs",
            "top_logprobs",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
        ],
        // llama-server's and vLLM's spellings of the same fields.
        Endpoint::Tokenize => &[
            "model",
            "content",
            "prompt",
            "add_special",
            "add_special_tokens",
            "parse_special",
            "with_pieces",
        ],
        Endpoint::Detokenize => &["model", "tokens"],
        Endpoint::Embeddings => &["model", "input", "encoding_format", "dimensions", "user"],
    }
}

/// Fields of OpenAI's request reference (or llama.cpp's) this server does not implement,
/// with whether a value asks for nothing and may pass.
fn not_implemented(endpoint: Endpoint, field: &str, v: &Value) -> Option<bool> {
    if !endpoint.generates() {
        return None;
    }
    let empty = v.is_null()
        || v.as_object().is_some_and(Map::is_empty)
        || v.as_array().is_some_and(Vec::is_empty);
    let is = |want: &Value| v == want;
    let harmless = match (endpoint, field) {
        (Endpoint::Completion, "suffix") => empty || v.as_str() == Some(""),
        // The deprecated spellings of `tools` and `tool_choice`.
        (Endpoint::Chat, "functions") => empty,
        (Endpoint::Chat, "function_call") => empty || v.as_str() == Some("none"),
        (Endpoint::Chat, "store") => empty || is(&Value::Bool(false)),
        (Endpoint::Chat, "modalities") => {
            empty || v.as_array().is_some_and(|m| m.iter().all(|x| x == "text"))
        }
        (Endpoint::Chat, "service_tier") => empty || matches!(v.as_str(), Some("auto" | "default")),
        (
            Endpoint::Chat,
            "metadata" | "audio" | "prediction" | "reasoning_effort" | "verbosity"
            | "web_search_options" | "prompt_cache_key",
        ) => empty,
        (_, "cache_prompt" | "n_probs") => empty,
        _ => return None,
    };
    Some(harmless)
}

/// Fields of a chat message this server reads, and those that may pass when empty.
const MESSAGE_FIELDS: &[&str] = &["role", "content", "name", "tool_calls", "tool_call_id"];
const MESSAGE_EMPTY_OK: &[&str] = &["function_call", "refusal", "audio"];
const PART_FIELDS: &[&str] = &["type", "text"];

fn unsupported(param: &str, what: &str) -> ApiError {
    ApiError::invalid_param(param, what.to_string()).with_code("unsupported_parameter")
}

/// [`parse_checked`] of a body axum read, or the error that kept it from being read.
pub(super) fn parse_body<T: DeserializeOwned>(
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
    endpoint: Endpoint,
    model_id: &str,
) -> Result<T, ApiError> {
    let bytes = body.map_err(|rejection| ApiError {
        status: rejection.status(),
        ..ApiError::invalid(format!(
            "reading the request body: {}",
            rejection.body_text()
        ))
    })?;
    parse_checked(&bytes, endpoint, model_id)
}

/// Checks the fields of a request body for `endpoint` and the model it names, then parses
/// it as `T`. `model_id` is the id this server answers to.
pub(super) fn parse_checked<T: DeserializeOwned>(
    bytes: &[u8],
    endpoint: Endpoint,
    model_id: &str,
) -> Result<T, ApiError> {
    let mut body: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}")))?;
    let Some(fields) = body.as_object_mut() else {
        return Err(ApiError::invalid("the request body must be a JSON object"));
    };
    let mut passed = Vec::new();
    for (key, value) in fields.iter() {
        if (endpoint.generates() && COMMON.contains(&key.as_str()))
            || own_fields(endpoint).contains(&key.as_str())
        {
            continue;
        }
        match not_implemented(endpoint, key, value) {
            Some(true) => passed.push(key.clone()),
            Some(false) => {
                return Err(unsupported(
                    key,
                    &format!(
                        "`{key}` is not supported by this server; leave it out (see the API reference for the fields it implements)"
                    ),
                ));
            }
            None => {
                return Err(ApiError::invalid_param(
                    key,
                    format!("unknown field `{key}` for this endpoint"),
                )
                .with_code("unknown_parameter"));
            }
        }
    }
    for key in passed {
        fields.remove(&key);
    }
    if let Some(model) = fields.get("model").filter(|m| !m.is_null()) {
        match model.as_str() {
            Some(m) if m == model_id => {}
            Some(m) => {
                return Err(ApiError {
                    status: axum::http::StatusCode::NOT_FOUND,
                    ..ApiError::invalid_param(
                        "model",
                        format!("the model `{m}` does not exist here; this server serves `{model_id}` (GET /v1/models)"),
                    )
                }
                .with_code("model_not_found"));
            }
            None => return Err(ApiError::invalid_param("model", "`model` must be a string")),
        }
    }
    if endpoint == Endpoint::Chat
        && let Some(Value::Array(messages)) = fields.get_mut("messages")
    {
        for (i, m) in messages.iter_mut().enumerate() {
            check_message(m, i)?;
        }
    }
    // The shared fields are flattened into each request type, where serde loses their
    // names: read on their own first, so that a bad one is named.
    if endpoint.generates() {
        typed::<CommonParams>(&body)?;
    }
    typed(&body)
}

fn typed<T: DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        ApiError::invalid_param(&path, format!("`{path}`: {}", in_words(e.inner())))
    })
}

fn check_message(m: &mut Value, i: usize) -> Result<(), ApiError> {
    let Some(fields) = m.as_object_mut() else {
        return Ok(()); // the parser names the wrong type
    };
    let mut passed = Vec::new();
    for (key, value) in fields.iter() {
        let param = format!("messages[{i}].{key}");
        if MESSAGE_FIELDS.contains(&key.as_str()) {
            continue;
        }
        let empty = value.is_null() || value.as_array().is_some_and(Vec::is_empty);
        if MESSAGE_EMPTY_OK.contains(&key.as_str()) && empty {
            passed.push(key.clone());
        } else if MESSAGE_EMPTY_OK.contains(&key.as_str()) {
            return Err(unsupported(
                &param,
                &format!("`{param}` is not supported by this server; leave it out"),
            ));
        } else {
            return Err(
                ApiError::invalid_param(&param, format!("unknown field `{param}`"))
                    .with_code("unknown_parameter"),
            );
        }
    }
    for key in passed {
        fields.remove(&key);
    }
    if let Some(Value::Array(parts)) = fields.get("content") {
        for (j, part) in parts.iter().enumerate() {
            // Parts of other types are refused by type when the message is read.
            let text_part = part.get("type").and_then(Value::as_str) == Some("text");
            if let Some(extra) = part
                .as_object()
                .filter(|_| text_part)
                .and_then(|p| p.keys().find(|k| !PART_FIELDS.contains(&k.as_str())))
            {
                let param = format!("messages[{i}].content[{j}].{extra}");
                return Err(unsupported(
                    &param,
                    &format!("`{param}` is not supported: only text parts (`type`, `text`) are"),
                ));
            }
        }
    }
    Ok(())
}

/// serde's description of a bad value, with Rust type names put in words.
fn in_words(e: &serde_json::Error) -> String {
    let text = e.to_string();
    // serde_json appends the position, which means nothing in a re-parsed value.
    let text = text.split(" at line ").next().unwrap_or(&text).to_string();
    [
        ("expected usize", "expected a non-negative integer"),
        ("expected u64", "expected a non-negative integer"),
        ("expected u32", "expected a non-negative integer"),
        ("expected f32", "expected a number"),
        ("expected f64", "expected a number"),
        ("expected a sequence", "expected an array"),
        ("expected a map", "expected an object"),
        (
            "data did not match any variant of untagged enum Prompt",
            "expected a string, an array of token ids, or an array of one of those",
        ),
        (
            "data did not match any variant of untagged enum Stop",
            "expected a string or an array of strings",
        ),
        (
            "data did not match any variant of untagged enum MessageContent",
            "expected a string or an array of content parts",
        ),
    ]
    .iter()
    .fold(text, |t, (from, to)| t.replace(from, to))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::types::{ChatRequest, CompletionRequest};

    fn completion(body: &str) -> Result<CompletionRequest, ApiError> {
        parse_checked(body.as_bytes(), Endpoint::Completion, "tiny")
    }

    fn chat(body: &str) -> Result<ChatRequest, ApiError> {
        parse_checked(body.as_bytes(), Endpoint::Chat, "tiny")
    }

    #[test]
    fn unimplemented_fields_are_refused_by_name() {
        for (body, param) in [
            (r#"{"prompt":"x","logprobs":"many"}"#, "logprobs"),
            (r#"{"prompt":"x","echo":1}"#, "echo"),
            (r#"{"prompt":"x","suffix":"end"}"#, "suffix"),
            (r#"{"prompt":"x","grammar":7}"#, "grammar"),
            (r#"{"prompt":"x","frobnicate":1}"#, "frobnicate"),
        ] {
            let e = completion(body).expect_err(body);
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
            assert!(e.message.contains(param), "{}", e.message);
        }
        for (body, param) in [
            (r#"{"messages":[],"echo":true}"#, "echo"),
            (r#"{"messages":[],"top_logprobs":-1}"#, "top_logprobs"),
            (r#"{"messages":[],"functions":[{"name":"f"}]}"#, "functions"),
            (r#"{"messages":[],"function_call":"auto"}"#, "function_call"),
            (
                r#"{"messages":[{"role":"assistant","content":"a","refusal":"no"}]}"#,
                "messages[0].refusal",
            ),
            (
                r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a","cache":1}]}]}"#,
                "messages[0].content[0].cache",
            ),
        ] {
            let e = chat(body).expect_err(body);
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
    }

    #[test]
    fn values_that_ask_for_nothing_pass() {
        let r = completion(
            r#"{"prompt":"x","logprobs":null,"echo":false,"best_of":1,"n":1,"user":"u"}"#,
        )
        .expect("no-op values pass");
        assert_eq!(r.common.n, Some(1));
        let r = completion(r#"{"prompt":"x","logprobs":3,"echo":true,"best_of":2,"n":2}"#)
            .expect("log-probability fields parse");
        assert_eq!(
            (r.logprobs, r.echo, r.best_of),
            (Some(3), Some(true), Some(2))
        );
        let r = chat(r#"{"messages":[],"logprobs":true,"top_logprobs":4}"#).expect("parses");
        assert_eq!((r.logprobs, r.top_logprobs), (Some(true), Some(4)));
        chat(
            r#"{"model":"tiny","messages":[{"role":"assistant","content":null,"tool_calls":[]}],
               "logprobs":false,"tools":[],"tool_choice":"none","response_format":{"type":"text"},
               "store":false,"parallel_tool_calls":true}"#,
        )
        .expect("no-op values pass");
        let r = chat(
            r#"{"messages":[],"response_format":{"type":"json_object"},"grammar":"start: /a/"}"#,
        )
        .expect("constraint fields parse (and are checked when prepared)");
        assert_eq!(r.common.grammar.as_deref(), Some("start: /a/"));
    }

    #[test]
    fn end_of_generation_fields_parse_and_name_bad_values() {
        let r = completion(
            r#"{"prompt":"x","logit_bias":{"5":-100,"7":2.5},"ignore_eos":true,"min_tokens":3}"#,
        )
        .expect("implemented fields pass");
        assert_eq!(r.common.logit_bias.map(|b| b.len()), Some(2));
        assert_eq!(
            (r.common.ignore_eos, r.common.min_tokens),
            (Some(true), Some(3))
        );
        for (body, param) in [
            (r#"{"messages":[],"logit_bias":[1,2]}"#, "logit_bias"),
            (r#"{"messages":[],"ignore_eos":"yes"}"#, "ignore_eos"),
            (r#"{"messages":[],"min_tokens":-1}"#, "min_tokens"),
            (
                r#"{"messages":[],"stop_token_ids":[-2]}"#,
                "stop_token_ids[0]",
            ),
        ] {
            let e = chat(body).expect_err(body);
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
    }

    #[test]
    fn a_model_not_served_is_404() {
        let e = completion(r#"{"prompt":"x","model":"gpt-4"}"#).expect_err("wrong model");
        assert_eq!(e.status, axum::http::StatusCode::NOT_FOUND);
        assert_eq!(e.code, Some("model_not_found"));
        assert!(e.message.contains("tiny"), "{}", e.message);
        completion(r#"{"prompt":"x","model":"tiny"}"#).expect("the served model");
    }

    #[test]
    fn bad_values_name_the_field_in_words() {
        let e = completion(r#"{"prompt":"x","max_tokens":-1}"#).expect_err("negative");
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(
            e.message.contains("non-negative integer") && !e.message.contains("usize"),
            "{}",
            e.message
        );
        let e = completion(r#"{"prompt":{"a":1}}"#).expect_err("object prompt");
        assert_eq!(e.param.as_deref(), Some("prompt"));
        assert!(e.message.contains("array of token ids"), "{}", e.message);
        let e = completion("[1,2]").expect_err("not an object");
        assert!(e.message.contains("JSON object"), "{}", e.message);
    }
}
