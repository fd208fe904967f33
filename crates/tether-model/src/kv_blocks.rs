//! The paged KV pool of a stage's global layers: the cells a session reserved are blocks of
//! [`KV_BLOCK_CELLS`] cells, and each sequence has a table of the blocks that hold its
//! positions (entry `i`: positions `[i·B, (i+1)·B)`). Sequences share blocks by reference
//! when one takes another's prefix, and a block is copied only when a sequence writes into
//! one it shares (copy on write). The pool has a block for every entry of every table, so
//! taking a block never fails and never allocates: it is the reservation, carved up. A
//! stage may also have sequences beyond the pool's (cached prefixes, see
//! `StageSpec::cached_seqs`): they take blocks from the same pool, and whoever runs the
//! stage keeps them within it; a block the pool does not have is an error, not an
//! allocation.
//!
//! A block a sequence has never shared is its "home" block, `seq·per_seq + i`, so sequences
//! that share nothing keep the identity table and the device's copy never changes.

use std::collections::BTreeSet;
use std::ops::Range;

use tether_compute::KV_BLOCK_CELLS;

use crate::error::ModelError;

/// A block to copy into a fresh one before a batch writes into the fresh one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCopy {
    pub from: u32,
    pub to: u32,
}

/// Block tables, reference counts and free blocks of one stage.
#[derive(Clone, Debug)]
pub struct KvBlocks {
    /// Table entries (and home blocks) per sequence.
    per_seq: u32,
    /// `[n_seq][per_seq]` block numbers; entries at or past a sequence's `live` count are
    /// stale and never read.
    table: Vec<u32>,
    /// Per sequence: entries `[0, live)` hold a reference to their block.
    live: Vec<u32>,
    /// Per block: how many table entries hold it.
    refs: Vec<u32>,
    free: BTreeSet<u32>,
    /// Entries changed since the device's copy of the table was last written.
    dirty: Option<Range<usize>>,
}

impl KvBlocks {
    /// Tables for `n_seq` sequences of `per_seq` entries each over a pool of `n_blocks`
    /// blocks, every table the identity where the pool has the block and dirty, so the
    /// device's copy is written before the first batch.
    pub fn new(n_seq: u32, per_seq: u32, n_blocks: u32) -> Self {
        let entries = n_seq as usize * per_seq as usize;
        Self {
            per_seq,
            table: (0..entries as u32)
                .map(|e| if e < n_blocks { e } else { 0 })
                .collect(),
            live: vec![0; n_seq as usize],
            refs: vec![0; n_blocks as usize],
            free: (0..n_blocks).collect(),
            dirty: Some(0..entries),
        }
    }

    /// Blocks in the pool.
    pub fn n_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Blocks no sequence holds.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// The first virtual cell of `seq` (its table's first entry, times the block size).
    pub(crate) fn first_virtual_cell(&self, seq: u32) -> u32 {
        seq * self.per_seq * KV_BLOCK_CELLS
    }

    /// The cache cell of position `pos` of `seq`, whose block must be live.
    pub(crate) fn cell(&self, seq: u32, pos: u32) -> u32 {
        let entry = self.entry(seq, pos / KV_BLOCK_CELLS);
        self.table[entry] * KV_BLOCK_CELLS + pos % KV_BLOCK_CELLS
    }

    /// Every table, `[n_seq][per_seq]`, as the attention kernels read it.
    pub(crate) fn table(&self) -> &[u32] {
        &self.table
    }

    /// The entries changed since the last call, which the device's copy must take.
    pub(crate) fn take_dirty(&mut self) -> Option<Range<usize>> {
        self.dirty.take()
    }

    fn entry(&self, seq: u32, i: u32) -> usize {
        (seq * self.per_seq + i) as usize
    }

    fn set(&mut self, seq: u32, i: u32, block: u32) {
        let e = self.entry(seq, i);
        if self.table[e] != block {
            self.table[e] = block;
            self.dirty = Some(match self.dirty.take() {
                Some(d) => d.start.min(e)..d.end.max(e + 1),
                None => e..e + 1,
            });
        }
    }

