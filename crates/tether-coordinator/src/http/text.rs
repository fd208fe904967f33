//! Generated token ids to text, as it streams: bytes of a UTF-8 character split over tokens
//! wait for the rest, and text that may begin a stop string waits until it is known not to.

use std::sync::Arc;

use tether_model::tokenizer::Tokenizer;

/// Turns byte pieces into text, holding back an incomplete UTF-8 character at the end.
#[derive(Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Adds `bytes`; returns the text that is complete now. Invalid sequences become U+FFFD.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(text) => {
                    out.push_str(text);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // `valid_up_to` bytes are UTF-8 by the error's contract.
                    out.push_str(&String::from_utf8_lossy(valid));
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[bad..];
                        }
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }

    /// Whatever is left, with an incomplete character replaced by U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

/// Finds stop strings in streamed text.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    /// Adds `text`; returns the text safe to show and whether a stop string was found (the
    /// text then ends right before it, and the matcher should not be fed again).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        let first_match = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first_match {
            let out = self.held[..at].to_owned();
            self.held.clear();
            return (out, true);
        }
        let keep_from = self.partial_match_start();
        let out = self.held[..keep_from].to_owned();
        self.held.drain(..keep_from);
        (out, false)
    }

    /// Where the longest tail of the held text that begins some stop string starts.
    fn partial_match_start(&self) -> usize {
        self.held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len())
    }

    /// The held text, once the stream has ended without a match.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// What one generated token added.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct TextStep {
    /// Text to send now (may be empty).
    pub text: String,
    /// A stop string was matched: generation should end.
    pub stopped: bool,
}

/// Token ids to visible text: detokenization, UTF-8 reassembly and stop strings.
pub struct TextAssembler {
    tokenizer: Arc<Tokenizer>,
    utf8: Utf8Stream,
    stops: StopMatcher,
    /// Tokens whose text is passed on without looking for stop strings (`min_tokens`).
    unchecked_tokens: usize,
    /// Control tokens shown as their text, which they otherwise do not decode to.
    shown: Vec<u32>,
}

impl TextAssembler {
    /// An assembler for a response of `tokenizer`'s model that ends at any of `stops`.
    pub fn new(tokenizer: Arc<Tokenizer>, stops: Vec<String>) -> Self {
        Self {
            tokenizer,
            utf8: Utf8Stream::default(),
            stops: StopMatcher::new(stops),
            unchecked_tokens: 0,
            shown: Vec::new(),
        }
    }

    /// Looks for stop strings only in the text of tokens after the first `n` (vLLM's
    /// `min_tokens`): a stop string must end after them to count.
    pub fn stops_after(mut self, n: usize) -> Self {
        self.unchecked_tokens = n;
        self
    }

    /// Shows the control tokens `ids` as their text: tool-call markers that the reply's
    /// parser looks for.
    pub fn showing(mut self, ids: Vec<u32>) -> Self {
        self.shown = ids;
        self
    }

    /// Adds one generated token.
    pub fn push_token(&mut self, id: u32) -> TextStep {
        let piece = if self.shown.contains(&id) {
            self.tokenizer
                .token_text(id)
                .unwrap_or_default()
                .as_bytes()
                .to_vec()
        } else {
            self.tokenizer.token_to_piece(id)
        };
        let text = self.utf8.push(&piece);
        if self.unchecked_tokens > 0 {
            self.unchecked_tokens -= 1;
            return TextStep {
                text,
                stopped: false,
            };
        }
        if text.is_empty() {
            return TextStep::default();
        }
        let (text, stopped) = self.stops.push(&text);
        TextStep { text, stopped }
    }

    /// The text still held when generation ended without a stop string (which may still
    /// match across the flushed bytes).
    pub fn finish(&mut self) -> TextStep {
        let tail = self.utf8.finish();
        let (mut text, stopped) = self.stops.push(&tail);
        if !stopped {
            text.push_str(&self.stops.finish());
        }
        TextStep { text, stopped }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_split_over_pieces_is_held_back() {
        let snowman = "☃".as_bytes();
        let mut s = Utf8Stream::default();
        assert_eq!(s.push(b"a"), "a");
        assert_eq!(s.push(&snowman[..1]), "");
        assert_eq!(s.push(&snowman[1..2]), "");
        assert_eq!(s.push(&[snowman[2], b'b']), "☃b");
        assert_eq!(s.finish(), "");
    }

    #[test]
    fn invalid_utf8_becomes_replacement_and_does_not_stall() {
        let mut s = Utf8Stream::default();
        assert_eq!(s.push(&[0xff, b'x']), "\u{fffd}x");
        assert_eq!(s.push(&[0xe2, 0x98]), "");
        assert_eq!(s.finish(), "\u{fffd}");
    }

    #[test]
    fn stop_string_across_pushes_is_cut() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("hello E"), ("hello ".into(), false));
        assert_eq!(m.push("N"), (String::new(), false));
        assert_eq!(m.push("Dtrailing"), (String::new(), true));
    }

    #[test]
    fn held_text_is_released_when_it_stops_matching() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("xE"), ("x".into(), false));
        assert_eq!(m.push("Nx"), ("ENx".into(), false));
        assert_eq!(m.push("E"), (String::new(), false));
        assert_eq!(m.finish(), "E");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let mut m = StopMatcher::new(vec!["cd".into(), "b".into(), String::new()]);
        assert_eq!(m.push("abcd"), ("a".into(), true));
    }

    #[test]
    fn multibyte_text_near_a_stop_keeps_char_boundaries() {
        let mut m = StopMatcher::new(vec!["éx".into()]);
        assert_eq!(m.push("aé"), ("a".into(), false));
        assert_eq!(m.push("y"), ("éy".into(), false));
    }
}
