//! Errors from reading and writing GGUF files.

/// Why a GGUF file could not be read or written. Every variant names the file; parse errors
/// also name the byte offset and what was being read (key, tensor).
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened, mapped, or written.
    #[error("{path}: {action} failed: {source}")]
    Io {
        /// The file.
        path: String,
        /// What was being done ("open", "mmap", "write").
        action: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error("{path}: not a GGUF file: magic at offset 0 is {found:02x?}, expected \"GGUF\"")]
    BadMagic {
        /// The file.
        path: String,
        /// The bytes found.
        found: [u8; 4],
    },
    /// A GGUF version this reader does not handle.
    #[error("{path}: GGUF version {version} is not supported ({hint})")]
    UnsupportedVersion {
        /// The file.
        path: String,
        /// The version field as read (little-endian).
        version: u32,
        /// What to do about it.
        hint: &'static str,
    },
    /// The file ends before a field that the header says is there.
    #[error(
        "{path}: truncated at offset {offset} while reading {what}: need {need} bytes, {left} left; \
         the file is incomplete (re-download it)"
    )]
    Truncated {
        /// The file.
        path: String,
        /// What was being read (names the key or tensor).
        what: String,
        /// Byte offset of the field.
        offset: u64,
        /// Bytes the field needs.
        need: u64,
        /// Bytes left in the file from `offset`.
        left: u64,
    },
    /// A field holds a value that cannot be right (bad length, type, count, alignment).
    #[error("{path}: invalid {what} at offset {offset}: {reason}")]
    Invalid {
        /// The file.
        path: String,
        /// What was being read (names the key or tensor).
        what: String,
        /// Byte offset of the field.
        offset: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// A tensor uses a ggml type id this crate cannot decode.
    #[error(
        "{path}: tensor '{tensor}' (info at offset {offset}) has type id {type_id} ({type_name}), \
         which is not supported; re-quantize the model to one of f32, f16, bf16, q4_0, q4_1, \
         q5_0, q5_1, q8_0, q2_k..q6_k, iq4_nl, iq4_xs"
    )]
    UnknownTensorType {
        /// The file.
        path: String,
        /// The tensor.
        tensor: String,
        /// Byte offset of the tensor's info record.
        offset: u64,
        /// The type id found.
        type_id: u32,
        /// ggml's name for that id (`iq2_xxs`), or `unknown type`.
        type_name: &'static str,
    },
    /// Two tensors share a name.
    #[error("{path}: duplicate tensor name '{tensor}' (second one at offset {offset})")]
    DuplicateTensor {
        /// The file.
        path: String,
        /// The repeated name.
        tensor: String,
        /// Byte offset of the second info record.
        offset: u64,
    },
    /// Two metadata entries share a key.
    #[error("{path}: duplicate metadata key '{key}' (second one at offset {offset})")]
    DuplicateKey {
        /// The file.
        path: String,
        /// The repeated key.
        key: String,
        /// Byte offset of the second entry.
        offset: u64,
    },
    /// A tensor's data does not lie within the file.
    #[error(
        "{path}: tensor '{tensor}' data at offsets {start}..{end} lies outside the file \
         ({file_len} bytes); the file is truncated or corrupt"
    )]
    TensorOutOfBounds {
        /// The file.
        path: String,
        /// The tensor.
        tensor: String,
        /// Absolute start offset.
        start: u64,
        /// Absolute end offset (exclusive), saturated on overflow.
        end: u64,
        /// The file's length.
        file_len: u64,
    },
    /// The writer was given something it cannot encode.
    #[error("{path}: cannot write {what}: {reason}")]
    Write {
        /// The file being written.
        path: String,
        /// What was being written.
        what: String,
        /// Why not.
        reason: String,
    },
}
