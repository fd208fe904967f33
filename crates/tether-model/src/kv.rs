//! Bookkeeping of the KV cache: how many positions each sequence holds, and where a
//! token's keys and values live.
//!
//! A global layer's cache is a paged pool ([`KvBlocks`]): the token at position `p` of
//! sequence `s` lives in a cell of the block its table holds for `p`, and attends to the
//! virtual cells `[s·ctx', s·ctx' + p]` (`ctx'`: the context in whole blocks) that the
//! table maps to cells.
//! A sliding-window layer whose window (plus a micro-batch) is shorter than the context
//! keeps a ring instead: sequence `s` owns `ring` cells from `s·ring`, position `p` lives in
//! cell `s·ring + p mod ring`, and the ring holds the positions `[oldest, len)` of the
//! sequence, at most `ring` of them. A sequence's first positions can be given to another
//! (prefix reuse): global layers share the blocks, rings are copied. The positions, and so
//! the rotary encoding of the keys, stay the same.

use tether_compute::{AttnSpan, KV_BLOCK_CELLS};

use crate::error::ModelError;
use crate::kv_blocks::{BlockCopy, KvBlocks};

/// One token of a batch: which sequence it belongs to and its position there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchToken {
    /// The sequence (`< n_seq`).
    pub seq: u32,
    /// Its position in the sequence (`< ctx_per_seq`).
    pub pos: u32,
}

/// The ring the sliding-window layers of a model keep (see [`crate::plan::kv_ring`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvRing {
    /// Cells per sequence (`window + chunk`, less than the context).
    pub cells: u32,
    /// Tokens of a micro-batch, whose keys are all written before any of them attends.
    pub chunk: u32,
    /// Positions a token sees, itself included.
    pub window: u32,
}

impl KvRing {
    /// Whether a ring that may hold positions from `oldest` on still holds the window of a
    /// token at position `len`, so a sequence can continue from its first `len` positions.
    pub fn serves(&self, oldest: u32, len: u32) -> bool {
        len == 0 || len.saturating_sub(self.window - 1) >= oldest
    }
}

/// Lengths of every sequence's cached prefix, and for ring layers the oldest position
/// their ring still holds.
#[derive(Clone, Debug)]
pub(crate) struct KvState {
    ctx_per_seq: u32,
    lens: Vec<u32>,
    ring: Option<KvRing>,
    oldest: Vec<u32>,
    blocks: KvBlocks,
}

/// What a checked batch leaves behind, applied by [`KvState::commit`] once it has run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct KvUpdate {
    lens: Vec<u32>,
    oldest: Vec<u32>,
}

impl KvState {
    /// The bookkeeping of `n_seq` sequences of `ctx_per_seq` positions; `ring`: the ring of
    /// the stage's sliding-window layers, when they keep one.
    /// `pool_seqs` (at most `n_seq`) sequences' whole contexts make the paged pool of the
    /// global layers, which all `n_seq` sequences share.
    pub(crate) fn new(
        n_seq: usize,
        ctx_per_seq: usize,
        ring: Option<KvRing>,
        pool_seqs: usize,
    ) -> Result<Self, ModelError> {
        let too_many = || {
            ModelError::InvalidArgument(format!(
                "{n_seq} sequences of {ctx_per_seq} cells do not fit 32-bit cell indices"
            ))
        };
        let ctx_per_seq = u32::try_from(ctx_per_seq).map_err(|_| too_many())?;
        let per_seq = ctx_per_seq.div_ceil(KV_BLOCK_CELLS);
        // Spans are virtual cells: every sequence's table entries, in whole blocks.
        u32::try_from(n_seq)
            .ok()
            .and_then(|n| n.checked_mul(per_seq)?.checked_mul(KV_BLOCK_CELLS))
            .ok_or_else(too_many)?;
        // Ring spans are virtual cells, two rings per sequence (`AttnShape::ring_cells`).
        if let Some(r) = ring {
            let virtual_cells = u64::from(r.cells) * 2 * n_seq as u64;
            if virtual_cells > u64::from(u32::MAX) || r.cells == 0 || r.window > r.cells {
                return Err(too_many());
            }
        }
        Ok(Self {
            ctx_per_seq,
            lens: vec![0; n_seq],
            ring,
            oldest: vec![0; n_seq],
            blocks: KvBlocks::new(
                n_seq as u32,
                per_seq,
                (pool_seqs.min(n_seq) as u32) * per_seq,
            ),
        })
    }

