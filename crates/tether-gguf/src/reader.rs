//! [`GgufFile`]: a parsed GGUF v2/v3 file over a memory map (or owned bytes).

use std::collections::HashMap;
use std::path::Path;

use crate::error::GgufError;
use crate::metadata::MetaValue;
use crate::parse::parse;
use crate::quant::dequantize;
use crate::types::GgmlType;

/// One tensor's header record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Element type.
    pub ty: GgmlType,
    /// Shape in ggml order (`ne`): `dims[0]` is the contiguous dimension.
    pub dims: Vec<u64>,
    /// Absolute file offset of the data.
    pub offset: u64,
    /// Size of the data in bytes.
    pub bytes: u64,
}

impl TensorInfo {
    /// Number of elements (product of `dims`; checked not to overflow when the file was read).
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

enum Storage {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A GGUF file whose header has been parsed and checked; tensor data stays in the file
/// (memory-mapped) and is handed out as byte slices.
pub struct GgufFile {
    path: String,
    storage: Storage,
    version: u32,
    alignment: u64,
    metadata: Vec<(String, MetaValue)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    data_offset: u64,
}

impl GgufFile {
    /// Memory-map and parse the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let name = path.as_ref().display().to_string();
        let io = |action, source| GgufError::Io {
            path: name.clone(),
            action,
            source,
        };
        let file = std::fs::File::open(path.as_ref()).map_err(|e| io("open", e))?;
        // SAFETY: the map is read-only; a file truncated by another process while mapped can
        // fault, the same caveat every mmap-based model loader accepts.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io("mmap", e))?;
        let len = map.len() as u64;
        Self::build(name, Storage::Mapped(map), len)
    }

    /// Memory-map and parse a file already opened, e.g. one whose path was checked against
    /// an allowed directory before opening; `name` is used in errors.
    pub fn map_file(name: &str, file: &std::fs::File) -> Result<GgufFile, GgufError> {
        // SAFETY: as in `open`: a read-only map; a file truncated while mapped can fault.
        let map = unsafe { memmap2::Mmap::map(file) }.map_err(|source| GgufError::Io {
            path: name.to_string(),
            action: "mmap",
            source,
        })?;
        let len = map.len() as u64;
        Self::build(name.to_string(), Storage::Mapped(map), len)
    }

    /// The file's bytes before its tensor data: the header, metadata and tensor infos.
    pub fn header_bytes(&self) -> &[u8] {
        let end = usize::try_from(self.data_offset).unwrap_or(usize::MAX);
        let bytes = self.storage.bytes();
        bytes.get(..end).unwrap_or(bytes)
    }

    /// Parse a GGUF file held in memory; `name` is used in errors.
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        let len = bytes.len() as u64;
        Self::build(name.to_string(), Storage::Owned(bytes), len)
    }

    /// Parse the header of a `file_len`-byte GGUF file from its first bytes only (what a
    /// coordinator sends a worker before the tensors). Tensors are checked against
    /// `file_len`; [`GgufFile::tensor_data`] is empty for data outside `header`.
    pub fn from_header(name: &str, header: Vec<u8>, file_len: u64) -> Result<GgufFile, GgufError> {
        if file_len < header.len() as u64 {
            return Err(GgufError::Invalid {
                path: name.to_string(),
                what: "header".into(),
                offset: 0,
                reason: format!(
                    "{} header bytes cannot start a file of {file_len} bytes",
                    header.len()
                ),
            });
        }
        Self::build(name.to_string(), Storage::Owned(header), file_len)
    }

    fn build(path: String, storage: Storage, file_len: u64) -> Result<GgufFile, GgufError> {
        let header = parse(&path, storage.bytes(), file_len)?;
        let key_index = header
            .metadata
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
        let tensor_index = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            path,
            storage,
            version: header.version,
            alignment: header.alignment,
            metadata: header.metadata,
            key_index,
            tensors: header.tensors,
            tensor_index,
            data_offset: header.data_offset,
        })
    }

    /// The file name used in errors.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Data alignment: `general.alignment`, or 32.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// All metadata entries, in file order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key)?.as_str()
    }

    /// Any integer value that fits `u64`.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }

    /// Any integer value that fits `u32`.
    pub fn get_u32(&self, key: &str) -> Option<u32> {
        self.get(key)?.as_u32()
    }

    /// An `F32` or `F64` value.
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key)?.as_f32()
    }

    /// A bool value.
    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key)?.as_bool()
    }

    /// An array of strings (`None` if any element is not a string).
    pub fn get_str_array(&self, key: &str) -> Option<Vec<&str>> {
        Some(self.get(key)?.as_array()?.as_strings()?.iter().collect())
    }

    /// An array of `F32`/`F64` values.
    pub fn get_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        self.get(key)?.as_array()?.to_f32s()
    }

    /// An array of integers that all fit `i32`.
    pub fn get_i32_array(&self, key: &str) -> Option<Vec<i32>> {
        self.get(key)?.as_array()?.to_i32s()
    }

    /// All tensor records, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw data of `t`. Bounds were checked when the file was opened; a `TensorInfo` from
    /// another file whose range does not fit this one, or data beyond the bytes of a file
    /// read with [`GgufFile::from_header`], yields an empty slice.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let bytes = self.storage.bytes();
        let start = usize::try_from(t.offset).unwrap_or(usize::MAX);
        let len = usize::try_from(t.bytes).unwrap_or(usize::MAX);
        start
            .checked_add(len)
            .and_then(|end| bytes.get(start..end))
            .unwrap_or(&[])
    }

    /// Asks the kernel to start reading `data` (bytes of this file's map, e.g. a tensor's)
    /// into the page cache now, so that a copy reaching them later finds them there: a
    /// loader hints what lies ahead of its copy, and the disk reads while it copies. A hint
    /// only: files held in memory, slices of other memory and refusals are ignored.
    pub fn read_ahead(&self, data: &[u8]) {
        let Storage::Mapped(map) = &self.storage else {
            return;
        };
        let base = map.as_ptr() as usize;
        let start = (data.as_ptr() as usize).wrapping_sub(base);
        if data.is_empty() || start >= map.len() || data.len() > map.len() - start {
            return;
        }
        // The range must start on a page; rounding down only widens the hint.
        let aligned = start - start % 4096;
        let _ = map.advise_range(
            memmap2::Advice::WillNeed,
            aligned,
            data.len() + (start - aligned),
        );
    }

    /// Dequantize tensor `t` to `f32` (a convenience for tests and the cpu backend).
    pub fn tensor_f32(&self, t: &TensorInfo) -> Result<Vec<f32>, GgufError> {
        let invalid = |reason: String| GgufError::Invalid {
            path: self.path.clone(),
            what: format!("data of tensor '{}'", t.name),
            offset: t.offset,
            reason,
        };
        // The output is sized by the header's dims: check the data is really here first,
        // so a header-only file cannot make this allocate what its dims merely claim.
        let data = self.tensor_data(t);
        if data.len() as u64 != t.bytes {
            return Err(invalid(format!(
                "{} of its {} bytes are held here (a header-only or different file)",
                data.len(),
                t.bytes
            )));
        }
        let n = usize::try_from(t.elements()).map_err(|e| invalid(e.to_string()))?;
        let mut out = vec![0.0f32; n];
        dequantize(t.ty, data, &mut out).map_err(|e| invalid(e.to_string()))?;
        Ok(out)
    }

    /// Absolute file offset where the tensor data section starts.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }
}
