//! Prefix reuse over the sequence slots. A slot's KV cells outlive its request: the cache
//! remembers which tokens each slot's cells hold. A new request that continues what a free
//! slot holds takes that slot, so only the rest is prefilled. Otherwise the longest prefix
//! of its prompt that any slot holds, free or busy, is given to the slot it takes on every
//! worker (a KV copy, which the workers' paged pools make a share of the blocks; the
//! partly filled last one is copied when either slot writes into it), and the slot that
//! held it keeps its cells. Taking a slot for another prompt overwrites what it held: that
//! is the eviction, least recently used first.
//!
//! A model whose sliding-window layers keep only a ring of cells (see
//! [`tether_model::kv_ring`]) can continue a slot only from a length whose window its ring
//! still holds: each slot remembers the highest position written since its cells were
//! last started afresh, and a prefix too far behind it is not reused (the prompt is
//! prefilled from its start). Copies between slots are not made for such models, since
//! what a running request has overwritten is not tracked.
//!
//! Tokens are hashed in blocks of [`BLOCK`] with a chain hash (each block's hash covers
//! every token before it), so comparing two slots' prefixes is a comparison of hashes, and
//! a paged KV cache can later key its shared blocks by the same hashes.

use tether_model::KvRing;

use crate::load::LoadedStage;
use crate::loss::Loss;
use crate::sequence::Sequence;
use std::hash::{DefaultHasher, Hash, Hasher};

/// Tokens per block: the unit of copies between slots and of the chain hash.
pub(crate) const BLOCK: usize = 32;

/// The chain hash of every full block of `tokens`.
fn chain_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut prev = 0u64;
    tokens
        .chunks_exact(BLOCK)
        .map(|block| {
            // DefaultHasher::new() has fixed keys: the same tokens hash the same in every
            // process, which a cache shared beyond one coordinator would need.
            let mut h = DefaultHasher::new();
            prev.hash(&mut h);
            block.hash(&mut h);
            prev = h.finish();
            prev
        })
        .collect()
}

/// What one slot's cells hold: `tokens[p]` at position `p`.
#[derive(Debug, Default)]
struct Held {
    tokens: Vec<u32>,
    chain: Vec<u64>,
    /// When the slot was last taken or released ([`PrefixCache`]'s clock).
    last_used: u64,
    /// At least the positions written into the slot's cells since they last started from
    /// position 0: a ring keeps at most the last ring's worth before this.
    written: usize,
}

impl Held {
    fn set(&mut self, tokens: &[u32], now: u64) {
        self.tokens.clear();
        self.tokens.extend_from_slice(tokens);
        self.chain = chain_hashes(tokens);
        self.last_used = now;
    }

    /// How many first tokens of `prompt` (whose blocks hash to `chain`) this slot holds.
    fn common(&self, prompt: &[u32], chain: &[u64]) -> usize {
        // Chain hashes match for a leading run of blocks and then never again.
        let shared = chain.iter().zip(&self.chain).take_while(|(a, b)| a == b);
        let blocks = shared.count();
        let mut n = blocks * BLOCK;
        // A hash collision must not make outputs differ: the tokens decide.
        if self.tokens[..n] != prompt[..n] {
            n = 0;
        }
        let end = self.tokens.len().min(prompt.len());
        while n < end && self.tokens[n] == prompt[n] {
            n += 1;
        }
        n
    }
}

/// A slot as the scheduler sees it when a request comes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SlotUse {
    /// No request: its cells hold what the cache remembers for it.
    Free,
    /// Running a request whose first `valid` prompt tokens are in its cells now.
    Busy { valid: usize },
}

/// Where a new request goes and what it starts with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Placement {
    /// The free slot the request takes.
    pub slot: usize,
    /// A slot whose first `cached` cells are to be copied into `slot` first.
    pub copy_from: Option<usize>,
    /// Prompt tokens whose cells are reused: prefill starts at this position.
    pub cached: usize,
    /// Positions `slot`'s cells held before: those past `cached` are now stale.
    pub held_before: usize,
}

/// The tokens each slot's cells hold, for prefix reuse.
#[derive(Debug)]
pub(crate) struct PrefixCache {
    held: Vec<Held>,
    clock: u64,
    /// The ring of the model's sliding-window layers, if they keep one.
    ring: Option<KvRing>,
}

