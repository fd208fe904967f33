//! Hidden states handed from one worker's GPU to the next's without the host: the first
//! leaves a batch's output in one of its hand-off slots ([`Rows::HandOff`]) and answers
//! with where; the next copies it from there ([`ForwardInput::Lent`]). This side names
//! the slots: one goes back only once the next worker has answered the pass that read it.
//! Over two GPUs of one host a 512-token prompt chunk's 8 MiB then crosses NVLink instead
//! of two sockets, the coordinator and two host copies.

use std::sync::{Arc, Mutex};

use tether_model::plan::HANDOFF_SLOTS;
use tether_protocol::{ForwardCall, ForwardInput, ForwardOutput, Rows};
use tokio::sync::Semaphore;

use crate::load::LoadedStage;
use crate::stage_call;

/// Batches of fewer tokens go through the host: the steps that replay recorded graphs (8
/// tokens and under) cannot take a lent input, and a few more tokens' hidden states are
/// a pinned copy of a few KiB each way.
pub(crate) const HANDOFF_MIN_TOKENS: usize = 16;

/// The hand-off slots of one worker's session, for the edge to the next worker.
pub struct Handoff {
    free: Mutex<Vec<u32>>,
    ready: Semaphore,
}

/// A slot taken for one batch: back to its [`Handoff`] when dropped, which the pipeline
/// does once the next worker has answered the pass that copied from it (or the batch
/// failed).
pub(crate) struct SlotLease {
    slot: u32,
    from: Arc<Handoff>,
}

impl SlotLease {
    pub(crate) fn slot(&self) -> u32 {
        self.slot
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        self.from
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(self.slot);
        self.from.ready.add_permits(1);
    }
}

impl Handoff {
    fn new(slots: usize) -> Self {
        Self {
            free: Mutex::new((0..slots as u32).rev().collect()),
            ready: Semaphore::new(slots),
        }
    }

    /// A free slot, waiting for one to come back.
    pub(crate) async fn take(self: &Arc<Self>) -> SlotLease {
        // The semaphore is never closed; a permit stands for one slot in `free`.
        if let Ok(permit) = self.ready.acquire().await {
            permit.forget();
        }
        let slot = self
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .unwrap_or(0);
        SlotLease {
            slot,
            from: Arc::clone(self),
        }
    }
}

/// Asks each pair of neighbouring workers whether the first can lend its slots and the
/// next open them (both on GPUs of one host, over data links), and sets
/// [`LoadedStage::handoff`] where they can. A refusal is no error: those stages pass
/// hidden states through the host as before.
pub(crate) async fn probe(stages: &mut [LoadedStage]) {
    for i in 1..stages.len() {
        let (before, after) = stages.split_at_mut(i);
        let (from, to) = (&mut before[i - 1], &after[0]);
        let linked = |st: &LoadedStage| st.link.as_ref().is_some_and(|l| l.usable());
        if !linked(from) || !linked(to) {
            continue;
        }
        match try_pair(from, to).await {
            Ok(()) => {
                tracing::info!(
                    from = %from.client.addr(),
                    to = %to.client.addr(),
                    "hidden states go device to device between these workers"
                );
                from.handoff = Some(Arc::new(Handoff::new(HANDOFF_SLOTS)));
            }
            Err(why) => tracing::info!(
                from = %from.client.addr(),
                to = %to.client.addr(),
                %why,
                "hidden states go through the host between these workers"
            ),
        }
    }
}

async fn try_pair(from: &LoadedStage, to: &LoadedStage) -> Result<(), String> {
    let call = |input, rows| ForwardCall {
        tokens: Vec::new(),
        input,
        logits_rows: Vec::new(),
        rows,
        targets: Vec::new(),
    };
    let lent = stage_call::forward(
        from,
        call(ForwardInput::Hidden(Vec::new()), Rows::HandOff(0)),
        false,
    )
    .await
    .map_err(|e| e.to_string())?;
    let ForwardOutput::Lent(area) = lent else {
        return Err("the first worker lent no slot".into());
    };
    stage_call::forward(to, call(ForwardInput::Lent(area), Rows::Logits), false)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_slot_is_taken_once_and_the_next_waits_until_one_comes_back() {
        let handoff = Arc::new(Handoff::new(3));
        let (a, b, c) = (
            handoff.take().await,
            handoff.take().await,
            handoff.take().await,
        );
        let mut slots = vec![a.slot(), b.slot(), c.slot()];
        slots.sort_unstable();
        assert_eq!(slots, [0, 1, 2], "three distinct slots");
        let waiting = tokio::time::timeout(Duration::from_millis(50), handoff.take()).await;
        assert!(
            waiting.is_err(),
            "a fourth was handed out while three were out"
        );
        let freed = b.slot();
        let next = tokio::spawn({
            let handoff = Arc::clone(&handoff);
            async move { handoff.take().await.slot() }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !next.is_finished(),
            "the wait ended before a slot came back"
        );
        drop(b);
        let got = tokio::time::timeout(Duration::from_secs(5), next)
            .await
            .expect("the waiter wakes when a slot comes back")
            .expect("the waiter's task");
        assert_eq!(got, freed, "the slot that came back is the one handed out");
        drop((a, c));
    }
}
