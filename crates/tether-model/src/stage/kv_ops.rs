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

    /// Keeps only the first `len` positions of sequence `seq`.
    pub fn kv_truncate(&mut self, seq: u32, len: u32) -> Result<(), ModelError> {
        self.kv.truncate(seq, len)
    }

    /// Makes sequence `dst` hold the first `len` positions of sequence `src` (which keeps
    /// them): every layer's K and V cells are copied inside the cache, so nothing is
    /// allocated. What `dst` held before is forgotten, even when the copy fails.
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
        let (src_cell, dst_cell, n) = (src_cell as usize, dst_cell as usize, len as usize);
        for (l, (k, v)) in self.kv_cache.iter_mut().enumerate() {
            for (cache, cell) in [(k, k_cell), (v, v_cell)] {
                self.backend
                    .copy_within(cache, src_cell * cell, dst_cell * cell, n * cell)
                    .map_err(compute_in("kv copy", self.spec.first_layer + l))?;
            }
        }
        self.kv.commit_copy(dst, len);
        Ok(())
    }
}
