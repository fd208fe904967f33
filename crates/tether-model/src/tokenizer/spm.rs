//! SentencePiece-style encoding as llama.cpp does it: start from UTF-8 characters and keep
//! merging the adjacent pair whose concatenation is the vocabulary entry with the highest
//! score; whatever is left that is not a token falls back to `<0xXX>` byte tokens.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// The SentencePiece word-boundary marker that stands for a space.
pub(super) const SPACE_MARKER: &str = "\u{2581}";

const NONE: usize = usize::MAX;

/// A run of the text, `text[start..end]`, linked to its neighbours in the current segmentation.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    end: usize,
    prev: usize,
    next: usize,
}

/// A candidate merge of two adjacent symbols; `size` detects candidates made stale by merges.
struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl Ord for Candidate {
    // Highest score first; on ties the leftmost pair, which keeps results deterministic and
    // equal to llama.cpp's.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

/// What the SentencePiece encoder needs to know about the vocabulary.
pub(super) struct SpmVocab<'a> {
    /// Token text to id.
    pub token_to_id: &'a HashMap<String, u32>,
    /// Score of each token id.
    pub scores: &'a [f32],
    /// The token for each byte value, for byte fallback.
    pub byte_tokens: &'a [Option<u32>; 256],
    /// Emitted for a byte that has no token at all (vocabularies without byte fallback).
    pub unknown: Option<u32>,
}

/// Appends the tokens of `text` (spaces already escaped as U+2581) to `out`.
pub(super) fn encode(vocab: &SpmVocab<'_>, text: &str, out: &mut Vec<u32>) {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (start, ch) in text.char_indices() {
        let index = symbols.len();
        symbols.push(Symbol {
            start,
            end: start + ch.len_utf8(),
            prev: if index == 0 { NONE } else { index - 1 },
            next: NONE,
        });
        if index > 0 {
            symbols[index - 1].next = index;
        }
    }
    if symbols.is_empty() {
        return;
    }

    let mut queue = BinaryHeap::new();
    for right in 1..symbols.len() {
        push_candidate(vocab, text, &symbols, right - 1, right, &mut queue);
    }
    while let Some(candidate) = queue.pop() {
        let (left, right) = (symbols[candidate.left], symbols[candidate.right]);
        let left_len = left.end - left.start;
        let right_len = right.end - right.start;
        if left_len == 0 || right_len == 0 || left_len + right_len != candidate.size {
            continue;
        }
        symbols[candidate.left].end = right.end;
        symbols[candidate.left].next = right.next;
        symbols[candidate.right].end = right.start; // now empty: marks it merged away
        if right.next != NONE {
            symbols[right.next].prev = candidate.left;
        }
        let merged = symbols[candidate.left];
        if merged.prev != NONE {
            push_candidate(
                vocab,
                text,
                &symbols,
                merged.prev,
                candidate.left,
                &mut queue,
            );
        }
        if merged.next != NONE {
            push_candidate(
                vocab,
                text,
                &symbols,
                candidate.left,
                merged.next,
                &mut queue,
            );
        }
    }

    let mut index = 0;
    while index != NONE {
        let symbol = symbols[index];
        let piece = &text[symbol.start..symbol.end];
        match vocab.token_to_id.get(piece) {
            Some(&id) => out.push(id),
            None => {
                for &byte in piece.as_bytes() {
                    if let Some(id) = vocab.byte_tokens[usize::from(byte)].or(vocab.unknown) {
                        out.push(id);
                    }
                }
            }
        }
        index = symbol.next;
    }
}

fn push_candidate(
    vocab: &SpmVocab<'_>,
    text: &str,
    symbols: &[Symbol],
    left: usize,
    right: usize,
    queue: &mut BinaryHeap<Candidate>,
) {
    let merged = &text[symbols[left].start..symbols[right].end];
    if let Some(&id) = vocab.token_to_id.get(merged) {
        let score = vocab.scores.get(id as usize).copied().unwrap_or(0.0);
        queue.push(Candidate {
            score,
            left,
            right,
            size: merged.len(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab_of(entries: &[(&str, f32)]) -> (HashMap<String, u32>, Vec<f32>) {
        let map = entries
            .iter()
            .enumerate()
            .map(|(i, (t, _))| (t.to_string(), i as u32))
            .collect();
        (map, entries.iter().map(|(_, s)| *s).collect())
    }

    fn run(entries: &[(&str, f32)], bytes: &[(u8, u32)], text: &str) -> Vec<u32> {
        let (map, scores) = vocab_of(entries);
        let mut byte_tokens = [None; 256];
        for &(b, id) in bytes {
            byte_tokens[usize::from(b)] = Some(id);
        }
        let vocab = SpmVocab {
            token_to_id: &map,
            scores: &scores,
            byte_tokens: &byte_tokens,
            unknown: None,
        };
        let mut out = Vec::new();
        encode(&vocab, text, &mut out);
        out
    }

    #[test]
    fn higher_score_merge_wins_over_leftmost() {
        // "ab" and "bc" both possible; "bc" scores higher, so "a" stays alone.
        let entries = [
            ("a", -1.0),
            ("b", -1.0),
            ("c", -1.0),
            ("ab", -5.0),
            ("bc", -2.0),
        ];
        assert_eq!(run(&entries, &[], "abc"), vec![0, 4]);
    }

    #[test]
    fn equal_scores_merge_leftmost_first() {
        let entries = [("a", -1.0), ("aa", -2.0)];
        assert_eq!(run(&entries, &[], "aaa"), vec![1, 0]);
    }

    #[test]
    fn merges_chain_into_longer_tokens() {
        let entries = [
            ("h", -9.0),
            ("e", -9.0),
            ("l", -9.0),
            ("he", -3.0),
            ("hel", -1.0),
        ];
        assert_eq!(run(&entries, &[], "hel"), vec![4]);
    }

    #[test]
    fn unknown_characters_fall_back_to_bytes() {
        let entries = [("a", -1.0), ("<0xC3>", 0.0), ("<0xA9>", 0.0)];
        assert_eq!(run(&entries, &[(0xC3, 1), (0xA9, 2)], "aé"), vec![0, 1, 2]);
    }
}
