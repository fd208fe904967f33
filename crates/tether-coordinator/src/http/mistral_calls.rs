//! Mistral's tool-call syntax: `[TOOL_CALLS]` followed by a JSON array of calls (7B v0.3,
//! Nemo, Small up to 3.1), or by `name[ARGS]{...}` a call (templates of tokenizer v11 on,
//! e.g. Small 3.2); the grammars that force either; and the 9-character call ids its
//! templates insist on.

use serde_json::{Value, json};
use tether_model::tokenizer::Tokenizer;

use super::tools::{ToolCall, call_of_value, is_valid_name};
use crate::constraint::json_layout;

/// Opens the calls of a reply.
pub(super) const TOOL_CALLS: &str = "[TOOL_CALLS]";
/// Separates a call's name from its arguments (v11 on).
const ARGS: &str = "[ARGS]";
/// Separates a call's name from its id, when the model writes one (v13 on).
const CALL_ID: &str = "[CALL_ID]";

/// The markers a reply may hold. In Mistral vocabularies they are control tokens, which
/// decode to no text, so the reply's text keeps them for the parser to find.
pub(super) const MARKERS: [&str; 3] = [TOOL_CALLS, ARGS, CALL_ID];

/// Length of the ids Mistral's templates accept (they raise on any other).
const ID_LEN: usize = 9;

/// The text before the first `[TOOL_CALLS]` (if any) and the calls after it; `None` when
/// there is no marker or what follows it is not calls, so the reply stays text.
pub(super) fn parse(text: &str) -> Option<(Option<String>, Vec<ToolCall>)> {
    let first = text.find(TOOL_CALLS)?;
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    // Models differ in writing one marker before all calls or one before each.
    while let Some(after) = rest.strip_prefix(TOOL_CALLS) {
        let body = after.trim_start();
        let tail = if body.starts_with(['[', '{']) {
            json_calls(body, &mut calls)?
        } else {
            args_call(body, &mut calls)?
        };
        rest = tail.trim_start();
    }
    if !rest.is_empty() || calls.is_empty() {
        return None;
    }
    let content = text[..first].trim();
    Some(((!content.is_empty()).then(|| content.to_owned()), calls))
}

/// The JSON array of calls (or a lone call object) `body` starts with, added to `calls`;
/// returns the text after it.
fn json_calls<'t>(body: &'t str, calls: &mut Vec<ToolCall>) -> Option<&'t str> {
    let (value, tail) = first_json(body)?;
    let items = match value {
        Value::Array(items) if !items.is_empty() => items,
        one @ Value::Object(_) => vec![one],
        _ => return None,
    };
    for item in &items {
        let mut call = call_of_value(item, &["arguments", "parameters"])?;
        call.id = Some(reply_id(item.get("id").and_then(Value::as_str)));
        calls.push(call);
    }
    Some(tail)
}

/// One `name[ARGS]{...}` (or `name[CALL_ID]id[ARGS]{...}`) call at the start of `body`,
/// added to `calls`; returns the text after it.
fn args_call<'t>(body: &'t str, calls: &mut Vec<ToolCall>) -> Option<&'t str> {
    let (head, args_text) = body.split_once(ARGS)?;
    let (name, id) = match head.split_once(CALL_ID) {
        Some((name, id)) => (name.trim(), Some(id.trim())),
        None => (head.trim(), None),
    };
    if !is_valid_name(name) {
        return None;
    }
    let (args, tail) = first_json(args_text)?;
    let arguments = match args {
        // Some models write the arguments as a JSON string already.
        Value::String(s) => s,
        object @ Value::Object(_) => object.to_string(),
        _ => return None,
    };
    calls.push(ToolCall {
        name: name.to_owned(),
        arguments,
        id: Some(reply_id(id)),
    });
    Some(tail)
}

/// The JSON value `text` starts with (after any whitespace) and the text after it.
fn first_json(text: &str) -> Option<(Value, &str)> {
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    let value = values.next()?.ok()?;
    Some((value, &text[values.byte_offset()..]))
}

/// How the grammar writes `marker`: as its token where the vocabulary has one (the token
/// the model learned, which a text literal could only spell out byte by byte when it is a
/// control token), else as text.
fn marker(marker: &str, tokenizer: &Tokenizer) -> String {
    match tokenizer.token_id(marker) {
        Some(id) => format!("<[{id}]>"),
        None => format!("\"{marker}\""),
    }
}

