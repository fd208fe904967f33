//! `--context-shift` and `--keep`, as llama.cpp names them, shared by `run` and `serve`.

use clap::Args;
use tether_coordinator::api::ContextShift;

/// What a generation does when it fills its context.
#[derive(Args, Debug, Clone, Default)]
pub struct ContextShiftArgs {
    /// When a generation fills its context, drop the oldest half of the tokens after the
    /// first --keep and go on (the kept tail is fed again), instead of ending it with
    /// finish_reason "length".
    #[arg(long)]
    pub context_shift: bool,
    /// Tokens at the start of the context that a shift never drops.
    #[arg(long, default_value_t = 0, requires = "context_shift")]
    pub keep: usize,
}

impl ContextShiftArgs {
    /// The policy, or `None` without --context-shift.
    pub fn policy(&self) -> Option<ContextShift> {
        self.context_shift
            .then_some(ContextShift { keep: self.keep })
    }
}