    /// The paged pool of the global layers.
    pub(crate) fn blocks(&self) -> &KvBlocks {
        &self.blocks
    }

    /// The block-table entries changed since the last call (see [`KvBlocks::take_dirty`]).
    pub(crate) fn take_dirty_blocks(&mut self) -> Option<std::ops::Range<usize>> {
        self.blocks.take_dirty()
    }

    fn check_seq(&self, seq: u32) -> Result<usize, ModelError> {
        let i = seq as usize;
        if i >= self.lens.len() {
            return Err(ModelError::InvalidArgument(format!(
                "unknown sequence {seq}: this stage has {} sequences",
                self.lens.len()
            )));
        }
        Ok(i)
    }

    /// Cached positions of `seq`.
    pub(crate) fn len(&self, seq: u32) -> Result<u32, ModelError> {
        Ok(self.lens[self.check_seq(seq)?])
    }

    /// The ring of the stage's sliding-window layers, if they keep one.
    pub(crate) fn ring(&self) -> Option<KvRing> {
        self.ring
    }

    /// Checks a whole batch without changing anything: known sequences, positions inside the
    /// context, and each token's position at most the length its sequence has when it comes
    /// (so no gap in the cache). With a ring, the batch runs in chunks of `ring.chunk` tokens
    /// (attention reads a chunk's cells once the whole chunk is written): a sequence's tokens
    /// in a chunk must be consecutive, and every token's window must still be in the ring
    /// after its chunk is written (which holds for chunks that follow the cached positions).
    pub(crate) fn check_batch(&self, batch: &[BatchToken]) -> Result<KvUpdate, ModelError> {
        let mut lens = self.lens.clone();
        let mut oldest = self.oldest.clone();
        let chunk = self.ring.map_or(batch.len(), |r| r.chunk as usize).max(1);
        for (c, tokens) in batch.chunks(chunk).enumerate() {
            // Per sequence: the chunk's first position and the one after its last.
            let mut written: Vec<Option<(u32, u32)>> = vec![None; lens.len()];
            for (j, t) in tokens.iter().enumerate() {
                let i = c * chunk + j;
                let s = self.check_seq(t.seq)?;
                if t.pos >= self.ctx_per_seq {
                    return Err(ModelError::InvalidArgument(format!(
                        "token {i}: position {} of sequence {} is outside its context of {} cells",
                        t.pos, t.seq, self.ctx_per_seq
                    )));
                }
                if t.pos > lens[s] {
                    return Err(ModelError::InvalidArgument(format!(
                        "token {i}: position {} of sequence {} leaves a gap: the cache holds {} positions",
                        t.pos, t.seq, lens[s]
                    )));
                }
                written[s] = match written[s] {
                    None => Some((t.pos, t.pos + 1)),
                    Some((first, end)) if t.pos == end => Some((first, end + 1)),
                    Some(_) if self.ring.is_none() => Some((0, 0)),
                    Some(_) => {
                        return Err(ModelError::InvalidArgument(format!(
                            "token {i}: position {} of sequence {} does not follow the previous \
                             token of that sequence in its micro-batch, which a model with \
                             sliding-window rings needs",
                            t.pos, t.seq
                        )));
                    }
                };
                // Writing position p makes everything after it stale.
                lens[s] = t.pos + 1;
            }
            let Some(ring) = self.ring else { continue };
            for (s, w) in written.iter().enumerate() {
                let Some((first, end)) = *w else { continue };
                // Rewriting from `first` drops whatever the ring held from there on; writing
                // up to `end` overwrites the positions one ring before.
                let kept_from = oldest[s].min(first);
                oldest[s] = kept_from.max(end.saturating_sub(ring.cells));
                let needs = first.saturating_sub(ring.window - 1);
                if needs < oldest[s] {
                    return Err(ModelError::InvalidArgument(format!(
                        "sequence {s}: position {first} needs positions from {needs} on, but \
                         the sliding-window ring of {} cells holds them only from {} on; \
                         prefill the sequence again from its start",
                        ring.cells, oldest[s]
                    )));
                }
            }
        }
        Ok(KvUpdate { lens, oldest })
    }

