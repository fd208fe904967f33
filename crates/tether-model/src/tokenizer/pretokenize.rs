//! Splitting text into words before byte-level BPE, with the regexes each model family uses
//! (chosen by `tokenizer.ggml.pre`). Most families split with one regex; DeepSeek's published
//! pre-tokenizers are a sequence of splits, each applied to the words the previous one made
//! (Hugging Face's `Split` with `Isolated` behaviour: matches and the text between them both
//! become words).

use fancy_regex::Regex;

use super::TokenizerError;

/// GPT-2's original split: contractions, optional space + letters/digits/other, whitespace.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Llama 3's split: case-insensitive contractions, digits in groups of at most three, and
/// newlines kept apart from other whitespace.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's split: as Llama 3 but every digit is a word of its own.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Mistral's tekken (Mistral Nemo): words split where lower case turns to upper case, no
/// contractions, single digits, and `/` may trail a punctuation run.
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// DeepSeek LLM (7B/67B): newlines alone; an optional space + a run of cased letters (the
/// published class lists Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee, Glagolitic,
/// Coptic, Deseret, Osage, Old Hungarian, Warang Citi and Adlam ranges); an optional space +
/// ASCII or full-width punctuation; trailing whitespace; CJK and Hangul runs; single digits
/// (the tokenizer's `Digits` step with `individual_digits`).
const DEEPSEEK_LLM: &[&str] = &[
    r"[\r\n]",
    // Six letters of the class are written as escapes: each has a canonically equivalent
    // character (Greek with oxia, ohm and kelvin signs) that normalizing editors substitute,
    // which would change the ranges.
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u{1F7D}ᾀ-ᾴᾶ-ᾼ\u{1FBE}ῂ-ῄῆ-ῌῐ-\u{1FD3}ῖ-\u{1FDB}ῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u{2126}ℨ\u{212A}-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}",
];

/// DeepSeek Coder: newlines alone, an optional space + letters, an optional space +
/// punctuation, CJK and Hangul runs, single digits.
const DEEPSEEK_CODER: &[&str] = &[
    r"[\r\n]",
    r"\s?\p{L}+",
    r"\s?\p{P}+",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}",
];

/// DeepSeek V3 (and R1): digits in groups of at most three, CJK and kana runs, then a
/// Llama 3-like split where ASCII punctuation may lead an ASCII word and marks join letters.
const DEEPSEEK_V3: &[&str] = &[
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

/// The pre-tokenizer regex families this crate knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizerKind {
    /// GPT-2's regex (`default`, `gpt2`, `gpt-2`, and any name not listed here).
    Gpt2,
    /// Llama 3's regex (`llama-bpe`, `llama3`, `llama-v3`); also skips merges for whole-word tokens.
    Llama3,
    /// Qwen2's regex (`qwen2`, and `deepseek-r1-qwen` of the Qwen-based R1 distills).
    Qwen2,
    /// Mistral's tekken (`tekken`, Mistral Nemo); also skips merges for whole-word tokens.
    Tekken,
    /// DeepSeek LLM's split sequence (`deepseek-llm`).
    DeepseekLlm,
    /// DeepSeek Coder's split sequence (`deepseek-coder`).
    DeepseekCoder,
    /// DeepSeek V3's split sequence (`deepseek-v3`, also DeepSeek R1).
    DeepseekV3,
}

impl PreTokenizerKind {
    /// The family for a `tokenizer.ggml.pre` value. Names this crate does not know use GPT-2's
    /// regex, which is right for many older BPE models and close for most others; the original
    /// name stays available from `Tokenizer::pre_tokenizer` so callers can warn. The Llama-based
    /// DeepSeek R1 distills carry `llama-bpe`, so they need no name of their own.
    pub fn from_name(name: &str) -> PreTokenizerKind {
        match name {
            "llama-bpe" | "llama3" | "llama-v3" => PreTokenizerKind::Llama3,
            "qwen2" | "deepseek-r1-qwen" => PreTokenizerKind::Qwen2,
            "tekken" => PreTokenizerKind::Tekken,
            "deepseek-llm" => PreTokenizerKind::DeepseekLlm,
            "deepseek-coder" => PreTokenizerKind::DeepseekCoder,
            "deepseek-v3" => PreTokenizerKind::DeepseekV3,
            _ => PreTokenizerKind::Gpt2,
        }
    }

    /// Whether `name` is a `tokenizer.ggml.pre` value this crate splits as its model does
    /// (the names [`Self::from_name`] lists, and GPT-2's own).
    pub fn is_known(name: &str) -> bool {
        matches!(name, "default" | "gpt2" | "gpt-2")
            || PreTokenizerKind::from_name(name) != PreTokenizerKind::Gpt2
    }

