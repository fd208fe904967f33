//! A SentencePiece-style vocabulary for synthetic models, so they can be tokenized and run.

use tether_gguf::{GgufWriter, MetaArray, MetaValue};

const SPACE: char = '\u{2581}';
const CONSONANTS: &[u8] = b"bcdfghjklmnprstvwz";
const VOWELS: &[u8] = b"aeiou";

/// Distinct filler pieces: `▁` + 1, 2, 3… consonant-vowel syllables, in order.
fn filler(n: usize) -> Vec<String> {
    let syllables: Vec<String> = CONSONANTS
        .iter()
        .flat_map(|&c| {
            VOWELS
                .iter()
                .map(move |&v| format!("{}{}", c as char, v as char))
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    let mut width = 1u32;
    while out.len() < n {
        let combos = syllables.len().pow(width);
        for mut i in 0..combos {
            if out.len() == n {
                break;
            }
            let mut piece = String::from(SPACE);
            for _ in 0..width {
                piece.push_str(&syllables[i % syllables.len()]);
                i /= syllables.len();
            }
            out.push(piece);
        }
        width += 1;
    }
    out
}

/// Adds `tokenizer.ggml.*` for a `n_vocab`-token SentencePiece vocabulary: `<unk>`, `<s>`,
/// `</s>`, the 256 byte tokens, then filler pieces with decreasing scores.
pub(crate) fn add_tokenizer(w: &mut GgufWriter, n_vocab: usize) {
    let mut tokens = vec!["<unk>".to_string(), "<s>".to_string(), "</s>".to_string()];
    let mut types = vec![2i32, 3, 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    let fixed = tokens.len();
    tokens.extend(filler(n_vocab.saturating_sub(fixed)));
    types.resize(tokens.len(), 1);
    tokens.truncate(n_vocab);
    types.truncate(n_vocab);
    let scores = (0..tokens.len())
        .map(|i| {
            if i < fixed {
                0.0
            } else {
                -((i - fixed) as f32)
            }
        })
        .collect();
    w.add_metadata("tokenizer.ggml.model", MetaValue::String("llama".into()));
    w.add_metadata(
        "tokenizer.ggml.tokens",
        MetaValue::Array(MetaArray::strings(&tokens)),
    );
    w.add_metadata(
        "tokenizer.ggml.scores",
        MetaValue::Array(MetaArray::F32(scores)),
    );
    w.add_metadata(
        "tokenizer.ggml.token_type",
        MetaValue::Array(MetaArray::I32(types)),
    );
    w.add_metadata("tokenizer.ggml.bos_token_id", MetaValue::U32(1));
    w.add_metadata("tokenizer.ggml.eos_token_id", MetaValue::U32(2));
    w.add_metadata("tokenizer.ggml.unknown_token_id", MetaValue::U32(0));
    w.add_metadata("tokenizer.ggml.add_bos_token", MetaValue::Bool(true));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filler_pieces_are_distinct() {
        let pieces = filler(10_000);
        let set: std::collections::HashSet<_> = pieces.iter().collect();
        assert_eq!(set.len(), 10_000);
        assert!(pieces.iter().all(|p| p.starts_with(SPACE)));
    }

    fn tokenizer_with(extra: &[(&str, MetaValue)]) -> Result<crate::tokenizer::Tokenizer, String> {
        let mut w = GgufWriter::new();
        add_tokenizer(&mut w, 300);
        for (k, v) in extra {
            w.add_metadata(*k, v.clone());
        }
        let mut bytes = Vec::new();
        w.write_to(&mut bytes, "vocab").map_err(|e| e.to_string())?;
        let file = tether_gguf::GgufFile::from_bytes("vocab", bytes).map_err(|e| e.to_string())?;
        crate::tokenizer::Tokenizer::from_gguf(&file).map_err(|e| e.to_string())
    }

    #[test]
    fn a_special_id_of_minus_one_means_none_but_other_bad_ids_are_refused() {
        // Converters write -1 (u32::MAX) for "no padding token"; stories260K does.
        let tok = tokenizer_with(&[("tokenizer.ggml.padding_token_id", MetaValue::U32(u32::MAX))])
            .expect("u32::MAX is 'none'");
        assert_eq!(tok.padding(), None);
        let err = tokenizer_with(&[("tokenizer.ggml.padding_token_id", MetaValue::U32(300))])
            .expect_err("300 is outside a 300-token vocabulary");
        assert!(err.contains("padding_token_id"), "{err}");
    }
}
