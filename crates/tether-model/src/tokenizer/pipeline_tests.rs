//! Whole-pipeline tests on small hand-built vocabularies: pre-tokenizer choice, special tokens,
//! defaults, and the errors for inconsistent metadata.

use super::bpe::byte_to_char_table;
use super::{PreTokenizerKind, TokenType, Tokenizer, TokenizerError, TokenizerKind, Vocab};

/// A byte-level BPE vocabulary: the 256 byte characters, then `extra` tokens.
fn bpe_vocab(pre: &str, extra: &[(&str, TokenType)], merges: &[&str]) -> Vocab {
    let mut tokens: Vec<String> = byte_to_char_table().iter().map(|c| c.to_string()).collect();
    let mut types = vec![TokenType::Normal; tokens.len()];
    for (text, ty) in extra {
        tokens.push(text.to_string());
        types.push(*ty);
    }
    Vocab {
        model: "gpt2".into(),
        pre: Some(pre.into()),
        tokens,
        token_types: types,
        merges: merges.iter().map(|m| m.to_string()).collect(),
        ..Vocab::default()
    }
}

fn ids(tokenizer: &Tokenizer, texts: &[&str]) -> Vec<u32> {
    texts
        .iter()
        .map(|t| {
            tokenizer
                .token_id(t)
                .unwrap_or_else(|| panic!("{t:?} is in the test vocab"))
        })
        .collect()
}

const WORDS: &[(&str, TokenType)] = &[
    ("Hi", TokenType::Normal),
    ("202", TokenType::Normal),
    ("!ĊĊ", TokenType::Normal),
    ("<|eot_id|>", TokenType::Control),
];

#[test]
fn llama3_pre_tokenizer_groups_digits_and_keeps_whole_word_tokens() {
    let tokenizer = Tokenizer::from_vocab(bpe_vocab("llama-bpe", WORDS, &["x y"])).expect("valid");
    assert_eq!(tokenizer.pre_tokenizer_kind(), PreTokenizerKind::Llama3);
    let want = ids(&tokenizer, &["Hi", "Ġ", "202", "4", "!ĊĊ", "o", "k"]);
    assert_eq!(tokenizer.encode("Hi 2024!\n\nok", false, false), want);
    assert!(tokenizer.add_bos_default() == tokenizer.bos().is_some());
}

#[test]
fn qwen2_pre_tokenizer_splits_single_digits() {
    let tokenizer =
        Tokenizer::from_vocab(bpe_vocab("qwen2", WORDS, &["2 0", "20 2"])).expect("valid");
    // "202" would be reachable by merges, but Qwen2 never lets digits share a word.
    let want = ids(&tokenizer, &["2", "0", "2", "4"]);
    assert_eq!(tokenizer.encode("2024", false, false), want);
}

#[test]
fn gpt2_and_unknown_pre_names_use_gpt2_rules() {
    let mut extra = WORDS.to_vec();
    extra.extend([("Ġ2", TokenType::Normal), ("Ġ20", TokenType::Normal)]);
    let tokenizer =
        Tokenizer::from_vocab(bpe_vocab("brand-new", &extra, &["Ġ 2", "Ġ2 0"])).expect("valid");
    assert_eq!(tokenizer.pre_tokenizer(), "brand-new");
    assert_eq!(tokenizer.pre_tokenizer_kind(), PreTokenizerKind::Gpt2);
    assert_eq!(tokenizer.kind(), TokenizerKind::Bpe);
    // GPT-2 keeps the space with the digits and does not skip merges for whole-word tokens.
    let want = ids(&tokenizer, &["Ġ20", "2"]);
    assert_eq!(tokenizer.encode(" 202", false, false), want);
}

#[test]
fn control_tokens_are_matched_only_when_parsing_specials() {
    let tokenizer = Tokenizer::from_vocab(bpe_vocab("llama-bpe", WORDS, &["x y"])).expect("valid");
    let eot = tokenizer.token_id("<|eot_id|>").expect("in vocab");
    assert_eq!(
        tokenizer.encode("Hi<|eot_id|>", false, true),
        vec![ids(&tokenizer, &["Hi"])[0], eot]
    );
    assert!(
        !tokenizer
            .encode("Hi<|eot_id|>", false, false)
            .contains(&eot)
    );
    // Found by its text as end of turn, and it ends generation; it renders as nothing.
    assert_eq!(tokenizer.eot(), Some(eot));
    assert!(tokenizer.is_eog(eot));
    assert_eq!(tokenizer.decode(&[eot]), "");
    assert_eq!(
        tokenizer.decode(&tokenizer.encode("Hi 2024!\n\nok", false, false)),
        "Hi 2024!\n\nok"
    );
}

