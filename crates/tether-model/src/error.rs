//! Errors of model loading, the forward pass, and file synthesis.

use tether_compute::ComputeError;
use tether_gguf::GgufError;

/// What went wrong while reading a model, running it, or writing a synthetic one.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file's architecture is not one this crate runs.
    #[error(
        "unsupported architecture '{0}' (general.architecture); supported: llama, qwen2, qwen3, qwen3moe"
    )]
    UnsupportedArchitecture(String),
    /// A required metadata key is missing or has the wrong type.
    #[error("metadata key '{key}' {problem}; the file is not a complete {arch} model")]
    Metadata {
        /// The architecture being read.
        arch: String,
        /// The key.
        key: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A hyper-parameter is out of range or inconsistent with the others.
    #[error("invalid model configuration: {0}")]
    Config(String),
    /// A tensor the model needs is absent.
    #[error(
        "tensor '{0}' is missing from the model; the file is incomplete or of another architecture"
    )]
    MissingTensor(String),
    /// A tensor's shape or type does not match the configuration.
    #[error("tensor '{name}': expected dims {expected:?}, found {actual:?}")]
    TensorShape {
        /// The tensor.
        name: String,
        /// Dims (ggml order) the configuration implies.
        expected: Vec<u64>,
        /// Dims in the file.
        actual: Vec<u64>,
    },
    /// A tensor has a type the model code cannot use there.
    #[error("tensor '{name}' has type {ty}; {reason}")]
    TensorType {
        /// The tensor.
        name: String,
        /// Its type.
        ty: tether_gguf::GgmlType,
        /// Why it cannot be used.
        reason: String,
    },
    /// A caller passed an argument that is out of range; nothing was changed.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An operation was called in a state that does not allow it.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The compute backend failed.
    #[error("{what}: {source}")]
    Compute {
        /// What the model code was doing.
        what: String,
        /// The backend error.
        #[source]
        source: ComputeError,
    },
    /// Reading or writing a GGUF file failed.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// Writing a file failed.
    #[error("writing '{path}': {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// Wraps a backend error with the op that failed; the message is built only on failure.
pub(crate) fn compute(op: &'static str) -> impl FnOnce(ComputeError) -> ModelError {
    move |source| ModelError::Compute {
        what: op.to_string(),
        source,
    }
}

/// Like [`compute`], naming the layer too.
pub(crate) fn compute_in(
    op: &'static str,
    layer: usize,
) -> impl FnOnce(ComputeError) -> ModelError {
    move |source| ModelError::Compute {
        what: format!("{op} in layer {layer}"),
        source,
    }
}
