//! Log-probabilities in OpenAI's two shapes: the completions API's parallel lists
//! (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and the chat API's list of
//! entries (`content[] {token, logprob, bytes, top_logprobs}`).

use serde_json::{Map, Value, json};
use tether_model::tokenizer::Tokenizer;

use crate::api::TokenLogProb;

/// One reported token: its id and, except for a prompt's first token, its scores.
pub(super) type Entry = (u32, Option<TokenLogProb>);

/// A token's text as the log-probabilities name it: its bytes, invalid UTF-8 (a piece of a
/// character split over tokens) replaced by U+FFFD.
fn piece(tokenizer: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tokenizer.token_to_piece(id);
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// A log-probability as JSON: a number, or null where there is none (a NaN from a row of
/// NaN logits is no number JSON can carry).
fn number(logprob: f32) -> Value {
    serde_json::Number::from_f64(f64::from(logprob)).map_or(Value::Null, Value::Number)
}

/// The completions API's `logprobs` object of `entries`; `offset` is where the first
/// entry's text starts in the choice's text (counted in bytes of the pieces), advanced past
/// every entry so a stream's chunks continue it.
pub(super) fn completion(tokenizer: &Tokenizer, entries: &[Entry], offset: &mut usize) -> Value {
    let mut tokens = Vec::with_capacity(entries.len());
    let mut token_logprobs = Vec::with_capacity(entries.len());
    let mut top_logprobs = Vec::with_capacity(entries.len());
    let mut text_offset = Vec::with_capacity(entries.len());
    for (id, scored) in entries {
        let (text, bytes) = piece(tokenizer, *id);
        text_offset.push(*offset);
        *offset += bytes.len();
        tokens.push(Value::String(text));
        match scored {
            Some(s) => {
                token_logprobs.push(number(s.logprob));
                let mut top = Map::new();
                for &(alt, lp) in &s.top {
                    // Two ids of one text keep the likelier (the first).
                    top.entry(piece(tokenizer, alt).0).or_insert(number(lp));
                }
                top_logprobs.push(Value::Object(top));
            }
            None => {
                token_logprobs.push(Value::Null);
                top_logprobs.push(Value::Null);
            }
        }
    }
    json!({
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    })
}

/// The chat API's `logprobs` object of `entries`.
pub(super) fn chat(tokenizer: &Tokenizer, entries: &[TokenLogProb]) -> Value {
    let one = |id: u32, logprob: f32| {
        let (text, bytes) = piece(tokenizer, id);
        json!({"token": text, "logprob": number(logprob), "bytes": bytes})
    };
    let content: Vec<Value> = entries
        .iter()
        .map(|s| {
            let mut entry = one(s.token, s.logprob);
            entry["top_logprobs"] = s.top.iter().map(|&(id, lp)| one(id, lp)).collect();
            entry
        })
        .collect();
    json!({ "content": content })
}
