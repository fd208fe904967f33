//! The hyper-parameters only some architectures have (sliding windows, attention scale
//! overrides, embedding scale, logit soft-capping), read from GGUF metadata as llama.cpp's
//! converter writes it.

use crate::config::Meta;
use crate::error::ModelError;

/// What [`crate::ModelConfig`] takes from these keys.
pub(crate) struct ArchExtras {
    pub(crate) sliding_window: Option<usize>,
    pub(crate) attn_scale: f32,
    pub(crate) embed_scale: Option<f32>,
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
        if meta.file.get(&meta.key("attn_logit_softcapping")).is_some() {
            return Err(meta.err(
                "attn_logit_softcapping",
                "is set: attention logit soft-capping (Gemma 2) is not supported yet",
            ));
        }
        let final_softcap = match meta.file.get(&meta.key("final_logit_softcapping")) {
            None => None,
            Some(_) => {
                let cap = meta.f32_req("final_logit_softcapping")?;
                if !(cap.is_finite() && cap > 0.0) {
                    return Err(meta.err(
                        "final_logit_softcapping",
                        &format!("is {cap}; it must be a positive number"),
                    ));
                }
                Some(cap)
            }
        };
        Ok(Self {
            sliding_window,
            attn_scale,
            embed_scale: traits.scaled_embedding.then(|| (n_embd as f32).sqrt()),
            final_softcap,
        })
    }
}