/// The grammar of one call of the JSON-array form: `call` is the Lark rule of one call
/// object. The space is the model's to write or not: 7B v0.3's template puts one after
/// the marker, Nemo's does not.
pub(super) fn array_grammar(call: &str, tokenizer: &Tokenizer) -> String {
    format!(
        "start: {} \" \"? \"[\" call \"]\"\n{call}",
        marker(TOOL_CALLS, tokenizer)
    )
}

/// The grammar of one `name[ARGS]{...}` call of one of `callable` (name, parameters
/// schema).
pub(super) fn args_grammar(callable: &[&(String, Value)], tokenizer: &Tokenizer) -> String {
    let args = marker(ARGS, tokenizer);
    let mut alternatives = Vec::with_capacity(callable.len());
    let mut rules = String::new();
    for (i, (name, params)) in callable.iter().enumerate() {
        alternatives.push(format!("\"{name}\" {args} args{i}"));
        let mut schema = params.clone();
        schema["x-guidance"] = json_layout();
        rules.push_str(&format!("args{i}: %json {schema}\n"));
    }
    format!(
        "start: {} call\ncall: {}\n{rules}",
        marker(TOOL_CALLS, tokenizer),
        alternatives.join(" | ")
    )
}

/// Whether `id` is one Mistral's templates accept: 9 ASCII letters and digits.
fn is_mistral_id(id: &str) -> bool {
    id.len() == ID_LEN && id.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// The id a returned call carries: the model's own when it wrote a valid one, else a fresh
/// one. Either way the template accepts it when the client sends it back.
fn reply_id(written: Option<&str>) -> String {
    match written {
        Some(id) if is_mistral_id(id) => id.to_owned(),
        _ => base62(uuid::Uuid::new_v4().as_u128()),
    }
}

/// `id` as the template accepts it: itself when valid, else a digest of it, so that a
/// call and the `tool` message answering it (which share the id) still match, and a
/// conversation renders the same every time.
pub(super) fn template_id(id: &str) -> String {
    if is_mistral_id(id) {
        return id.to_owned();
    }
    // FNV-1a: stable across builds and platforms, unlike std's hasher.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id.bytes() {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    base62(u128::from(hash))
}

/// The last [`ID_LEN`] base-62 digits of `n`.
fn base62(mut n: u128) -> String {
    const DIGITS: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    (0..ID_LEN)
        .map(|_| {
            let digit = DIGITS[(n % 62) as usize];
            n /= 62;
            char::from(digit)
        })
        .collect()
}

/// An assistant message's calls with their ids as the template accepts them.
pub(super) fn calls_with_template_ids(calls: &mut [Value]) {
    for call in calls {
        if let Some(id) = call.get_mut("id")
            && let Some(text) = id.as_str()
        {
            *id = json!(template_id(text));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_the_template_rejects_map_to_stable_valid_ones() {
        assert_eq!(template_id("a1B2c3D4e"), "a1B2c3D4e", "a valid id is kept");
        let mapped = template_id("call_0123456789abcdef");
        assert!(is_mistral_id(&mapped), "{mapped}");
        assert_eq!(
            mapped,
            template_id("call_0123456789abcdef"),
            "deterministic"
        );
        assert_ne!(mapped, template_id("call_0123456789abcdeg"));
        assert!(is_mistral_id(&template_id("")));
        let fresh = reply_id(Some("too-long-and-dashed"));
        assert!(is_mistral_id(&fresh), "{fresh}");
        assert_eq!(reply_id(Some("abcDEF123")), "abcDEF123");
    }

    #[test]
    fn call_ids_in_history_are_rewritten_in_place() {
        let mut calls = vec![
            json!({"id": "call_1", "function": {"name": "f"}}),
            json!({"id": "Abc123xyZ", "function": {"name": "g"}}),
            json!({"function": {"name": "h"}}),
        ];
        calls_with_template_ids(&mut calls);
        assert_eq!(calls[0]["id"], json!(template_id("call_1")));
        assert_eq!(calls[1]["id"], "Abc123xyZ");
        assert!(calls[2].get("id").is_none(), "no id is made up");
    }
}
