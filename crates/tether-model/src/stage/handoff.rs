//! Hand-off slots: a stage whose output is hidden states leaves a micro-batch's in one on
//! its device and lends it ([`SharedArea`]); the stage after copies it from there, GPU to
//! GPU, instead of the host carrying it ([`StepInput::Lent`](super::StepInput::Lent),
//! [`StepOutput::Slot`](super::StepOutput::Slot)).

use tether_compute::{Backend, SharedArea};

use super::Stage;
use super::forward::REPLAY_MAX_TOKENS;
use crate::error::{ModelError, compute};

/// Fails unless a step of `n` tokens may hand its hidden states over: replayed steps (up to
/// [`REPLAY_MAX_TOKENS`]) would repeat the copy they recorded.
pub(super) fn handed_over(n: usize) -> Result<(), ModelError> {
    if n <= REPLAY_MAX_TOKENS {
        return Err(ModelError::InvalidArgument(format!(
            "hidden states are handed between devices in steps of more than \
             {REPLAY_MAX_TOKENS} tokens, not {n}"
        )));
    }
    Ok(())
}

impl<B: Backend> Stage<B> {
    /// Fails unless the stage has hand-off slot `s`.
    pub(super) fn check_slot(&self, s: usize) -> Result<(), ModelError> {
        if s >= self.scratch.handoff.len() {
            return Err(ModelError::InvalidArgument(format!(
                "hand-off slot {s} of a stage with {}",
                self.scratch.handoff.len()
            )));
        }
        Ok(())
    }

    /// Copies the step's `bytes` of hidden states into slot `s` and waits for the copy:
    /// the stage after reads the slot once this one has answered.
    pub(super) fn fill_slot(&mut self, s: usize, bytes: usize) -> Result<SharedArea, ModelError> {
        self.check_slot(s)?;
        let slot = &mut self.scratch.handoff[s];
        self.backend
            .copy(&self.scratch.hidden, slot, bytes)
            .map_err(compute("filling a hand-off slot"))?;
        let area = self.slot_area(s)?;
        self.backend
            .synchronize()
            .map_err(compute("finishing a hand-off"))?;
        area.prefix(bytes as u64)
            .map_err(compute("lending a hand-off slot"))
    }

    /// The whole range of slot `s` as the stage after would open it: what a pipeline
    /// probes with before it hands anything over. Fails with
    /// [`ModelError::FailedPrecondition`] where the backend lends no memory.
    pub fn slot_area(&self, s: usize) -> Result<SharedArea, ModelError> {
        self.check_slot(s)?;
        self.backend
            .share(&self.scratch.handoff[s])
            .map_err(compute("lending a hand-off slot"))?
            .ok_or_else(|| {
                ModelError::FailedPrecondition("this stage's backend lends no device memory".into())
            })
    }
}