    /// Whether a word that is itself a vocabulary token is taken whole instead of merged
    /// (what the Llama 3 and tekken tokenizers do).
    pub fn ignores_merges(self) -> bool {
        matches!(self, PreTokenizerKind::Llama3 | PreTokenizerKind::Tekken)
    }

    /// Whether the family adds BOS when the file does not say.
    pub fn adds_bos_by_default(self) -> bool {
        matches!(self, PreTokenizerKind::Llama3 | PreTokenizerKind::Tekken)
    }

    /// The regexes applied one after another; each splits every word the previous made.
    pub fn patterns(self) -> &'static [&'static str] {
        match self {
            PreTokenizerKind::Gpt2 => &[GPT2],
            PreTokenizerKind::Llama3 => &[LLAMA3],
            PreTokenizerKind::Qwen2 => &[QWEN2],
            PreTokenizerKind::Tekken => &[TEKKEN],
            PreTokenizerKind::DeepseekLlm => DEEPSEEK_LLM,
            PreTokenizerKind::DeepseekCoder => DEEPSEEK_CODER,
            PreTokenizerKind::DeepseekV3 => DEEPSEEK_V3,
        }
    }
}

/// A compiled pre-tokenizer.
pub(super) struct PreTokenizer {
    kind: PreTokenizerKind,
    steps: Vec<Regex>,
}

impl PreTokenizer {
    /// Compiles the regexes for `kind`.
    pub fn new(kind: PreTokenizerKind) -> Result<PreTokenizer, TokenizerError> {
        let steps = kind
            .patterns()
            .iter()
            .map(|pattern| {
                Regex::new(pattern).map_err(|e| TokenizerError::Regex {
                    kind: format!("{kind:?}"),
                    reason: e.to_string(),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(PreTokenizer { kind, steps })
    }

    /// The regex family.
    pub fn kind(&self) -> PreTokenizerKind {
        self.kind
    }

    /// Calls `emit` with each word of `text`, in order; the words concatenate back to `text`.
    pub fn split<'t>(&self, text: &'t str, mut emit: impl FnMut(&'t str)) {
        match self.steps.as_slice() {
            [only] => split_one(only, text, &mut emit),
            [first, rest @ ..] => {
                let mut words = Vec::new();
                split_one(first, text, &mut |w| words.push(w));
                for step in rest {
                    let mut next = Vec::with_capacity(words.len());
                    for word in words {
                        split_one(step, word, &mut |w| next.push(w));
                    }
                    words = next;
                }
                words.into_iter().for_each(emit);
            }
            [] => emit(text),
        }
    }
}

/// One split: each match is a word, and so is the text between matches (none for the
/// single-regex families, whose patterns match everything). If the regex engine gives up
/// (backtrack limit), the rest of the text becomes one word rather than being lost.
fn split_one<'t>(regex: &Regex, text: &'t str, emit: &mut impl FnMut(&'t str)) {
    let mut covered = 0;
    for found in regex.find_iter(text) {
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
    fn tekken_splits_at_case_changes_and_single_digits() {
        assert_eq!(
            words(PreTokenizerKind::Tekken, "HelloWorld 12"),
            ["Hello", "World", " ", "1", "2"]
        );
    }

    #[test]
    fn deepseek_sequences_split_each_word_again() {
        assert_eq!(
            words(PreTokenizerKind::DeepseekCoder, "ab12 cd"),
            ["ab", "1", "2", " cd"]
        );
        assert_eq!(
            words(PreTokenizerKind::DeepseekV3, "abc 12345"),
            ["abc", " ", "123", "45"]
        );
        assert_eq!(
            words(PreTokenizerKind::DeepseekLlm, "Hello world 123\n"),
            ["Hello", " world", " ", "1", "2", "3", "\n"]
        );
    }

    #[test]
    fn deepseek_and_mistral_names_are_known() {
        for (name, kind) in [
            ("deepseek-llm", PreTokenizerKind::DeepseekLlm),
            ("deepseek-coder", PreTokenizerKind::DeepseekCoder),
            ("deepseek-v3", PreTokenizerKind::DeepseekV3),
            ("deepseek-r1-qwen", PreTokenizerKind::Qwen2),
            ("tekken", PreTokenizerKind::Tekken),
        ] {
            assert_eq!(PreTokenizerKind::from_name(name), kind, "{name}");
            assert!(PreTokenizerKind::is_known(name), "{name}");
        }
        assert!(!PreTokenizerKind::is_known("some-new-model"));
        assert!(PreTokenizerKind::Tekken.ignores_merges());
        assert!(!PreTokenizerKind::DeepseekV3.ignores_merges());
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
