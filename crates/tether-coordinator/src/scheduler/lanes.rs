//! Serving with several lanes: the sequences are shared out over lanes, and each lane's
//! step goes through the workers on its own. When a lane's step leaves the last worker it
//! is sampled and the lane's next step enters the first worker at once, while the other
//! lanes' steps are on the other workers, so with a lane per worker every worker stays
//! busy. Lanes hold disjoint sequences; a sequence changes lanes, is reaped or freed only
//! while its lane is not in flight, so a step's output always finds the sequences it was
//! built from.

use super::pipeline::{Done, Job, Jobs, RowsOut, stage_loops};
use super::{Ended, Scheduler, blame};
use crate::load::{LoadedModel, LoadedStage};
use crate::loss::Loss;
use crate::sequence::{Batch, build_step};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

/// A lane's step in flight: its batches and the outputs back so far.
struct InFlight {
    batches: Vec<Arc<Batch>>,
    outputs: Vec<Option<RowsOut>>,
    left: usize,
}

impl Scheduler {
    /// Serves with `self.lanes` lanes through stage loops that stay up meanwhile; the loops
    /// run in this task beside the lanes' driver, so they go on while it waits for a KV
    /// operation or a request.
    pub(super) async fn serve_lanes(
        &mut self,
        stages: &[LoadedStage],
        loaded: &mut LoadedModel,
    ) -> Ended {
        let (jobs, mut done, loops) = stage_loops(stages);
        let driver = self.drive_lanes(stages, loaded, jobs, &mut done);
        tokio::select! {
            ended = driver => return ended,
            () = loops => {}
        }
        // The loops end once one has failed, and that one sent its error (naming its
        // worker) last, after outputs the driver may not have taken yet.
        let mut reason = None;
        while let Ok(out) = done.try_recv() {
            if let Err(e) = out {
                reason = Some(e);
                break;
            }
        }
        let reason = reason.unwrap_or_else(|| {
            Loss::Internal("the workers' stage loops stopped while the model was served".into())
        });
        Ended::Lost(blame(loaded, reason))
    }

    async fn drive_lanes(
        &mut self,
        stages: &[LoadedStage],
        loaded: &mut LoadedModel,
        jobs: Jobs,
        done: &mut mpsc::UnboundedReceiver<Done>,
    ) -> Ended {
        let stop = self.stop.clone();
        let mut flight: Vec<Option<InFlight>> = (0..self.lanes).map(|_| None).collect();
        let mut requests_open = true;
        loop {
            let busy: Vec<bool> = flight.iter().map(Option::is_some).collect();
            if let Err(reason) = self.tidy(stages, &busy).await {
                return Ended::Lost(reason);
            }
            // Past a retiring model's grace no step starts, so the lanes drain.
            let overdue = self
                .retiring
                .as_ref()
                .is_some_and(|r| Instant::now() >= r.deadline);
            // A retired model's requests are ended only while no lane is in flight, so no
            // step's output comes back for sequences that are gone.
            if busy.iter().all(|b| !b)
                && self.retired()
                && let Some(retiring) = self.retiring.take()
            {
                return Ended::Replaced(retiring.replace);
            }
            self.rebalance(&busy);
            if let Err(reason) = self.flush_kv_moves(stages).await {
                return Ended::Lost(reason);
            }
            if !overdue {
                self.launch(stages.len(), &jobs, &mut flight);
            }
            let idle = flight.iter().all(Option::is_none);
            if idle && !requests_open && self.active() == 0 {
                return Ended::Stopped;
            }
            let room = requests_open && self.free_slots() > 0;
            tokio::select! {
                () = stop.cancelled() => return Ended::Stopped,
                reason = loaded.lost() => return Ended::Lost(Loss::SessionEnded(reason)),
                reason = self.setup.workers_changed() => return Ended::Lost(Loss::WorkersChanged(reason)),
                Some(replace) = self.control.recv() => self.begin_retire(replace),
                next = self.requests.recv(), if room && self.held.is_none() => match next {
                    Some(a) => self.take_in(a),
                    None => requests_open = false,
                },
                out = done.recv(), if !idle => {
                    let landed = match out {
                        Some(Ok((lane, k, rows))) => self.land(&mut flight, lane, k, rows),
                        Some(Err(reason)) => Err(reason),
                        None => Err(Loss::Internal("the workers' stage loops stopped".into())),
                    };
                    if let Err(reason) = landed {
                        return Ended::Lost(blame(loaded, reason));
                    }
                }
            }
        }
    }