    /// A free block for entry `i` of `seq`: its home block when free (so the table need not
    /// change), else the lowest free one.
    fn take(&mut self, seq: u32, i: u32) -> Result<u32, ModelError> {
        let home = seq * self.per_seq + i;
        let block = if (home as usize) < self.refs.len() && self.free.remove(&home) {
            home
        } else {
            self.free.pop_first().ok_or_else(|| {
                // Without cached-prefix sequences the pool has a block per entry.
                ModelError::FailedPrecondition(format!(
                    "the KV pool of {} blocks has none free for sequence {seq}: its \
                     cached-prefix sequences hold more than the pool has room for",
                    self.refs.len()
                ))
            })?
        };
        self.refs[block as usize] = 1;
        Ok(block)
    }

    fn release(&mut self, block: u32) {
        let r = &mut self.refs[block as usize];
        *r -= 1;
        if *r == 0 {
            self.free.insert(block);
        }
    }

    /// Makes entry `i` of `seq` a block that `seq` alone holds, so a batch can write
    /// positions `[i·B, (i+1)·B)` of it: a new block when `i` is the entry after the live
    /// ones, a copy of the shared block when another sequence holds it too (returned, to be
    /// copied before the batch writes), nothing when `seq` already holds it alone.
    pub fn writable(&mut self, seq: u32, i: u32) -> Result<Option<BlockCopy>, ModelError> {
        let live = self.live[seq as usize];
        if i > live || i >= self.per_seq {
            return Err(ModelError::FailedPrecondition(format!(
                "block {i} of sequence {seq} is not the next one: it holds {live} of {}",
                self.per_seq
            )));
        }
        if i == live {
            let block = self.take(seq, i)?;
            self.set(seq, i, block);
            self.live[seq as usize] += 1;
            return Ok(None);
        }
        let old = self.table[self.entry(seq, i)];
        if self.refs[old as usize] == 1 {
            return Ok(None);
        }
        let block = self.take(seq, i)?;
        self.release(old);
        self.set(seq, i, block);
        Ok(Some(BlockCopy {
            from: old,
            to: block,
        }))
    }

    /// Keeps the blocks of the first `len` positions of `seq` and lets go of the rest.
    pub fn keep(&mut self, seq: u32, len: u32) {
        let keep = len.div_ceil(KV_BLOCK_CELLS);
        let live = self.live[seq as usize];
        for i in keep..live {
            let block = self.table[self.entry(seq, i)];
            self.release(block);
        }
        self.live[seq as usize] = live.min(keep);
    }