impl PrefixCache {
    /// A cache of `n_slots` slots that hold nothing, for a model whose sliding-window
    /// layers keep `ring` (`None`: every layer keeps the whole context).
    pub fn new(n_slots: usize, ring: Option<KvRing>) -> Self {
        Self {
            held: (0..n_slots).map(|_| Held::default()).collect(),
            clock: 0,
            ring,
        }
    }

    /// Whether a prompt's cells are copied from another slot (never for a model whose
    /// sliding-window layers keep a ring).
    pub fn copies_between_slots(&self) -> bool {
        self.ring.is_none()
    }

    /// Forgets everything (the workers' sessions, and so their cells, are new).
    pub fn clear(&mut self) {
        *self = Self::new(self.held.len(), self.ring);
    }

    /// How many of `common` first tokens of a slot whose cells were written up to
    /// `written` can be reused: all of them, or none when a ring no longer holds the
    /// window their continuation needs.
    fn reusable(&self, common: usize, written: usize) -> usize {
        let Some(ring) = self.ring else {
            return common;
        };
        let oldest = written.saturating_sub(ring.cells as usize);
        let fits = |n: usize| u32::try_from(n).ok();
        match (fits(oldest), fits(common)) {
            (Some(oldest), Some(len)) if ring.serves(oldest, len) => common,
            _ => 0,
        }
    }

    /// Chooses a free slot for `prompt` (not empty) among `slots` (at least one free) and
    /// records that the slot now holds the prompt. The last prompt token is never counted
    /// as cached: running it gives the logits of the first generated token.
    ///
    /// A free slot whose cells the prompt continues is taken as it is. Otherwise the
    /// request takes an empty slot, or else the least recently used free one, and the
    /// longest prefix of the prompt that any other slot holds, free or busy, is shared into
    /// it: a conversation that shares only a system prompt with the new one keeps its cells.
    pub fn place(&mut self, prompt: &[u32], slots: &[SlotUse]) -> Option<Placement> {
        let chain = chain_hashes(prompt);
        let most = prompt.len().saturating_sub(1);
        let common: Vec<usize> = self
            .held
            .iter()
            .map(|held| self.reusable(held.common(prompt, &chain).min(most), held.written))
            .collect();
        let free = |i: usize| slots.get(i) == Some(&SlotUse::Free);
        // The free slot holding the longest part of the prompt, the least recently used
        // among equals.
        let own = (0..self.held.len())
            .filter(|&i| free(i))
            .min_by_key(|&i| (std::cmp::Reverse(common[i]), self.held[i].last_used))?;
        let thrown = self.held[own].tokens.len().saturating_sub(common[own]);
        // Without copies (a ring model) a long reused prefix is worth the rest of a slot.
        let takes_own = thrown < BLOCK || (!self.copies_between_slots() && common[own] >= BLOCK);
        let victim = (0..self.held.len())
            .find(|&i| free(i) && self.held[i].tokens.is_empty())
            .or_else(|| self.least_recently_used(slots))
            .unwrap_or(own);
        let mut placement = if takes_own {
            Placement {
                slot: own,
                copy_from: None,
                cached: common[own],
                held_before: 0,
            }
        } else {
            Placement {
                slot: victim,
                copy_from: None,
                cached: common[victim],
                held_before: 0,
            }
        };
        if self.copies_between_slots() {
            let source = (0..self.held.len())
                .filter(|&i| i != placement.slot)
                .filter_map(|i| match slots.get(i)? {
                    SlotUse::Free => Some((i, common[i])),
                    SlotUse::Busy { valid } => Some((i, common[i].min(*valid))),
                })
                .max_by_key(|&(_, shared)| shared);
            if let Some((from, shared)) = source
                && shared > placement.cached
            {
                // Into the slot chosen above: what it held past its reused part is under a
                // block, or it is the slot to give up.
                placement = Placement {
                    copy_from: Some(from),
                    cached: shared,
                    ..placement
                };
            }
        }
        self.clock += 1;
        let held = &mut self.held[placement.slot];
        let placement = Placement {
            held_before: held.tokens.len(),
            ..placement
        };
        // A prefill from position 0 starts the slot's cells afresh.
        if placement.cached == 0 {
            held.written = 0;
        }
        held.set(prompt, self.clock);
        Some(placement)
    }

