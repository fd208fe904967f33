//! Forward calls whose hidden states stay on the devices: the input copied from the
//! previous stage's hand-off slot ([`StepInput::Lent`]), the output left in this stage's
//! ([`StepOutput::Slot`]). A call with no tokens is the pipeline's probe of whether two
//! stages can hand over at all.

use tether_compute::{Backend, ComputeError, SharedArea};
use tether_model::{BatchToken, ModelError, Stage, StepInput, StepOutput};
use tether_protocol::{ForwardInput, ForwardOutput, Result, Rows, WorkerError};

use super::{ModelStage, model_error};

/// Allocations a session keeps open: the previous stage's session, and room for a few
/// more should the coordinator's sessions there change.
const MAX_BORROWED: usize = 4;

impl<B: Backend> ModelStage<B> {
    /// A call with no tokens: the slot's area (nothing run), or the lent allocation opened.
    pub(super) fn probe(&mut self, input: &ForwardInput, rows: Rows) -> Result<ForwardOutput> {
        if let ForwardInput::Lent(area) = input {
            self.view(area)?;
        }
        match rows {
            Rows::HandOff(s) => self
                .stage
                .slot_area(s as usize)
                .and_then(|a| a.prefix(0).map_err(lent))
                .map(ForwardOutput::Lent)
                .map_err(|e| model_error("forward: hand-off probe", e)),
            _ => Ok(ForwardOutput::Hidden(Vec::new())),
        }
    }

    /// The index in `borrowed` of the opened allocation `area` lies in, opening it the
    /// first time.
    pub(super) fn view(&mut self, area: &SharedArea) -> Result<usize> {
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

/// A decode step of `batch` from `input` whose output is left in hand-off slot `slot`.
pub(super) fn hand_off<B: Backend>(
    stage: &mut Stage<B>,
    batch: &[BatchToken],
    input: StepInput<'_, B::Borrowed>,
    slot: usize,
) -> Result<ForwardOutput> {
    let mut area = None;
    stage
        .decode_step(input, batch, StepOutput::Slot(slot, &mut area))
        .map_err(|e| model_error("forward: decode step", e))?;
    area.map(ForwardOutput::Lent)
        .ok_or_else(|| WorkerError::Internal("a hand-off named no slot".into()))
}
