//! The model side of a worker on a compute backend: plans and builds layer blocks with
//! `tether_model::Stage`, which allocates all of a block's device memory when built and
//! frees it when dropped.

mod handoff;

use handoff::hand_off;

use crate::stage::{PlannedStage, ServingStage, StageFactory, StageShape, TensorNeed};
use std::sync::Arc;
use tether_compute::{Backend, ComputeError, CpuBackend};
use tether_gguf::GgufFile;
use tether_model::{
    BatchToken, ModelConfig, ModelError, Stage, StageSpec, StepInput, StepOutput, TensorSlot,
    plan_stage,
};
use tether_protocol::{BlockSpec, ForwardInput, ForwardOutput, Rows, TokenPos};
use tether_protocol::{Result, WorkerError};

/// The largest model file a Prepare may describe (1 TiB): bounds the header check below.
const MAX_FILE_BYTES: u64 = 1 << 40;

/// Builds layer blocks on backend `B`.
pub struct ModelStageFactory<B: Backend> {
    backend: Arc<B>,
}

impl<B: Backend> ModelStageFactory<B> {
    /// A factory building on `backend`.
    pub fn new(backend: Arc<B>) -> Self {
        Self { backend }
    }
}

/// The worker error for a model error: bad input stays INVALID_ARGUMENT, a device that
/// cannot give the memory is RESOURCE_EXHAUSTED.
fn model_error(what: &str, e: ModelError) -> WorkerError {
    let msg = format!("{what}: {e}");
    match e {
        ModelError::FailedPrecondition(_) => WorkerError::FailedPrecondition(msg),
        ModelError::Compute {
            source: ComputeError::OutOfMemory {
                requested, free, ..
            },
            ..
        } => WorkerError::ResourceExhausted {
            what: msg,
            asked: requested,
            free,
            limit: free,
            held: 0,
        },
        ModelError::Compute { .. } | ModelError::Io { .. } => WorkerError::Internal(msg),
        _ => WorkerError::InvalidArgument(msg),
    }
}

/// Parses a GGUF header sent without its tensor data, checking every tensor against the
/// file length the coordinator names. Only the header's own bytes are held: the length is
/// a number from the network and must not size an allocation.
fn parse_header(header: &[u8], file_bytes: u64) -> Result<GgufFile> {
    if file_bytes > MAX_FILE_BYTES || (header.len() as u64) > file_bytes {
        return Err(WorkerError::InvalidArgument(format!(
            "prepare: a {}-byte GGUF header cannot start a {file_bytes}-byte file (limit {MAX_FILE_BYTES})",
            header.len()
        )));
    }
    GgufFile::from_header(
        "GGUF header from the coordinator",
        header.to_vec(),
        file_bytes,
    )
    .map_err(|e| {
        WorkerError::InvalidArgument(format!("prepare: the GGUF header does not parse: {e}"))
    })
}

impl<B: Backend> StageFactory for ModelStageFactory<B> {
    fn device_name(&self) -> String {
        self.backend.name()
    }

    fn holds_host_memory(&self) -> bool {
        std::any::TypeId::of::<B>() == std::any::TypeId::of::<CpuBackend>()
    }

    fn memory_info(&self) -> Result<(u64, u64)> {
        let m = self
            .backend
            .memory_info()
            .map_err(|e| WorkerError::Internal(format!("reading device memory: {e}")))?;
        Ok((m.total, m.free))
    }

    fn process_device_bytes(&self) -> Option<u64> {
        self.backend.process_memory()
    }

    fn plan(
        &self,
        gguf_header: &[u8],
        file_bytes: u64,
        spec: &BlockSpec,
    ) -> Result<Box<dyn PlannedStage>> {
        let file = parse_header(gguf_header, file_bytes)?;
        let cfg = ModelConfig::from_gguf(&file)
            .map_err(|e| model_error("prepare: reading hyper-parameters", e))?;
        let model_spec = StageSpec::from(spec);
        let slots = tether_model::required_tensors(&cfg, &model_spec, file.tensors())
            .map_err(|e| model_error("prepare: planning the layer block", e))?;
        let total_bytes = plan_stage(&cfg, &model_spec, &slots).total_bytes;
        let needs = slots
            .iter()
            .map(|s| TensorNeed {
                name: s.name.clone(),
                bytes: s.bytes,
            })
            .collect();
        Ok(Box::new(PlannedModelStage {
            backend: Arc::clone(&self.backend),
            cfg,
            spec: *spec,
            slots,
            needs,
            total_bytes,
        }))
    }
}

struct PlannedModelStage<B: Backend> {
    backend: Arc<B>,
    cfg: ModelConfig,
    spec: BlockSpec,
    slots: Vec<TensorSlot>,
    needs: Vec<TensorNeed>,
    total_bytes: u64,
}

