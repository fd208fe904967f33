//! Requests of several choices (the API's `n`): each choice is a sequence of its own, and a
//! request is admitted only when it has a slot for every choice, so two requests can never
//! each hold part of what they need and wait on each other.
//!
//! The choices share the prompt. The first choice starts at once; the others keep their
//! slots reserved and start once the first has fed the prompt but its last token
//! ([`crate::prefix`]), so they share those cells instead of computing them again and run
//! only the last token. Without a prefix cache, on models whose
//! sliding-window layers keep a ring (whose busy slots are never copied), or when the
//! prompt is scored, every choice starts at once and prefills the prompt itself.

use std::time::Instant;

use super::Scheduler;
use crate::api::{GenError, GenRequest};
use crate::sequence::Events;

/// One choice of a request: its own sequence and event channel.
pub(crate) struct Choice {
    pub req: GenRequest,
    pub events: Events,
}

/// A request accepted by `submit`, waiting for a slot for each of its choices.
pub(crate) struct Admitted {
    /// At least one.
    pub choices: Vec<Choice>,
    /// The model epoch it was admitted for.
    pub epoch: u64,
}

impl Admitted {
    /// Ends every choice with `error`.
    pub fn refuse(&self, error: &GenError) {
        for choice in &self.choices {
            let _ = choice.events.try_send(Err(error.clone()));
        }
    }
}

/// Choices whose slots are reserved, waiting for their first choice's prompt.
pub(super) struct Siblings {
    /// The first choice's events, to know it in its slot.
    leader: Events,
    leader_slot: usize,
    /// Prompt tokens the first choice must have fed before the others start.
    ready_at: usize,
    choices: Vec<Choice>,
}

impl Scheduler {
    /// Slots a request taken off the queue may have: free ones not reserved for waiting
    /// choices, and no more than leave `--parallel` running (the other slots only keep
    /// cached prefixes).
    pub(super) fn free_slots(&self) -> usize {
        let free = self.slots.iter().filter(|s| s.is_none()).count();
        let free = free.min(self.setup.shape.n_seq.saturating_sub(self.active()));
        let reserved: usize = self.siblings.iter().map(|s| s.choices.len()).sum();
        free.saturating_sub(reserved)
    }

    /// Whether every choice of `a` has a slot now.
    pub(super) fn fits(&self, a: &Admitted) -> bool {
        a.choices.len() <= self.free_slots()
    }

    /// Starts the first choice of `a` (which fits) and starts or reserves the others.
    pub(super) fn start_choices(&mut self, a: Admitted) {
        let mut choices = a.choices.into_iter();
        let Some(first) = choices.next() else { return };
        let rest: Vec<Choice> = choices.collect();
        let ready_at = self.shared_prompt(&first.req);
        let leader = first.events.clone();
        let leader_slot = self.start(first);
        match leader_slot {
            Some(leader_slot) if ready_at > 0 && !rest.is_empty() => {
                self.siblings.push(Siblings {
                    leader,
                    leader_slot,
                    ready_at,
                    choices: rest,
                });
                self.start_ready_siblings();
            }
            _ => {
                for choice in rest {
                    self.start(choice);
                }
            }
        }
    }

    /// How many prompt tokens of `req` the other choices can copy from its slot once fed:
    /// all but the last (which every choice runs itself); 0 when nothing is copied.
    fn shared_prompt(&self, req: &GenRequest) -> usize {
        let copies = self
            .prefix
            .as_ref()
            .is_some_and(|p| p.copies_between_slots());
        if !copies || req.prompt_logprobs.is_some() {
            return 0;
        }
        req.prompt.len().saturating_sub(1)
    }

    /// Starts the waiting choices whose first choice has fed the shared prompt, or no
    /// longer runs (its slot then holds the prompt for the cache).
    pub(super) fn start_ready_siblings(&mut self) {
        let mut i = 0;
        while i < self.siblings.len() {
            let s = &self.siblings[i];
            let leader = self.slots[s.leader_slot]
                .as_ref()
                .filter(|seq| seq.events.same_channel(&s.leader));
            let ready = leader.is_none_or(|seq| seq.fed.min(seq.prompt_len) >= s.ready_at);
            if !ready {
                i += 1;
                continue;
            }
            let s = self.siblings.remove(i);
            for choice in s.choices {
                self.start(choice);
            }
        }
    }

    /// Forgets waiting choices whose client left, and ends those whose deadline passed.
    pub(super) fn reap_siblings(&mut self) {
        let now = Instant::now();
        for s in &mut self.siblings {
            s.choices.retain(|c| {
                if c.events.is_closed() {
                    return false;
                }
                if c.req.deadline.is_some_and(|d| now >= d) {
                    let _ = c.events.try_send(Err(GenError::Timeout(
                        "the deadline passed while the choice waited for the first one's prompt"
                            .into(),
                    )));
                    return false;
                }
                true
            });
        }
        self.siblings.retain(|s| !s.choices.is_empty());
    }

    /// Ends every waiting choice, and a request held for the model served, with `error`.
    pub(super) fn fail_waiting(&mut self, error: &GenError) {
        for s in self.siblings.drain(..) {
            for c in s.choices {
                let _ = c.events.try_send(Err(error.clone()));
            }
        }
        let epoch = self.epoch;
        if let Some(a) = self.held.take_if(|a| a.epoch <= epoch) {
            a.refuse(error);
        }
    }
}
