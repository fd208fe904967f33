//! Opens real GGUF files of the test data (skipped when absent).

use tether_gguf::{GgmlType, GgufFile};

/// `relative` inside the test data, opened, when present.
fn open_if_present(relative: &str) -> Option<GgufFile> {
    let path = tether_test_data::path(relative)?;
    Some(GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}")))
}

#[test]
fn stories260k_has_the_documented_shape() {
    let Some(f) = open_if_present("models/stories260K.gguf") else {
        return;
    };
    assert!(f.version() == 2 || f.version() == 3);
    assert_eq!(f.get_str("general.architecture"), Some("llama"));
    assert_eq!(f.get_u32("llama.block_count"), Some(5));
    assert_eq!(f.get_u32("llama.embedding_length"), Some(64));
    assert_eq!(f.get_u32("llama.attention.head_count"), Some(8));
    assert_eq!(f.get_u32("llama.attention.head_count_kv"), Some(4));
    assert_eq!(f.get_u32("llama.feed_forward_length"), Some(172));
    let tokens = f.get_str_array("tokenizer.ggml.tokens").unwrap_or_default();
    assert_eq!(tokens.len(), 512);
    assert!(
        f.get_f32_array("tokenizer.ggml.scores")
            .is_some_and(|s| s.len() == 512)
    );
    assert!(
        f.get_i32_array("tokenizer.ggml.token_type")
            .is_some_and(|s| s.len() == 512)
    );
    // The README: all tensors F32; the data section ends exactly at the end of the file.
    let last_end = f
        .tensors()
        .iter()
        .map(|t| t.offset + t.bytes)
        .max()
        .unwrap_or(0);
    assert_eq!(last_end, 1_185_376);
    let emb = f.tensor("token_embd.weight").expect("token_embd.weight");
    assert_eq!(emb.dims, vec![64, 512]);
    assert_eq!(emb.ty, GgmlType::F32);
    assert!(f.tensors().iter().all(|t| t.ty == GgmlType::F32));
    assert_eq!(f.tensor_data(emb).len() as u64, 64 * 512 * 4);
    let values = f.tensor_f32(emb).unwrap_or_else(|e| panic!("{e}"));
    assert!(values.iter().all(|v| v.is_finite()) && values.iter().any(|v| *v != 0.0));
    // 5 layers × 9 tensors + embedding, final norm, output (output may be tied).
    assert!(f.tensors().len() >= 47, "{} tensors", f.tensors().len());
}

#[test]
fn tokenizer_vocab_files_parse() {
    for (path, model) in [
        ("tokenizers/ggml-vocab-llama-spm.gguf", "llama"),
        ("tokenizers/ggml-vocab-gpt-2.gguf", "gpt2"),
    ] {
        let Some(f) = open_if_present(path) else {
            continue;
        };
        assert_eq!(f.get_str("tokenizer.ggml.model"), Some(model), "{path}");
        let tokens = f.get_str_array("tokenizer.ggml.tokens").unwrap_or_default();
        assert!(tokens.len() > 30_000, "{path}: {} tokens", tokens.len());
        if model == "gpt2" {
            assert!(
                f.get_str_array("tokenizer.ggml.merges")
                    .is_some_and(|m| m.len() > 40_000)
            );
        }
    }
}

#[test]
fn describe_summarizes_a_real_model() {
    let Some(f) = open_if_present("models/stories260K.gguf") else {
        return;
    };
    let text = tether_gguf::describe(&f);
    assert!(text.contains("tokenizer.ggml.tokens (array)") && text.contains("(512 × string)"));
    assert!(text.lines().count() < f.metadata().len() + f.tensors().len() + 10);
    let json = tether_gguf::describe_json(&f);
    assert_eq!(
        json["metadata"]["tokenizer.ggml.tokens"]["value"]["length"],
        512
    );
    println!("{text}");
}

#[test]
fn rewriting_a_real_model_reproduces_it_byte_for_byte() {
    let Some(f) = open_if_present("models/stories260K.gguf") else {
        return;
    };
    let mut w = tether_gguf::GgufWriter::new();
    for (k, v) in f.metadata() {
        w.add_metadata(k.clone(), v.clone());
    }
    for t in f.tensors() {
        w.add_tensor(t.name.clone(), t.ty, &t.dims, f.tensor_data(t).to_vec())
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let mut out = Vec::new();
    w.write_to(&mut out, "rewrite")
        .unwrap_or_else(|e| panic!("{e}"));
    let original = std::fs::read(f.path()).unwrap_or_default();
    assert_eq!(out.len(), original.len());
    assert!(out == original, "rewritten file differs from the original");
}
