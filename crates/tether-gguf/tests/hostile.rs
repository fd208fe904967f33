//! Truncated, corrupted and hostile GGUF input: every case must be a clear error, never a
//! panic or an allocation sized by an unchecked field.

use proptest::prelude::*;
use tether_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, MetaArray, MetaValue};

fn valid_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", MetaValue::String("llama".into()));
    w.add_metadata("llama.block_count", MetaValue::U32(2));
    w.add_metadata(
        "tokenizer.ggml.tokens",
        MetaValue::Array(MetaArray::strings(["<s>", "a", "bc"])),
    );
    w.add_metadata("scores", MetaValue::Array(MetaArray::F32(vec![0.5; 3])));
    w.add_tensor("t0", GgmlType::F32, &[4, 2], vec![1; 32])
        .unwrap();
    w.add_tensor("t1", GgmlType::Q4_0, &[32], vec![2; 18])
        .unwrap();
    let mut out = Vec::new();
    w.write_to(&mut out, "valid").unwrap();
    out
}

/// A v3 header with the given counts, followed by `rest`.
fn raw(version: u32, n_tensors: u64, n_kv: u64, rest: &[u8]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(version.to_le_bytes());
    b.extend(n_tensors.to_le_bytes());
    b.extend(n_kv.to_le_bytes());
    b.extend(rest);
    b
}

fn string(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend(s.as_bytes());
    b
}

/// A tensor info record.
fn tensor_info(name: &str, dims: &[u64], type_id: u32, offset: u64) -> Vec<u8> {
    let mut b = string(name);
    b.extend((dims.len() as u32).to_le_bytes());
    for d in dims {
        b.extend(d.to_le_bytes());
    }
    b.extend(type_id.to_le_bytes());
    b.extend(offset.to_le_bytes());
    b
}

