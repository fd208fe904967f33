//! Hidden states handed from one worker's GPU to the next's without the host: the first
//! leaves a batch's output in one of its hand-off slots ([`Rows::HandOff`]) and answers
//! with where; the next copies it from there ([`ForwardInput::Lent`]). This side names
//! the slots: one goes back only once the next worker has answered the pass that read it
//! (`handoff_probe` finds the pairs of workers that can).
//! Over two GPUs of one host a 512-token prompt chunk's 8 MiB then crosses NVLink instead
//! of two sockets, the coordinator and two host copies.

use std::sync::{Arc, Mutex};

use tokio::sync::Semaphore;

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
    pub(crate) fn new(slots: usize) -> Self {
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
