//! Splitting text into words before byte-level BPE, with the regex each model family uses
//! (chosen by `tokenizer.ggml.pre`).

use fancy_regex::Regex;

use super::TokenizerError;

/// GPT-2's original split: contractions, optional space + letters/digits/other, whitespace.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Llama 3's split: case-insensitive contractions, digits in groups of at most three, and
/// newlines kept apart from other whitespace.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's split: as Llama 3 but every digit is a word of its own.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer regex families this crate knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizerKind {
    /// GPT-2's regex (`default`, `gpt2`, `gpt-2`, and any name not listed here).
    Gpt2,
    /// Llama 3's regex (`llama-bpe`, `llama3`, `llama-v3`); also skips merges for whole-word tokens.
    Llama3,
    /// Qwen2's regex (`qwen2`).
    Qwen2,
}

impl PreTokenizerKind {
    /// The family for a `tokenizer.ggml.pre` value. Names this crate does not know use GPT-2's
    /// regex, which is right for many older BPE models and close for most others; the original
    /// name stays available from `Tokenizer::pre_tokenizer` so callers can warn.
    pub fn from_name(name: &str) -> PreTokenizerKind {
        match name {
            "llama-bpe" | "llama3" | "llama-v3" => PreTokenizerKind::Llama3,
            "qwen2" => PreTokenizerKind::Qwen2,
            _ => PreTokenizerKind::Gpt2,
        }
    }

    /// Whether `name` is a `tokenizer.ggml.pre` value this crate splits as its model does
    /// (the names [`Self::from_name`] lists, and GPT-2's own).
    pub fn is_known(name: &str) -> bool {
        matches!(
            name,
            "default" | "gpt2" | "gpt-2" | "llama-bpe" | "llama3" | "llama-v3" | "qwen2"
        )
    }

    fn pattern(self) -> &'static str {
        match self {
            PreTokenizerKind::Gpt2 => GPT2,
            PreTokenizerKind::Llama3 => LLAMA3,
            PreTokenizerKind::Qwen2 => QWEN2,
        }
    }
}

/// A compiled pre-tokenizer.
pub(super) struct PreTokenizer {
    kind: PreTokenizerKind,
    regex: Regex,
}

impl PreTokenizer {
    /// Compiles the regex for `kind`.
    pub fn new(kind: PreTokenizerKind) -> Result<PreTokenizer, TokenizerError> {
        let regex = Regex::new(kind.pattern()).map_err(|e| TokenizerError::Regex {
            kind: format!("{kind:?}"),
            reason: e.to_string(),
        })?;
        Ok(PreTokenizer { kind, regex })
    }

    /// The regex family.
    pub fn kind(&self) -> PreTokenizerKind {
        self.kind
    }

    /// Calls `emit` with each word of `text`, in order; the words concatenate back to `text`.
    /// Text the regex does not match (none for these patterns, but kept for safety) is emitted
    /// as a word of its own; if the regex engine gives up (backtrack limit), the rest of the
    /// text becomes one word rather than being lost.
    pub fn split<'t>(&self, text: &'t str, mut emit: impl FnMut(&'t str)) {
        let mut covered = 0;
        for found in self.regex.find_iter(text) {
            let Ok(m) = found else { break };
            if m.start() > covered {
                emit(&text[covered..m.start()]);
            }
            if m.end() > m.start() {
                emit(m.as_str());
            }
            covered = m.end();
        }
        if covered < text.len() {
            emit(&text[covered..]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(kind: PreTokenizerKind, text: &str) -> Vec<String> {
        let pre = PreTokenizer::new(kind).expect("built-in patterns compile");
        let mut out = Vec::new();
        pre.split(text, |w| out.push(w.to_string()));
        out
    }

    #[test]
    fn gpt2_keeps_digit_runs_and_leading_spaces() {
        assert_eq!(
            words(PreTokenizerKind::Gpt2, "I'm 12345 ok  !"),
            ["I", "'m", " 12345", " ok", " ", " !"]
        );
    }

    #[test]
    fn llama3_groups_digits_by_three_and_splits_newlines() {
        assert_eq!(
            words(PreTokenizerKind::Llama3, "x 1234567\n\nHello"),
            ["x", " ", "123", "456", "7", "\n\n", "Hello"]
        );
        // Case-insensitive contraction; punctuation may take a leading non-letter.
        assert_eq!(
            words(PreTokenizerKind::Llama3, "I'VE,a"),
            ["I", "'VE", ",a"]
        );
    }

    #[test]
    fn qwen2_splits_every_digit() {
        assert_eq!(
            words(PreTokenizerKind::Qwen2, "a 123"),
            ["a", " ", "1", "2", "3"]
        );
    }

    #[test]
    fn unknown_names_fall_back_to_gpt2() {
        assert_eq!(PreTokenizerKind::from_name("gpt-2"), PreTokenizerKind::Gpt2);
        assert_eq!(
            PreTokenizerKind::from_name("some-new-model"),
            PreTokenizerKind::Gpt2
        );
        assert_eq!(
            PreTokenizerKind::from_name("llama-bpe"),
            PreTokenizerKind::Llama3
        );
        assert_eq!(
            PreTokenizerKind::from_name("qwen2"),
            PreTokenizerKind::Qwen2
        );
    }
}
