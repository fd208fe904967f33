//! Forward calls whose hidden states stay on the devices: the input copied from the
//! previous stage's hand-off slot, the output left in this stage's (see
//! `tether_model::Stage::forward_from`). A call with no tokens is the pipeline's probe of
//! whether two stages can hand over at all.

use tether_compute::{Backend, ComputeError, SharedArea};
use tether_model::{BatchToken, ModelError, StepInput, StepOutput};
use tether_protocol::{ForwardInput, ForwardOutput, Result, Rows, WorkerError};

use super::{ModelStage, model_error};

/// Allocations a session keeps open: the previous stage's session, and room for a few
/// more should the coordinator's sessions there change.
const MAX_BORROWED: usize = 4;

impl<B: Backend> ModelStage<B> {
    /// [`ModelStage::forward`] for a call with lent input or asking for a hand-off: a
    /// decode step (one micro-batch, hidden states kept on the device) whose input is
    /// copied from the previous stage's slot, or whose output is left in this one's.
    pub(super) fn hand_over(
        &mut self,
        batch: &[BatchToken],
        input: &ForwardInput,
        logits_rows: &[u32],
        rows: Rows,
        targets: &[u32],
    ) -> Result<ForwardOutput> {
        let slot = match rows {
            Rows::HandOff(s) => Some(s as usize),
            _ => None,
        };
        let view = match input {
            ForwardInput::Lent(area) => Some(self.view(area)?),
            _ => None,
        };
        if batch.is_empty() {
            return match slot {
                Some(s) => self
                    .stage
                    .slot_area(s)
                    .and_then(|a| a.prefix(0).map_err(lent))
                    .map(ForwardOutput::Lent)
                    .map_err(|e| model_error("forward: hand-off probe", e)),
                None => Ok(ForwardOutput::Hidden(Vec::new())),
            };
        }
        let n = batch.len();
        let increasing = logits_rows.windows(2).all(|w| w[0] < w[1]);
        if n > self.stage.decode_step_tokens() || !increasing || rows == Rows::Embeddings {
            return Err(WorkerError::InvalidArgument(format!(
                "forward: hidden states are handed over in one micro-batch (at most {} \
                 tokens) with increasing logits rows, not for embeddings",
                self.stage.decode_step_tokens()
            )));
        }
        let step_input = match (input, view) {
            (ForwardInput::Lent(area), Some(i)) => StepInput::Lent(&self.borrowed[i].1, area),
            (ForwardInput::Hidden(h), _) => StepInput::Hidden(h),
            (ForwardInput::TokenIds(ids), _) => StepInput::Ids(ids),
            (ForwardInput::Lent(_), None) => {
                return Err(WorkerError::Internal("a hand-off lost its view".into()));
            }
        };
        let began = std::time::Instant::now();
        let out = match slot {
            Some(s) => {
                let mut area = None;
                self.stage
                    .decode_step(step_input, batch, StepOutput::Slot(s, &mut area))
                    .map_err(|e| model_error("forward: decode step", e))?;
                let area =
                    area.ok_or_else(|| WorkerError::Internal("a hand-off named no slot".into()))?;
                ForwardOutput::Lent(area)
            }
            None => {
                let all_rows = logits_rows.iter().copied().eq(0..n as u32);
                let chosen = (!all_rows).then_some(logits_rows);
                Self::decode_step(
                    &mut self.stage,
                    self.shape,
                    batch,
                    step_input,
                    chosen,
                    rows,
                    targets,
                )?
            }
        };
        tracing::trace!(
            tokens = n,
            us = began.elapsed().as_micros() as u64,
            lent_in = view.is_some(),
            slot,
            "stage forward, handed over"
        );
        Ok(out)
    }

    /// The index in `borrowed` of the opened allocation `area` lies in, opening it the
    /// first time.
    fn view(&mut self, area: &SharedArea) -> Result<usize> {
        if let Some(i) = self
            .borrowed
            .iter()
            .position(|(a, _)| a.same_allocation(area))
        {
            return Ok(i);
        }
        let opened = self
            .stage
            .backend()
            .open_shared(area)
            .map_err(|e| model_error("forward: opening lent hidden states", lent(e)))?;
        if self.borrowed.len() >= MAX_BORROWED {
            self.borrowed.remove(0);
        }
        self.borrowed.push((*area, opened));
        Ok(self.borrowed.len() - 1)
    }
}

/// Lending refused: the caller's to change (it falls back to hidden states on the host).
fn lent(e: ComputeError) -> ModelError {
    match e {
        ComputeError::NotShared(m) => ModelError::FailedPrecondition(m),
        other => ModelError::Compute {
            what: "handing over hidden states".into(),
            source: other,
        },
    }
}
