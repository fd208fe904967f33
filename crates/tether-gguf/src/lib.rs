//! GGUF v2/v3: a memory-mapped reader, a writer, and the quantized block formats.

pub mod types;

pub use types::{GgmlType, QK_K};
