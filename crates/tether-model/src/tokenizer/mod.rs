//! Tokenizers built from GGUF metadata, matching llama.cpp token for token: SentencePiece-style
//! (`tokenizer.ggml.model = "llama"`) and GPT-2 byte-level BPE (`"gpt2"`).

mod bpe;
mod decode;
mod error;
mod pretokenize;
mod special;
mod spm;
mod vocab;

#[cfg(test)]
mod oracle_tests;
#[cfg(test)]
mod pipeline_tests;
#[cfg(test)]
mod pretokenize_reference_tests;

use std::collections::{HashMap, HashSet};

pub use error::TokenizerError;
pub use pretokenize::PreTokenizerKind;
pub use vocab::{TokenType, Vocab};

use bpe::{BpeVocab, MergeRanks};
use pretokenize::PreTokenizer;
use special::Fragment;
use spm::{SPACE_MARKER, SpmVocab};

/// Token texts that end generation when present, whatever their id (llama.cpp's list).
const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
];

/// Token texts taken as end-of-turn when `tokenizer.ggml.eot_token_id` is absent.
const END_OF_TURN_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<EOT>",
    "_<EOT>",
];

/// The subword algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerKind {
    /// SentencePiece-style score-driven merges with byte fallback (`"llama"`).
    Spm,
    /// GPT-2 byte-level BPE with ranked merges (`"gpt2"`).
    Bpe,
}

/// Algorithm-specific state.
enum Engine {
    Spm {
        byte_tokens: Box<[Option<u32>; 256]>,
    },
    Bpe {
        ranks: MergeRanks,
        pre: Box<PreTokenizer>,
        byte_chars: Box<[char; 256]>,
        char_bytes: HashMap<char, u8>,
    },
}

/// A text ↔ token-id converter for one model's vocabulary.
pub struct Tokenizer {
    engine: Engine,
    pre_name: String,
    tokens: Vec<String>,
    types: Vec<TokenType>,
    scores: Vec<f32>,
    token_to_id: HashMap<String, u32>,
    /// Control, user-defined and unknown tokens, longest text first (matched when parsing specials).
    specials_parsed: Vec<(u32, String)>,
    /// User-defined tokens only, longest first: llama.cpp matches these even without special parsing.
    specials_always: Vec<(u32, String)>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    unknown: Option<u32>,
    padding: Option<u32>,
    end_of_generation: HashSet<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
}

