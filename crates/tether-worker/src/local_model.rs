//! Reading a block's tensors from the worker's own copy of the model file, when a Prepare
//! names one (`local_path`) instead of sending chunks. The copy must be the coordinator's
//! file: same length, same header bytes, and either the announced CRC-32 for every tensor
//! or the very file the coordinator mapped (same identity, checked again after the read);
//! any difference refuses the Prepare with the check that failed, and nothing stays staged.
//!
//! The pages are read ahead of the copy on a second thread (`read_ahead.rs`).

use crate::metrics::{TensorSourceKind, WorkerMetrics};
use crate::model_dir::ModelDirs;
use crate::read_ahead::copy_with_read_ahead;
use crate::stage::ServingStage;
use crate::staging::Staging;
use std::path::PathBuf;
use tether_gguf::GgufFile;
use tether_protocol::{FileIdentity, Result, WorkerError};
use tokio_util::sync::CancellationToken;

/// Bytes copied and hashed per step: large enough that the upload fills a pinned buffer
/// with several threads at once, small enough that an ended session stops the read quickly.
const READ_CHUNK: usize = 8 << 20;

/// The worker's copy of the model, opened inside its `--model-dir` and checked against the
/// coordinator's header and length.
pub(crate) struct LocalModel {
    requested: String,
    path: PathBuf,
    file: GgufFile,
    /// The open file, for checking its identity again after the read.
    handle: std::fs::File,
    /// The coordinator's identity of its copy, when this is that very file.
    same_file: Option<FileIdentity>,
}

impl LocalModel {
    /// Opens `requested` within `dirs`; refuses a file whose length is not `file_bytes`,
    /// whose bytes before the tensor data are not `header`, or, when `same_file` is given,
    /// which is not that file.
    pub fn open(
        dirs: &ModelDirs,
        requested: &str,
        header: &[u8],
        file_bytes: u64,
        same_file: Option<FileIdentity>,
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
        if let Some(want) = &same_file {
            check_identity(want, &allowed.file).map_err(|why| {
                refuse(format!(
                    "identity check failed: {why}; it is not the file the coordinator mapped, so its tensors need CRC-32s"
                ))
            })?;
        }
        Ok(LocalModel {
            requested: requested.to_string(),
            path: allowed.path,
            file,
            handle: allowed.file,
            same_file,
        })
    }

    /// Whether this is the very file the coordinator mapped (no checksums needed).
    pub fn is_same_file(&self) -> bool {
        self.same_file.is_some()
    }

    /// The file's path, symlinks resolved.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Copies every tensor `staging` expects from the file into `stage`, hashing each chunk
    /// as it is copied (one pass over the bytes) unless this is the coordinator's very
    /// file, then checks every CRC-32 (or that the file is still that file). Stops when
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
        let read = copy_with_read_ahead(&self.file, &tensors, |progress| {
            let mut read = 0u64;
            for (name, data) in &tensors {
                for (i, chunk) in data.chunks(READ_CHUNK).enumerate() {
                    if cancel.is_cancelled() {
                        return Err(WorkerError::Aborted(format!(
                            "the session ended while the worker read {:?}; nothing stays staged",
                            self.requested
                        )));
                    }
                    staging.accept(stage, name, (i * READ_CHUNK) as u64, chunk)?;
                    metrics.count_tensor_bytes(TensorSourceKind::LocalFile, chunk.len() as u64);
                    progress.advance(chunk.len() as u64);
                    read += chunk.len() as u64;
                }
            }
            Ok(read)
        })?;
        if let Some(want) = &self.same_file {
            check_identity(want, &self.handle).map_err(|why| {
                self.refuse(format!(
                    "identity check failed after the read: {why}; the file changed while it was read"
                ))
            })?;
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

/// Why `file` is not the file `want` names, if it is not.
fn check_identity(want: &FileIdentity, file: &std::fs::File) -> std::result::Result<(), String> {
    let have = FileIdentity::of(file)
        .ok_or_else(|| "this host gives no file identity (no boot id)".to_string())?;
    match want.differs(&have) {
        Some(why) => Err(why),
        None => Ok(()),
    }
}
