//! The forward pass of a stage: embedding, layers, output head — in micro-batches.

use tether_compute::{
    AttnShape, AttnSpan, Backend, GateAct, KvCache, KvCacheMut, Qkv, Rope, Scores,
};

use super::{FfnWeights, Stage, Weight};
use crate::error::{ModelError, compute, compute_in};
use crate::kv::{BatchToken, KvRing, KvState, windowed};

/// The spans of one micro-batch's tokens for global layers and for sliding-window layers
/// (empty when the model has none), and for sliding-window layers that keep a ring their
/// cells and virtual spans (empty without a ring).
#[derive(Clone, Copy)]
pub(super) struct LayerSpans<'a> {
    full: &'a [AttnSpan],
    window: &'a [AttnSpan],
    ring: Option<KvRing>,
    ring_cells: &'a [u32],
    ring_spans: &'a [AttnSpan],
}

pub(super) fn as_bytes(x: &[f32]) -> &[u8] {
    // SAFETY: u8 has alignment 1 and the byte length covers exactly the f32s.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}

pub(super) fn as_bytes_mut(x: &mut [f32]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; every byte pattern is a valid f32.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}

pub(super) fn need_len(what: &str, got: usize, want: usize) -> Result<(), ModelError> {
    if got == want {
        Ok(())
    } else {
        Err(ModelError::InvalidArgument(format!(
            "{what} holds {got} values, {want} expected"
        )))
    }
}

/// Batches of at most this many tokens run as replayable steps (see `Backend::replay`).
pub(super) const REPLAY_MAX_TOKENS: usize = 8;
impl<B: Backend> Stage<B> {
    /// Looks up `ids` in the embedding table into `hidden_out` (`[ids.len()][n_embd]`).
    pub fn embed(&mut self, ids: &[u32], hidden_out: &mut [f32]) -> Result<(), ModelError> {
        self.check_loaded()?;
        let e = self.cfg.n_embd;
        let table = self.embd.ok_or_else(|| {
            ModelError::FailedPrecondition("this stage does not hold the token embedding".into())
        })?;
        need_len("the hidden-state buffer", hidden_out.len(), ids.len() * e)?;
        self.check_ids(ids)?;
        let w = &self.weights[table];
        for (ids, out) in ids
            .chunks(self.spec.ubatch)
            .zip(hidden_out.chunks_mut(self.spec.ubatch * e))
        {
            let hidden = &mut self.scratch.hidden;
            self.backend
                .get_rows(&w.buf, w.ty, e, ids, hidden)
                .map_err(compute("embedding lookup"))?;
            if let Some(f) = self.cfg.embed_scale {
                self.backend
                    .scale(hidden, ids.len() * e, f)
                    .map_err(compute("embedding scale"))?;
            }
            self.backend
                .download(hidden, 0, as_bytes_mut(out))
                .map_err(compute("downloading embeddings"))?;
        }
        Ok(())
    }

    pub(super) fn check_ids(&self, ids: &[u32]) -> Result<(), ModelError> {
        match ids.iter().find(|&&id| id as usize >= self.cfg.n_vocab) {
            Some(bad) => Err(ModelError::InvalidArgument(format!(
                "token id {bad} is outside the vocabulary of {} tokens",
                self.cfg.n_vocab
            ))),
            None => Ok(()),
        }
    }

    /// Runs `hidden` (`[batch.len()][n_embd]`) through the stage's layers in place, writing
    /// each token's keys and values into its sequence's cells. On a bad token nothing changes.
    pub fn forward(&mut self, batch: &[BatchToken], hidden: &mut [f32]) -> Result<(), ModelError> {
        let backend = self.backend.clone();
        backend.scope(|| self.forward_in_scope(batch, hidden))
    }

    fn forward_in_scope(
        &mut self,
        batch: &[BatchToken],
        hidden: &mut [f32],
    ) -> Result<(), ModelError> {
        self.check_loaded()?;
        let e = self.cfg.n_embd;
        need_len("the hidden-state buffer", hidden.len(), batch.len() * e)?;
        let lens = self.kv.check_batch(batch)?;
        self.claim_cells(batch)?;
        let ub = self.spec.ubatch;
        for (toks, h) in batch.chunks(ub).zip(hidden.chunks_mut(ub * e)) {
            self.layers_on_device(toks, |stage| stage.upload_hidden(h))?;
            self.backend
                .download(&self.scratch.hidden, 0, as_bytes_mut(h))
                .map_err(compute("downloading hidden states"))?;
        }
        self.kv.commit(lens);
        Ok(())
    }

    /// Copies `h` into `scratch.hidden`.
    pub(super) fn upload_hidden(&mut self, h: &[f32]) -> Result<(), ModelError> {
        self.backend
            .upload(&mut self.scratch.hidden, 0, as_bytes(h))
            .map_err(compute("uploading hidden states"))
    }

    /// Runs `input`, which puts the hidden states of one micro-batch in `scratch.hidden`,
    /// then the tokens through every layer, writing their keys and values into their cells.
    /// A replayed step holds the input too, so the GPU starts on it with the step's first
    /// piece instead of the host waiting for it alone.
    pub(super) fn layers_on_device(
        &mut self,
        toks: &[BatchToken],
        input: impl FnOnce(&mut Self) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let mut positions = Vec::with_capacity(toks.len());
        let mut cells = Vec::with_capacity(toks.len());
        let mut spans = Vec::with_capacity(toks.len());
        for &t in toks {
            let (cell, span) = self.kv.place(t);
            positions.push(t.pos);
            cells.push(cell);
            spans.push(span);
        }
        let ring = self.kv.ring();
        let (ring_cells, ring_spans): (Vec<u32>, Vec<AttnSpan>) = match ring {
            Some(r) => toks.iter().map(|&t| KvState::place_in_ring(t, r)).unzip(),
            None => Default::default(),
        };
        // Sliding-window layers without a ring see only the last `window` cells of each span.
        let window_spans: Vec<AttnSpan> = match self.cfg.sliding_window {
            Some(w) if ring.is_none() => spans
                .iter()
                .map(|&s| windowed(s, u32::try_from(w).unwrap_or(u32::MAX)))
                .collect(),
            _ => Vec::new(),
        };
        let spans = LayerSpans {
            full: &spans,
            window: &window_spans,
            ring,
            ring_cells: &ring_cells,
            ring_spans: &ring_spans,
        };
        if toks.len() <= REPLAY_MAX_TOKENS {
            // Decode steps repeat the same ops on the same buffers: let the backend
            // replay them (CUDA graphs) instead of issuing each op.
            let mut replays = std::mem::take(&mut self.replays);
            let backend = self.backend.clone();
            let step = backend.replay(&mut replays, toks.len() as u64, || {
                input(self)?;
                (0..self.layers.len()).try_for_each(|i| self.layer(i, &positions, &cells, spans))
            });
            self.replays = replays;
            step.map_err(compute("running a recorded decode step"))??;
        } else {
            input(self)?;
            for i in 0..self.layers.len() {
                self.layer(i, &positions, &cells, spans)?;
            }
        }
        Ok(())
    }

    /// One transformer block over the tokens of one micro-batch in `scratch.hidden`.
    fn layer(
        &mut self,
        i: usize,
        positions: &[u32],
        cells: &[u32],
        spans: LayerSpans<'_>,
    ) -> Result<(), ModelError> {
        let layer_no = self.spec.first_layer + i;
        let sliding = self.cfg.is_sliding(layer_no);
        let (spans, cells, ring_cells) = match (sliding, spans.ring) {
            (true, Some(ring)) => (spans.ring_spans, spans.ring_cells, ring.cells),
            (true, None) => (spans.window, cells, 0),
            (false, _) => (spans.full, cells, 0),
        };
        let rope = self.cfg.layer_rope(layer_no);
        let ce = |op| compute_in(op, layer_no);
        let cfg = &self.cfg;
        let spec = &self.spec;
        let be = &*self.backend;
        let lw = &self.layers[i];
        let w = &self.weights;
        let n = positions.len();
        let (e, qd, kvd, ff) = (cfg.n_embd, cfg.q_dim(), cfg.kv_dim(), cfg.n_ff);
        let s = &mut self.scratch;
        let (Some(normed), Some(ls)) = (s.normed.as_mut(), s.layer.as_mut()) else {
            return Err(ModelError::FailedPrecondition(
                "layer scratch missing from a stage with layers".into(),
            ));
        };
        let (kc, vc) = &mut self.kv_cache[i];
        // Global layers read their cells through the paged pool's block tables.
        let table = self.kv_table.as_ref().filter(|_| ring_cells == 0);
        let freqs = self.rope_freqs.map(|f| &w[f].buf);
        be.rms_norm(&s.hidden, &w[lw.attn_norm].buf, n, e, cfg.rms_eps, normed)
            .map_err(ce("attention norm"))?;
        be.matmul3(
            [
                w[lw.wq].matrix(qd, e),
                w[lw.wk].matrix(kvd, e),
                w[lw.wv].matrix(kvd, e),
            ],
            normed,
            n,
            [&mut ls.q, &mut ls.k, &mut ls.v],
        )
        .map_err(ce("q/k/v projection"))?;
        if let Some([bq, bk, bv]) = lw.bias {
            be.add_bias(&mut ls.q, &w[bq].buf, n, qd)
                .map_err(ce("q bias"))?;
            be.add_bias(&mut ls.k, &w[bk].buf, n, kvd)
                .map_err(ce("k bias"))?;
            be.add_bias(&mut ls.v, &w[bv].buf, n, kvd)
                .map_err(ce("v bias"))?;
        }
        // Qwen3 normalizes each head of Q and K before rope. The norm reads and writes
        // different buffers, so the normed heads go to buffers free until later in the
        // layer (`attn`, and `gate`, sized for keys too) and the attention output to `q`.
        let (q, k, attn_out) = match lw.qk_norm {
            Some([q_norm, k_norm]) => {
                let hd = cfg.head_dim;
                be.rms_norm(
                    &ls.q,
                    &w[q_norm].buf,
                    n * cfg.n_head,
                    hd,
                    cfg.rms_eps,
                    &mut ls.attn,
                )
                .map_err(ce("q norm"))?;
                be.rms_norm(
                    &ls.k,
                    &w[k_norm].buf,
                    n * cfg.n_head_kv,
                    hd,
                    cfg.rms_eps,
                    &mut ls.gate,
                )
                .map_err(ce("k norm"))?;
                (&mut ls.attn, &mut ls.gate, &mut ls.q)
            }
            None => (&mut ls.q, &mut ls.k, &mut ls.attn),
        };
        let shape = AttnShape {
            n_heads: cfg.n_head,
            n_kv_heads: cfg.n_head_kv,
            head_dim: cfg.head_dim,
            ring_cells,
        };
        // Mixed cache types are refused when the stage is planned; the stores are one op.
        debug_assert_eq!(spec.cache_k, spec.cache_v);
        be.rope_and_store(
            Qkv::new(q, k, &ls.v),
            shape,
            positions,
            Rope::new(rope, freqs),
            cells,
            KvCacheMut::new(kc, vc, spec.cache_k),
        )
        .map_err(ce("rope and cache write"))?;
        // Gemma 2 soft-caps the scores; 0 caps nothing.
        let softcap = cfg.attn_softcap.unwrap_or(0.0);
        let cache = KvCache::new(kc, vc, spec.cache_k);
        be.attention_capped(
            q,
            table.map_or(cache, |t| cache.paged(t)),
            spans,
            shape,
            Scores::capped(cfg.attn_scale, softcap),
            attn_out,
        )
        .map_err(ce("attention"))?;
        // Gemma's post-norm uses `up` (free until the feed-forward, at least n_embd wide).
        let post_attn = lw.post_norms.map(|[a, _]| (&w[a].buf, cfg.rms_eps));
        residual_add(
            be,
            &w[lw.wo],
            (e, qd, attn_out, n),
            post_attn,
            &mut s.hidden,
            [normed, &mut ls.up],
        )
        .map_err(ce("attention output"))?;
        be.rms_norm(&s.hidden, &w[lw.ffn_norm].buf, n, e, cfg.rms_eps, normed)
            .map_err(ce("ffn norm"))?;
        // MoE architectures have no post-norms: their experts add into the stream directly.
        let (gate, up, down) = match &lw.ffn {
            FfnWeights::Dense { gate, up, down } => (*gate, *up, *down),
            FfnWeights::Moe(m) => {
                let ms = s.moe.as_mut();
                let (weights, input) = ((m, w.as_slice()), (&*normed, n));
                return super::moe::moe_ffn(be, cfg, weights, input, &mut s.hidden, ms, layer_no);
            }
        };
        let act = if cfg.arch.traits().gelu_gate {
            GateAct::GeluTanh
        } else {
            GateAct::Silu
        };
        if w[gate].ty != w[up].ty {
            // Mixed-type files (some quantization mixes) take the three steps apart.
            be.matmul(w[gate].matrix(ff, e), normed, n, &mut ls.gate)
                .map_err(ce("ffn gate"))?;
            be.matmul(w[up].matrix(ff, e), normed, n, &mut ls.up)
                .map_err(ce("ffn up"))?;
            be.gated(act, &ls.gate, &ls.up, n * ff, &mut ls.act)
                .map_err(ce("gated activation"))?;
        } else {
            be.matmul_gated(
                act,
                [w[gate].matrix(ff, e), w[up].matrix(ff, e)],
                normed,
                n,
                &mut ls.act,
                [&mut ls.gate, &mut ls.up],
            )
            .map_err(ce("ffn gate and up"))?;
        }
        let post_ffw = lw.post_norms.map(|[_, f]| (&w[f].buf, cfg.rms_eps));
        residual_add(
            be,
            &w[down],
            (e, ff, &ls.act, n),
            post_ffw,
            &mut s.hidden,
            [&mut ls.gate, normed],
        )
        .map_err(ce("ffn down"))?;
        Ok(())
    }

    /// Final norm and output head: `out` (`[n_tokens][n_vocab]`) from `hidden`
    /// (`[n_tokens][n_embd]`).
    pub fn logits(
        &mut self,
        hidden: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let backend = self.backend.clone();
        backend.scope(|| self.logits_in_scope(hidden, n_tokens, out))
    }

    fn logits_in_scope(
        &mut self,
        hidden: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        self.check_loaded()?;
        let (e, v) = (self.cfg.n_embd, self.cfg.n_vocab);
        let (Some(norm), Some(head)) = (self.out_norm, self.output) else {
            return Err(ModelError::FailedPrecondition(
                "this stage does not hold the output head".into(),
            ));
        };
        need_len("the hidden-state buffer", hidden.len(), n_tokens * e)?;
        need_len("the logits buffer", out.len(), n_tokens * v)?;
        let ub = self.spec.ubatch;
        for (h, o) in hidden.chunks(ub * e).zip(out.chunks_mut(ub * v)) {
            self.backend
                .upload(&mut self.scratch.hidden, 0, as_bytes(h))
                .map_err(compute("uploading hidden states"))?;
            self.head_on_device(norm, head, h.len() / e, o)?;
        }
        Ok(())
    }

    /// The final norm alone: `out` (`[n_tokens][n_embd]`) from `hidden`, the vectors an
    /// embedding pools (the head's input, as llama.cpp's embeddings and Hugging Face's
    /// `last_hidden_state` are).
    pub fn output_normed(
        &mut self,
        hidden: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let backend = self.backend.clone();
        backend.scope(|| self.output_normed_in_scope(hidden, n_tokens, out))
    }

    fn output_normed_in_scope(
        &mut self,
        hidden: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        self.check_loaded()?;
        let e = self.cfg.n_embd;
        let Some(norm) = self.out_norm else {
            return Err(ModelError::FailedPrecondition(
                "this stage does not hold the output norm".into(),
            ));
        };
        need_len("the hidden-state buffer", hidden.len(), n_tokens * e)?;
        need_len("the embeddings buffer", out.len(), n_tokens * e)?;
        let ub = self.spec.ubatch;
        for (h, o) in hidden.chunks(ub * e).zip(out.chunks_mut(ub * e)) {
            let s = &mut self.scratch;
            let be = &*self.backend;
            be.upload(&mut s.hidden, 0, as_bytes(h))
                .map_err(compute("uploading hidden states"))?;
            let normed = s.normed.as_mut().ok_or_else(head_scratch_missing)?;
            be.rms_norm(
                &s.hidden,
                &self.weights[norm].buf,
                h.len() / e,
                e,
                self.cfg.rms_eps,
                normed,
            )
            .map_err(compute("output norm"))?;
            be.download(normed, 0, as_bytes_mut(o))
                .map_err(compute("downloading normed hidden states"))?;
        }
        Ok(())
    }

    /// The output head over the `n` hidden states in `scratch.hidden`, into `out`.
    pub(super) fn head_on_device(
        &mut self,
        norm: usize,
        head: usize,
        n: usize,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let v = self.cfg.n_vocab;
        self.head_into_scratch(norm, head, n)?;
        let logits = self
            .scratch
            .logits
            .as_ref()
            .ok_or_else(head_scratch_missing)?;
        self.backend
            .download(logits, 0, as_bytes_mut(&mut out[..n * v]))
            .map_err(compute("downloading logits"))
    }

    /// Runs the output head over the `n` hidden states in `scratch.hidden` into
    /// `scratch.logits`.
    pub(super) fn head_into_scratch(
        &mut self,
        norm: usize,
        head: usize,
        n: usize,
    ) -> Result<(), ModelError> {
        let (e, v) = (self.cfg.n_embd, self.cfg.n_vocab);
        let s = &mut self.scratch;
        let (Some(normed), Some(logits)) = (s.normed.as_mut(), s.logits.as_mut()) else {
            return Err(head_scratch_missing());
        };
        let be = &*self.backend;
        let (nw, hw) = (&self.weights[norm], &self.weights[head]);
        be.rms_norm(&s.hidden, &nw.buf, n, e, self.cfg.rms_eps, normed)
            .map_err(compute("output norm"))?;
        be.matmul(hw.matrix(v, e), normed, n, logits)
            .map_err(compute("output head"))?;
        match self.cfg.final_softcap {
            Some(cap) => be
                .softcap(logits, n * v, cap)
                .map_err(compute("logit soft-capping")),
            None => Ok(()),
        }
    }
}

/// Adds `w · x` (`w`: `[rows][cols]`, `x`: `[n][cols]`) into `hidden` (`[n][rows]`): straight into the
/// stream (`scratch[0]` may serve as scratch), or, with Gemma's `post_norm` (weight and
/// epsilon), the product into `scratch[0]`, its norm into `scratch[1]`, then added.
fn residual_add<B: Backend>(
    be: &B,
    w: &Weight<B::Buffer>,
    (rows, cols, x, n): (usize, usize, &B::Buffer, usize),
    post_norm: Option<(&B::Buffer, f32)>,
    hidden: &mut B::Buffer,
    [product, norm_out]: [&mut B::Buffer; 2],
) -> tether_compute::Result<()> {
    match post_norm {
        None => be.matmul_add(w.matrix(rows, cols), x, n, hidden, product),
        Some((norm, eps)) => {
            be.matmul(w.matrix(rows, cols), x, n, product)?;
            be.rms_norm(product, norm, n, rows, eps, norm_out)?;
            be.add(hidden, norm_out, n * rows)
        }
    }
}

pub(super) fn head_scratch_missing() -> ModelError {
    ModelError::FailedPrecondition("head scratch missing".into())
}