    /// Takes the update returned by [`Self::check_batch`] once the batch has run.
    pub(crate) fn commit(&mut self, update: KvUpdate) {
        self.lens = update.lens;
        self.oldest = update.oldest;
        for (s, &len) in self.lens.iter().enumerate() {
            self.blocks.keep(s as u32, len);
        }
    }

    /// Gives every token of `batch` (checked by [`Self::check_batch`]) a block its sequence
    /// alone holds, and returns the shared blocks to copy into theirs before the batch
    /// writes (copy on write). What the tables hold is consistent whether or not the batch
    /// then runs: a copied block holds what the shared one did.
    pub(crate) fn claim_blocks(
        &mut self,
        batch: &[BatchToken],
    ) -> Result<Vec<BlockCopy>, ModelError> {
        let mut copies = Vec::new();
        for t in batch {
            if let Some(c) = self.blocks.writable(t.seq, t.pos / KV_BLOCK_CELLS)? {
                copies.push(c);
            }
        }
        Ok(copies)
    }

    /// The cell of `t` and the virtual cells it attends to in a global layer (`t` must have
    /// passed `check_batch`, and its block [`Self::claim_blocks`]).
    pub(crate) fn place(&self, t: BatchToken) -> (u32, AttnSpan) {
        (
            self.blocks.cell(t.seq, t.pos),
            AttnSpan {
                first_cell: self.blocks.first_virtual_cell(t.seq),
                n_cells: t.pos + 1,
            },
        )
    }

    /// The cell of `t` in a ring of `ring` and the virtual cells of its window (see
    /// `AttnShape::ring_cells`): the positions `p - window + 1 ..= p` that exist.
    pub(crate) fn place_in_ring(t: BatchToken, ring: KvRing) -> (u32, AttnSpan) {
        let start = t.pos.saturating_sub(ring.window - 1);
        (
            t.seq * ring.cells + t.pos % ring.cells,
            AttnSpan {
                first_cell: t.seq * 2 * ring.cells + start % ring.cells,
                n_cells: t.pos - start + 1,
            },
        )
    }

    /// Forgets everything `seq` holds.
    pub(crate) fn clear(&mut self, seq: u32) -> Result<(), ModelError> {
        let s = self.check_seq(seq)?;
        self.lens[s] = 0;
        self.oldest[s] = 0;
        self.blocks.keep(seq, 0);
        Ok(())
    }

    /// Keeps the first `len` positions of `seq`; a `len` at or past its length changes
    /// nothing. Returns the length kept: 0 (the sequence is cleared) when the ring no longer
    /// holds the window the next position needs, so the caller prefills it again.
    pub(crate) fn truncate(&mut self, seq: u32, len: u32) -> Result<u32, ModelError> {
        let s = self.check_seq(seq)?;
        if len > self.ctx_per_seq {
            return Err(ModelError::InvalidArgument(format!(
                "cannot truncate sequence {seq} to {len} positions: its context is {} cells",
                self.ctx_per_seq
            )));
        }
        let len = self.lens[s].min(len);
        let len = if self.ring.is_some() && !self.ring_serves(s, len) {
            self.oldest[s] = 0;
            0
        } else {
            len
        };
        self.lens[s] = len;
        self.blocks.keep(seq, len);
        Ok(len)
    }

    /// Whether the ring of sequence `s` holds the window of a token at position `len`.
    fn ring_serves(&self, s: usize, len: u32) -> bool {
        self.ring
            .is_none_or(|ring| ring.serves(self.oldest[s], len))
    }

    /// The longest prefix of `seq` (at most `len`) whose continuation the cache can serve:
    /// `len` itself without a ring, else `len` if the ring still holds the window of
    /// position `len`, or 0.
    pub(crate) fn reusable(&self, seq: u32, len: u32) -> Result<u32, ModelError> {
        let s = self.check_seq(seq)?;
        let len = len.min(self.lens[s]);
        Ok(if self.ring_serves(s, len) { len } else { 0 })
    }