    fn least_recently_used(&self, slots: &[SlotUse]) -> Option<usize> {
        (0..self.held.len())
            .filter(|&i| slots.get(i) == Some(&SlotUse::Free))
            .min_by_key(|&i| self.held[i].last_used)
    }

    /// The free slot other than `except` whose cells hold something and were used least
    /// recently: the next to give its cells up when the KV pool needs room.
    pub fn eviction_candidate(&self, slots: &[SlotUse], except: usize) -> Option<usize> {
        (0..self.held.len())
            .filter(|&i| i != except && slots.get(i) == Some(&SlotUse::Free))
            .filter(|&i| !self.held[i].tokens.is_empty())
            .min_by_key(|&i| self.held[i].last_used)
    }

    /// Forgets what `slot`'s cells hold (they are being cleared).
    pub fn forget(&mut self, slot: usize) {
        if let Some(held) = self.held.get_mut(slot) {
            held.tokens.clear();
            held.chain.clear();
            held.written = 0;
        }
    }

    /// Records what `slot`'s cells hold once its request is over: `tokens[p]` at `p`.
    pub fn release(&mut self, slot: usize, tokens: &[u32]) {
        self.clock += 1;
        if let Some(held) = self.held.get_mut(slot) {
            held.set(tokens, self.clock);
            held.written = held.written.max(tokens.len());
        }
    }
}

/// What each slot of `slots` is to [`PrefixCache::place`]. A running request's prompt is
/// in its cells up to what it has fed; after a context shift, only up to the kept tokens
/// (`keep`), since what follows them was dropped.
pub(crate) fn slot_uses(slots: &[Option<Sequence>], keep: Option<usize>) -> Vec<SlotUse> {
    slots
        .iter()
        .map(|s| match s {
            None => SlotUse::Free,
            Some(seq) => {
                let mut valid = seq.fed.min(seq.prompt_len);
                if seq.dropped > 0 {
                    valid = valid.min(keep.unwrap_or(0));
                }
                SlotUse::Busy { valid }
            }
        })
        .collect()
}

/// A change to the slots' cells on every worker, queued until the next step. They are made
/// in the order they were queued: a copy from a slot comes before that slot's eviction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KvMove {
    /// Slot `to` gets slot `from`'s first `cells` (their blocks shared on the workers, the
    /// partly filled last one copied when either slot writes into it).
    Copy { from: u32, to: u32, cells: u32 },
    /// Slot `slot` keeps only its first `keep` cells; the rest of its blocks go back to
    /// the pool.
    Truncate { slot: u32, keep: u32 },
}

