//! Shapes, types and sizes of synthesized files.
use super::*;
use crate::config::ModelConfig;

#[test]
fn shapes_round_trip_through_config() {
    let dir = std::env::temp_dir().join(format!("tether-synth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (shape, ty) in [
        (SynthShape::Tiny, GgmlType::Q4K),
        (SynthShape::TinyQwen2, GgmlType::Q8_0),
        (SynthShape::TinyQwen3, GgmlType::Q4K),
        (SynthShape::TinyGemma3, GgmlType::Q4K),
        (SynthShape::TinyPhi3, GgmlType::Q4K),
        (SynthShape::TinyGemma2, GgmlType::Q4K),
        (SynthShape::TinyQwen3Yarn, GgmlType::Q4K),
    ] {
        let path = dir.join(format!("{}.gguf", shape.name()));
        synthesize(&path, shape, ty, 1).unwrap();
        let file = tether_gguf::GgufFile::open(&path).unwrap();
        let cfg = ModelConfig::from_gguf(&file).unwrap();
        let d = shape.dims();
        assert_eq!(
            (cfg.n_embd, cfg.n_layer, cfg.n_vocab),
            (d.n_embd, d.n_layer, d.n_vocab)
        );
        assert_eq!(cfg.tied_output, d.tied);
        assert_eq!(cfg.rope.neox, d.arch != "llama");
        assert_eq!(cfg.head_dim, d.head_dim.unwrap_or(d.n_embd / d.n_head));
        assert_eq!(cfg.rope.n_rot, cfg.head_dim);
        assert_eq!(file.tensor("blk.1.attn_k_norm.weight").is_some(), d.qk_norm);
        assert_eq!(cfg.has_rope_freqs, d.rope_freqs);
        assert_eq!(file.tensor("blk.1.ffn_down.weight").unwrap().ty, ty);
        assert_eq!(cfg.sliding_window, d.window);
        assert_eq!(
            file.tensor("blk.1.post_ffw_norm.weight").is_some(),
            d.post_norms
        );
        assert_eq!(file.tensor("blk.1.attn_qkv.weight").is_some(), d.fused);
        assert_eq!(
            file.get_str_array("tokenizer.ggml.tokens").unwrap().len(),
            d.n_vocab
        );
        std::fs::remove_file(&path).unwrap();
    }
}

#[test]
fn q4_k_m_file_has_llama_cpp_types_per_tensor() {
    let path = std::env::temp_dir().join(format!("tether-synth-q4km-{}.gguf", std::process::id()));
    synthesize(&path, SynthShape::Tiny, QuantMix::Q4KM, 3).unwrap();
    let file = tether_gguf::GgufFile::open(&path).unwrap();
    let ty = |name: &str| file.tensor(name).unwrap().ty;
    assert_eq!(ty("output.weight"), GgmlType::Q6K);
    assert_eq!(ty("token_embd.weight"), GgmlType::Q4K);
    // Two layers: only layer 1 (the last eighth) gets more bits.
    for (layer, more) in [(0, GgmlType::Q4K), (1, GgmlType::Q6K)] {
        assert_eq!(ty(&format!("blk.{layer}.attn_v.weight")), more);
        assert_eq!(ty(&format!("blk.{layer}.ffn_down.weight")), more);
        for m in ["attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"] {
            assert_eq!(ty(&format!("blk.{layer}.{m}.weight")), GgmlType::Q4K, "{m}");
        }
    }
    assert_eq!(ty("blk.0.attn_norm.weight"), GgmlType::F32);
    assert!(file.get_str("general.name").unwrap().contains("q4_k_m"));
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn tied_output_gives_token_embd_the_output_type() {
    let w = build(SynthShape::TinyQwen2, QuantMix::Q3KM.into(), 1).unwrap();
    let mut bytes = Vec::new();
    w.write_to(&mut bytes, "mem").unwrap();
    let file = tether_gguf::GgufFile::from_bytes("mem", bytes).unwrap();
    let ty = |name: &str| file.tensor(name).unwrap().ty;
    assert!(file.tensor("output.weight").is_none());
    assert_eq!(ty("token_embd.weight"), GgmlType::Q6K);
    assert_eq!(ty("blk.1.attn_v.weight"), GgmlType::Q5K);
    assert_eq!(ty("blk.1.attn_output.weight"), GgmlType::Q4K);
    assert_eq!(ty("blk.1.ffn_down.weight"), GgmlType::Q4K);
    assert_eq!(ty("blk.1.ffn_up.weight"), GgmlType::Q3K);
}

/// llama.cpp's Q4_K_M of Llama 3.1 8B is 4.58 GiB (4.92 GB); ours has the same tensor
/// types, so the same size up to its tokenizer metadata. Counted without writing.
#[test]
fn llama3_8b_q4_k_m_is_the_size_llama_cpp_writes() {
    let w = build(SynthShape::Llama3_8b, QuantMix::Q4KM.into(), 1).unwrap();
    // 4 912 898 304 bytes: the sum of the tensor sizes by the mix rules.
    let gib = w.tensor_data_bytes() as f64 / f64::from(1u32 << 30);
    assert!((4.55..4.60).contains(&gib), "{gib} GiB");
}

/// llama.cpp's Q4_K_M of Qwen3 8B is 4.68 GiB (5.03 GB); ours has the same tensor types.
#[test]
fn qwen3_8b_q4_k_m_is_the_size_llama_cpp_writes() {
    let w = build(SynthShape::Qwen3_8b, QuantMix::Q4KM.into(), 1).unwrap();
    let gib = w.tensor_data_bytes() as f64 / f64::from(1u32 << 30);
    assert!((4.6..4.75).contains(&gib), "{gib} GiB");
}

/// Gemma 3 12B in q4_k: 11.8 G parameters (1.0 G of them the tied embedding) at 4.5
/// bits; Phi-3 mini: 3.8 G. Counted without writing.
#[test]
fn gemma3_12b_and_phi3_mini_q4_k_have_their_parameter_counts() {
    for (shape, lo, hi) in [
        (SynthShape::Gemma3_12b, 6.0, 6.4),
        (SynthShape::Phi3Mini, 1.9, 2.1),
    ] {
        let w = build(shape, GgmlType::Q4K.into(), 1).unwrap();
        let gib = w.tensor_data_bytes() as f64 / f64::from(1u32 << 30);
        assert!((lo..hi).contains(&gib), "{}: {gib} GiB", shape.name());
    }
}

/// The 70B shape in the mix that fills two 80 GB GPUs: about 40 GiB, as llama.cpp's
/// Q4_K_M of Llama 3.1 70B (39.6 GiB). Counted without writing.
#[test]
fn llama3_70b_q4_k_m_is_about_40_gib() {
    let w = build(SynthShape::Llama3_70b, QuantMix::Q4KM.into(), 1).unwrap();
    let gib = w.tensor_data_bytes() as f64 / f64::from(1u32 << 30);
    assert!((39.0..40.5).contains(&gib), "{gib} GiB");
}

#[test]
fn types_fall_back_where_blocks_do_not_fit() {
    assert_eq!(fit_type(GgmlType::Q4K, 896), GgmlType::Q5_0);
    assert_eq!(fit_type(GgmlType::Q6K, 896), GgmlType::Q8_0);
    assert_eq!(fit_type(GgmlType::Q4K, 4096), GgmlType::Q4K);
    assert_eq!(fit_type(GgmlType::Q4_0, 20), GgmlType::F16);
    assert_eq!(fit_type(GgmlType::IQ4XS, 896), GgmlType::IQ4NL);
}

/// Slow (writes about 4.6 GB): `cargo test -p tether-model -- --ignored synth_8b`.
#[test]
#[ignore]
fn synth_8b_q4_k_takes_well_under_a_minute() {
    let path = std::env::temp_dir().join(format!("tether-synth-8b-{}.gguf", std::process::id()));
    let start = std::time::Instant::now();
    synthesize(&path, SynthShape::Llama3_8b, GgmlType::Q4K, 1).unwrap();
    let took = start.elapsed();
    let file = tether_gguf::GgufFile::open(&path).unwrap();
    let cfg = ModelConfig::from_gguf(&file).unwrap();
    assert_eq!((cfg.n_layer, cfg.n_vocab, cfg.n_head_kv), (32, 128256, 8));
    std::fs::remove_file(&path).unwrap();
    println!("llama3-8b q4_k synthesized in {took:?}");
    assert!(took.as_secs() < 45, "{took:?}");
}
