//! The bounded GGUF header parser: every count and length read from the file is checked
//! against the bytes that remain and a fixed maximum before anything is allocated.

use std::collections::HashMap;

use crate::array::{MetaArray, Strings};
use crate::error::GgufError;
use crate::metadata::{MetaValue, type_id};
use crate::reader::TensorInfo;
use crate::types::GgmlType;

/// Longest metadata key accepted.
pub const MAX_KEY_LEN: u64 = 64 * 1024;
/// Longest string value accepted (chat templates are the long ones, well under this).
pub const MAX_STRING_LEN: u64 = 16 * 1024 * 1024;
/// Longest tensor name accepted.
pub const MAX_TENSOR_NAME_LEN: u64 = 64 * 1024;
/// Most dimensions a tensor may have (ggml's limit).
pub const MAX_DIMS: u32 = 4;
/// Deepest nesting of arrays inside arrays; real files use none.
const MAX_ARRAY_DEPTH: u32 = 2;
/// Alignment used when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Everything the header says, with tensor offsets made absolute and checked.
pub(crate) struct Header {
    pub version: u32,
    pub alignment: u64,
    pub metadata: Vec<(String, MetaValue)>,
    pub tensors: Vec<TensorInfo>,
    pub data_offset: u64,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a str,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn invalid(&self, what: impl Into<String>, offset: usize, reason: String) -> GgufError {
        GgufError::Invalid {
            path: self.path.to_string(),
            what: what.into(),
            offset: offset as u64,
            reason,
        }
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        if n > self.left() as u64 {
            return Err(GgufError::Truncated {
                path: self.path.to_string(),
                what: what(),
                offset: self.pos as u64,
                need: n,
                left: self.left() as u64,
            });
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.bytes[start..self.pos])
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A u64-length-prefixed UTF-8 string of at most `max` bytes.
    fn string(&mut self, max: u64, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        self.str(max, what).map(str::to_string)
    }

    /// [`Cursor::string`], borrowed from the bytes.
    fn str(&mut self, max: u64, what: &dyn Fn() -> String) -> Result<&'a str, GgufError> {
        let at = self.pos;
        let len = self.u64(what)?;
        if len > max {
            return Err(self.invalid(
                what(),
                at,
                format!("string length {len} exceeds the limit of {max} bytes"),
            ));
        }
        let raw = self.take(len, what)?;
        match std::str::from_utf8(raw) {
            Ok(s) => Ok(s),
            Err(e) => Err(self.invalid(what(), at, format!("string is not UTF-8: {e}"))),
        }
    }

    /// The smallest encoding of one value of type `ty`, for bounding counts.
    fn min_size(ty: u32) -> u64 {
        match ty {
            type_id::U8 | type_id::I8 | type_id::BOOL => 1,
            type_id::U16 | type_id::I16 => 2,
            type_id::U32 | type_id::I32 | type_id::F32 => 4,
            type_id::U64 | type_id::I64 | type_id::F64 | type_id::STRING => 8,
            _ => 12, // array: element type + count
        }
    }

