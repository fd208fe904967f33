//! The tokenizer's inputs as plain data: what GGUF's `tokenizer.ggml.*` keys hold.

use tether_gguf::GgufFile;

use super::TokenizerError;

/// What a token is, from `tokenizer.ggml.token_type` (the numbering is GGUF's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// Ordinary text (1).
    Normal,
    /// The unknown-token placeholder (2).
    Unknown,
    /// A control token such as BOS/EOS; never produced from text unless special parsing is on (3).
    Control,
    /// A token added by the model's authors; always matched as a whole in text (4).
    UserDefined,
    /// A reserved slot that carries no text (5).
    Unused,
    /// One raw byte, written `<0xXX>` (6).
    Byte,
}

impl TokenType {
    /// The type for GGUF's numeric code; codes outside 1..=6 (0 is "undefined") read as normal.
    pub fn from_code(code: i32) -> TokenType {
        match code {
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Normal,
        }
    }
}

/// Everything a [`super::Tokenizer`] is built from, as read from `tokenizer.ggml.*` metadata.
///
/// Optional lists may be empty (scores then read as 0, types as normal); optional flags left as
/// `None` take llama.cpp's defaults for the tokenizer model.
#[derive(Debug, Clone, Default)]
pub struct Vocab {
    /// `tokenizer.ggml.model`: `"llama"` (SentencePiece) or `"gpt2"` (byte-level BPE).
    pub model: String,
    /// `tokenizer.ggml.pre`: the BPE pre-tokenizer name (`gpt2`, `llama-bpe`, `qwen2`, ...).
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`: token texts, indexed by id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores`: SentencePiece merge scores, one per token (or empty).
    pub scores: Vec<f32>,
    /// `tokenizer.ggml.token_type`, one per token (or empty).
    pub token_types: Vec<TokenType>,
    /// `tokenizer.ggml.merges`: BPE merges as `"left right"`, highest priority first.
    pub merges: Vec<String>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos: Option<u32>,
    /// `tokenizer.ggml.eot_token_id` (end of turn).
    pub eot: Option<u32>,
    /// `tokenizer.ggml.eom_token_id` (end of message).
    pub eom: Option<u32>,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unknown: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub padding: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`.
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token`.
    pub add_eos: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix` (SentencePiece only).
    pub add_space_prefix: Option<bool>,
}

impl Vocab {
    /// Reads the `tokenizer.ggml.*` keys of `file`.
    pub fn from_gguf(file: &GgufFile) -> Result<Vocab, TokenizerError> {
        let missing = |key: &str| TokenizerError::MissingKey {
            key: key.to_string(),
            file: file.path().to_string(),
        };
        let model = file
            .get_str("tokenizer.ggml.model")
            .ok_or_else(|| missing("tokenizer.ggml.model"))?
            .to_string();
        let tokens: Vec<String> = file
            .get_str_array("tokenizer.ggml.tokens")
            .ok_or_else(|| missing("tokenizer.ggml.tokens"))?
            .into_iter()
            .map(str::to_string)
            .collect();
        let scores = file
            .get_f32_array("tokenizer.ggml.scores")
            .unwrap_or_default();
        let token_types = file
            .get_i32_array("tokenizer.ggml.token_type")
            .unwrap_or_default()
            .into_iter()
            .map(TokenType::from_code)
            .collect();
        let merges = file
            .get_str_array("tokenizer.ggml.merges")
            .unwrap_or_default()
            .into_iter()
            .map(str::to_string)
            .collect();
        // Converters write -1 (stored as u32::MAX) for "this model has no such token".
        let id = |name: &str| {
            file.get_u32(&format!("tokenizer.ggml.{name}_token_id"))
                .filter(|&v| v != u32::MAX)
        };
        let flag = |name: &str| file.get_bool(&format!("tokenizer.ggml.{name}"));
        Ok(Vocab {
            model,
            pre: file.get_str("tokenizer.ggml.pre").map(str::to_string),
            tokens,
            scores,
            token_types,
            merges,
            bos: id("bos"),
            eos: id("eos"),
            eot: id("eot"),
            eom: id("eom"),
            unknown: id("unknown"),
            padding: id("padding"),
            add_bos: flag("add_bos_token"),
            add_eos: flag("add_eos_token"),
            add_space_prefix: flag("add_space_prefix"),
        })
    }
}