    /// Makes `dst` hold the blocks of the first `len` positions of `src` by reference,
    /// after letting go of its own. `src` must hold `len` positions.
    pub fn share(&mut self, src: u32, dst: u32, len: u32) {
        self.keep(dst, 0);
        let n = len.div_ceil(KV_BLOCK_CELLS).min(self.live[src as usize]);
        for i in 0..n {
            let block = self.table[self.entry(src, i)];
            self.refs[block as usize] += 1;
            self.set(dst, i, block);
        }
        self.live[dst as usize] = n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: u32 = KV_BLOCK_CELLS;

    /// Writes positions `range` of `seq` as a batch would, returning the copies it needed.
    fn write(p: &mut KvBlocks, seq: u32, range: Range<u32>) -> Vec<BlockCopy> {
        range
            .filter_map(|pos| p.writable(seq, pos / B).unwrap())
            .collect()
    }

    /// Every block is free or held by exactly as many live entries as its count says.
    fn assert_counts(p: &KvBlocks) {
        let mut held = vec![0u32; p.n_blocks()];
        for (s, &live) in p.live.iter().enumerate() {
            for i in 0..live {
                held[p.table[p.entry(s as u32, i)] as usize] += 1;
            }
        }
        assert_eq!(held, p.refs);
        for (b, &r) in p.refs.iter().enumerate() {
            assert_eq!(r == 0, p.free.contains(&(b as u32)), "block {b}");
        }
    }

    #[test]
    fn sequences_that_share_nothing_keep_their_home_blocks() {
        let mut p = KvBlocks::new(3, 4, 12);
        assert_eq!(p.take_dirty(), Some(0..12));
        assert!(write(&mut p, 1, 0..70).is_empty());
        assert!(write(&mut p, 0, 0..5).is_empty());
        assert_eq!(p.take_dirty(), None, "the identity table never changes");
        assert_eq!((p.cell(1, 0), p.cell(1, 69)), (4 * B, 6 * B + 5));
        assert_eq!(p.free_blocks(), 12 - 3 - 1);
        p.keep(1, 33);
        assert_eq!(p.free_blocks(), 12 - 2 - 1);
        assert_counts(&p);
    }

    #[test]
    fn a_shared_prefix_is_copied_only_where_it_is_written() {
        let mut p = KvBlocks::new(3, 4, 12);
        write(&mut p, 0, 0..80);
        p.take_dirty();
        // Sequence 2 takes 70 positions: blocks 0, 1 whole and block 2 in part.
        p.share(0, 2, 70);
        assert_eq!(p.free_blocks(), 12 - 3);
        assert_eq!(p.cell(2, 69), p.cell(0, 69));
        assert_eq!(p.take_dirty(), Some(8..11));
        // Writing position 70 of sequence 2 copies block 2 into its home block 10.
        let copies = write(&mut p, 2, 70..72);
        assert_eq!(copies, vec![BlockCopy { from: 2, to: 10 }]);
        assert_eq!(p.cell(2, 70), 10 * B + 6);
        // The source writes on in its own block 2, now held by it alone.
        assert!(write(&mut p, 0, 80..81).is_empty());
        assert_counts(&p);
        // The source lets go of everything: sequence 2 keeps blocks 0 and 1 alive.
        p.keep(0, 0);
        assert_eq!(p.free_blocks(), 12 - 3);
        // Its home blocks are taken, so the source's next block is the lowest free one.
        assert!(write(&mut p, 0, 0..1).is_empty());
        assert_eq!(p.cell(0, 0), 2 * B);
        let copies = write(&mut p, 2, 0..1);
        assert_eq!(copies.len(), 0, "sequence 2 holds block 0 alone now");
        assert_counts(&p);
    }

    #[test]
    fn every_entry_can_take_a_block_however_the_pool_is_shared() {
        // Each sequence shares the one before it and then rewrites all of it: every write
        // needs a fresh block, and the pool (one per entry) never runs out.
        let (n_seq, per_seq) = (4, 3);
        let mut p = KvBlocks::new(n_seq, per_seq, n_seq * per_seq);
        write(&mut p, 0, 0..per_seq * B);
        for s in 1..n_seq {
            p.share(s - 1, s, per_seq * B);
            let copies = write(&mut p, s, 0..per_seq * B);
            assert_eq!(copies.len(), per_seq as usize);
            assert_counts(&p);
        }
        assert_eq!(p.free_blocks(), 0);
        let err = p.writable(0, per_seq).unwrap_err();
        assert!(err.to_string().contains("not the next one"), "{err}");
        let err = p.writable(1, 0).map(|_| ());
        assert!(err.is_ok(), "rewriting a block held alone needs nothing");
    }

    #[test]
    fn a_gap_in_the_blocks_is_refused() {
        let mut p = KvBlocks::new(1, 4, 4);
        let err = p.writable(0, 1).unwrap_err();
        assert!(err.to_string().contains("not the next one"), "{err}");
        assert_eq!(p.free_blocks(), 4, "nothing was taken");
    }

    #[test]
    fn sequences_beyond_the_pool_share_its_blocks_and_an_empty_pool_is_an_error() {
        // Two sequences' worth of blocks (2 x 2) for four sequences.
        let mut p = KvBlocks::new(4, 2, 4);
        assert_eq!(p.table(), &[0, 1, 2, 3, 0, 0, 0, 0]);
        write(&mut p, 3, 0..40);
        assert_eq!((p.cell(3, 0), p.cell(3, 39)), (0, B + 7));
        write(&mut p, 2, 0..33);
        assert_eq!(p.free_blocks(), 0);
        let err = p.writable(0, 0).unwrap_err();
        assert!(err.to_string().contains("none free"), "{err}");
        assert_eq!(p.live[0], 0, "the refused claim took nothing");
        p.keep(3, 0);
        assert!(write(&mut p, 0, 0..64).is_empty());
        assert_counts(&p);
    }
}
