//! Request bodies of the OpenAI-style endpoints. `strict` checks every field of a body
//! before it is parsed into these: fields not listed here are refused, not ignored.

use serde::Deserialize;

/// `prompt` of a completion: text or token ids.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum Prompt {
    /// Text to tokenize.
    Text(String),
    /// Token ids, used as given.
    Tokens(Vec<u32>),
    /// A batch of texts; only one is supported.
    Texts(Vec<String>),
    /// A batch of token-id lists; only one is supported.
    TokenLists(Vec<Vec<u32>>),
}

/// `stop`: one string or several.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl Stop {
    /// The stop strings.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` before `[DONE]`.
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling and length fields shared by both endpoints.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct CommonParams {
    /// Most tokens to generate.
    pub max_tokens: Option<usize>,
    /// Softmax temperature; `0` is greedy.
    pub temperature: Option<f32>,
    /// Nucleus sampling mass.
    pub top_p: Option<f32>,
    /// Keep the `top_k` most likely tokens (llama.cpp extension).
    pub top_k: Option<usize>,
    /// Minimum probability relative to the best token (llama.cpp extension).
    pub min_p: Option<f32>,
    /// Repetition penalty (llama.cpp extension).
    pub repeat_penalty: Option<f32>,
    /// Tokens the penalties look back at (llama.cpp extension).
    pub repeat_last_n: Option<usize>,
    /// Subtracted from a recent token's logit per occurrence.
    pub frequency_penalty: Option<f32>,
    /// Subtracted from every recent token's logit.
    pub presence_penalty: Option<f32>,
    /// Random seed.
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Number of choices.
    pub n: Option<usize>,
    /// Token id (a decimal string key, as OpenAI sends it) to a bias in [-100, 100] added
    /// to its logit; checked in `prepare`, so that errors name the field.
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    /// Go on past end-of-generation tokens (llama.cpp extension).
    pub ignore_eos: Option<bool>,
    /// Tokens generated before an end-of-generation token or a stop string may end the
    /// request (vLLM extension).
    pub min_tokens: Option<usize>,
    /// Token ids that end generation as an end-of-generation token does (vLLM extension).
    pub stop_token_ids: Option<Vec<u32>>,
    /// `{"type": "text" | "json_object" | "json_schema", ...}`; checked in `structured`,
    /// so that errors name the field.
    pub response_format: Option<serde_json::Value>,
    /// A grammar the output must follow, in llguidance's Lark-like syntax (llama.cpp
    /// extension; its GBNF is not this syntax).
    pub grammar: Option<String>,
    /// A JSON schema the output must validate against (llama.cpp extension).
    pub json_schema: Option<serde_json::Value>,
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct CompletionRequest {
    /// The model id (informational: one model is served).
    pub model: Option<String>,
    /// The prompt.
    pub prompt: Prompt,
    /// Report each token's log-probability with this many alternatives (0 to 20).
    pub logprobs: Option<usize>,
    /// Return the prompt before the completion (with `logprobs`, scored too).
    pub echo: Option<bool>,
    /// Candidates to choose the `n` returned from; only `best_of` = `n` is supported.
    pub best_of: Option<usize>,
    /// Sampling, length and streaming.
    #[serde(flatten)]
    pub common: CommonParams,
}

/// One part of a message's content array.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct ContentPart {
    /// `text` (other kinds are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    pub text: Option<String>,
}

/// A message's `content`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Parts, of which only text is supported.
    Parts(Vec<ContentPart>),
}

/// One chat message.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct RequestMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The content; `null` for an assistant message that only called tools.
    pub content: Option<MessageContent>,
    /// The calls an assistant message made, as OpenAI returns them.
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// The call a `tool` message answers.
    pub tool_call_id: Option<String>,
    /// The participant's (or function's) name.
    pub name: Option<String>,
}

/// One entry of `tools`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct ToolDef {
    /// `function` (the only kind).
    #[serde(rename = "type")]
    pub kind: String,
    /// The function.
    pub function: FunctionDef,
}

/// A function the model may call.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct FunctionDef {
    /// Its name.
    pub name: String,
    /// What it does, for the model.
    pub description: Option<String>,
    /// A JSON schema of its arguments.
    pub parameters: Option<serde_json::Value>,
    /// OpenAI's strict flag: arguments always follow the schema when a call is forced.
    pub strict: Option<bool>,
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct ChatRequest {
    /// The model id (informational: one model is served).
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<RequestMessage>,
    /// The newer name of `max_tokens`.
    pub max_completion_tokens: Option<usize>,
    /// Report each generated token's log-probability.
    pub logprobs: Option<bool>,
    /// With `logprobs`, this many most likely alternatives of each token (0 to 20).
    pub top_logprobs: Option<usize>,
    /// Functions the model may call.
    pub tools: Option<Vec<ToolDef>>,
    /// `none`, `auto`, `required` or `{"type": "function", "function": {"name": ...}}`;
    /// checked in `tools`.
    pub tool_choice: Option<serde_json::Value>,
    /// Whether several calls may come in one reply (they may, in the Hermes format).
    pub parallel_tool_calls: Option<bool>,
    /// Sampling, length and streaming.
    #[serde(flatten)]
    pub common: CommonParams,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_forms_parse() {
        let text: CompletionRequest = serde_json::from_str(r#"{"prompt":"hi"}"#).expect("parses");
        assert_eq!(text.prompt, Prompt::Text("hi".into()));
        let ids: CompletionRequest =
            serde_json::from_str(r#"{"prompt":[1,2,3],"extra":{"x":1}}"#).expect("parses");
        assert_eq!(ids.prompt, Prompt::Tokens(vec![1, 2, 3]));
        let batch: CompletionRequest =
            serde_json::from_str(r#"{"prompt":["a","b"]}"#).expect("parses");
        assert_eq!(batch.prompt, Prompt::Texts(vec!["a".into(), "b".into()]));
        assert!(serde_json::from_str::<CompletionRequest>(r#"{"max_tokens":3}"#).is_err());
    }

    #[test]
    fn flattened_common_fields_and_stop_forms_parse() {
        let r: CompletionRequest = serde_json::from_str(
            r#"{"prompt":"x","max_tokens":5,"temperature":0,"stop":"\n","stream":true}"#,
        )
        .expect("parses");
        assert_eq!(r.common.max_tokens, Some(5));
        assert_eq!(r.common.temperature, Some(0.0));
        assert!(r.common.stream);
        assert_eq!(
            r.common.stop.map(Stop::into_vec),
            Some(vec!["\n".to_string()])
        );
    }

    #[test]
    fn chat_content_forms_parse() {
        let r: ChatRequest = serde_json::from_str(
            r#"{"messages":[{"role":"user","content":"a"},
                {"role":"user","content":[{"type":"text","text":"b"}]},
                {"role":"assistant","content":null}],"max_completion_tokens":7}"#,
        )
        .expect("parses");
        assert_eq!(
            r.messages[0].content,
            Some(MessageContent::Text("a".into()))
        );
        assert!(
            matches!(r.messages[1].content, Some(MessageContent::Parts(ref p)) if p[0].text.as_deref() == Some("b"))
        );
        assert_eq!(r.messages[2].content, None);
        assert_eq!(r.max_completion_tokens, Some(7));
    }
}
