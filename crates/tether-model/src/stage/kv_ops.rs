//! What a stage does to its sequences' KV cells between forward passes: forget them, keep
//! a prefix, or copy a prefix into another sequence (prefix reuse across requests).

use tether_compute::Backend;

use super::Stage;
use crate::error::{ModelError, compute_in};
use crate::plan::kv_cell_bytes;

impl<B: Backend> Stage<B> {
    /// Positions cached for `seq`.
    pub fn seq_len(&self, seq: u32) -> Result<u32, ModelError> {
        self.kv.len(seq)
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
    /// them): every layer's K and V cells are copied inside the cache, so nothing is
    /// allocated; a sliding-window ring is copied whole (it holds the window `len` needs,
    /// or the copy is refused). What `dst` held before is forgotten, even when the copy
    /// fails.
    pub fn kv_copy(&mut self, src: u32, dst: u32, len: u32) -> Result<(), ModelError> {
        let (src_cell, dst_cell) = self.kv.start_copy(src, dst, len)?;
        let cell_bytes = |ty| {
            usize::try_from(kv_cell_bytes(&self.cfg, ty))
                .map_err(|_| ModelError::InvalidArgument("a KV cell's size overflows".into()))
        };
        let (k_cell, v_cell) = (
            cell_bytes(self.spec.cache_k)?,
            cell_bytes(self.spec.cache_v)?,
        );
        let ring = self.kv.ring();
        for (l, (k, v)) in self.kv_cache.iter_mut().enumerate() {
            let (src_cell, dst_cell, n) = match ring {
                Some(r) if self.cfg.is_sliding(self.spec.first_layer + l) => (
                    self.kv.ring_cells_of(src, r) as usize,
                    self.kv.ring_cells_of(dst, r) as usize,
                    r.cells as usize,
                ),
                _ => (src_cell as usize, dst_cell as usize, len as usize),
            };
            for (cache, cell) in [(k, k_cell), (v, v_cell)] {
                self.backend
                    .copy_within(cache, src_cell * cell, dst_cell * cell, n * cell)
                    .map_err(compute_in("kv copy", self.spec.first_layer + l))?;
            }
        }
        self.kv.commit_copy(src, dst, len);
        Ok(())
    }
}
