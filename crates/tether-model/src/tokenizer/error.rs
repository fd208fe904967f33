//! Why a tokenizer could not be built.

/// Errors from building a [`super::Tokenizer`]; encoding and decoding never fail.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A required `tokenizer.ggml.*` key is absent.
    #[error(
        "reading the tokenizer of {file}: metadata key {key} is missing; the file has no usable \
         tokenizer (re-convert the model with its tokenizer files)"
    )]
    MissingKey {
        /// The missing key.
        key: String,
        /// The GGUF file.
        file: String,
    },
    /// `tokenizer.ggml.model` names an algorithm this crate does not implement.
    #[error(
        "tokenizer model {model:?} is not supported (supported: \"llama\" = SentencePiece, \
         \"gpt2\" = byte-level BPE); use a model with one of those tokenizers"
    )]
    UnsupportedModel {
        /// The model name from the metadata.
        model: String,
    },
    /// `tokenizer.ggml.tokens` is empty.
    #[error("tokenizer.ggml.tokens is empty; the file has no vocabulary")]
    EmptyVocab,
    /// A per-token list has a different length from the token list.
    #[error(
        "tokenizer metadata {key} has {got} entries but the vocabulary has {expected} tokens; \
         the GGUF file is inconsistent (re-convert it)"
    )]
    LengthMismatch {
        /// The key of the list.
        key: &'static str,
        /// Number of tokens.
        expected: usize,
        /// Number of entries found.
        got: usize,
    },
    /// A special-token id does not name a token.
    #[error(
        "tokenizer metadata {key} = {id} is outside the vocabulary of {vocab_size} tokens; \
         fix or remove that key in the GGUF file"
    )]
    IdOutOfRange {
        /// The key holding the id.
        key: &'static str,
        /// The id found.
        id: u32,
        /// Number of tokens.
        vocab_size: usize,
    },
    /// A BPE vocabulary without merges.
    #[error(
        "tokenizer.ggml.model is \"gpt2\" but tokenizer.ggml.merges is missing or empty; \
         re-convert the model with its merges"
    )]
    MissingMerges,
    /// A merge line is not `"left right"`.
    #[error("tokenizer.ggml.merges[{index}] = {merge:?} is not two space-separated parts")]
    BadMerge {
        /// Position in the merge list.
        index: usize,
        /// The offending entry.
        merge: String,
    },
    /// A built-in pre-tokenizer pattern failed to compile (a bug in this crate).
    #[error("compiling the {kind} pre-tokenizer regex failed: {reason} (please report this bug)")]
    Regex {
        /// The pre-tokenizer family.
        kind: String,
        /// The regex engine's message.
        reason: String,
    },
}