    /// Checks a copy of the first `len` positions of `src` over `dst` and empties `dst`, so
    /// a copy that fails half-way leaves it holding nothing rather than a mix. KvRing layers
    /// copy the whole ring of `src` (see [`Self::ring_cells_of`]); global layers share its
    /// blocks, which [`Self::commit_copy`] does once the rings are copied. A prefix whose
    /// continuation the ring no longer holds is refused.
    pub(crate) fn start_copy(&mut self, src: u32, dst: u32, len: u32) -> Result<(), ModelError> {
        let s = self.check_seq(src)?;
        let d = self.check_seq(dst)?;
        if s == d {
            return Err(ModelError::InvalidArgument(format!(
                "cannot copy sequence {src} onto itself"
            )));
        }
        if len > self.lens[s] {
            return Err(ModelError::InvalidArgument(format!(
                "cannot copy {len} positions of sequence {src}: it holds {}",
                self.lens[s]
            )));
        }
        if !self.ring_serves(s, len) {
            return Err(ModelError::InvalidArgument(format!(
                "cannot copy {len} positions of sequence {src}: its sliding-window ring holds \
                 positions from {} on, and position {len} needs more",
                self.oldest[s]
            )));
        }
        self.lens[d] = 0;
        self.oldest[d] = 0;
        self.blocks.keep(dst, 0);
        Ok(())
    }

    /// The first cell of `seq`'s ring in a ring layer's cache.
    pub(crate) fn ring_cells_of(&self, seq: u32, ring: KvRing) -> u32 {
        seq * ring.cells
    }

    /// Records that `dst` now holds the first `len` positions of `src` checked by
    /// [`Self::start_copy`]: its rings were copied, and it takes the blocks by reference.
    pub(crate) fn commit_copy(&mut self, src: u32, dst: u32, len: u32) {
        self.lens[dst as usize] = len;
        self.oldest[dst as usize] = self.oldest[src as usize].min(len);
        self.blocks.share(src, dst, len);
    }
}

