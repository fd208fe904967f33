//! Writing tensor data into a stage's preallocated weight buffers, in chunks.

use tether_compute::{Backend, DeviceBuffer};

use super::Stage;
use crate::error::ModelError;

/// Adds `[start, end)` to sorted, merged ranges.
fn add_range(ranges: &mut Vec<(u64, u64)>, start: u64, end: u64) {
    ranges.push((start, end));
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for &(s, e) in ranges.iter() {
        match merged.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    *ranges = merged;
}

impl<B: Backend> Stage<B> {
    /// Writes `data` into tensor `name` at byte `offset` (chunks may come in any order).
    /// The stage does not run again until [`Self::finish_load`] has checked the load.
    pub fn load_tensor(&mut self, name: &str, offset: u64, data: &[u8]) -> Result<(), ModelError> {
        if let Some(parts) = self.parts.get(name).cloned() {
            return self.load_fused(name, &parts, offset, data);
        }
        let &i = self.by_name.get(name).ok_or_else(|| {
            ModelError::InvalidArgument(format!("tensor '{name}' is not part of this stage"))
        })?;
        self.write_weight(i, name, offset, data)
    }

    /// Writes a chunk of fused tensor `name` into the weights that hold its `parts`: the
    /// rows of each part are one byte range of the file tensor.
    fn load_fused(
        &mut self,
        name: &str,
        parts: &[(usize, u64)],
        offset: u64,
        data: &[u8],
    ) -> Result<(), ModelError> {
        let total: u64 = parts
            .iter()
            .map(|&(i, _)| self.weights[i].buf.bytes() as u64)
            .sum();
        let end = offset
            .checked_add(data.len() as u64)
            .filter(|&e| e <= total);
        let Some(end) = end else {
            return Err(ModelError::InvalidArgument(format!(
                "tensor '{name}': {} bytes at offset {offset} run past its {total} bytes",
                data.len()
            )));
        };
        for &(i, start) in parts {
            let part_end = start + self.weights[i].buf.bytes() as u64;
            let (lo, hi) = (offset.max(start), end.min(part_end));
            if lo < hi {
                let chunk = &data[(lo - offset) as usize..(hi - offset) as usize];
                self.write_weight(i, name, lo - start, chunk)?;
            }
        }
        Ok(())
    }

    /// Writes `data` at `offset` of weight `i` (of file tensor `name`).
    fn write_weight(
        &mut self,
        i: usize,
        name: &str,
        offset: u64,
        data: &[u8],
    ) -> Result<(), ModelError> {
        let w = &mut self.weights[i];
        if w.finished {
            return Err(ModelError::FailedPrecondition(format!(
                "tensor '{name}' was already loaded in full and finished; a stage's weights are written once"
            )));
        }
        let size = w.buf.bytes() as u64;
        let end = offset.checked_add(data.len() as u64).filter(|&e| e <= size);
        let (Some(end), Ok(at)) = (end, usize::try_from(offset)) else {
            return Err(ModelError::InvalidArgument(format!(
                "tensor '{name}': {} bytes at offset {offset} run past its {size} bytes",
                data.len()
            )));
        };
        let uploading = |source| ModelError::Compute {
            what: format!("uploading tensor '{name}' at offset {offset}"),
            source,
        };
        let uploads = match &mut self.uploads {
            Some(u) => u,
            empty => empty.insert(self.backend.begin_uploads().map_err(uploading)?),
        };
        self.backend
            .upload_weight(uploads, &mut w.buf, at, data)
            .map_err(uploading)?;
        add_range(&mut w.written, offset, end);
        self.loaded = false;
        Ok(())
    }

    /// Checks that every tensor has been written in full and makes the stage ready to run.
    pub fn finish_load(&mut self) -> Result<(), ModelError> {
        if let Some(uploads) = self.uploads.take() {
            self.backend
                .finish_uploads(uploads)
                .map_err(|source| ModelError::Compute {
                    what: "waiting for the weight uploads".to_string(),
                    source,
                })?;
        }
        for w in &self.weights {
            let size = w.buf.bytes() as u64;
            let full = size == 0 || w.written.first() == Some(&(0, size));
            if !full {
                let have: u64 = w.written.iter().map(|(s, e)| e - s).sum();
                return Err(ModelError::FailedPrecondition(format!(
                    "tensor '{}' ({}) has {have} of its {size} bytes loaded; send the rest before finishing the load",
                    w.name, w.ty
                )));
            }
        }
        for w in self.weights.iter_mut().filter(|w| !w.finished) {
            self.backend
                .finish_weight(&mut w.buf, w.ty, w.row_len)
                .map_err(|source| ModelError::Compute {
                    what: format!("finishing tensor '{}'", w.name),
                    source,
                })?;
            w.finished = true;
        }
        self.synchronize()?;
        self.loaded = true;
        Ok(())
    }

    pub(super) fn check_loaded(&self) -> Result<(), ModelError> {
        if self.loaded {
            Ok(())
        } else {
            Err(ModelError::FailedPrecondition(
                "the stage's weights are not fully loaded; call finish_load first".into(),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::add_range;

    #[test]
    fn ranges_merge() {
        let mut r = Vec::new();
        add_range(&mut r, 10, 20);
        add_range(&mut r, 0, 5);
        assert_eq!(r, vec![(0, 5), (10, 20)]);
        add_range(&mut r, 5, 10);
        assert_eq!(r, vec![(0, 20)]);
        add_range(&mut r, 3, 8);
        assert_eq!(r, vec![(0, 20)]);
    }
}