    /// Sends the next step of every lane that is not in flight and has tokens to feed.
    fn launch(&mut self, stages: usize, jobs: &Jobs, flight: &mut [Option<InFlight>]) {
        let counts = self.lane_counts();
        let lanes_with_work = counts.iter().filter(|&&c| c > 0).count();
        for lane in 0..flight.len() {
            if flight[lane].is_some() || counts[lane] == 0 {
                continue;
            }
            let chunks = build_step(&self.slots, lane, self.step, self.rotation);
            self.rotation = self.rotation.wrapping_add(1);
            if chunks.iter().all(|c| c.tokens.is_empty()) {
                continue;
            }
            // Spare workers (more than lanes) still get groups of the lane's sequences.
            let groups = self.groups(chunks, (stages / self.lanes).max(1));
            self.claim_blocks(&groups);
            let nothing_else = lanes_with_work == 1 && flight.iter().all(Option::is_none);
            let alone = nothing_else && groups.len() == 1;
            let batches: Vec<Arc<Batch>> = groups.into_iter().map(Arc::new).collect();
            for (k, batch) in batches.iter().enumerate() {
                // A stopped loop sends its error as a Done, which ends serving.
                jobs.send(Job {
                    lane,
                    k,
                    batch: Arc::clone(batch),
                    alone,
                });
            }
            flight[lane] = Some(InFlight {
                outputs: (0..batches.len()).map(|_| None).collect(),
                left: batches.len(),
                batches,
            });
        }
    }

    /// Takes the output of batch `k` of `lane`'s step; once the whole step is back, samples
    /// its sequences and frees the lane for its next step.
    fn land(
        &mut self,
        flight: &mut [Option<InFlight>],
        lane: usize,
        k: usize,
        rows: RowsOut,
    ) -> Result<(), Loss> {
        let step = flight
            .get_mut(lane)
            .and_then(Option::as_mut)
            .filter(|f| k < f.outputs.len() && f.outputs[k].is_none())
            .ok_or_else(|| {
                Loss::Internal(format!(
                    "an output came back for lane {lane} batch {k}, which is not in flight"
                ))
            })?;
        step.outputs[k] = Some(rows);
        step.left -= 1;
        if step.left > 0 {
            return Ok(());
        }
        let Some(step) = flight[lane].take() else {
            return Ok(());
        };
        for (batch, out) in step.batches.iter().zip(step.outputs) {
            let out = out.ok_or_else(|| Loss::Internal("a lane's step lost an output".into()))?;
            self.apply(batch, &out)?;
        }
        Ok(())
    }

    /// Evens out the lanes when requests ended unevenly: a sequence of a lane not in
    /// flight that holds two more than another moves to that lane (whose next step, not the
    /// one in flight, takes it).
    fn rebalance(&mut self, busy: &[bool]) {
        let mut counts = self.lane_counts();
        for i in 0..self.slots.len() {
            let Some(seq) = &mut self.slots[i] else {
                continue;
            };
            if busy.get(seq.lane).copied().unwrap_or(false) {
                continue;
            }
            let (fewest, least) = counts
                .iter()
                .copied()
                .enumerate()
                .min_by_key(|&(_, c)| c)
                .unwrap_or((0, 0));
            if counts[seq.lane] > least + 1 {
                counts[seq.lane] -= 1;
                counts[fewest] += 1;
                seq.lane = fewest;
            }
        }
    }
}