/// `span` cut to its last `window` cells: a token of a sliding-window layer at position `p`
/// sees positions `p - window + 1 ..= p` (HF's and llama.cpp's `p - j < window`).
pub(crate) fn windowed(span: AttnSpan, window: u32) -> AttnSpan {
    let n_cells = span.n_cells.min(window.max(1));
    AttnSpan {
        first_cell: span.first_cell + (span.n_cells - n_cells),
        n_cells,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(seq: u32, pos: u32) -> BatchToken {
        BatchToken { seq, pos }
    }

    /// Runs one batch that takes sequence `i` from its length to `lens[i]` positions, as a
    /// stage does: checked, blocks claimed, committed; returns the blocks it copied.
    fn fill(kv: &mut KvState, lens: &[u32]) -> Vec<BlockCopy> {
        let mut batch = Vec::new();
        for (s, &len) in lens.iter().enumerate() {
            let from = kv.len(s as u32).unwrap();
            batch.extend((from..len).map(|p| tok(s as u32, p)));
        }
        let update = kv.check_batch(&batch).unwrap();
        let copies = kv.claim_blocks(&batch).unwrap();
        kv.commit(update);
        copies
    }

    /// Window 4, micro-batches of 3 tokens: rings of 7 cells, contexts of 64.
    const RING: KvRing = KvRing {
        cells: 7,
        chunk: 3,
        window: 4,
    };

    /// Runs `seq` from its length up to `len` in micro-batches of the ring's chunk.
    fn advance(kv: &mut KvState, seq: u32, len: u32) {
        let from = kv.len(seq).unwrap();
        let batch: Vec<BatchToken> = (from..len).map(|p| tok(seq, p)).collect();
        let update = kv
            .check_batch(&batch)
            .expect("a prompt in order fits the ring");
        kv.claim_blocks(&batch).unwrap();
        kv.commit(update);
    }

    #[test]
    fn ring_cells_wrap_and_spans_are_virtual() {
        // Position 9 of sequence 2: cell 2·7 + 9 mod 7 = 16; window 6..=9, from virtual
        // cell 2·14 + 6 = 34, and virtual cells 34..38 map to cells 20, 14, 15, 16.
        let (cell, span) = KvState::place_in_ring(tok(2, 9), RING);
        assert_eq!(cell, 16);
        assert_eq!(
            span,
            AttnSpan {
                first_cell: 34,
                n_cells: 4
            }
        );
        let cells: Vec<u32> = (34..38)
            .map(|v| tether_compute::ring_cell(v, RING.cells))
            .collect();
        assert_eq!(cells, [20, 14, 15, 16]);
        // Early positions see only what exists.
        let (cell, span) = KvState::place_in_ring(tok(1, 1), RING);
        assert_eq!((cell, span.first_cell, span.n_cells), (8, 14, 2));
    }

    #[test]
    fn rings_take_prompts_in_micro_batches_and_refuse_lost_windows() {
        let mut kv = KvState::new(2, 64, Some(RING), 2).unwrap();
        advance(&mut kv, 0, 40);
        assert_eq!(kv.len(0).unwrap(), 40);
        // The last chunk wrote 37..40, so the ring holds 33..40.
        assert_eq!(kv.oldest[0], 33);
        // Going back to 38 is fine (its window 35..38 is held), to 30 is not.
        assert!(kv.check_batch(&[tok(0, 38)]).is_ok());
        assert!(kv.check_batch(&[tok(0, 30)]).is_err());
        // A sequence restarted from position 0 needs nothing before it.
        assert!(kv.check_batch(&[tok(0, 0), tok(0, 1)]).is_ok());
        // Tokens of a sequence in one micro-batch must be consecutive.
        assert!(kv.check_batch(&[tok(1, 0), tok(1, 0)]).is_err());
        // Batches longer than a micro-batch are checked chunk by chunk.
        assert!(
            kv.check_batch(&(0..20).map(|p| tok(1, p)).collect::<Vec<_>>())
                .is_ok()
        );
    }

    #[test]
    fn ring_truncation_below_the_window_clears_the_sequence() {
        let mut kv = KvState::new(1, 64, Some(RING), 1).unwrap();
        advance(&mut kv, 0, 40);
        // Position 37 needs 34..37: held.
        assert_eq!(kv.truncate(0, 37).unwrap(), 37);
        assert_eq!(kv.reusable(0, 37).unwrap(), 37);
        assert_eq!(kv.reusable(0, 35).unwrap(), 0, "35 needs 32, which is gone");
        // Position 20 needs 17..20, long overwritten: the sequence starts again.
        assert_eq!(kv.truncate(0, 20).unwrap(), 0);
        assert_eq!(kv.len(0).unwrap(), 0);
        advance(&mut kv, 0, 5);
        assert_eq!(kv.truncate(0, 2).unwrap(), 2, "nothing was overwritten yet");
    }

    #[test]
    fn ring_copies_need_the_window_and_carry_the_oldest_position() {
        let mut kv = KvState::new(2, 64, Some(RING), 2).unwrap();
        advance(&mut kv, 0, 40);
        assert!(
            kv.start_copy(0, 1, 30).is_err(),
            "30's window is overwritten"
        );
        assert_eq!(kv.len(0).unwrap(), 40, "a refused copy changes nothing");
        kv.start_copy(0, 1, 38).unwrap();
        kv.commit_copy(0, 1, 38);
        assert_eq!((kv.len(1).unwrap(), kv.oldest[1]), (38, 33));
        // The copy continues like the source would.
        advance(&mut kv, 1, 45);
        assert!(kv.ring_cells_of(1, RING) == 7);
    }

    #[test]
    fn batches_must_extend_the_cache_without_gaps() {
        let mut kv = KvState::new(2, 8, None, 2).unwrap();
        let update = kv.check_batch(&[tok(0, 0), tok(1, 0), tok(0, 1)]).unwrap();
        assert_eq!(update.lens, vec![2, 1]);
        kv.commit(update);
        assert!(kv.check_batch(&[tok(0, 3)]).is_err(), "gap after 2");
        assert!(kv.check_batch(&[tok(2, 0)]).is_err(), "unknown sequence");
        assert!(kv.check_batch(&[tok(1, 8)]).is_err(), "outside context");
        assert_eq!(kv.len(0).unwrap(), 2, "failed checks change nothing");
        assert_eq!(kv.check_batch(&[tok(0, 1)]).unwrap().lens, vec![2, 1]);
    }

    #[test]
    fn cells_and_spans_follow_the_layout() {
        // Contexts of 16 take one block of 32 cells each: sequence 2's virtual cells start
        // at 64, and its home block is block 2.
        let mut kv = KvState::new(3, 16, None, 3).unwrap();
        fill(&mut kv, &[0, 0, 6]);
        let (cell, span) = kv.place(tok(2, 5));
        assert_eq!(cell, 69);
        assert_eq!(
            span,
            AttnSpan {
                first_cell: 64,
                n_cells: 6
            }
        );
    }

    #[test]
    fn windows_keep_the_last_cells() {
        let span = AttnSpan {
            first_cell: 32,
            n_cells: 6,
        };
        let w = windowed(span, 4);
        assert_eq!((w.first_cell, w.n_cells), (34, 4));
        assert_eq!(windowed(span, 6), span);
        assert_eq!(windowed(span, 100), span);
    }

    #[test]
    fn truncate_and_clear() {
        let mut kv = KvState::new(1, 16, None, 1).unwrap();
        fill(&mut kv, &[10]);
        assert_eq!(kv.truncate(0, 4).unwrap(), 4);
        assert_eq!(kv.len(0).unwrap(), 4);
        kv.truncate(0, 9).unwrap();
        assert_eq!(kv.len(0).unwrap(), 4);
        assert!(kv.truncate(0, 17).is_err());
        assert!(kv.truncate(1, 0).is_err());
        kv.clear(0).unwrap();
        assert_eq!(kv.len(0).unwrap(), 0);
    }

    #[test]
    fn copies_need_two_sequences_and_cached_positions() {
        let mut kv = KvState::new(3, 16, None, 3).unwrap();
        fill(&mut kv, &[10, 3, 0]);
        assert!(kv.start_copy(0, 0, 4).is_err(), "onto itself");
        assert!(kv.start_copy(0, 3, 4).is_err(), "unknown destination");
        assert!(
            kv.start_copy(1, 2, 4).is_err(),
            "more than the source holds"
        );
        assert_eq!(kv.len(2).unwrap(), 0, "a refused copy changes nothing");
        assert_eq!(kv.len(1).unwrap(), 3, "a refused copy changes nothing");
        kv.start_copy(0, 1, 8).unwrap();
        assert_eq!(kv.len(1).unwrap(), 0, "emptied until the copy is done");
        kv.commit_copy(0, 1, 8);
        assert_eq!(kv.len(1).unwrap(), 8);
        assert_eq!(kv.len(0).unwrap(), 10, "the source keeps its cells");
    }

    #[test]
    fn copies_share_blocks_until_either_sequence_writes_into_them() {
        let mut kv = KvState::new(3, 100, None, 3).unwrap();
        fill(&mut kv, &[70, 0, 0]);
        assert_eq!(kv.take_dirty_blocks(), Some(0..12), "new: all of it");
        let free = kv.blocks().free_blocks();
        kv.start_copy(0, 1, 40).unwrap();
        kv.commit_copy(0, 1, 40);
        kv.start_copy(0, 2, 64).unwrap();
        kv.commit_copy(0, 2, 64);
        assert_eq!(kv.blocks().free_blocks(), free, "sharing takes no block");
        // Both read sequence 0's cells.
        assert_eq!(kv.place(tok(1, 39)).0, kv.place(tok(0, 39)).0);
        assert_eq!(kv.place(tok(2, 63)).0, kv.place(tok(0, 63)).0);
        // Sequence 1 writes position 40, inside the shared second block: it gets a copy.
        // Sequence 2 writes position 64, the start of a block of its own: no copy.
        let copies = fill(&mut kv, &[70, 41, 65]);
        assert_eq!(copies, vec![BlockCopy { from: 1, to: 5 }]);
        assert_ne!(kv.place(tok(1, 40)).0, kv.place(tok(0, 40)).0);
        assert_eq!(kv.place(tok(1, 39)).0, 5 * KV_BLOCK_CELLS + 7);
        // Clearing the source leaves the blocks the others hold.
        kv.clear(0).unwrap();
        assert_eq!(kv.place(tok(2, 0)).0, 0);
        // Entries 4-5 (sequence 1) and 8-9 (sequence 2) changed; 10 is 2's home block.
        assert_eq!(kv.take_dirty_blocks(), Some(4..10));
    }
}
