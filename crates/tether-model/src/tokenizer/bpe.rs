//! Byte-level BPE as GPT-2 defined it and llama.cpp runs it: each pre-tokenized word becomes
//! one printable character per byte, then the adjacent pair with the best (lowest) merge rank
//! is merged until no listed merge applies.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use super::TokenizerError;

const NONE: usize = usize::MAX;

/// GPT-2's reversible map from bytes to printable characters: printable Latin-1 bytes stand
/// for themselves, the rest are shifted to U+0100 onwards so no token holds a control char.
pub(super) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut shifted = 0u32;
    for byte in 0..=255u8 {
        let printable = matches!(byte, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            u32::from(byte)
        } else {
            shifted += 1;
            255 + shifted
        };
        // Every code here is below U+0200, so it is always a valid char.
        table[usize::from(byte)] = char::from_u32(code).unwrap_or('\u{FFFD}');
    }
    table
}

/// The inverse of [`byte_to_char_table`].
pub(super) fn char_to_byte_map(table: &[char; 256]) -> HashMap<char, u8> {
    (0..=255u8).map(|b| (table[usize::from(b)], b)).collect()
}

/// Merge priorities: each distinct merge operand gets a small id so a pair lookup needs no
/// string allocation.
pub(super) struct MergeRanks {
    operand_ids: HashMap<String, u32>,
    ranks: HashMap<(u32, u32), u32>,
}

impl MergeRanks {
    /// Parses `"left right"` merges; earlier lines have higher priority, and a repeated pair
    /// keeps its first rank.
    pub fn parse(merges: &[String]) -> Result<MergeRanks, TokenizerError> {
        let mut operand_ids = HashMap::new();
        let mut ranks = HashMap::with_capacity(merges.len());
        for (rank, merge) in merges.iter().enumerate() {
            // Split at the first space after the first character, so a merge whose left side is a
            // space (possible in some vocabularies) still parses.
            let first_len = merge.chars().next().map_or(0, char::len_utf8);
            let split = merge[first_len..]
                .find(' ')
                .map(|pos| pos + first_len)
                .ok_or_else(|| TokenizerError::BadMerge {
                    index: rank,
                    merge: merge.clone(),
                })?;
            let (left, right) = (&merge[..split], &merge[split + 1..]);
            let mut id_of = |s: &str| {
                let next = operand_ids.len() as u32;
                *operand_ids.entry(s.to_string()).or_insert(next)
            };
            let pair = (id_of(left), id_of(right));
            ranks.entry(pair).or_insert(rank as u32);
        }
        Ok(MergeRanks { operand_ids, ranks })
    }

    fn rank(&self, left: &str, right: &str) -> Option<u32> {
        let l = *self.operand_ids.get(left)?;
        let r = *self.operand_ids.get(right)?;
        self.ranks.get(&(l, r)).copied()
    }
}

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    end: usize,
    prev: usize,
    next: usize,
}

struct Candidate {
    rank: u32,
    left: usize,
    right: usize,
    size: usize,
}

impl Ord for Candidate {
    // BinaryHeap pops the greatest: lowest rank first, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .rank
            .cmp(&self.rank)
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

/// What the BPE encoder needs to know about the vocabulary.
pub(super) struct BpeVocab<'a> {
    /// Token text (byte-level encoded) to id.
    pub token_to_id: &'a HashMap<String, u32>,
    /// Merge priorities.
    pub ranks: &'a MergeRanks,
    /// Byte to GPT-2 printable character.
    pub byte_chars: &'a [char; 256],
    /// Emit a word that is itself a token without merging (Llama-3 does).
    pub ignore_merges: bool,
    /// Emitted for a character with no token (only in incomplete vocabularies).
    pub unknown: Option<u32>,
}

