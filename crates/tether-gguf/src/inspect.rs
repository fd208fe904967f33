//! Human- and machine-readable summaries of a GGUF file (for `tether gguf inspect`).

use std::fmt::Write;

use serde_json::{Value, json};

use crate::array::MetaArray;
use crate::metadata::MetaValue;
use crate::reader::GgufFile;

/// Arrays longer than this are shown as their length and first few items.
const ARRAY_PREVIEW: usize = 8;
/// Strings longer than this are cut in the human summary (chat templates run to kilobytes).
const STRING_PREVIEW: usize = 120;

/// The first elements of `items`, as values of their own.
fn preview(items: &MetaArray) -> Vec<MetaValue> {
    (0..items.len().min(ARRAY_PREVIEW))
        .filter_map(|i| items.get(i))
        .collect()
}

fn short_value(v: &MetaValue) -> String {
    match v {
        MetaValue::String(s) if s.chars().count() > STRING_PREVIEW => {
            let head: String = s.chars().take(STRING_PREVIEW).collect();
            format!("{head:?}… ({} bytes)", s.len())
        }
        MetaValue::Array(items) => {
            let shown: Vec<String> = preview(items).iter().map(short_value).collect();
            if items.len() > ARRAY_PREVIEW {
                let elem = items.elem_type_name();
                format!("[{}, …] ({} × {elem})", shown.join(", "), items.len())
            } else {
                format!("[{}]", shown.join(", "))
            }
        }
        other => other.to_string(),
    }
}

/// A multi-line description: version, metadata (long arrays and strings abbreviated), and a
/// tensor table of name, type, dims, bytes and absolute offset.
pub fn describe(file: &GgufFile) -> String {
    let mut out = String::new();
    let total: u64 = file.tensors().iter().map(|t| t.bytes).sum();
    // Writing to a String cannot fail.
    let _ = writeln!(
        out,
        "{}: GGUF v{}, alignment {}, {} metadata entries, {} tensors ({} bytes of data from offset {})",
        file.path(),
        file.version(),
        file.alignment(),
        file.metadata().len(),
        file.tensors().len(),
        total,
        file.data_offset()
    );
    let _ = writeln!(out, "\nmetadata:");
    for (key, value) in file.metadata() {
        let _ = writeln!(
            out,
            "  {key} ({}) = {}",
            value.type_name(),
            short_value(value)
        );
    }
    let _ = writeln!(out, "\ntensors:");
    let width = file
        .tensors()
        .iter()
        .map(|t| t.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    let _ = writeln!(
        out,
        "  {:<width$}  {:<5}  {:<24}  {:>12}  {:>12}",
        "name", "type", "dims", "bytes", "offset"
    );
    for t in file.tensors() {
        let dims = format!("{:?}", t.dims);
        let _ = writeln!(
            out,
            "  {:<width$}  {:<5}  {:<24}  {:>12}  {:>12}",
            t.name,
            t.ty.name(),
            dims,
            t.bytes,
            t.offset
        );
    }
    out
}

fn json_value(v: &MetaValue) -> Value {
    match v {
        MetaValue::U8(x) => json!(x),
        MetaValue::I8(x) => json!(x),
        MetaValue::U16(x) => json!(x),
        MetaValue::I16(x) => json!(x),
        MetaValue::U32(x) => json!(x),
        MetaValue::I32(x) => json!(x),
        MetaValue::U64(x) => json!(x),
        MetaValue::I64(x) => json!(x),
        MetaValue::F32(x) => json!(x),
        MetaValue::F64(x) => json!(x),
        MetaValue::Bool(x) => json!(x),
        MetaValue::String(s) => json!(s),
        MetaValue::Array(items) if items.len() > ARRAY_PREVIEW => json!({
            "length": items.len(),
            "element_type": items.elem_type_name(),
            "first": preview(items).iter().map(json_value).collect::<Vec<_>>(),
        }),
        MetaValue::Array(items) => Value::Array(preview(items).iter().map(json_value).collect()),
    }
}

/// The same summary as JSON: `{path, version, alignment, data_offset, metadata: {key: {type,
/// value}}, tensors: [{name, type, dims, bytes, offset}]}`; arrays longer than 8 become
/// `{length, element_type, first}`.
pub fn describe_json(file: &GgufFile) -> Value {
    let metadata: serde_json::Map<String, Value> = file
        .metadata()
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                json!({ "type": v.type_name(), "value": json_value(v) }),
            )
        })
        .collect();
    let tensors: Vec<Value> = file
        .tensors()
        .iter()
        .map(|t| {
            json!({ "name": t.name, "type": t.ty.name(), "dims": t.dims, "bytes": t.bytes, "offset": t.offset })
        })
        .collect();
    json!({
        "path": file.path(),
        "version": file.version(),
        "alignment": file.alignment(),
        "data_offset": file.data_offset(),
        "metadata": metadata,
        "tensors": tensors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::GgmlType;
    use crate::writer::GgufWriter;

    fn sample() -> GgufFile {
        let mut w = GgufWriter::new();
        w.add_metadata("general.name", MetaValue::String("tiny".into()));
        w.add_metadata(
            "long",
            MetaValue::Array(MetaArray::I32((0..1000).collect())),
        );
        w.add_metadata("short", MetaValue::Array(MetaArray::Bool(vec![true])));
        w.add_tensor("blk.0.w", GgmlType::Q8_0, &[32, 2], vec![0; 68])
            .unwrap();
        let mut bytes = Vec::new();
        w.write_to(&mut bytes, "sample").unwrap();
        GgufFile::from_bytes("sample.gguf", bytes).unwrap()
    }

    #[test]
    fn text_summary_abbreviates_long_arrays_and_lists_tensors() {
        let text = describe(&sample());
        assert!(text.contains("GGUF v3"), "{text}");
        assert!(text.contains("general.name (string) = \"tiny\""), "{text}");
        assert!(
            text.contains("(1000 × i32)") && !text.contains(" 999"),
            "{text}"
        );
        assert!(text.contains("short (array) = [true]"), "{text}");
        let row = text
            .lines()
            .find(|l| l.contains("blk.0.w"))
            .unwrap_or_default();
        assert!(
            row.contains("q8_0") && row.contains("[32, 2]") && row.contains("68"),
            "{row}"
        );
    }

    #[test]
    fn json_summary_has_lengths_and_previews() {
        let f = sample();
        let j = describe_json(&f);
        assert_eq!(j["version"], 3);
        assert_eq!(j["metadata"]["long"]["value"]["length"], 1000);
        assert_eq!(
            j["metadata"]["long"]["value"]["first"]
                .as_array()
                .map(Vec::len),
            Some(8)
        );
        assert_eq!(j["metadata"]["short"]["value"], json!([true]));
        let t = &j["tensors"][0];
        assert_eq!(t["name"], "blk.0.w");
        assert_eq!(t["dims"], json!([32, 2]));
        assert_eq!(t["offset"], f.tensors()[0].offset);
    }
}
