//! Single-process generation: one [`Stage`] holding the whole model, for `tether run`,
//! `eval` and `bench`.

use std::sync::Arc;

use tether_compute::Backend;
use tether_gguf::{GgmlType, GgufFile};

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::kv::BatchToken;
use crate::sampling::Sampler;
use crate::stage::{Stage, StageSpec, StepInput, StepOutput};
use crate::stop::{StopReason, StopRules, Verdict};

/// Bytes uploaded per `load_tensor` call, so a device backend never stages a whole tensor.
const LOAD_CHUNK: usize = 64 << 20;

/// Builds a stage of `spec` from `file` and uploads its tensors from the file's mapping.
pub fn load_stage_from_file<B: Backend>(
    backend: Arc<B>,
    file: &GgufFile,
    spec: StageSpec,
) -> Result<Stage<B>, ModelError> {
    let cfg = ModelConfig::from_gguf(file)?;
    let slots = crate::required_tensors(&cfg, &spec, file.tensors())?;
    let mut stage = Stage::new(backend, cfg, spec, &slots)?;
    for slot in &slots {
        let info = file
            .tensor(&slot.name)
            .ok_or_else(|| ModelError::MissingTensor(slot.name.clone()))?;
        let data = file.tensor_data(info);
        if data.len() as u64 != slot.bytes {
            return Err(ModelError::InvalidArgument(format!(
                "tensor '{}' in '{}': {} data bytes, {} expected; the file is truncated",
                slot.name,
                file.path(),
                data.len(),
                slot.bytes
            )));
        }
        for (i, chunk) in data.chunks(LOAD_CHUNK).enumerate() {
            stage.load_tensor(&slot.name, (i * LOAD_CHUNK) as u64, chunk)?;
        }
    }
    stage.finish_load()?;
    Ok(stage)
}

/// Runs a whole model in one process on sequence 0 of a stage holding every layer.
pub struct Generator<B: Backend> {
    stage: Stage<B>,
}

impl<B: Backend> Generator<B> {
    /// Loads every layer, the embedding and the head of `file` with one sequence of `ctx`
    /// cells and micro-batches of `ubatch` tokens, with an f16 KV cache.
    pub fn from_file(
        backend: Arc<B>,
        file: &GgufFile,
        ctx: usize,
        ubatch: usize,
    ) -> Result<Self, ModelError> {
        Self::from_file_with_cache(backend, file, ctx, ubatch, GgmlType::F16, GgmlType::F16)
    }

    /// As [`Self::from_file`], with the K and V caches stored as `cache_k` and `cache_v`
    /// (see [`StageSpec::cache_k`]).
    pub fn from_file_with_cache(
        backend: Arc<B>,
        file: &GgufFile,
        ctx: usize,
        ubatch: usize,
        cache_k: GgmlType,
        cache_v: GgmlType,
    ) -> Result<Self, ModelError> {
        let n_layer = ModelConfig::from_gguf(file)?.n_layer;
        let spec = StageSpec::whole_model(n_layer, ctx, 1, ubatch, cache_k, cache_v);
        Self::new(load_stage_from_file(backend, file, spec)?)
    }

    /// Wraps a loaded stage, which must hold the whole model.
    pub fn new(stage: Stage<B>) -> Result<Self, ModelError> {
        let s = stage.spec();
        if s.first_layer != 0
            || s.last_layer != stage.config().n_layer
            || !s.has_embed
            || !s.has_head
        {
            return Err(ModelError::InvalidArgument(
                "a generator needs a stage with every layer, the embedding and the head".into(),
            ));
        }
        Ok(Self { stage })
    }

    /// The stage (for accounting).
    pub fn stage(&self) -> &Stage<B> {
        &self.stage
    }

    /// Runs `tokens` at positions `start..` of sequence 0; returns the last hidden states of
    /// the tokens whose index is in `keep_from..`.
    fn run(
        &mut self,
        tokens: &[u32],
        start: u32,
        keep_from: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let e = self.stage.config().n_embd;
        let ub = self.stage.spec().ubatch;
        let mut kept = Vec::with_capacity((tokens.len() - keep_from.min(tokens.len())) * e);
        let mut hidden = vec![0.0f32; ub.min(tokens.len()) * e];
        for (ci, chunk) in tokens.chunks(ub).enumerate() {
            let first = ci * ub;
            let h = &mut hidden[..chunk.len() * e];
            self.stage.embed(chunk, h)?;
            let batch: Vec<BatchToken> = (0..chunk.len())
                .map(|i| BatchToken {
                    seq: 0,
                    pos: start + (first + i) as u32,
                })
                .collect();
            self.stage.forward(&batch, h)?;
            let from = keep_from.saturating_sub(first).min(chunk.len());
            kept.extend_from_slice(&h[from * e..]);
        }
        Ok(kept)
    }

