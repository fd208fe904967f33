//! GGUF v2/v3: a memory-mapped reader, a writer, and the quantized block formats.

pub mod array;
pub mod error;
pub mod inspect;
pub mod metadata;
mod parse;
pub mod quant;
pub mod reader;
pub mod types;
pub mod writer;

pub use array::{MetaArray, Strings};
pub use error::GgufError;
pub use inspect::{describe, describe_json};
pub use metadata::MetaValue;
pub use parse::{DEFAULT_ALIGNMENT, MAX_DIMS, MAX_KEY_LEN, MAX_STRING_LEN, MAX_TENSOR_NAME_LEN};
pub use quant::{QuantError, dequantize, quantize_q4_0, quantize_q8_0};
pub use reader::{GgufFile, TensorInfo};
pub use types::{GgmlType, QK_K};
pub use writer::{GgufWriter, TensorStream};
