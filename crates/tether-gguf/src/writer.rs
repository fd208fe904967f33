//! [`GgufWriter`]: builds a GGUF v3 file from metadata and tensors.
//!
//! Tensor data may be given as bytes or as a closure that streams them, so a multi-gigabyte
//! model can be written without holding it in memory: the header needs only each tensor's
//! size, which follows from its type and shape.

use std::io::{self, Read, Write};
use std::path::Path;

use crate::array::MetaArray;
use crate::error::GgufError;
use crate::metadata::MetaValue;
use crate::parse::{DEFAULT_ALIGNMENT, MAX_DIMS};
use crate::types::GgmlType;

/// Writes a tensor's bytes into the output; must write exactly the tensor's size.
pub type TensorStream = Box<dyn FnOnce(&mut dyn Write) -> io::Result<()>>;

enum TensorData {
    Bytes(Vec<u8>),
    Stream(TensorStream),
}

struct PendingTensor {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
    bytes: u64,
    data: TensorData,
}

/// Collects metadata and tensors, then writes a GGUF v3 file in one pass.
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<PendingTensor>,
    alignment: u64,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

fn write_err(what: impl Into<String>, reason: impl Into<String>) -> GgufError {
    GgufError::Write {
        path: "<gguf writer>".to_string(),
        what: what.into(),
        reason: reason.into(),
    }
}

impl GgufWriter {
    /// An empty file with the default alignment (32).
    pub fn new() -> Self {
        GgufWriter {
            metadata: Vec::new(),
            tensors: Vec::new(),
            alignment: DEFAULT_ALIGNMENT,
        }
    }

    /// Use `alignment` (a power of two) for tensor data; recorded as `general.alignment`.
    pub fn set_alignment(&mut self, alignment: u32) -> Result<(), GgufError> {
        if !alignment.is_power_of_two() {
            return Err(write_err(
                "general.alignment",
                format!("{alignment} is not a power of two"),
            ));
        }
        self.alignment = u64::from(alignment);
        self.add_metadata("general.alignment", MetaValue::U32(alignment));
        Ok(())
    }

    /// Add (or replace) a metadata entry. Entries are written in the order first added.
    pub fn add_metadata(&mut self, key: impl Into<String>, value: MetaValue) {
        let key = key.into();
        match self.metadata.iter_mut().find(|(k, _)| *k == key) {
            Some(entry) => entry.1 = value,
            None => self.metadata.push((key, value)),
        }
    }

    /// Add a tensor whose data is `data` (exactly the bytes its type and shape need).
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        dims: &[u64],
        data: Vec<u8>,
    ) -> Result<(), GgufError> {
        let name = name.into();
        let bytes = self.check_tensor(&name, ty, dims)?;
        if data.len() as u64 != bytes {
            return Err(write_err(
                format!("tensor '{name}'"),
                format!(
                    "{} data bytes given, {ty} {dims:?} needs {bytes}",
                    data.len()
                ),
            ));
        }
        self.push(name, ty, dims, bytes, TensorData::Bytes(data));
        Ok(())
    }

    /// Add a tensor whose data `stream` writes when the file is written.
    pub fn add_tensor_stream(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        dims: &[u64],
        stream: TensorStream,
    ) -> Result<(), GgufError> {
        let name = name.into();
        let bytes = self.check_tensor(&name, ty, dims)?;
        self.push(name, ty, dims, bytes, TensorData::Stream(stream));
        Ok(())
    }

    fn push(&mut self, name: String, ty: GgmlType, dims: &[u64], bytes: u64, data: TensorData) {
        self.tensors.push(PendingTensor {
            name,
            ty,
            dims: dims.to_vec(),
            bytes,
            data,
        });
    }

    fn check_tensor(&self, name: &str, ty: GgmlType, dims: &[u64]) -> Result<u64, GgufError> {
        let what = || format!("tensor '{name}'");
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(write_err(what(), "a tensor of that name was already added"));
        }
        if dims.is_empty() || dims.len() > MAX_DIMS as usize {
            return Err(write_err(
                what(),
                format!("{} dims; 1 to {MAX_DIMS} allowed", dims.len()),
            ));
        }
        let elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
        match elements.and_then(|n| ty.bytes_for(n)) {
            Some(b) if dims[0].is_multiple_of(ty.block_elems() as u64) => Ok(b),
            _ => Err(write_err(
                what(),
                format!(
                    "dims {dims:?} overflow or dims[0] is not a multiple of {ty}'s block of {}",
                    ty.block_elems()
                ),
            )),
        }
    }

    /// Bytes of tensor data the file will hold, alignment padding included (the file is this
    /// plus its header); known before any tensor stream runs.
    pub fn tensor_data_bytes(&self) -> u64 {
        self.tensors.iter().fold(0, |offset, t| {
            (offset + t.bytes).div_ceil(self.alignment) * self.alignment
        })
    }

    /// Write the file to `out`; `name` is used in errors.
    pub fn write_to(self, out: &mut dyn Write, name: &str) -> Result<(), GgufError> {
        let io_err = |source| GgufError::Io {
            path: name.to_string(),
            action: "write",
            source,
        };
        let mut header = Vec::new();
        header.extend_from_slice(b"GGUF");
        header.extend_from_slice(&3u32.to_le_bytes());
        header.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut header, key);
            header.extend_from_slice(&value.type_id().to_le_bytes());
            put_value(&mut header, value);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            put_string(&mut header, &t.name);
            header.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                header.extend_from_slice(&d.to_le_bytes());
            }
            header.extend_from_slice(&t.ty.id().to_le_bytes());
            header.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.bytes).div_ceil(self.alignment) * self.alignment;
        }
        pad(&mut header, self.alignment);
        out.write_all(&header).map_err(io_err)?;

        let mut written = 0u64;
        for (t, start) in self.tensors.into_iter().zip(offsets) {
            write_zeros(out, start - written).map_err(io_err)?;
            let mut counting = CountingWriter {
                inner: out,
                count: 0,
            };
            match t.data {
                TensorData::Bytes(b) => counting.write_all(&b).map_err(io_err)?,
                TensorData::Stream(f) => f(&mut counting).map_err(io_err)?,
            }
            if counting.count != t.bytes {
                return Err(GgufError::Write {
                    path: name.to_string(),
                    what: format!("tensor '{}'", t.name),
                    reason: format!(
                        "its stream wrote {} bytes, {} expected",
                        counting.count, t.bytes
                    ),
                });
            }
            written = start + t.bytes;
        }
        let end = written.div_ceil(self.alignment) * self.alignment;
        write_zeros(out, end - written).map_err(io_err)?;
        out.flush().map_err(io_err)
    }

    /// Write the file to `path` (created or truncated).
    pub fn write_file(self, path: impl AsRef<Path>) -> Result<(), GgufError> {
        let name = path.as_ref().display().to_string();
        let file = std::fs::File::create(path.as_ref()).map_err(|source| GgufError::Io {
            path: name.clone(),
            action: "create",
            source,
        })?;
        let mut out = io::BufWriter::new(file);
        self.write_to(&mut out, &name)
    }
}

