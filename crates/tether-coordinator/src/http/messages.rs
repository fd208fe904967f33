//! A request's chat messages as the chat template reads them.

use super::error::ApiError;
use super::template::ChatMessage;
use super::tools::{ToolFormat, call_id_for_template, calls_for_template};
use super::types::{MessageContent, RequestMessage};

/// `messages` for the template: text parts joined, tool calls with their arguments as
/// objects, tool results with the call they answer; call ids as a template writing calls
/// in `format` accepts them.
pub(super) fn template_messages(
    messages: Vec<RequestMessage>,
    format: Option<ToolFormat>,
) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "`messages` is empty; send at least one message",
        ));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.into_iter().enumerate() {
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
        let tool_calls = m
            .tool_calls
            .filter(|calls| !calls.is_empty())
            .map(|calls| calls_for_template(&calls, format));
        out.push(ChatMessage {
            role: m.role,
            content,
            tool_calls,
            tool_call_id: m.tool_call_id.map(|id| call_id_for_template(id, format)),
            name: m.name,
        });
    }
    Ok(out)
}