/// Appends the tokens of one pre-tokenized `word` to `out`; `scratch` is reused between words.
pub(super) fn encode_word(
    vocab: &BpeVocab<'_>,
    word: &str,
    scratch: &mut String,
    out: &mut Vec<u32>,
) {
    scratch.clear();
    scratch.extend(word.bytes().map(|b| vocab.byte_chars[usize::from(b)]));
    let text = scratch.as_str();
    if vocab.ignore_merges
        && let Some(&id) = vocab.token_to_id.get(text)
    {
        out.push(id);
        return;
    }

    let mut symbols: Vec<Symbol> = Vec::with_capacity(word.len());
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

    let mut queue = BinaryHeap::new();
    for right in 1..symbols.len() {
        push_candidate(vocab, text, &symbols, right - 1, right, &mut queue);
    }
    while let Some(candidate) = queue.pop() {
        let (left, right) = (symbols[candidate.left], symbols[candidate.right]);
        let left_len = left.end - left.start;
        let right_len = right.end - right.start;
        if left_len == 0
            || right_len == 0
            || left.next != candidate.right
            || left_len + right_len != candidate.size
        {
            continue;
        }
        symbols[candidate.left].end = right.end;
        symbols[candidate.left].next = right.next;
        symbols[candidate.right].end = right.start;
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

    let mut index = if symbols.is_empty() { NONE } else { 0 };
    while index != NONE {
        let symbol = symbols[index];
        let piece = &text[symbol.start..symbol.end];
        if let Some(&id) = vocab.token_to_id.get(piece) {
            out.push(id);
        } else {
            // A merge produced text the vocabulary lacks: emit its characters one by one.
            let mut buf = [0u8; 4];
            for ch in piece.chars() {
                let single: &str = ch.encode_utf8(&mut buf);
                if let Some(id) = vocab.token_to_id.get(single).copied().or(vocab.unknown) {
                    out.push(id);
                }
            }
        }
        index = symbol.next;
    }
}

fn push_candidate(
    vocab: &BpeVocab<'_>,
    text: &str,
    symbols: &[Symbol],
    left: usize,
    right: usize,
    queue: &mut BinaryHeap<Candidate>,
) {
    let (l, r) = (symbols[left], symbols[right]);
    if let Some(rank) = vocab
        .ranks
        .rank(&text[l.start..l.end], &text[r.start..r.end])
    {
        queue.push(Candidate {
            rank,
            left,
            right,
            size: r.end - l.start,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_a_bijection_with_gpt2_landmarks() {
        let table = byte_to_char_table();
        assert_eq!(char_to_byte_map(&table).len(), 256);
        assert_eq!(table[usize::from(b' ')], '\u{120}'); // "Ġ"
        assert_eq!(table[usize::from(b'\n')], '\u{10A}'); // "Ċ"
        assert_eq!(table[usize::from(b'A')], 'A');
        assert_eq!(table[0xAD], '\u{143}');
    }

    fn encode(tokens: &[&str], merges: &[&str], word: &str, ignore_merges: bool) -> Vec<u32> {
        let map: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let merges: Vec<String> = merges.iter().map(|m| m.to_string()).collect();
        let ranks = MergeRanks::parse(&merges).expect("test merges are well formed");
        let table = byte_to_char_table();
        let vocab = BpeVocab {
            token_to_id: &map,
            ranks: &ranks,
            byte_chars: &table,
            ignore_merges,
            unknown: None,
        };
        let mut out = Vec::new();
        encode_word(&vocab, word, &mut String::new(), &mut out);
        out
    }

    #[test]
    fn merges_apply_in_rank_order_not_left_to_right() {
        // "b c" outranks "a b", so "abc" becomes a + bc.
        let tokens = ["a", "b", "c", "ab", "bc"];
        assert_eq!(encode(&tokens, &["b c", "a b"], "abc", false), vec![0, 4]);
        assert_eq!(encode(&tokens, &["a b", "b c"], "abc", false), vec![3, 2]);
    }

    #[test]
    fn space_is_byte_encoded_before_merging() {
        let tokens = ["Ġ", "h", "i", "Ġh", "Ġhi"];
        assert_eq!(encode(&tokens, &["Ġ h", "Ġh i"], " hi", false), vec![4]);
    }

    #[test]
    fn ignore_merges_takes_whole_word_tokens() {
        // No merge path leads to "abc", but the word itself is a token.
        let tokens = ["a", "b", "c", "abc"];
        assert_eq!(encode(&tokens, &[], "abc", true), vec![3]);
        assert_eq!(encode(&tokens, &[], "abc", false), vec![0, 1, 2]);
    }

    #[test]
    fn malformed_merge_is_an_error() {
        let err = MergeRanks::parse(&["nospace".to_string()]);
        assert!(matches!(
            err,
            Err(TokenizerError::BadMerge { index: 0, .. })
        ));
    }
}