impl Tokenizer {
    /// Builds the tokenizer described by the `tokenizer.ggml.*` metadata of `file`.
    pub fn from_gguf(file: &tether_gguf::GgufFile) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::from_vocab(Vocab::from_gguf(file)?)
    }

    /// Builds a tokenizer from plain vocabulary data, checking it is consistent.
    pub fn from_vocab(vocab: Vocab) -> Result<Tokenizer, TokenizerError> {
        let n = vocab.tokens.len();
        if n == 0 {
            return Err(TokenizerError::EmptyVocab);
        }
        check_len("tokenizer.ggml.scores", n, vocab.scores.len())?;
        check_len("tokenizer.ggml.token_type", n, vocab.token_types.len())?;
        let scores = if vocab.scores.is_empty() {
            vec![0.0; n]
        } else {
            vocab.scores
        };
        let types = if vocab.token_types.is_empty() {
            vec![TokenType::Normal; n]
        } else {
            vocab.token_types
        };
        let mut token_to_id = HashMap::with_capacity(n);
        for (id, text) in vocab.tokens.iter().enumerate() {
            // A later duplicate wins, as in llama.cpp.
            token_to_id.insert(text.clone(), id as u32);
        }
        let pre_name = vocab.pre.clone().unwrap_or_else(|| "default".to_string());
        let pre_kind = PreTokenizerKind::from_name(&pre_name);

        let (engine, mut bos, mut eos, mut unknown) = match vocab.model.as_str() {
            "llama" => {
                let mut byte_tokens = Box::new([None; 256]);
                for (byte, slot) in byte_tokens.iter_mut().enumerate() {
                    *slot = token_to_id
                        .get(&format!("<0x{byte:02X}>"))
                        .or_else(|| {
                            char::from_u32(byte as u32)
                                .and_then(|c| token_to_id.get(&c.to_string()))
                        })
                        .copied();
                }
                // llama.cpp's defaults for SentencePiece files that omit the ids.
                let default = |id: u32| (id < n as u32).then_some(id);
                (
                    Engine::Spm { byte_tokens },
                    vocab.bos.or(default(1)),
                    vocab.eos.or(default(2)),
                    vocab.unknown.or(default(0)),
                )
            }
            "gpt2" => {
                if vocab.merges.is_empty() {
                    return Err(TokenizerError::MissingMerges);
                }
                if !PreTokenizerKind::is_known(&pre_name) {
                    tracing::warn!(
                        pre = %pre_name,
                        "tokenizer.ggml.pre '{pre_name}' is not known: splitting text with \
                         GPT-2's regex, so some texts may tokenize unlike the model's own \
                         tokenizer"
                    );
                }
                let byte_chars = Box::new(bpe::byte_to_char_table());
                let engine = Engine::Bpe {
                    ranks: MergeRanks::parse(&vocab.merges)?,
                    pre: Box::new(PreTokenizer::new(pre_kind)?),
                    char_bytes: bpe::char_to_byte_map(&byte_chars),
                    byte_chars,
                };
                (engine, vocab.bos, vocab.eos, vocab.unknown)
            }
            other => {
                return Err(TokenizerError::UnsupportedModel {
                    model: other.to_string(),
                });
            }
        };
        let mut padding = vocab.padding;
        let find = |texts: &[&str]| texts.iter().find_map(|t| token_to_id.get(*t).copied());
        let mut eot = vocab.eot.or_else(|| find(END_OF_TURN_TEXTS));
        let mut eom = vocab.eom.or_else(|| find(&["<|eom_id|>"]));
        for (key, id) in [
            ("tokenizer.ggml.bos_token_id", &mut bos),
            ("tokenizer.ggml.eos_token_id", &mut eos),
            ("tokenizer.ggml.unknown_token_id", &mut unknown),
            ("tokenizer.ggml.padding_token_id", &mut padding),
            ("tokenizer.ggml.eot_token_id", &mut eot),
            ("tokenizer.ggml.eom_token_id", &mut eom),
        ] {
            if let Some(value) = *id
                && value as usize >= n
            {
                return Err(TokenizerError::IdOutOfRange {
                    key,
                    id: value,
                    vocab_size: n,
                });
            }
        }
        let mut end_of_generation: HashSet<u32> = [eos, eot, eom].into_iter().flatten().collect();
        end_of_generation.extend(
            END_OF_GENERATION_TEXTS
                .iter()
                .filter_map(|t| token_to_id.get(*t)),
        );

        let specials_of = |wanted: &[TokenType]| {
            let mut list: Vec<(u32, String)> = types
                .iter()
                .enumerate()
                .filter(|(id, ty)| wanted.contains(ty) && !vocab.tokens[*id].is_empty())
                .map(|(id, _)| (id as u32, vocab.tokens[id].clone()))
                .collect();
            list.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(&b.0)));
            list
        };
        let specials_parsed = specials_of(&[
            TokenType::Control,
            TokenType::UserDefined,
            TokenType::Unknown,
        ]);
        let specials_always = specials_of(&[TokenType::UserDefined]);

        let is_spm = matches!(engine, Engine::Spm { .. });
        Ok(Tokenizer {
            add_bos: vocab
                .add_bos
                .unwrap_or(is_spm || pre_kind.adds_bos_by_default()),
            add_eos: vocab.add_eos.unwrap_or(false),
            add_space_prefix: is_spm && vocab.add_space_prefix.unwrap_or(true),
            engine,
            pre_name,
            tokens: vocab.tokens,
            types,
            scores,
            token_to_id,
            specials_parsed,
            specials_always,
            bos,
            eos,
            eot,
            unknown,
            padding,
            end_of_generation,
        })
    }

    /// Token ids for `text`. `add_bos` puts the BOS token first (if the vocabulary has one; see
    /// [`Tokenizer::add_bos_default`]); EOS is never appended. With `parse_special`, text equal
    /// to a control token's string (e.g. `<|im_end|>`) becomes that token; without it only
    /// user-defined tokens are matched literally, as in llama.cpp.
    pub fn encode(&self, text: &str, add_bos: bool, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_bos {
            out.extend(self.bos);
        }
        if text.is_empty() {
            return out;
        }
        let specials = if parse_special {
            &self.specials_parsed
        } else {
            &self.specials_always
        };
        let specials: Vec<(u32, &str)> = specials.iter().map(|(id, t)| (*id, t.as_str())).collect();
        let fragments = special::partition(text, &specials);
        match &self.engine {
            Engine::Spm { byte_tokens } => {
                let spm_vocab = SpmVocab {
                    token_to_id: &self.token_to_id,
                    scores: &self.scores,
                    byte_tokens,
                    unknown: self.unknown,
                };
                // The space prefix goes before text that starts the input or follows a special
                // token, which is where SentencePiece would see a word start.
                let mut after_special = true;
                let mut escaped = String::new();
                for fragment in fragments {
                    match fragment {
                        Fragment::Token(id) => {
                            out.push(id);
                            after_special = true;
                        }
                        Fragment::Text(piece) => {
                            escaped.clear();
                            if self.add_space_prefix && after_special {
                                escaped.push_str(SPACE_MARKER);
                            }
                            escaped.push_str(&piece.replace(' ', SPACE_MARKER));
                            spm::encode(&spm_vocab, &escaped, &mut out);
                            after_special = false;
                        }
                    }
                }
            }
            Engine::Bpe {
                ranks,
                pre,
                byte_chars,
                ..
            } => {
                let bpe_vocab = BpeVocab {
                    token_to_id: &self.token_to_id,
                    ranks,
                    byte_chars,
                    ignore_merges: pre.kind().ignores_merges(),
                    unknown: self.unknown,
                };
                let mut scratch = String::new();
                for fragment in fragments {
                    match fragment {
                        Fragment::Token(id) => out.push(id),
                        Fragment::Text(piece) => pre.split(piece, |word| {
                            bpe::encode_word(&bpe_vocab, word, &mut scratch, &mut out)
                        }),
                    }
                }
            }
        }
        out
    }

    /// The subword algorithm.
    pub fn kind(&self) -> TokenizerKind {
        match self.engine {
            Engine::Spm { .. } => TokenizerKind::Spm,
            Engine::Bpe { .. } => TokenizerKind::Bpe,
        }
    }

    /// The `tokenizer.ggml.pre` name as given (`"default"` when absent). For BPE, names other
    /// than those [`PreTokenizerKind::from_name`] lists are split with GPT-2's regex.
    pub fn pre_tokenizer(&self) -> &str {
        &self.pre_name
    }

    /// The regex family actually used to split text (meaningful for BPE only).
    pub fn pre_tokenizer_kind(&self) -> PreTokenizerKind {
        match &self.engine {
            Engine::Bpe { pre, .. } => pre.kind(),
            Engine::Spm { .. } => PreTokenizerKind::from_name(&self.pre_name),
        }
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// Beginning-of-sequence token.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence token.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// End-of-turn token (from metadata, or found by its text, e.g. `<|eot_id|>`, `<|im_end|>`).
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }

    /// Unknown-text token.
    pub fn unknown(&self) -> Option<u32> {
        self.unknown
    }

    /// Padding token.
    pub fn padding(&self) -> Option<u32> {
        self.padding
    }

    /// Whether generation should stop at `id`: EOS, EOT, EOM, or a token whose text is a known
    /// end marker such as `<|im_end|>` or `<|endoftext|>`.
    pub fn is_eog(&self, id: u32) -> bool {
        self.end_of_generation.contains(&id)
    }

    /// Every end-of-generation token id ([`Tokenizer::is_eog`]), sorted.
    pub fn eog_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.end_of_generation.iter().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Whether prompts for this model should start with BOS (`tokenizer.ggml.add_bos_token`;
    /// when absent, true for SentencePiece and Llama-3 BPE, false for other BPE).
    pub fn add_bos_default(&self) -> bool {
        self.add_bos && self.bos.is_some()
    }

    /// Whether the model's metadata asks for EOS after each sequence (`add_eos_token`).
    pub fn add_eos_default(&self) -> bool {
        self.add_eos && self.eos.is_some()
    }

    /// The stored text of token `id` (byte-level encoded for BPE, `▁` for spaces in SPM).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The type of token `id`.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    /// The id of the token whose stored text is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The vocabulary itself is too large to be useful in debug output.
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind())
            .field("pre_tokenizer", &self.pre_name)
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eot", &self.eot)
            .finish_non_exhaustive()
    }
}

fn check_len(key: &'static str, expected: usize, got: usize) -> Result<(), TokenizerError> {
    if got != 0 && got != expected {
        return Err(TokenizerError::LengthMismatch { key, expected, got });
    }
    Ok(())
}