fn spm_vocab() -> Vocab {
    let entries: &[(&str, f32, TokenType)] = &[
        ("<unk>", 0.0, TokenType::Unknown),
        ("<s>", 0.0, TokenType::Control),
        ("</s>", 0.0, TokenType::Control),
        ("<0x21>", 0.0, TokenType::Byte),
        ("▁", -1.0, TokenType::Normal),
        ("H", -2.0, TokenType::Normal),
        ("i", -2.0, TokenType::Normal),
        ("▁H", -3.0, TokenType::Normal),
        ("▁Hi", -1.5, TokenType::Normal),
        ("<tool>", 0.0, TokenType::UserDefined),
    ];
    Vocab {
        model: "llama".into(),
        tokens: entries.iter().map(|e| e.0.to_string()).collect(),
        scores: entries.iter().map(|e| e.1).collect(),
        token_types: entries.iter().map(|e| e.2).collect(),
        ..Vocab::default()
    }
}

#[test]
fn spm_adds_the_space_prefix_after_specials_and_falls_back_to_bytes() {
    let tokenizer = Tokenizer::from_vocab(spm_vocab()).expect("valid");
    assert_eq!(tokenizer.kind(), TokenizerKind::Spm);
    // Defaults for SentencePiece files without ids: BOS 1, EOS 2, UNK 0, add BOS.
    assert_eq!(
        (tokenizer.bos(), tokenizer.eos(), tokenizer.unknown()),
        (Some(1), Some(2), Some(0))
    );
    assert!(tokenizer.add_bos_default());
    assert_eq!(tokenizer.encode("Hi!", true, false), vec![1, 8, 3]);
    // User-defined tokens are always matched; the text after one gets a fresh space prefix.
    assert_eq!(tokenizer.encode("Hi<tool>Hi", false, false), vec![8, 9, 8]);
    assert_eq!(tokenizer.encode("<s>Hi", false, true), vec![1, 8]);
    assert_eq!(tokenizer.decode(&[1, 8, 3]), "Hi!");
    assert_eq!(tokenizer.token_to_piece(8), b" Hi");
    assert_eq!(tokenizer.token_to_piece(3), b"!");
    assert!(tokenizer.is_eog(2));
}

#[test]
fn spm_without_space_prefix_keeps_text_as_is() {
    let mut vocab = spm_vocab();
    vocab.add_space_prefix = Some(false);
    let tokenizer = Tokenizer::from_vocab(vocab).expect("valid");
    assert_eq!(tokenizer.encode("Hi", false, false), vec![5, 6]);
    assert_eq!(tokenizer.decode(&[4, 5]), " H");
}

#[test]
fn inconsistent_metadata_is_refused() {
    let mut vocab = spm_vocab();
    vocab.scores.pop();
    assert!(matches!(
        Tokenizer::from_vocab(vocab),
        Err(TokenizerError::LengthMismatch {
            key: "tokenizer.ggml.scores",
            ..
        })
    ));
    let mut vocab = spm_vocab();
    vocab.eos = Some(99);
    assert!(matches!(
        Tokenizer::from_vocab(vocab),
        Err(TokenizerError::IdOutOfRange { id: 99, .. })
    ));
    let mut vocab = spm_vocab();
    vocab.model = "bert".into();
    assert!(matches!(
        Tokenizer::from_vocab(vocab),
        Err(TokenizerError::UnsupportedModel { .. })
    ));
    assert!(matches!(
        Tokenizer::from_vocab(bpe_vocab("gpt2", &[], &[])),
        Err(TokenizerError::MissingMerges)
    ));
    assert!(matches!(
        Tokenizer::from_vocab(Vocab::default()),
        Err(TokenizerError::EmptyVocab)
    ));
}

#[test]
fn tokenizer_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    let tokenizer = Tokenizer::from_vocab(spm_vocab()).expect("valid");
    assert!(format!("{tokenizer:?}").contains("Spm"));
}

/// Writes what a tracing subscriber formats into a shared buffer.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .map_err(|_| std::io::Error::other("poisoned"))?
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// An unknown BPE pre-tokenizer name is logged by name (it still loads, split as GPT-2);
/// known ones, and SentencePiece files (which ignore it), log nothing.
#[test]
fn unknown_pre_tokenizer_names_are_logged_by_name() {
    let logged = |pre: &str| {
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            Tokenizer::from_vocab(bpe_vocab(pre, WORDS, &["x y"])).expect("valid")
        });
        let bytes = out.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    };
    let text = logged("deepseek-v9");
    assert!(
        text.contains("WARN") && text.contains("'deepseek-v9'"),
        "{text}"
    );
    for known in ["qwen2", "llama-bpe", "default", "gpt2"] {
        assert!(PreTokenizerKind::is_known(known));
        assert_eq!(logged(known), "", "{known}");
    }
}