    fn value(
        &mut self,
        ty: u32,
        depth: u32,
        what: &dyn Fn() -> String,
    ) -> Result<MetaValue, GgufError> {
        let at = self.pos;
        Ok(match ty {
            type_id::U8 => MetaValue::U8(self.array::<1>(what)?[0]),
            type_id::I8 => MetaValue::I8(self.array::<1>(what)?[0] as i8),
            type_id::U16 => MetaValue::U16(u16::from_le_bytes(self.array(what)?)),
            type_id::I16 => MetaValue::I16(i16::from_le_bytes(self.array(what)?)),
            type_id::U32 => MetaValue::U32(self.u32(what)?),
            type_id::I32 => MetaValue::I32(i32::from_le_bytes(self.array(what)?)),
            type_id::F32 => MetaValue::F32(f32::from_le_bytes(self.array(what)?)),
            type_id::U64 => MetaValue::U64(self.u64(what)?),
            type_id::I64 => MetaValue::I64(i64::from_le_bytes(self.array(what)?)),
            type_id::F64 => MetaValue::F64(f64::from_le_bytes(self.array(what)?)),
            type_id::BOOL => match self.array::<1>(what)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => {
                    return Err(self.invalid(
                        what(),
                        at,
                        format!("bool byte is {b}, expected 0 or 1"),
                    ));
                }
            },
            type_id::STRING => MetaValue::String(self.string(MAX_STRING_LEN, what)?),
            type_id::ARRAY => MetaValue::Array(self.meta_array(depth, what)?),
            other => return Err(self.invalid(what(), at, format!("unknown value type {other}"))),
        })
    }

    /// An array value (element type, count, elements) at nesting `depth`, held packed.
    fn meta_array(
        &mut self,
        depth: u32,
        what: &dyn Fn() -> String,
    ) -> Result<MetaArray, GgufError> {
        let at = self.pos;
        if depth >= MAX_ARRAY_DEPTH {
            return Err(self.invalid(
                what(),
                at,
                format!("arrays nested deeper than {MAX_ARRAY_DEPTH}"),
            ));
        }
        let elem_ty = self.u32(what)?;
        if elem_ty > type_id::F64 {
            return Err(self.invalid(what(), at, format!("unknown array element type {elem_ty}")));
        }
        let count_at = self.pos;
        let count = self.u64(what)?;
        let fits = self.left() as u64 / Self::min_size(elem_ty);
        if count > fits {
            return Err(self.invalid(
                what(),
                count_at,
                format!(
                    "array of {count} elements cannot fit in the {} bytes left",
                    self.left()
                ),
            ));
        }
        // `count` is bounded by the bytes left, so every allocation below is too.
        let n = count as usize;
        Ok(match elem_ty {
            type_id::U8 => MetaArray::U8(self.fixed(n, what, |[b]| b)?),
            type_id::I8 => MetaArray::I8(self.fixed(n, what, |[b]| b as i8)?),
            type_id::U16 => MetaArray::U16(self.fixed(n, what, u16::from_le_bytes)?),
            type_id::I16 => MetaArray::I16(self.fixed(n, what, i16::from_le_bytes)?),
            type_id::U32 => MetaArray::U32(self.fixed(n, what, u32::from_le_bytes)?),
            type_id::I32 => MetaArray::I32(self.fixed(n, what, i32::from_le_bytes)?),
            type_id::F32 => MetaArray::F32(self.fixed(n, what, f32::from_le_bytes)?),
            type_id::U64 => MetaArray::U64(self.fixed(n, what, u64::from_le_bytes)?),
            type_id::I64 => MetaArray::I64(self.fixed(n, what, i64::from_le_bytes)?),
            type_id::F64 => MetaArray::F64(self.fixed(n, what, f64::from_le_bytes)?),
            type_id::BOOL => {
                let start = self.pos;
                let raw = self.take(count, what)?;
                if let Some(i) = raw.iter().position(|&b| b > 1) {
                    return Err(self.invalid(
                        what(),
                        start + i,
                        format!("bool byte is {}, expected 0 or 1", raw[i]),
                    ));
                }
                MetaArray::Bool(raw.iter().map(|&b| b == 1).collect())
            }
            type_id::STRING => {
                let mut strings = Strings::with_capacity(n);
                for _ in 0..n {
                    strings.push(self.str(MAX_STRING_LEN, what)?);
                }
                MetaArray::String(strings)
            }
            _ => {
                let mut arrays = Vec::with_capacity(n);
                for _ in 0..n {
                    arrays.push(self.meta_array(depth + 1, what)?);
                }
                MetaArray::Array(arrays)
            }
        })
    }

    /// `n` fixed-size little-endian elements of `N` bytes each.
    fn fixed<T, const N: usize>(
        &mut self,
        n: usize,
        what: &dyn Fn() -> String,
        decode: impl Fn([u8; N]) -> T,
    ) -> Result<Vec<T>, GgufError> {
        let raw = self.take(n as u64 * N as u64, what)?;
        Ok(raw
            .chunks_exact(N)
            .map(|chunk| {
                let mut bytes = [0u8; N];
                bytes.copy_from_slice(chunk);
                decode(bytes)
            })
            .collect())
    }
}