    /// Logits `[tokens.len()][n_vocab]` of `tokens` from an empty context.
    pub fn eval_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        self.check_fits(tokens.len())?;
        self.stage.kv_clear(0)?;
        let hidden = self.run(tokens, 0, 0)?;
        let mut out = vec![0.0f32; tokens.len() * self.stage.config().n_vocab];
        self.stage.logits(&hidden, tokens.len(), &mut out)?;
        Ok(out)
    }

    /// Logits `[n_vocab]` of the last of `tokens`, run from an empty context: a prompt's
    /// prefill, as llama-bench's `pp` test measures it (the head runs for one token only).
    pub fn prefill_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        self.check_fits(tokens.len())?;
        self.stage.kv_clear(0)?;
        let mut out = vec![0.0f32; self.stage.config().n_vocab];
        self.prefill_last(tokens, &mut out)?;
        Ok(out)
    }

    /// Runs `tokens` from position 0 a micro-batch at a time, each through the stage as one
    /// decode step: the hidden states never leave the device (three 8 MiB copies a
    /// 512-token micro-batch of an 8B model on the host path), and the head runs for the
    /// last token only, into `logits`.
    fn prefill_last(&mut self, tokens: &[u32], logits: &mut [f32]) -> Result<(), ModelError> {
        let ub = self.stage.decode_step_tokens().max(1);
        let last = tokens.len().div_ceil(ub).saturating_sub(1);
        for (ci, chunk) in tokens.chunks(ub).enumerate() {
            let batch: Vec<BatchToken> = (0..chunk.len())
                .map(|i| BatchToken {
                    seq: 0,
                    pos: (ci * ub + i) as u32,
                })
                .collect();
            let (rows, out) = if ci == last {
                (&[chunk.len() as u32 - 1][..], &mut *logits)
            } else {
                (&[][..], &mut [][..])
            };
            self.stage.decode_step_rows(
                StepInput::Ids(chunk),
                &batch,
                rows,
                StepOutput::Logits(out),
            )?;
        }
        Ok(())
    }

    fn check_fits(&self, n: usize) -> Result<(), ModelError> {
        let ctx = self.stage.spec().ctx_per_seq;
        if n == 0 || n > ctx {
            return Err(ModelError::InvalidArgument(format!(
                "{n} tokens do not fit a context of {ctx} (at least one token is needed)"
            )));
        }
        Ok(())
    }

    /// Generates up to `n_predict` tokens after `prompt` (from an empty context), calling
    /// `on_token` with each; stops early at a token in `eog`, a full context, or when
    /// `on_token` returns false. Returns the generated tokens and why it stopped.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        n_predict: usize,
        sampler: &mut Sampler,
        eog: &[u32],
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<(Vec<u32>, StopReason), ModelError> {
        self.check_fits(prompt.len())?;
        self.stage.kv_clear(0)?;
        let v = self.stage.config().n_vocab;
        let ctx = self.stage.spec().ctx_per_seq;
        let mut history = prompt.to_vec();
        let mut logits = vec![0.0f32; v];
        self.prefill_last(prompt, &mut logits)?;
        let mut out = Vec::new();
        let rules = StopRules {
            max_tokens: n_predict,
            ctx,
        };
        if let Some(why) = rules.before_first() {
            return Ok((out, why));
        }
        // A greedy sampler's next token is found on the device: one id is downloaded a step
        // instead of every logit.
        let mut chosen = None;
        loop {
            let tok = match chosen.take() {
                Some(t) => t,
                None => sampler.sample(&logits, &history),
            };
            let verdict = rules.on_sampled(eog.contains(&tok), out.len(), history.len());
            if verdict == Verdict::Discard {
                return Ok((out, StopReason::EndOfGeneration));
            }
            out.push(tok);
            history.push(tok);
            if !on_token(tok) {
                return Ok((out, StopReason::Callback));
            }
            if let Verdict::KeepAndEnd(why) = verdict {
                return Ok((out, why));
            }
            // Embedding, layers and head in one call: the hidden state stays on the device.
            let at = BatchToken {
                seq: 0,
                pos: (history.len() - 1) as u32,
            };
            if sampler.is_greedy() {
                let mut id = [0];
                let next = StepOutput::ArgMax(&mut id);
                self.stage
                    .decode_step(StepInput::Ids(&[tok]), &[at], next)?;
                chosen = Some(id[0]);
            } else {
                self.stage.decode_logits(&[tok], &[at], &mut logits)?;
            }
        }
    }
}
