//! Mixture-of-experts files with bad metadata or tensors: each refused with an error that
//! names the key or tensor.

use tether_gguf::{GgmlType, GgufFile, MetaValue};
use tether_model::{ModelConfig, SynthShape};

use crate::support::{spec, synth};

/// The metadata of `file` with `key` set to `value` (or removed when `None`), and its
/// tensors' headers, re-read as a header-only file would be: enough for `ModelConfig`.
fn with_key(file: &GgufFile, key: &str, value: Option<MetaValue>) -> Result<ModelConfig, String> {
    let mut w = tether_gguf::GgufWriter::new();
    for (k, v) in file.metadata() {
        if k != key {
            w.add_metadata(k.clone(), v.clone());
        }
    }
    if let Some(v) = value {
        w.add_metadata(key, v);
    }
    for t in file.tensors() {
        w.add_tensor(t.name.clone(), t.ty, &t.dims, file.tensor_data(t).to_vec())
            .unwrap();
    }
    let mut bytes = Vec::new();
    w.write_to(&mut bytes, "edited").unwrap();
    let edited = GgufFile::from_bytes("edited", bytes).unwrap();
    ModelConfig::from_gguf(&edited).map_err(|e| e.to_string())
}

#[test]
fn moe_metadata_is_read_and_bad_values_are_refused() {
    let m = synth(SynthShape::TinyQwen3Moe, GgmlType::Q8_0, 3);
    let cfg = ModelConfig::from_gguf(&m.file).unwrap();
    let moe = cfg.moe.unwrap();
    assert_eq!((moe.n_expert, moe.n_used, moe.n_ff_exp), (8, 2, 256));
    assert!(moe.norm_weights, "qwen3moe renormalizes by default");
    let key = |k: &str| format!("qwen3moe.{k}");
    let u = |n| Some(MetaValue::U32(n));
    for (k, v, want) in [
        ("expert_used_count", u(9), "expert_used_count"),
        ("expert_used_count", u(0), "expert_used_count"),
        ("expert_used_count", None, "expert_used_count' is missing"),
        ("expert_count", u(0), "expert_count' is 0"),
        ("expert_count", None, "expert_count' is missing"),
        ("expert_count", u(100_000), "at most 1024"),
        ("expert_count", u(16), "blk.0.ffn_gate_inp.weight"),
        (
            "expert_feed_forward_length",
            u(128),
            "blk.0.ffn_gate_exps.weight",
        ),
        ("expert_weights_norm", u(1), "not a boolean"),
    ] {
        let err = with_key(&m.file, &key(k), v).unwrap_err();
        assert!(err.contains(want), "{k}: {err}");
    }
    let off = with_key(
        &m.file,
        &key("expert_weights_norm"),
        Some(MetaValue::Bool(false)),
    )
    .unwrap();
    assert!(!off.moe.unwrap().norm_weights);
}

#[test]
fn mixtral_is_a_llama_with_experts_and_needs_their_tensors() {
    let m = synth(SynthShape::TinyMixtral, GgmlType::Q8_0, 3);
    let cfg = ModelConfig::from_gguf(&m.file).unwrap();
    assert_eq!(cfg.arch.name(), "llama");
    // Mixtral's expert width is its feed_forward_length.
    assert_eq!(cfg.moe.unwrap().n_ff_exp, cfg.n_ff);
    // A llama without expert_count is dense, and then lacks the dense ffn tensors.
    let err = with_key(&m.file, "llama.expert_count", None).unwrap_err();
    assert!(err.contains("blk.0.ffn_gate.weight"), "{err}");
    let mut tensors = m.file.tensors().to_vec();
    tensors.retain(|t| t.name != "blk.1.ffn_down_exps.weight");
    let err =
        tether_model::required_tensors(&cfg, &spec(1, 2, false, true, 1, 1), &tensors).unwrap_err();
    assert!(
        err.to_string().contains("blk.1.ffn_down_exps.weight"),
        "{err}"
    );
}