/// Parse the header of a GGUF v2/v3 file that starts with `bytes` and is `file_len` bytes
/// long (`bytes` may hold only the header); every tensor must lie inside `file_len`.
pub(crate) fn parse(path: &str, bytes: &[u8], file_len: u64) -> Result<Header, GgufError> {
    let mut c = Cursor {
        bytes,
        pos: 0,
        path,
    };
    let magic: [u8; 4] = c.array(&|| "magic".to_string())?;
    if &magic != b"GGUF" {
        return Err(GgufError::BadMagic {
            path: path.to_string(),
            found: magic,
        });
    }
    let version = c.u32(&|| "version".to_string())?;
    let hint = match version {
        2 | 3 => None,
        1 => Some("v1 files predate 2023-10; re-convert the model with a current llama.cpp"),
        v if (1..=3).contains(&v.swap_bytes()) => {
            Some("this looks like a big-endian GGUF; use a little-endian file")
        }
        _ => Some("only versions 2 and 3 are read; the file may be corrupt or from a newer tool"),
    };
    if let Some(hint) = hint {
        return Err(GgufError::UnsupportedVersion {
            path: path.to_string(),
            version,
            hint,
        });
    }
    let n_tensors_at = c.pos;
    let n_tensors = c.u64(&|| "tensor count".to_string())?;
    let n_kv_at = c.pos;
    let n_kv = c.u64(&|| "metadata count".to_string())?;
    // Smallest possible records: a key (8) + type (4) + one byte; a tensor info of 24 bytes.
    if n_kv > c.left() as u64 / 13 {
        return Err(c.invalid(
            "metadata count",
            n_kv_at,
            format!("{n_kv} entries cannot fit in {} bytes", c.left()),
        ));
    }

    let mut metadata = Vec::with_capacity(n_kv as usize);
    let mut keys: HashMap<String, ()> = HashMap::with_capacity(n_kv as usize);
    for index in 0..n_kv {
        let at = c.pos;
        let key = c.string(MAX_KEY_LEN, &|| format!("key of metadata entry {index}"))?;
        let what = || format!("value of metadata key '{key}'");
        let ty = c.u32(&what)?;
        let value = c.value(ty, 0, &what)?;
        if keys.insert(key.clone(), ()).is_some() {
            return Err(GgufError::DuplicateKey {
                path: path.to_string(),
                key,
                offset: at as u64,
            });
        }
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => match v.as_u64() {
            Some(a) if a.is_power_of_two() && a <= 1 << 20 => a,
            _ => {
                return Err(c.invalid(
                    "metadata key 'general.alignment'",
                    0,
                    format!("{v} is not a power of two up to 1 MiB"),
                ));
            }
        },
    };

    if n_tensors > c.left() as u64 / 24 {
        return Err(c.invalid(
            "tensor count",
            n_tensors_at,
            format!("{n_tensors} tensors cannot fit in {} bytes", c.left()),
        ));
    }
    let mut raw = Vec::with_capacity(n_tensors as usize);
    let mut names: HashMap<String, ()> = HashMap::with_capacity(n_tensors as usize);
    for index in 0..n_tensors {
        let at = c.pos;
        let name = c.string(MAX_TENSOR_NAME_LEN, &|| format!("name of tensor {index}"))?;
        let what = || format!("info of tensor '{name}'");
        let dims_at = c.pos;
        let n_dims = c.u32(&what)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(c.invalid(
                what(),
                dims_at,
                format!("{n_dims} dimensions; 1 to {MAX_DIMS} allowed"),
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&what)?);
        }
        let type_at = c.pos;
        let type_id = c.u32(&what)?;
        let ty = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType {
            path: path.to_string(),
            tensor: name.clone(),
            offset: type_at as u64,
            type_id,
            type_name: crate::types::unsupported_type_name(type_id),
        })?;
        let offset_at = c.pos;
        let rel_offset = c.u64(&what)?;
        let elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
        let bytes = elements.and_then(|n| ty.bytes_for(n));
        let bytes = match bytes {
            Some(b) if dims[0].is_multiple_of(ty.block_elems() as u64) => b,
            _ => {
                return Err(c.invalid(
                    what(),
                    dims_at,
                    format!(
                        "dims {dims:?} overflow or are not whole {}-element blocks of {ty}",
                        ty.block_elems()
                    ),
                ));
            }
        };
        if !rel_offset.is_multiple_of(alignment) {
            return Err(c.invalid(
                what(),
                offset_at,
                format!("data offset {rel_offset} is not a multiple of the alignment {alignment}"),
            ));
        }
        if names.insert(name.clone(), ()).is_some() {
            return Err(GgufError::DuplicateTensor {
                path: path.to_string(),
                tensor: name,
                offset: at as u64,
            });
        }
        raw.push(TensorInfo {
            name,
            ty,
            dims,
            offset: rel_offset,
            bytes,
        });
    }

    let header_end = c.pos as u64;
    let data_offset = header_end.div_ceil(alignment) * alignment;
    for t in &mut raw {
        let start = data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.bytes));
        match (start, end) {
            (Some(s), Some(e)) if e <= file_len => t.offset = s,
            _ => {
                return Err(GgufError::TensorOutOfBounds {
                    path: path.to_string(),
                    tensor: t.name.clone(),
                    start: start.unwrap_or(u64::MAX),
                    end: end.unwrap_or(u64::MAX),
                    file_len,
                });
            }
        }
    }
    Ok(Header {
        version,
        alignment,
        metadata,
        tensors: raw,
        data_offset,
    })
}