/// Makes every queued move on every worker, in order, before the step that needs them.
pub(crate) async fn apply_kv_moves(
    stages: &[LoadedStage],
    moves: &mut Vec<KvMove>,
) -> Result<(), Loss> {
    for m in moves.drain(..) {
        for st in stages {
            let done = match m {
                KvMove::Copy { from, to, cells } => {
                    st.client.kv_copy(st.session, from, to, cells).await
                }
                KvMove::Truncate { slot, keep } => {
                    st.client.kv_truncate(st.session, slot, keep).await
                }
            };
            done.map_err(Loss::Call)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(seed: u32, n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| seed * 1000 + i).collect()
    }

    fn joined(a: &[u32], b: &[u32]) -> Vec<u32> {
        [a, b].concat()
    }

    const FREE: SlotUse = SlotUse::Free;

    #[test]
    fn chain_hashes_cover_every_token_before() {
        let a = tokens(1, 96);
        let mut b = a.clone();
        b[5] = 9;
        let (ha, hb) = (chain_hashes(&a), chain_hashes(&b));
        assert_eq!(ha.len(), 3);
        assert!(
            ha.iter().zip(&hb).all(|(x, y)| x != y),
            "one token changes them all"
        );
        assert_eq!(
            chain_hashes(&a[..70]),
            ha[..2],
            "partial blocks are not hashed"
        );
    }

    #[test]
    fn a_free_slot_with_the_prompt_is_taken_whatever_its_length() {
        let mut cache = PrefixCache::new(3, None);
        let history = tokens(1, 50);
        cache.release(1, &history);
        let next = joined(&history, &tokens(2, 10));
        let p = cache.place(&next, &[FREE; 3]).unwrap();
        assert_eq!(
            p,
            Placement {
                slot: 1,
                copy_from: None,
                cached: 50,
                held_before: 50,
            }
        );
        // The same prompt again: everything but the last token.
        cache.release(1, &next);
        let p = cache.place(&next, &[FREE; 3]).unwrap();
        assert_eq!((p.slot, p.cached), (1, next.len() - 1));
    }

    #[test]
    fn a_few_shared_tokens_do_not_cost_a_conversation() {
        let mut cache = PrefixCache::new(3, None);
        // Every chat prompt starts with the same few template tokens.
        let template = tokens(9, 20);
        let history = joined(&template, &tokens(1, 200));
        cache.release(0, &history);
        let other = joined(&template, &tokens(2, 50));
        let p = cache.place(&other, &[FREE; 3]).unwrap();
        assert_eq!(
            (p.slot, p.copy_from, p.cached),
            (1, Some(0), 20),
            "an empty slot, not the conversation's, with its template tokens shared"
        );
        // The conversation comes back to its cells.
        let next = joined(&history, &tokens(3, 10));
        let p = cache.place(&next, &[FREE; 3]).unwrap();
        assert_eq!((p.slot, p.cached), (0, history.len()));
        // With no empty slot left, the least recently used one gives its cells up, and
        // its few shared tokens are reused.
        cache.release(2, &joined(&template, &tokens(4, 100)));
        let p = cache
            .place(&joined(&template, &tokens(5, 50)), &[FREE; 3])
            .unwrap();
        assert_eq!((p.slot, p.cached), (1, 20));
    }

    #[test]
    fn a_prompt_that_leaves_off_mid_block_reuses_up_to_where_it_differs() {
        let mut cache = PrefixCache::new(2, None);
        cache.release(0, &tokens(1, 80));
        let mut prompt = tokens(1, 80);
        prompt[45] = 7;
        // With an empty slot, the cells before the difference are shared into it and slot
        // 0 keeps its 80 tokens.
        let p = cache.place(&prompt, &[FREE; 2]).unwrap();
        assert_eq!((p.slot, p.copy_from, p.cached), (1, Some(0), 45));
        cache.release(1, &prompt);
        // Without one, the least recently used slot is continued where it differs.
        let mut other = tokens(1, 80);
        other[50] = 7;
        let p = cache.place(&other, &[FREE; 2]).unwrap();
        assert_eq!((p.slot, p.copy_from, p.cached), (0, None, 50));
    }

    #[test]
    fn conversations_that_share_a_system_prompt_keep_their_own_cells() {
        let mut cache = PrefixCache::new(4, None);
        let system = tokens(9, 100);
        let a = joined(&system, &tokens(1, 60));
        let b = joined(&system, &tokens(2, 40));
        cache.place(&a, &[FREE; 4]);
        cache.release(0, &a);
        // b shares a's cells of the system prompt, in a slot of its own.
        let p = cache.place(&b, &[FREE; 4]).unwrap();
        assert_eq!((p.slot, p.copy_from, p.cached), (1, Some(0), 100));
        cache.release(1, &b);
        // Each conversation's next turn finds its whole history where it left it.
        let next_a = joined(&a, &tokens(3, 5));
        let p = cache.place(&next_a, &[FREE; 4]).unwrap();
        assert_eq!((p.slot, p.copy_from, p.cached), (0, None, a.len()));
        let next_b = joined(&b, &tokens(4, 5));
        let p = cache.place(&next_b, &[SlotUse::Busy { valid: 0 }, FREE, FREE, FREE]);
        assert_eq!(p.map(|p| (p.slot, p.cached)), Some((1, b.len())));
        // A third conversation, while both run, shares the busy slots' blocks.
        let busy = [
            SlotUse::Busy { valid: 160 },
            SlotUse::Busy { valid: 0 },
            FREE,
            FREE,
        ];
        let p = cache.place(&joined(&system, &tokens(5, 7)), &busy).unwrap();
        assert_eq!((p.slot, p.copy_from, p.cached), (2, Some(0), 100));
    }

    #[test]
    fn a_longer_prefix_in_a_busy_slot_is_copied_as_far_as_it_has_fed() {
        let mut cache = PrefixCache::new(3, None);
        let system = tokens(1, 70);
        cache.release(2, &tokens(3, 40));
        cache.release(1, &tokens(4, 40));
        cache.place(&joined(&system, &tokens(5, 5)), &[FREE; 3]);
        // Slot 0 (never used) runs the first request; 60 of its prompt tokens are in.
        let busy = [SlotUse::Busy { valid: 60 }, FREE, FREE];
        let p = cache.place(&joined(&system, &tokens(6, 9)), &busy).unwrap();
        assert_eq!(
            p,
            Placement {
                slot: 2,
                copy_from: Some(0),
                cached: 60,
                held_before: 40,
            },
            "the 60 cells fed so far; into the least recently used slot"
        );
        // Nothing in common: nothing to copy.
        let busy = [
            SlotUse::Busy { valid: 31 },
            FREE,
            SlotUse::Busy { valid: 64 },
        ];
        let p = cache.place(&tokens(8, 40), &busy).unwrap();
        assert_eq!((p.slot, p.copy_from, p.cached), (1, None, 0));
    }

    #[test]
    fn eviction_takes_the_least_recently_used_slot() {
        let mut cache = PrefixCache::new(3, None);
        cache.release(0, &tokens(1, 40));
        cache.release(1, &tokens(2, 40));
        cache.release(2, &tokens(3, 40));
        cache.place(&tokens(2, 41), &[FREE; 3]);
        cache.release(1, &tokens(2, 45));
        // Nothing shared: slot 0 is the oldest.
        let p = cache.place(&tokens(9, 10), &[FREE; 3]).unwrap();
        assert_eq!((p.slot, p.cached), (0, 0));
        cache.release(0, &tokens(9, 12));
        let p = cache.place(&tokens(8, 10), &[FREE; 3]).unwrap();
        assert_eq!(p.slot, 2);
        assert_eq!(
            cache.place(&tokens(8, 10), &[SlotUse::Busy { valid: 0 }; 3]),
            None
        );
    }

    /// Window 8, micro-batches of 4: rings of 12 cells.
    const RING: KvRing = KvRing {
        cells: 12,
        chunk: 4,
        window: 8,
    };

    #[test]
    fn a_ring_slot_is_reused_only_where_it_holds_the_next_window() {
        let mut cache = PrefixCache::new(2, Some(RING));
        // Slot 0 wrote 40 positions: its ring holds 28..40 at best.
        cache.place(&tokens(1, 40), &[FREE, FREE]);
        cache.release(0, &tokens(1, 40));
        // Continuing at 40 needs 33..40: reused.
        let longer = joined(&tokens(1, 40), &tokens(2, 5));
        let p = cache
            .place(&longer, &[FREE, SlotUse::Busy { valid: 0 }])
            .unwrap();
        assert_eq!((p.slot, p.cached), (0, 40));
        cache.release(0, &longer);
        // A prompt sharing only 30 tokens would need 23..30, long overwritten: prefilled
        // from the start, and the slot's cells start afresh.
        let diverging = joined(&tokens(1, 30), &tokens(3, 10));
        let p = cache
            .place(&diverging, &[FREE, SlotUse::Busy { valid: 0 }])
            .unwrap();
        assert_eq!((p.slot, p.cached), (0, 0));
        cache.release(0, &diverging[..20]);
        // Short histories are held whole.
        let p = cache
            .place(&tokens(1, 30), &[FREE, SlotUse::Busy { valid: 0 }])
            .unwrap();
        assert_eq!((p.slot, p.cached), (0, 20));
    }

    #[test]
    fn a_ring_model_copies_nothing_from_busy_slots() {
        let mut cache = PrefixCache::new(2, Some(RING));
        cache.place(&tokens(1, 64), &[FREE, FREE]);
        let p = cache
            .place(&tokens(1, 64), &[SlotUse::Busy { valid: 64 }, FREE])
            .unwrap();
        assert_eq!((p.slot, p.copy_from, p.cached), (1, None, 0));
    }

    #[test]
    fn clear_forgets_every_slot() {
        let mut cache = PrefixCache::new(1, None);
        cache.release(0, &tokens(1, 40));
        cache.clear();
        let p = cache.place(&tokens(1, 40), &[FREE]).unwrap();
        assert_eq!(p.cached, 0);
    }
}
