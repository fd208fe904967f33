//! Bookkeeping of the KV cache: how many positions each sequence holds, and where a
//! token's keys and values live.
//!
//! Sequence `s` owns cells `[s·ctx, (s+1)·ctx)`; the token at position `p` lives in cell
//! `s·ctx + p` and attends to the cells of positions `0..=p`. A sequence's first positions
//! can be copied into another's cells (prefix reuse): the positions, and so the rotary
//! encoding of the keys, stay the same.

use tether_compute::AttnSpan;

use crate::error::ModelError;

/// One token of a batch: which sequence it belongs to and its position there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchToken {
    /// The sequence (`< n_seq`).
    pub seq: u32,
    /// Its position in the sequence (`< ctx_per_seq`).
    pub pos: u32,
}

/// Lengths of every sequence's cached prefix.
#[derive(Clone, Debug)]
pub(crate) struct KvState {
    ctx_per_seq: u32,
    lens: Vec<u32>,
}

impl KvState {
    pub(crate) fn new(n_seq: usize, ctx_per_seq: usize) -> Result<Self, ModelError> {
        let ctx_per_seq = u32::try_from(ctx_per_seq)
            .ok()
            .filter(|&c| c.checked_mul(n_seq as u32).is_some() && n_seq <= u32::MAX as usize)
            .ok_or_else(|| {
                ModelError::InvalidArgument(format!(
                    "{n_seq} sequences of {ctx_per_seq} cells do not fit 32-bit cell indices"
                ))
            })?;
        Ok(Self {
            ctx_per_seq,
            lens: vec![0; n_seq],
        })
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

    /// Checks a whole batch without changing anything: known sequences, positions inside the
    /// context, and each token's position at most the length its sequence has when it comes
    /// (so no gap in the cache). Returns the lengths after the batch.
    pub(crate) fn check_batch(&self, batch: &[BatchToken]) -> Result<Vec<u32>, ModelError> {
        let mut lens = self.lens.clone();
        for (i, t) in batch.iter().enumerate() {
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
            // Writing position p makes everything after it stale.
            lens[s] = t.pos + 1;
        }
        Ok(lens)
    }

    /// Takes the lengths returned by [`Self::check_batch`] once the batch has run.
    pub(crate) fn commit(&mut self, lens: Vec<u32>) {
        self.lens = lens;
    }

    /// The cell of `t` and the cells it attends to (`t` must have passed `check_batch`).
    pub(crate) fn place(&self, t: BatchToken) -> (u32, AttnSpan) {
        let first_cell = t.seq * self.ctx_per_seq;
        (
            first_cell + t.pos,
            AttnSpan {
                first_cell,
                n_cells: t.pos + 1,
            },
        )
    }

    /// Forgets everything `seq` holds.
    pub(crate) fn clear(&mut self, seq: u32) -> Result<(), ModelError> {
        let s = self.check_seq(seq)?;
        self.lens[s] = 0;
        Ok(())
    }

    /// Keeps the first `len` positions of `seq`; a `len` at or past its length changes nothing.
    pub(crate) fn truncate(&mut self, seq: u32, len: u32) -> Result<(), ModelError> {
        let s = self.check_seq(seq)?;
        if len > self.ctx_per_seq {
            return Err(ModelError::InvalidArgument(format!(
                "cannot truncate sequence {seq} to {len} positions: its context is {} cells",
                self.ctx_per_seq
            )));
        }
        self.lens[s] = self.lens[s].min(len);
        Ok(())
    }

    /// Checks a copy of the first `len` positions of `src` over `dst` and returns the cell
    /// ranges `(first source cell, first destination cell)`; `dst` is emptied, so a copy
    /// that fails half-way leaves it holding nothing rather than a mix. [`Self::commit_copy`]
    /// records the copy once the cells are moved.
    pub(crate) fn start_copy(
        &mut self,
        src: u32,
        dst: u32,
        len: u32,
    ) -> Result<(u32, u32), ModelError> {
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
        self.lens[d] = 0;
        Ok((src * self.ctx_per_seq, dst * self.ctx_per_seq))
    }

    /// Records that `dst` now holds `len` positions copied by [`Self::start_copy`].
    pub(crate) fn commit_copy(&mut self, dst: u32, len: u32) {
        self.lens[dst as usize] = len;
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

    #[test]
    fn batches_must_extend_the_cache_without_gaps() {
        let mut kv = KvState::new(2, 8).unwrap();
        let lens = kv.check_batch(&[tok(0, 0), tok(1, 0), tok(0, 1)]).unwrap();
        assert_eq!(lens, vec![2, 1]);
        kv.commit(lens);
        assert!(kv.check_batch(&[tok(0, 3)]).is_err(), "gap after 2");
        assert!(kv.check_batch(&[tok(2, 0)]).is_err(), "unknown sequence");
        assert!(kv.check_batch(&[tok(1, 8)]).is_err(), "outside context");
        assert_eq!(kv.len(0).unwrap(), 2, "failed checks change nothing");
        assert_eq!(kv.check_batch(&[tok(0, 1)]).unwrap(), vec![2, 1]);
    }

    #[test]
    fn cells_and_spans_follow_the_layout() {
        let kv = KvState::new(3, 16).unwrap();
        let (cell, span) = kv.place(tok(2, 5));
        assert_eq!(cell, 37);
        assert_eq!(
            span,
            AttnSpan {
                first_cell: 32,
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
        let mut kv = KvState::new(1, 16).unwrap();
        kv.commit(vec![10]);
        kv.truncate(0, 4).unwrap();
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
        let mut kv = KvState::new(3, 16).unwrap();
        kv.commit(vec![10, 3, 0]);
        assert!(kv.start_copy(0, 0, 4).is_err(), "onto itself");
        assert!(kv.start_copy(0, 3, 4).is_err(), "unknown destination");
        assert!(
            kv.start_copy(1, 2, 4).is_err(),
            "more than the source holds"
        );
        assert_eq!(kv.len(2).unwrap(), 0, "a refused copy changes nothing");
        assert_eq!(kv.len(1).unwrap(), 3, "a refused copy changes nothing");
        assert_eq!(kv.start_copy(0, 1, 8).unwrap(), (0, 16));
        assert_eq!(kv.len(1).unwrap(), 0, "emptied until the copy is done");
        kv.commit_copy(1, 8);
        assert_eq!(kv.len(1).unwrap(), 8);
        assert_eq!(kv.len(0).unwrap(), 10, "the source keeps its cells");
    }
}
