//! The hyper-parameters only some architectures have (sliding windows, attention scale
//! overrides, embedding scale, logit soft-capping), read from GGUF metadata as llama.cpp's
//! converter writes it.

use tether_compute::rope::YarnParams;

use crate::config::Meta;
use crate::error::ModelError;

/// `rope.scaling.*`: the frequency scale (1 / factor) and YaRN's parameters. llama3-style
/// scaling lives in `rope_freqs.weight` and needs nothing here.
pub(crate) fn rope_scaling(meta: &Meta<'_>) -> Result<(f32, Option<YarnParams>), ModelError> {
    let kind = meta.file.get_str(&meta.key("rope.scaling.type"));
    let factor = || {
        let factor = meta
            .file
            .get_f32(&meta.key("rope.scaling.factor"))
            .unwrap_or(1.0);
        if factor.is_finite() && factor > 0.0 {
            Ok(factor)
        } else {
            Err(meta.err(
                "rope.scaling.factor",
                &format!("is {factor}; it must be a positive number"),
            ))
        }
    };
    let positive = |key: &str, default: f32| {
        let v = meta.file.get_f32(&meta.key(key)).unwrap_or(default);
        if v.is_finite() && v > 0.0 {
            Ok(v)
        } else {
            Err(meta.err(key, &format!("is {v}; it must be a positive number")))
        }
    };
    match kind {
        None | Some("none") | Some("llama3") => Ok((1.0, None)),
        Some("linear") => Ok((1.0 / factor()?, None)),
        Some("yarn") => {
            let factor = factor()?;
            let orig = meta.usize_req("rope.scaling.original_context_length")?;
            let orig_ctx = u32::try_from(orig).ok().filter(|&c| c > 0).ok_or_else(|| {
                meta.err(
                    "rope.scaling.original_context_length",
                    &format!("is {orig}; it must be a positive 32-bit count"),
                )
            })?;
            let yarn = YarnParams {
                orig_ctx,
                beta_fast: positive("rope.scaling.yarn_beta_fast", 32.0)?,
                beta_slow: positive("rope.scaling.yarn_beta_slow", 1.0)?,
                attn_factor: positive("rope.scaling.attn_factor", 1.0)?,
            };
            Ok((1.0 / factor, Some(yarn)))
        }
        Some(other) => Err(meta.err(
            "rope.scaling.type",
            &format!("is '{other}', which is not supported (none, linear, llama3, yarn)"),
        )),
    }
}

/// What [`crate::ModelConfig`] takes from these keys.
pub(crate) struct ArchExtras {
    pub(crate) sliding_window: Option<usize>,
    pub(crate) attn_scale: f32,
    pub(crate) embed_scale: Option<f32>,
    pub(crate) attn_softcap: Option<f32>,
    pub(crate) final_softcap: Option<f32>,
}

impl ArchExtras {
    pub(crate) fn read(
        meta: &Meta<'_>,
        n_embd: usize,
        n_head: usize,
        head_dim: usize,
    ) -> Result<Self, ModelError> {
        let traits = meta.arch.traits();
        let sliding_window = match traits.swa_period {
            Some(_) => {
                let w = meta.usize_req("attention.sliding_window")?;
                if w == 0 || w > u32::MAX as usize {
                    return Err(meta.err(
                        "attention.sliding_window",
                        &format!("is {w}; it must be a positive 32-bit count of positions"),
                    ));
                }
                Some(w)
            }
            None => None,
        };
        let n_layer = meta.usize_req("block_count")?;
        let query_width = match traits.embd_scaled_query_at_layers {
            Some(layers) if layers == n_layer => n_embd / n_head,
            _ => head_dim,
        };
        let attn_scale = 1.0 / (query_width as f32).sqrt();
        let cap = |key: &str| match meta.file.get(&meta.key(key)) {
            None => Ok(None),
            Some(_) => {
                let cap = meta.f32_req(key)?;
                if cap.is_finite() && cap > 0.0 {
                    Ok(Some(cap))
                } else {
                    Err(meta.err(key, &format!("is {cap}; it must be a positive number")))
                }
            }
        };
        Ok(Self {
            sliding_window,
            attn_scale,
            embed_scale: traits.scaled_embedding.then(|| (n_embd as f32).sqrt()),
            attn_softcap: cap("attn_logit_softcapping")?,
            final_softcap: cap("final_logit_softcapping")?,
        })
    }
}
