//! The model's vocabulary as llguidance sees it: each token's bytes from our tokenizer
//! (byte-level BPE and SentencePiece byte tokens alike), special tokens marked so that no
//! grammar over text can produce them.

use std::sync::Arc;

use tether_model::tokenizer::{TokenType, Tokenizer};
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use super::ConstraintError;

/// A [`TokenizerEnv`] over our tokenizer's pieces. Text is tokenized greedily through the
/// trie: llguidance only tokenizes for forced tokens, which we do not use, and greedy
/// tokenization is byte-exact where ours would add a SentencePiece space prefix.
struct Vocabulary {
    trie: TokTrie,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// The bytes llguidance matches token `id` by: its text for ordinary tokens, and for
/// control, unknown and unused ones the special-token marker before its name, which no
/// text grammar matches (a grammar may still name them as `<|im_end|>`-style tokens).
fn token_bytes(tokenizer: &Tokenizer, id: u32) -> Vec<u8> {
    match tokenizer.token_type(id) {
        Some(TokenType::Control | TokenType::Unknown | TokenType::Unused) | None => {
            let mut bytes = vec![TokTrie::SPECIAL_TOKEN_MARKER];
            bytes.extend_from_slice(tokenizer.token_text(id).unwrap_or_default().as_bytes());
            bytes
        }
        Some(_) => tokenizer.token_to_piece(id),
    }
}

/// llguidance's view of `tokenizer`, ending on every end-of-generation token.
pub(super) fn token_env(tokenizer: &Tokenizer) -> Result<TokEnv, ConstraintError> {
    let n_vocab = tokenizer.vocab_size();
    let vocab_size = u32::try_from(n_vocab).map_err(|_| {
        ConstraintError::Vocabulary(format!("a vocabulary of {n_vocab} tokens is too large"))
    })?;
    let mut ends = tokenizer.eog_ids();
    // The first end token is the one llguidance puts in masks; prefer the model's EOS.
    if let Some(eos) = tokenizer.eos().filter(|e| ends.contains(e)) {
        ends.retain(|&t| t != eos);
        ends.insert(0, eos);
    }
    let Some(&first) = ends.first() else {
        return Err(ConstraintError::Vocabulary(
            "the model has no end-of-generation token, so no grammar could end".into(),
        ));
    };
    let words: Vec<Vec<u8>> = (0..vocab_size)
        .map(|id| token_bytes(tokenizer, id))
        .collect();
    // The trie asserts its invariants; a vocabulary that breaks one is refused, not a panic.
    let trie = std::panic::catch_unwind(|| {
        TokTrie::from(&TokRxInfo::new(vocab_size, first), &words).with_eos_tokens(&ends)
    })
    .map_err(|_| {
        ConstraintError::Vocabulary("the vocabulary cannot be indexed for grammars".into())
    })?;
    Ok(Arc::new(Vocabulary { trie }))
}