impl<B: Backend> PlannedStage for PlannedModelStage<B> {
    fn tensors(&self) -> &[TensorNeed] {
        &self.needs
    }

    fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    fn build(self: Box<Self>) -> Result<Box<dyn ServingStage>> {
        let shape = StageShape {
            n_embd: self.cfg.n_embd,
            n_vocab: self.cfg.n_vocab,
            spec: self.spec,
        };
        let stage = Stage::new(
            self.backend,
            self.cfg,
            StageSpec::from(&self.spec),
            &self.slots,
        )
        .map_err(|e| model_error("prepare: allocating the layer block", e))?;
        Ok(Box::new(ModelStage {
            stage,
            shape,
            borrowed: Vec::new(),
        }))
    }
}

struct ModelStage<B: Backend> {
    stage: Stage<B>,
    shape: StageShape,
    /// Allocations of the previous stage's sessions this one copies hidden states from
    /// (see `handoff`), opened once; closed with the session.
    borrowed: Vec<(tether_compute::SharedArea, B::Borrowed)>,
}

impl<B: Backend> ModelStage<B> {
    /// A decode step with the hidden states kept on the device from input to output: the
    /// next stage's hidden states, every logit, or arg-max tokens (greedy rows) or top
    /// candidates (sampled rows) found on the device.
    ///
    /// `logits_rows`: the tokens whose head output is wanted, `None` for every token; with
    /// none at all, the hidden states are the output.
    fn decode_step(
        stage: &mut Stage<B>,
        shape: StageShape,
        batch: &[BatchToken],
        input: StepInput<'_, B::Borrowed>,
        logits_rows: Option<&[u32]>,
        rows: Rows,
        targets: &[u32],
    ) -> Result<ForwardOutput> {
        let hidden_out = logits_rows.is_some_and(<[u32]>::is_empty);
        let step = |stage: &mut Stage<B>, out| {
            let stepped = match logits_rows {
                Some(chosen) if !hidden_out => stage.decode_step_rows(input, batch, chosen, out),
                _ => stage.decode_step(input, batch, out),
            };
            stepped.map_err(|e| model_error("forward: decode step", e))
        };
        if hidden_out {
            let mut h = vec![0.0; batch.len() * shape.n_embd];
            step(stage, StepOutput::Hidden(&mut h))?;
            return Ok(ForwardOutput::Hidden(h));
        }
        // One output row per head row.
        let n = logits_rows.map_or(batch.len(), <[u32]>::len);
        if rows == Rows::ArgMax {
            let mut ids = vec![0; n];
            step(stage, StepOutput::ArgMax(&mut ids))?;
            Ok(ForwardOutput::ArgMax(ids))
        } else if let Rows::LogProbs(k) = rows {
            let mut top = vec![Vec::new(); n];
            let mut scores = vec![(0.0, 0.0); n];
            let out = StepOutput::Scored {
                k: k as usize,
                targets,
                top: &mut top,
                scores: &mut scores,
            };
            step(stage, out)?;
            Ok(ForwardOutput::Scored {
                counts: top.iter().map(|r| r.len() as u32).collect(),
                candidates: top.concat(),
                scores,
            })
        } else if let Rows::Top(k) = rows {
            let mut top = vec![Vec::new(); n];
            step(stage, StepOutput::Top(k as usize, &mut top))?;
            Ok(ForwardOutput::Top {
                counts: top.iter().map(|r| r.len() as u32).collect(),
                candidates: top.concat(),
            })
        } else {
            let mut logits = vec![0.0; n * shape.n_vocab];
            step(stage, StepOutput::Logits(&mut logits))?;
            Ok(ForwardOutput::Logits(logits))
        }
    }

    /// What the call's `logits_rows` ask for, from the batch's hidden states on the host.
    fn rows_out(
        &mut self,
        hidden: Vec<f32>,
        logits_rows: &[u32],
        rows: Rows,
    ) -> Result<ForwardOutput> {
        let n_embd = self.shape.n_embd;
        if logits_rows.is_empty() {
            return Ok(ForwardOutput::Hidden(hidden));
        }
        let mut rows_in = Vec::with_capacity(logits_rows.len() * n_embd);
        for &r in logits_rows {
            let start = r as usize * n_embd;
            let row = hidden.get(start..start + n_embd).ok_or_else(|| {
                WorkerError::InvalidArgument(format!(
                    "forward: logits row {r} is outside the batch"
                ))
            })?;
            rows_in.extend_from_slice(row);
        }
        if rows == Rows::Embeddings {
            let mut normed = vec![0.0; logits_rows.len() * n_embd];
            self.stage
                .output_normed(&rows_in, logits_rows.len(), &mut normed)
                .map_err(|e| model_error("forward: output norm", e))?;
            return Ok(ForwardOutput::Embeddings(normed));
        }
        let mut logits = vec![0.0; logits_rows.len() * self.shape.n_vocab];
        self.stage
            .logits(&rows_in, logits_rows.len(), &mut logits)
            .map_err(|e| model_error("forward: output head", e))?;
        Ok(ForwardOutput::Logits(logits))
    }
}