fn err(bytes: Vec<u8>) -> String {
    match GgufFile::from_bytes("hostile.gguf", bytes) {
        Ok(_) => panic!("hostile input was accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn valid_file_parses() {
    let f = GgufFile::from_bytes("valid", valid_file()).unwrap();
    assert_eq!(f.tensors().len(), 2);
    assert_eq!(
        f.get_str_array("tokenizer.ggml.tokens"),
        Some(vec!["<s>", "a", "bc"])
    );
}

#[test]
fn an_opened_file_maps_like_a_path_and_hands_out_its_header_bytes() {
    let bytes = valid_file();
    let path = std::env::temp_dir().join(format!("tether-gguf-map-{}.gguf", std::process::id()));
    std::fs::write(&path, &bytes).unwrap();
    let opened = std::fs::File::open(&path).unwrap();
    let mapped = GgufFile::map_file("mapped", &opened);
    let _ = std::fs::remove_file(&path);
    let mapped = mapped.unwrap();
    let in_memory = GgufFile::from_bytes("valid", bytes.clone()).unwrap();
    let end = in_memory.data_offset() as usize;
    assert!(end > 0 && end < bytes.len());
    assert_eq!(mapped.header_bytes(), &bytes[..end]);
    assert_eq!(in_memory.header_bytes(), &bytes[..end]);
    let t1 = mapped.tensor("t1").unwrap();
    assert_eq!(mapped.tensor_data(t1), &[2u8; 18][..]);
}

#[test]
fn every_truncation_of_the_header_is_an_error() {
    let bytes = valid_file();
    let f = GgufFile::from_bytes("valid", bytes.clone()).unwrap();
    let first_data = f.tensors().iter().map(|t| t.offset).min().unwrap() as usize;
    for len in 0..first_data {
        let e = GgufFile::from_bytes("cut.gguf", bytes[..len].to_vec());
        assert!(e.is_err(), "prefix of {len} bytes accepted");
    }
    let e = err(bytes[..30].to_vec());
    assert!(e.contains("cut") || e.contains("hostile"), "{e}");
    assert!(e.contains("offset"), "{e}");
}

#[test]
fn bad_magic_and_old_versions_are_refused_clearly() {
    assert!(err(b"GGML\x03\0\0\0".to_vec()).contains("not a GGUF file"));
    let v1 = err(raw(1, 0, 0, &[]));
    assert!(
        v1.contains("version 1") && v1.contains("re-convert"),
        "{v1}"
    );
    assert!(err(raw(3u32.swap_bytes(), 0, 0, &[])).contains("big-endian"));
    assert!(err(raw(4, 0, 0, &[])).contains("version 4"));
    assert!(GgufFile::from_bytes("empty", raw(2, 0, 0, &[])).is_ok());
}

#[test]
fn hostile_counts_and_lengths_are_refused_before_allocating() {
    // Key length u64::MAX.
    let mut key = u64::MAX.to_le_bytes().to_vec();
    key.extend([0u8; 16]);
    let e = err(raw(3, 0, 1, &key));
    assert!(e.contains("metadata entry 0") && e.contains("limit"), "{e}");
    // A string value claiming u64::MAX bytes.
    let mut kv = string("k");
    kv.extend(8u32.to_le_bytes());
    kv.extend(u64::MAX.to_le_bytes());
    let e = err(raw(3, 0, 1, &kv));
    assert!(e.contains("'k'"), "{e}");
    // An array claiming 2^60 u32 elements.
    let mut kv = string("arr");
    kv.extend(9u32.to_le_bytes());
    kv.extend(4u32.to_le_bytes());
    kv.extend((1u64 << 60).to_le_bytes());
    let e = err(raw(3, 0, 1, &kv));
    assert!(e.contains("'arr'") && e.contains("cannot fit"), "{e}");
    // Counts far beyond the file.
    assert!(err(raw(3, 0, u64::MAX, &[0; 64])).contains("metadata count"));
    assert!(err(raw(3, u64::MAX, 0, &[0; 64])).contains("tensor count"));
    // Arrays nested without end.
    let mut kv = string("deep");
    kv.extend(9u32.to_le_bytes());
    for _ in 0..1000 {
        kv.extend(9u32.to_le_bytes());
        kv.extend(1u64.to_le_bytes());
    }
    assert!(err(raw(3, 0, 1, &kv)).contains("nested"));
}

#[test]
fn hostile_tensor_records_are_refused() {
    let pad = [0u8; 64];
    let with = |info: Vec<u8>| {
        let mut rest = info;
        rest.extend(pad);
        raw(3, 1, 0, &rest)
    };
    let e = err(with(tensor_info("w", &[4], 0, 1 << 40)));
    assert!(e.contains("'w'") && e.contains("outside the file"), "{e}");
    let e = err(with(tensor_info("w", &[4], 0, u64::MAX - 31)));
    assert!(e.contains("'w'"), "{e}");
    let e = err(with(tensor_info("w", &[1 << 32, 1 << 32, 1 << 32], 0, 0)));
    assert!(e.contains("'w'") && e.contains("overflow"), "{e}");
    let e = err(with(tensor_info("w", &[1, 1, 1, 1, 1], 0, 0)));
    assert!(e.contains("dimensions"), "{e}");
    let e = err(with(tensor_info("w", &[4], 0, 8)));
    assert!(e.contains("alignment"), "{e}");
    let e = err(with(tensor_info("w", &[16], 2, 0)));
    assert!(e.contains("multiple") || e.contains("blocks"), "{e}");
    let e = err(with(tensor_info("iq", &[256], 19, 0)));
    assert!(
        e.contains("'iq'") && e.contains("type id 19") && e.contains("iq1_s"),
        "{e}"
    );
    let e = err(with(tensor_info("iq", &[256], 16, 0)));
    assert!(e.contains("type id 16 (iq2_xxs)"), "{e}");
    let mut two = tensor_info("dup", &[4], 0, 0);
    two.extend(tensor_info("dup", &[4], 0, 32));
    two.extend([0u8; 128]);
    let e = err(raw(3, 2, 0, &two));
    assert!(e.contains("duplicate tensor name 'dup'"), "{e}");
}

#[test]
fn open_reports_missing_files() {
    match GgufFile::open("/nonexistent/x.gguf") {
        Err(GgufError::Io { path, .. }) => assert_eq!(path, "/nonexistent/x.gguf"),
        other => panic!("unexpected {:?}", other.map(|f| f.version())),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn corrupted_files_never_panic(
        cut in proptest::option::of(0usize..400),
        edits in proptest::collection::vec((0usize..400, any::<u8>()), 0..6),
        wide in proptest::option::of((0usize..400, any::<u64>())),
    ) {
        let mut bytes = valid_file();
        for (at, b) in edits {
            if at < bytes.len() {
                bytes[at] = b;
            }
        }
        if let Some((at, v)) = wide
            && at + 8 <= bytes.len()
        {
            bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
        }
        if let Some(cut) = cut {
            bytes.truncate(bytes.len().saturating_sub(cut));
        }
        if let Ok(f) = GgufFile::from_bytes("fuzz", bytes) {
            // Whatever was accepted must be internally consistent.
            for t in f.tensors() {
                prop_assert_eq!(f.tensor_data(t).len() as u64, t.bytes);
                prop_assert!(f.tensor_f32(t).is_ok());
            }
        }
    }
}

#[test]
fn a_header_alone_is_checked_against_the_file_length_it_names() {
    let bytes = valid_file();
    let full = GgufFile::from_bytes("valid", bytes.clone()).unwrap();
    let header = bytes[..full.data_offset() as usize].to_vec();
    let len = bytes.len() as u64;

    let f = GgufFile::from_header("header", header.clone(), len).unwrap();
    assert_eq!(f.tensors(), full.tensors());
    // The data is not held: empty slices, and dequantizing is an error, not a panic.
    assert!(f.tensors().iter().all(|t| f.tensor_data(t).is_empty()));
    assert!(f.tensor_f32(&f.tensors()[0]).is_err());
    // A huge claimed length costs nothing: nothing is allocated from it.
    assert!(GgufFile::from_header("header", header.clone(), 1 << 40).is_ok());

    let data_end = full
        .tensors()
        .iter()
        .map(|t| t.offset + t.bytes)
        .max()
        .unwrap();
    let e = GgufFile::from_header("header", header.clone(), data_end - 1)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("outside the file"), "{e}");
    let e = GgufFile::from_header("header", header.clone(), header.len() as u64 - 1)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("cannot start a file"), "{e}");
}