struct CountingWriter<'a> {
    inner: &'a mut dyn Write,
    count: u64,
}

impl Write for CountingWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.count += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn write_zeros(out: &mut dyn Write, n: u64) -> io::Result<()> {
    io::copy(&mut io::repeat(0).take(n), out).map(|_| ())
}

fn pad(buf: &mut Vec<u8>, alignment: u64) {
    let len = buf.len() as u64;
    let target = len.div_ceil(alignment) * alignment;
    buf.resize(target as usize, 0);
}

fn put_string(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn put_value(buf: &mut Vec<u8>, value: &MetaValue) {
    match value {
        MetaValue::U8(v) => buf.push(*v),
        MetaValue::I8(v) => buf.push(*v as u8),
        MetaValue::U16(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I16(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::U32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::F32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::Bool(v) => buf.push(u8::from(*v)),
        MetaValue::String(s) => put_string(buf, s),
        MetaValue::U64(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I64(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::F64(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::Array(items) => put_array(buf, items),
    }
}

/// Element type, count and elements; one type throughout, so nothing can be refused.
fn put_array(buf: &mut Vec<u8>, items: &MetaArray) {
    fn each<T: Copy, const N: usize>(buf: &mut Vec<u8>, v: &[T], le: impl Fn(T) -> [u8; N]) {
        for &x in v {
            buf.extend_from_slice(&le(x));
        }
    }
    buf.extend_from_slice(&items.elem_type_id().to_le_bytes());
    buf.extend_from_slice(&(items.len() as u64).to_le_bytes());
    match items {
        MetaArray::U8(v) => buf.extend_from_slice(v),
        MetaArray::I8(v) => each(buf, v, i8::to_le_bytes),
        MetaArray::U16(v) => each(buf, v, u16::to_le_bytes),
        MetaArray::I16(v) => each(buf, v, i16::to_le_bytes),
        MetaArray::U32(v) => each(buf, v, u32::to_le_bytes),
        MetaArray::I32(v) => each(buf, v, i32::to_le_bytes),
        MetaArray::F32(v) => each(buf, v, f32::to_le_bytes),
        MetaArray::Bool(v) => buf.extend(v.iter().map(|&b| u8::from(b))),
        MetaArray::String(v) => v.iter().for_each(|s| put_string(buf, s)),
        MetaArray::Array(v) => v.iter().for_each(|a| put_array(buf, a)),
        MetaArray::U64(v) => each(buf, v, u64::to_le_bytes),
        MetaArray::I64(v) => each(buf, v, i64::to_le_bytes),
        MetaArray::F64(v) => each(buf, v, f64::to_le_bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reader::GgufFile;

    fn every_type() -> Vec<(String, MetaValue)> {
        vec![
            ("k.u8".into(), MetaValue::U8(200)),
            ("k.i8".into(), MetaValue::I8(-100)),
            ("k.u16".into(), MetaValue::U16(60_000)),
            ("k.i16".into(), MetaValue::I16(-30_000)),
            ("k.u32".into(), MetaValue::U32(4_000_000_000)),
            ("k.i32".into(), MetaValue::I32(-2_000_000_000)),
            ("k.f32".into(), MetaValue::F32(1.25e-3)),
            ("k.bool".into(), MetaValue::Bool(true)),
            ("k.string".into(), MetaValue::String("héllo ✓".into())),
            ("k.u64".into(), MetaValue::U64(u64::MAX)),
            ("k.i64".into(), MetaValue::I64(i64::MIN)),
            ("k.f64".into(), MetaValue::F64(-2.5e300)),
            (
                "k.arr.str".into(),
                MetaValue::Array(MetaArray::strings(["a", ""])),
            ),
            (
                "k.arr.i32".into(),
                MetaValue::Array(MetaArray::I32((-3..4).collect())),
            ),
            (
                "k.arr.f32".into(),
                MetaValue::Array(MetaArray::F32(vec![0.5, -1.0])),
            ),
            (
                "k.arr.nested".into(),
                MetaValue::Array(MetaArray::Array(vec![MetaArray::U8(vec![1])])),
            ),
            (
                "k.arr.empty".into(),
                MetaValue::Array(MetaArray::F64(vec![])),
            ),
            (
                "k.arr.bool".into(),
                MetaValue::Array(MetaArray::Bool(vec![true, false])),
            ),
            (
                "k.arr.u64".into(),
                MetaValue::Array(MetaArray::U64(vec![u64::MAX, 0])),
            ),
        ]
    }

    #[test]
    fn round_trip_of_every_metadata_type_and_tensors() {
        let mut w = GgufWriter::new();
        w.set_alignment(64).unwrap();
        for (k, v) in every_type() {
            w.add_metadata(k, v);
        }
        let f32_data: Vec<u8> = (0..6)
            .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
            .collect();
        w.add_tensor("a", GgmlType::F32, &[3, 2], f32_data.clone())
            .unwrap();
        let q8: Vec<u8> = (0..68u8).collect();
        w.add_tensor("b.q8", GgmlType::Q8_0, &[64], q8.clone())
            .unwrap();
        w.add_tensor_stream(
            "c.streamed",
            GgmlType::F16,
            &[5, 1, 1, 1],
            Box::new(|out: &mut dyn Write| out.write_all(&[7u8; 10])),
        )
        .unwrap();
        // 24 bytes padded to 64, then 68 to 192 - 64, then 10 to 256 - 192.
        let data_bytes = w.tensor_data_bytes();
        assert_eq!(data_bytes, 256);
        let mut bytes = Vec::new();
        w.write_to(&mut bytes, "mem").unwrap();
        assert!((bytes.len() as u64 - data_bytes).is_multiple_of(64));

        let f = GgufFile::from_bytes("mem", bytes).unwrap();
        assert_eq!(f.version(), 3);
        assert_eq!(f.alignment(), 64);
        let got: Vec<_> = f
            .metadata()
            .iter()
            .filter(|(k, _)| k.starts_with("k."))
            .cloned()
            .collect();
        assert_eq!(got, every_type());
        assert_eq!(f.get_u32("k.u16"), Some(60_000));
        assert_eq!(f.get_u64("k.i8"), None);
        assert_eq!(
            f.get_i32_array("k.arr.i32"),
            Some(vec![-3, -2, -1, 0, 1, 2, 3])
        );
        assert_eq!(f.get_str_array("k.arr.str"), Some(vec!["a", ""]));
        assert_eq!(f.tensors().len(), 3);
        let a = f.tensor("a").unwrap();
        assert_eq!(
            (a.dims.clone(), a.ty, a.bytes),
            (vec![3, 2], GgmlType::F32, 24)
        );
        assert_eq!(f.tensor_data(a), &f32_data[..]);
        assert_eq!(f.tensor_data(f.tensor("b.q8").unwrap()), &q8[..]);
        assert_eq!(f.tensor_data(f.tensor("c.streamed").unwrap()), &[7u8; 10]);
        for t in f.tensors() {
            assert_eq!(t.offset % 64, 0, "{} aligned", t.name);
            assert!(t.offset >= f.data_offset());
        }
    }

    #[test]
    fn bad_tensors_and_short_streams_are_refused() {
        let mut w = GgufWriter::new();
        assert!(
            w.add_tensor("x", GgmlType::Q4_0, &[16], vec![0; 9])
                .is_err()
        );
        assert!(w.add_tensor("x", GgmlType::F32, &[2], vec![0; 7]).is_err());
        assert!(
            w.add_tensor("x", GgmlType::F32, &[1, 1, 1, 1, 1], vec![0; 4])
                .is_err()
        );
        w.add_tensor("x", GgmlType::F32, &[2], vec![0; 8]).unwrap();
        assert!(w.add_tensor("x", GgmlType::F32, &[2], vec![0; 8]).is_err());
        w.add_tensor_stream(
            "short",
            GgmlType::F32,
            &[4],
            Box::new(|o: &mut dyn Write| o.write_all(&[1; 15])),
        )
        .unwrap();
        let err = w.write_to(&mut Vec::new(), "mem").unwrap_err().to_string();
        assert!(err.contains("'short'") && err.contains("15"), "{err}");
    }
}
