//! The workers' KV block tables, kept here too. Every worker of a model makes the same
//! moves on its paged pool: blocks claimed as batches write positions, prefixes shared
//! between slots, slots truncated or cleared. Running the same bookkeeping
//! ([`KvBlocks`]) on those moves gives the blocks used and free without asking a worker;
//! the count does not depend on the order in which lanes' steps reach them.

use tether_compute::KV_BLOCK_CELLS;
use tether_model::KvBlocks;
use tether_model::plan::kv_blocks_per_seq;
use tether_protocol::TokenPos;

use crate::placement::ServeShape;
use crate::prefix::KvMove;

/// The coordinator's copy of one worker's block tables.
pub(super) struct KvLedger {
    blocks: KvBlocks,
    shape: ServeShape,
}

impl KvLedger {
    /// Tables for every slot of `shape` (running and cached-prefix ones) over a pool of the
    /// running slots' blocks, as the workers' sessions start.
    pub fn new(shape: ServeShape) -> Self {
        let per_seq = kv_blocks_per_seq(shape.ctx_per_seq) as u32;
        let slots = (shape.n_seq + shape.cached_seqs) as u32;
        Self {
            blocks: KvBlocks::new(slots, per_seq, shape.n_seq as u32 * per_seq),
            shape,
        }
    }

    /// Forgets every table (the workers' sessions are new).
    pub fn reset(&mut self) {
        *self = Self::new(self.shape);
    }

    /// A batch's `tokens` claim the blocks their positions are written into, and each
    /// sequence then keeps the blocks up to its last token's position: writing a position
    /// makes everything after it stale, as on the workers.
    pub fn write(&mut self, tokens: &[TokenPos]) {
        let mut ends: Vec<(u32, u32)> = Vec::new();
        for t in tokens {
            // A worker refuses the same step, which then ends the sessions and resets this.
            if let Err(e) = self.blocks.writable(t.seq, t.pos / KV_BLOCK_CELLS) {
                tracing::debug!("KV ledger: {e}");
            }
            match ends.iter_mut().find(|(s, _)| *s == t.seq) {
                Some(end) => end.1 = t.pos + 1,
                None => ends.push((t.seq, t.pos + 1)),
            }
        }
        for (seq, end) in ends {
            self.blocks.keep(seq, end);
        }
    }

    /// Makes a move the workers are to make before the next step.
    pub fn apply(&mut self, m: KvMove) {
        match m {
            KvMove::Copy { from, to, cells } => self.blocks.share(from, to, cells),
            KvMove::Truncate { slot, keep } => self.blocks.keep(slot, keep),
        }
    }

    /// Slot `slot` keeps the blocks of its first `keep` positions.
    pub fn keep(&mut self, slot: u32, keep: u32) {
        self.blocks.keep(slot, keep);
    }

    /// `(blocks in the pool, blocks no slot holds)`.
    pub fn counts(&self) -> (usize, usize) {
        (self.blocks.n_blocks(), self.blocks.free_blocks())
    }
}
