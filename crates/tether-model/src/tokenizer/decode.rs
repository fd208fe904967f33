//! Token ids back to text.

use super::spm::SPACE_MARKER;
use super::{Engine, TokenType, Tokenizer};

/// What llama.cpp shows for SentencePiece's unknown token: U+2585 "▅".
const UNKNOWN_PIECE: &str = "\u{2585}";

impl Tokenizer {
    /// The raw bytes token `id` stands for, for streaming output: a piece may be part of a
    /// UTF-8 character, so buffer until the bytes form valid text. Control and unused tokens
    /// (BOS, EOS, `<|im_end|>`, ...) and unknown ids give no bytes; use
    /// [`Tokenizer::token_text`] to show them. The SentencePiece word-start space is kept; see
    /// [`Tokenizer::decode`] for where it is dropped.
    pub fn token_to_piece(&self, id: u32) -> Vec<u8> {
        let (Some(text), Some(ty)) = (self.tokens.get(id as usize), self.types.get(id as usize))
        else {
            return Vec::new();
        };
        match (&self.engine, ty) {
            (_, TokenType::Control | TokenType::Unused) => Vec::new(),
            (Engine::Spm { .. }, TokenType::Byte) => match parse_byte_token(text) {
                Some(byte) => vec![byte],
                None => text.replace(SPACE_MARKER, " ").into_bytes(),
            },
            (Engine::Spm { .. }, TokenType::Unknown) => UNKNOWN_PIECE.as_bytes().to_vec(),
            (Engine::Spm { .. }, _) => text.replace(SPACE_MARKER, " ").into_bytes(),
            (Engine::Bpe { .. }, TokenType::UserDefined) => text.as_bytes().to_vec(),
            (Engine::Bpe { char_bytes, .. }, _) => {
                let mut bytes = Vec::with_capacity(text.len());
                for ch in text.chars() {
                    match char_bytes.get(&ch) {
                        Some(&byte) => bytes.push(byte),
                        // Not a byte-level character: the token holds literal text.
                        None => bytes.extend_from_slice(ch.encode_utf8(&mut [0; 4]).as_bytes()),
                    }
                }
                bytes
            }
        }
    }

    /// The text of `ids` (invalid UTF-8 replaced by U+FFFD). For SentencePiece vocabularies
    /// that add a space prefix when encoding, the first space of the first token that has
    /// text is dropped (whether or not BOS precedes it), so `decode(encode(x, ..)) == x`.
    /// Control tokens produce no text.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        let mut strip_space = self.add_space_prefix;
        for &id in ids {
            let piece = self.token_to_piece(id);
            if piece.is_empty() {
                continue;
            }
            let piece = match piece.split_first() {
                Some((b' ', rest)) if strip_space => rest,
                _ => &piece[..],
            };
            strip_space = false;
            bytes.extend_from_slice(piece);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// The byte of a `<0xXX>` token.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokens_parse_strictly() {
        assert_eq!(parse_byte_token("<0x0A>"), Some(10));
        assert_eq!(parse_byte_token("<0xff>"), Some(255));
        assert_eq!(parse_byte_token("<0x100>"), None);
        assert_eq!(parse_byte_token("0x0A"), None);
    }
}
