//! What a stage does to its sequences' KV cells between forward passes: forget them, keep
//! a prefix, or copy a prefix into another sequence (prefix reuse across requests).

use tether_compute::{Backend, KV_BLOCK_CELLS};

use super::Stage;
use crate::error::{ModelError, compute, compute_in};
use crate::kv::BatchToken;
use crate::plan::kv_cell_bytes;

impl<B: Backend> Stage<B> {
    /// Positions cached for `seq`.
    pub fn seq_len(&self, seq: u32) -> Result<u32, ModelError> {
        self.kv.len(seq)
    }

    /// Blocks of the global layers' paged pool: `(in the pool, held by no sequence)`.
    pub fn kv_pool(&self) -> (usize, usize) {
        let b = self.kv.blocks();
        (b.n_blocks(), b.free_blocks())
    }

    /// Forgets everything sequence `seq` has cached.
    pub fn kv_clear(&mut self, seq: u32) -> Result<(), ModelError> {
        self.kv.clear(seq)
    }

    /// Keeps only the first `len` positions of sequence `seq` and returns how many it
    /// keeps: 0 when the model's sliding-window rings no longer hold the window position
    /// `len` needs (the sequence is then cleared, and must be prefilled again).
    pub fn kv_truncate(&mut self, seq: u32, len: u32) -> Result<u32, ModelError> {
        self.kv.truncate(seq, len)
    }

    /// The longest prefix of sequence `seq`, at most `len` positions, that can be reused:
    /// `len` (or the sequence's length, if shorter), or 0 when the model's sliding-window
    /// rings no longer hold the window position `len` needs.
    pub fn kv_reusable(&self, seq: u32, len: u32) -> Result<u32, ModelError> {
        self.kv.reusable(seq, len)
    }

    /// Makes sequence `dst` hold the first `len` positions of sequence `src` (which keeps
    /// them): global layers share `src`'s blocks by reference (a block is copied, inside
    /// the pool, only when either sequence later writes into one they share), and a
    /// sliding-window ring is copied whole (it holds the window `len` needs, or the copy is
    /// refused). Nothing is allocated. What `dst` held before is forgotten, even when the
    /// copy fails.
    pub fn kv_copy(&mut self, src: u32, dst: u32, len: u32) -> Result<(), ModelError> {
        self.kv.start_copy(src, dst, len)?;
        if let Some(ring) = self.kv.ring() {
            let (src_cell, dst_cell) = (
                self.kv.ring_cells_of(src, ring) as usize,
                self.kv.ring_cells_of(dst, ring) as usize,
            );
            let rings = (0..self.kv_cache.len())
                .filter(|&l| self.cfg.is_sliding(self.spec.first_layer + l))
                .collect::<Vec<_>>();
            self.copy_cells(&rings, src_cell, dst_cell, ring.cells as usize)?;
        }
        self.kv.commit_copy(src, dst, len);
        Ok(())
    }

    /// Copies `n` cells from `src_cell` to `dst_cell` in the K and V caches of the stage's
    /// layers `layers` (indices into the stage's layers).
    fn copy_cells(
        &mut self,
        layers: &[usize],
        src_cell: usize,
        dst_cell: usize,
        n: usize,
    ) -> Result<(), ModelError> {
        let cell_bytes = |ty| {
            usize::try_from(kv_cell_bytes(&self.cfg, ty))
                .map_err(|_| ModelError::InvalidArgument("a KV cell's size overflows".into()))
        };
        let (k_cell, v_cell) = (
            cell_bytes(self.spec.cache_k)?,
            cell_bytes(self.spec.cache_v)?,
        );
        for &l in layers {
            let (k, v) = &mut self.kv_cache[l];
            for (cache, cell) in [(k, k_cell), (v, v_cell)] {
                self.backend
                    .copy_within(cache, src_cell * cell, dst_cell * cell, n * cell)
                    .map_err(compute_in("kv copy", self.spec.first_layer + l))?;
            }
        }
        Ok(())
    }

    /// Makes the KV cells of `batch` (checked by `check_batch`) writable before it runs:
    /// each token's block becomes its sequence's alone, shared blocks it writes into are
    /// copied in the global layers' pools first, and the device's block tables take what
    /// changed.
    pub(super) fn claim_cells(&mut self, batch: &[BatchToken]) -> Result<(), ModelError> {
        let copies = self.kv.claim_blocks(batch)?;
        if !copies.is_empty() {
            let global: Vec<usize> = (0..self.kv_cache.len())
                .filter(|&l| !self.ring_layer(l))
                .collect();
            let b = KV_BLOCK_CELLS as usize;
            for c in copies {
                self.copy_cells(&global, c.from as usize * b, c.to as usize * b, b)?;
            }
        }
        let (Some(dirty), Some(table)) = (self.kv.take_dirty_blocks(), self.kv_table.as_mut())
        else {
            return Ok(());
        };
        let entries: Vec<u8> = self.kv.blocks().table()[dirty.clone()]
            .iter()
            .flat_map(|e| e.to_le_bytes())
            .collect();
        self.backend
            .upload(table, dirty.start * 4, &entries)
            .map_err(compute("writing the KV block table"))
    }

    /// Whether layer `l` of the stage keeps a sliding-window ring instead of paged blocks.
    pub(super) fn ring_layer(&self, l: usize) -> bool {
        self.kv.ring().is_some() && self.cfg.is_sliding(self.spec.first_layer + l)
    }
}
