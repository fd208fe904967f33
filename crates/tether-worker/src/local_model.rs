//! Reading a block's tensors from the worker's own copy of the model file, when a Prepare
//! names one (`local_path`) instead of sending chunks. The copy must be the coordinator's
//! file: same length, same header bytes, and the announced CRC-32 for every tensor; any
//! difference refuses the Prepare with the check that failed, and nothing stays staged.

use crate::metrics::{TensorSourceKind, WorkerMetrics};
use crate::model_dir::ModelDirs;
use crate::stage::ServingStage;
use crate::staging::Staging;
use std::path::PathBuf;
use tether_gguf::GgufFile;
use tether_protocol::{Result, WorkerError};
use tokio_util::sync::CancellationToken;

/// Bytes copied and hashed per step: small enough that the hash reads what the copy just
/// brought into the cache, and that an ended session stops the read quickly.
const READ_CHUNK: usize = 1 << 20;

/// The worker's copy of the model, opened inside its `--model-dir` and checked against the
/// coordinator's header and length.
pub(crate) struct LocalModel {
    requested: String,
    path: PathBuf,
    file: GgufFile,
}

impl LocalModel {
    /// Opens `requested` within `dirs`; refuses a file whose length is not `file_bytes` or
    /// whose bytes before the tensor data are not `header`.
    pub fn open(
        dirs: &ModelDirs,
        requested: &str,
        header: &[u8],
        file_bytes: u64,
    ) -> Result<LocalModel> {
        let allowed = dirs.open(requested)?;
        let shown = format!("model file {requested:?} ({})", allowed.path.display());
        let refuse = |what: String| WorkerError::LocalFile(format!("{shown}: {what}"));
        let len = allowed
            .file
            .metadata()
            .map_err(|e| refuse(format!("reading its length: {e}")))?
            .len();
        if len != file_bytes {
            return Err(refuse(format!(
                "size check failed: it has {len} bytes, the coordinator's model {file_bytes}; it is another file or version"
            )));
        }
        let file = GgufFile::map_file(&shown, &allowed.file)
            .map_err(|e| refuse(format!("header check failed: it does not parse: {e}")))?;
        if file.header_bytes() != header {
            return Err(refuse(format!(
                "header check failed: its {} bytes of header, metadata and tensor table differ from the coordinator's {}; it is another file or version",
                file.header_bytes().len(),
                header.len()
            )));
        }
        Ok(LocalModel {
            requested: requested.to_string(),
            path: allowed.path,
            file,
        })
    }

    /// The file's path, symlinks resolved.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Copies every tensor `staging` expects from the file into `stage`, hashing each chunk
    /// as it is copied (one pass over the bytes), then checks every CRC-32. Stops when
    /// `cancel` fires. Returns the bytes read.
    pub fn stage_into(
        &self,
        staging: &mut Staging,
        stage: &mut dyn ServingStage,
        cancel: &CancellationToken,
        metrics: &WorkerMetrics,
    ) -> Result<u64> {
        let mut tensors = Vec::new();
        for (name, bytes) in staging.expected() {
            let data = self
                .file
                .tensor(&name)
                .map(|t| self.file.tensor_data(t))
                .filter(|d| d.len() as u64 == bytes)
                .ok_or_else(|| {
                    self.refuse(format!(
                        "tensor {name:?} of {bytes} bytes is not in it; it is another file"
                    ))
                })?;
            tensors.push((name, data));
        }
        // In file order, so the pages are read front to back.
        tensors.sort_by_key(|(_, data)| data.as_ptr() as usize);
        let mut read = 0u64;
        for (name, data) in tensors {
            for (i, chunk) in data.chunks(READ_CHUNK).enumerate() {
                if cancel.is_cancelled() {
                    return Err(WorkerError::Aborted(format!(
                        "the session ended while the worker read {:?}; nothing stays staged",
                        self.requested
                    )));
                }
                staging.accept(stage, &name, (i * READ_CHUNK) as u64, chunk)?;
                metrics.count_tensor_bytes(TensorSourceKind::LocalFile, chunk.len() as u64);
                read += chunk.len() as u64;
            }
        }
        if let Some((name, got, want)) = staging.crc_mismatch() {
            return Err(self.refuse(format!(
                "checksum check failed: tensor {name:?} has CRC-32 {got:#010x}, the coordinator's copy {want:#010x}; the files differ"
            )));
        }
        Ok(read)
    }

    fn refuse(&self, what: String) -> WorkerError {
        WorkerError::LocalFile(format!(
            "model file {:?} ({}): {what}",
            self.requested,
            self.path.display()
        ))
    }
}
