//! The coordinator's view of the model file: an mmap the tensors are streamed from, the
//! header the workers plan from, the hyper-parameters and the tokenizer.

use crate::api::Pooling;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tether_client::TensorSource;
use tether_gguf::GgufFile;
use tether_model::ModelConfig;
use tether_model::tokenizer::Tokenizer;
use tether_protocol::FileIdentity;

/// Why the model file could not be used.
#[derive(Debug, thiserror::Error)]
#[error("reading the model {path}: {detail}; check that it is a complete GGUF file")]
pub struct ModelFileError {
    /// The file.
    pub path: String,
    /// What went wrong.
    pub detail: String,
}

/// A model file opened once and shared by every load.
pub struct ModelFile {
    path: PathBuf,
    file: GgufFile,
    file_bytes: u64,
    config: ModelConfig,
    tokenizer: Arc<Tokenizer>,
    /// CRC-32 of each tensor once computed: a reload, or a second Prepare after a worker
    /// refused its own copy, does not read the tensor again.
    crcs: Mutex<HashMap<String, u32>>,
    /// Which file was mapped, taken from the handle that was mapped; `None` where the host
    /// gives no identity.
    identity: Option<FileIdentity>,
}

impl ModelFile {
    /// Opens `path`, reads its hyper-parameters, tokenizer and header bytes.
    pub fn open(path: impl AsRef<Path>) -> Result<Arc<ModelFile>, ModelFileError> {
        let path = path.as_ref().to_path_buf();
        let err = |detail: String| ModelFileError {
            path: path.display().to_string(),
            detail,
        };
        // One handle for the map, the length, the header and the identity, so that all
        // four describe the same file even if the path is replaced meanwhile.
        let handle = std::fs::File::open(&path).map_err(|e| err(format!("opening it: {e}")))?;
        let file = GgufFile::map_file(&path.display().to_string(), &handle)
            .map_err(|e| err(e.to_string()))?;
        let config = ModelConfig::from_gguf(&file).map_err(|e| err(e.to_string()))?;
        let tokenizer = Tokenizer::from_gguf(&file).map_err(|e| err(e.to_string()))?;
        let file_bytes = handle
            .metadata()
            .map_err(|e| err(format!("reading its size: {e}")))?
            .len();
        let identity = FileIdentity::of(&handle);
        Ok(Arc::new(ModelFile {
            path,
            file,
            file_bytes,
            config,
            tokenizer: Arc::new(tokenizer),
            crcs: Mutex::new(HashMap::new()),
            identity,
        }))
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The parsed file.
    pub fn gguf(&self) -> &GgufFile {
        &self.file
    }

    /// Bytes before the tensor data, which workers plan from: read from the map, not
    /// copied (a header can be tens of megabytes).
    pub fn header(&self) -> &[u8] {
        self.file.header_bytes()
    }

    /// Length of the whole file.
    pub fn file_bytes(&self) -> u64 {
        self.file_bytes
    }

    /// Hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> Arc<Tokenizer> {
        Arc::clone(&self.tokenizer)
    }

    /// The CRC-32 (IEEE) of tensor `name`'s bytes, computed on first use.
    pub fn tensor_crc32(&self, name: &str) -> Option<u32> {
        let crcs = || self.crcs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&crc) = crcs().get(name) {
            return Some(crc);
        }
        // Hashed outside the lock: loads on several workers hash their blocks at once.
        let crc = crc32fast::hash(self.file.tensor_data(self.file.tensor(name)?));
        crcs().insert(name.to_string(), crc);
        Some(crc)
    }

    /// Which file was mapped (see [`FileIdentity`]); `None` where the host gives none.
    pub fn identity(&self) -> Option<&FileIdentity> {
        self.identity.as_ref()
    }

    /// `tokenizer.chat_template`, when present.
    pub fn chat_template(&self) -> Option<String> {
        self.file
            .get_str("tokenizer.chat_template")
            .map(str::to_string)
    }

    /// The embedding pooling the file names (`{arch}.pooling_type`), when it names one.
    pub fn pooling(&self) -> Option<Pooling> {
        let arch = self.file.get_str("general.architecture")?;
        Pooling::from_gguf(self.file.get_u32(&format!("{arch}.pooling_type"))?)
    }
}

/// Streams tensor bytes straight from the mapping.
pub(crate) struct MappedSource(pub(crate) Arc<ModelFile>);

impl TensorSource for MappedSource {
    fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        let file = &self.0.file;
        file.tensor(name).map(|t| file.tensor_data(t))
    }

    fn crc32(&self, name: &str) -> Option<u32> {
        self.0.tensor_crc32(name)
    }
}
