//! The JSON bodies of `/v1/completions` and `/v1/chat/completions` replies: whole replies
//! of every choice, and the streamed chunks of one choice each (named by `index`).

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};
use tether_model::tokenizer::Tokenizer;

use super::logprobs;
use super::tools::{ToolCall, Tools};
use crate::api::FinishReason;

/// The finish reason of a reply that calls tools.
pub(super) const TOOL_CALLS: &str = "tool_calls";

/// Which of the two endpoints a reply is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Completion,
    Chat,
}

/// `usage` of a reply: the prompt counted once, the completion tokens of every choice.
pub(super) fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// Builds reply bodies of one response.
pub(super) struct Shape {
    pub kind: Kind,
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<Tokenizer>,
    /// Whether the request asked for log-probabilities.
    logprobs: bool,
}

impl Shape {
    pub fn new(kind: Kind, model: &str, tokenizer: Arc<Tokenizer>, logprobs: bool) -> Self {
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
    pub fn logprobs(&self, entries: &[logprobs::Entry], offset: &mut usize) -> Value {
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

    fn object(&self, choices: Vec<Value>, object: &str) -> Value {
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    fn chunk_object(&self) -> &'static str {
        match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        }
    }

    /// One choice of the non-streamed reply; a chat choice whose text calls `tools` carries
    /// the calls.
    pub fn choice(
        &self,
        index: usize,
        text: &str,
        finish: FinishReason,
        logprobs: Value,
        tools: Option<&Tools>,
    ) -> Value {
        let mut choice = match self.kind {
            Kind::Completion => {
                json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish.as_str()})
            }
            Kind::Chat => json!({
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish.as_str(),
            }),
        };
        if let Some((content, calls)) = tools.and_then(|t| t.parse(text)) {
            let calls: Vec<Value> = calls.iter().map(ToolCall::to_json).collect();
            choice["message"] =
                json!({"role": "assistant", "content": content, "tool_calls": calls});
            choice["finish_reason"] = json!(TOOL_CALLS);
        }
        choice
    }

    /// The non-streamed reply of `choices`.
    pub fn whole(&self, choices: Vec<Value>, usage: Value) -> Value {
        let object = match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion",
        };
        let mut body = self.object(choices, object);
        body["usage"] = usage;
        body
    }

    /// A streamed chunk of choice `index` with `text` (chat: as `delta.content`), the
    /// `logprobs` of its tokens, and maybe the finish reason.
    pub fn chunk(
        &self,
        index: usize,
        text: Option<&str>,
        finish: Option<&str>,
        logprobs: Value,
    ) -> Value {
        let choice = match self.kind {
            Kind::Completion => {
                json!({"index": index, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish})
            }
            Kind::Chat => {
                let delta = match text {
                    Some(t) => json!({"content": t}),
                    None => json!({}),
                };
                json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
        };
        self.object(vec![choice], self.chunk_object())
    }

    /// A chat chunk of choice `index` with tool calls (each whole, with its index) as
    /// `delta.tool_calls`.
    pub fn tool_calls_chunk(&self, index: usize, calls: &[ToolCall]) -> Value {
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
            vec![
                json!({"index": index, "delta": {"tool_calls": calls}, "logprobs": null, "finish_reason": null}),
            ],
            self.chunk_object(),
        )
    }

    /// The chat stream's opening chunk of choice `index`, naming the role.
    pub fn role_chunk(&self, index: usize) -> Value {
        self.object(
            vec![
                json!({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}),
            ],
            self.chunk_object(),
        )
    }

    /// The chunk with usage only, sent last when the client asked for it.
    pub fn usage_chunk(&self, usage: Value) -> Value {
        let mut body = self.object(Vec::new(), self.chunk_object());
        body["usage"] = usage;
        body
    }
}
