//! The GGUF target: a model file from an untrusted source (a download, a coordinator's
//! header) through the reader, the header-only reader the worker uses, the inspector, the
//! hyper-parameter reader and the tokenizer.

use crate::Finding;
use tether_gguf::GgufFile;
use tether_model::ModelConfig;
use tether_model::tokenizer::Tokenizer;

/// Text the tokenizer of an accepted file encodes: ASCII, multi-byte UTF-8, a special-token
/// look-alike and whitespace runs.
const SAMPLE_TEXT: &str = "Hello, wörld! <s> <|im_start|>\n\t  12345 ☃";

/// Runs one input through every GGUF consumer; an accepted file must be consistent.
pub fn run(data: &[u8]) -> Result<(), Finding> {
    // The worker's path: the same bytes as the header of a longer file.
    if let Ok(file) = GgufFile::from_header("fuzz-header.gguf", data.to_vec(), 1 << 30) {
        check(&file, false)?;
    }
    match GgufFile::from_bytes("fuzz.gguf", data.to_vec()) {
        Ok(file) => check(&file, true),
        Err(e) => {
            if e.to_string().is_empty() {
                return Err(Finding("a GGUF error with an empty message".into()));
            }
            Ok(())
        }
    }
}

fn check(file: &GgufFile, whole: bool) -> Result<(), Finding> {
    for t in file.tensors() {
        let data = file.tensor_data(t);
        if whole && data.len() as u64 != t.bytes {
            return Err(Finding(format!(
                "tensor '{}' announces {} bytes but its data slice holds {}",
                t.name,
                t.bytes,
                data.len()
            )));
        }
        let dequantized = file.tensor_f32(t);
        if whole && dequantized.is_err() {
            return Err(Finding(format!(
                "tensor '{}' was accepted but does not dequantize: {:?}",
                t.name,
                dequantized.err().map(|e| e.to_string())
            )));
        }
    }
    let _ = tether_gguf::describe(file);
    let _ = tether_gguf::describe_json(file);
    let _ = ModelConfig::from_gguf(file);
    if let Ok(tokenizer) = Tokenizer::from_gguf(file) {
        for parse_special in [false, true] {
            let ids = tokenizer.encode(SAMPLE_TEXT, true, parse_special);
            let _ = tokenizer.decode(&ids);
        }
    }
    Ok(())
}