impl<B: Backend> ServingStage for ModelStage<B> {
    fn shape(&self) -> StageShape {
        self.shape
    }

    fn load_tensor(&mut self, name: &str, offset: u64, data: &[u8]) -> Result<()> {
        self.stage
            .load_tensor(name, offset, data)
            .map_err(|e| model_error("prepare: loading a tensor", e))
    }

    fn finish_load(&mut self) -> Result<()> {
        self.stage
            .finish_load()
            .map_err(|e| model_error("prepare: finishing the load", e))
    }

    fn forward(
        &mut self,
        tokens: &[TokenPos],
        input: ForwardInput,
        logits_rows: &[u32],
        rows: Rows,
        targets: &[u32],
    ) -> Result<ForwardOutput> {
        let n_embd = self.shape.n_embd;
        let batch: Vec<BatchToken> = tokens
            .iter()
            .map(|t| BatchToken {
                seq: t.seq,
                pos: t.pos,
            })
            .collect();
        let n = tokens.len();
        let handing = matches!(input, ForwardInput::Lent(_)) || matches!(rows, Rows::HandOff(_));
        if n == 0 && handing {
            return self.probe(&input, rows);
        }
        // Prompt chunks beside decode tokens (only some rows want logits) take the decode
        // step too: the head, the selection and the hidden states stay on the device. So
        // do hidden states handed over device to device (one micro-batch at most).
        let increasing = logits_rows.windows(2).all(|w| w[0] < w[1]);
        if n > 0 && n <= self.stage.decode_step_tokens() && increasing && rows != Rows::Embeddings {
            let view = match &input {
                ForwardInput::Lent(area) => Some(self.view(area)?),
                _ => None,
            };
            let input = match (&input, view) {
                (ForwardInput::TokenIds(ids), _) => StepInput::Ids(ids.as_slice()),
                (ForwardInput::Hidden(h), _) => StepInput::Hidden(h.as_slice()),
                (ForwardInput::Lent(area), Some(i)) => StepInput::Lent(&self.borrowed[i].1, area),
                (ForwardInput::Lent(_), None) => {
                    return Err(WorkerError::Internal("lent input lost its view".into()));
                }
            };
            if let Rows::HandOff(slot) = rows {
                return hand_off(&mut self.stage, &batch, input, slot as usize);
            }
            let all_rows = logits_rows.iter().copied().eq(0..n as u32);
            let chosen = (!all_rows).then_some(logits_rows);
            let shape = self.shape;
            return Self::decode_step(&mut self.stage, shape, &batch, input, chosen, rows, targets);
        }
        if handing {
            return Err(WorkerError::InvalidArgument(format!(
                "forward: hidden states are handed over in one micro-batch (at most {} \
                 tokens) with increasing logits rows, not for embeddings",
                self.stage.decode_step_tokens()
            )));
        }
        let mut hidden = match input {
            ForwardInput::Hidden(h) => h,
            ForwardInput::Lent(_) => {
                return Err(WorkerError::Internal(
                    "lent input reached the host path".into(),
                ));
            }
            ForwardInput::TokenIds(ids) => {
                let mut h = vec![0.0; ids.len() * n_embd];
                self.stage
                    .embed(&ids, &mut h)
                    .map_err(|e| model_error("forward: embedding", e))?;
                h
            }
        };
        let began = std::time::Instant::now();
        self.stage
            .forward(&batch, &mut hidden)
            .map_err(|e| model_error("forward", e))?;
        tracing::trace!(
            tokens = n,
            us = began.elapsed().as_micros() as u64,
            "stage forward"
        );
        self.rows_out(hidden, logits_rows, rows)
    }

    fn kv_clear(&mut self, seq: u32) -> Result<()> {
        self.stage
            .kv_clear(seq)
            .map_err(|e| model_error("kv clear", e))
    }

    fn kv_truncate(&mut self, seq: u32, length: u32) -> Result<()> {
        self.stage
            .kv_truncate(seq, length)
            .map(|_kept| ())
            .map_err(|e| model_error("kv truncate", e))
    }

    fn kv_copy(&mut self, src: u32, dst: u32, length: u32) -> Result<()> {
        self.stage
            .kv_copy(src, dst, length)
            .map_err(|e| model_error("kv copy", e))
    }

    fn bytes(&self) -> u64 {
        self.stage.bytes()
    }

    fn kv_pool(&self) -> (u64, u64) {
        let (blocks, free) = self.stage.kv_pool();
        (blocks as u64, free as u64)
    }
}
