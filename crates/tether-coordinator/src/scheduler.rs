//! The scheduler task: owns the loaded model, gives each request a sequence slot, runs each
//! step's batch of every active sequence through the workers (cut into groups of sequences
//! that are in flight on different workers at once), samples, and reports. When a
//! worker's session ends it fails the in-flight requests, closes the other sessions and
//! loads again in the background over the workers that answer. A model replaced through
//! the admin API is swapped at a step boundary ([`replace`]).

mod apply;
mod choices;
mod lanes;
mod ledger;
mod pick;
mod pipeline;
pub(crate) mod replace;

use crate::api::{FinishReason, GenError, GenEvent, Health};
use crate::constraint::Picked;
use crate::engine::Setup;
use crate::load::{LoadedModel, LoadedStage};
use crate::loss::Loss;
use crate::model_file::ModelFile;
use crate::placement::Plan;
use crate::prefix::{KvMove, Placement, PrefixCache, apply_kv_moves, slot_uses};
use crate::sequence::{
    Batch, Embedding, Next, RowUse, Sequence, StepShape, build_step, split_batch, split_off,
};
use choices::Siblings;
pub(crate) use choices::{Admitted, Choice};
use ledger::KvLedger;
use pipeline::{RowsOut, clear_slots, rows_wanted, run_pipeline, truncate_slots};
use replace::{Replace, Retiring};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tether_compute::KV_BLOCK_CELLS;
use tether_model::plan::kv_blocks_per_seq;
use tether_model::{Sampler, kv_ring};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// What the front sends the scheduler: requests, and model replacements.
pub(crate) struct Inbox {
    pub requests: mpsc::Receiver<Admitted>,
    pub control: mpsc::Receiver<Replace>,
}

/// What the engine's front and the scheduler share.
pub(crate) struct Shared {
    pub health: Mutex<Health>,
    pub plan: Mutex<Option<Plan>>,
    pub running: AtomicUsize,
    /// Requests taken off the queue that wait for slots (one at most: a request of
    /// several choices waiting for room for all of them, or one for the next model).
    pub held: AtomicUsize,
    pub generated_tokens: AtomicU64,
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens whose KV cells were reused instead of prefilled.
    pub prefix_hit_tokens: AtomicU64,
    /// Cached prefixes whose cells were given up for room in the KV pool.
    pub prefix_evictions: AtomicU64,
    /// Blocks in each worker's paged KV pool, and those no slot holds.
    pub kv_blocks: AtomicUsize,
    pub kv_blocks_free: AtomicUsize,
}

impl Shared {
    pub fn new(plan: Option<Plan>, health: Health) -> Self {
        Self {
            health: Mutex::new(health),
            plan: Mutex::new(plan),
            running: AtomicUsize::new(0),
            held: AtomicUsize::new(0),
            generated_tokens: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            prefix_hit_tokens: AtomicU64::new(0),
            prefix_evictions: AtomicU64::new(0),
            kv_blocks: AtomicUsize::new(0),
            kv_blocks_free: AtomicUsize::new(0),
        }
    }

    pub fn health(&self) -> Health {
        self.health
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn set_health(&self, health: Health) {
        *self.health.lock().unwrap_or_else(|e| e.into_inner()) = health;
    }

    pub fn plan(&self) -> Option<Plan> {
        self.plan.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// How serving a loaded model ended.
enum Ended {
    Stopped,
    Lost(Loss),
    /// Retired for a replacement; the old sessions are closed.
    Replaced(Replace),
}

/// What the scheduler does next.
enum Step {
    Serve(LoadedModel),
    Recover(Loss),
    /// No model is loaded (unloaded through the admin API).
    Idle,
}

/// The scheduler's state.
pub(crate) struct Scheduler {
    pub shared: Arc<Shared>,
    pub requests: mpsc::Receiver<Admitted>,
    pub stop: CancellationToken,
    pub model: Arc<ModelFile>,
    pub setup: Setup,
    pub retry_every: Duration,
    /// Replacements from the front.
    control: mpsc::Receiver<Replace>,
    /// The epoch of the model served (or last served).
    epoch: u64,
    /// How long a retired model's requests may run on before they are ended.
    grace: Duration,
    /// The first request for the next model, waiting for the switch, or one whose choices
    /// wait for enough free slots.
    held: Option<Admitted>,
    /// Choices of running requests waiting for their first choice's prompt.
    siblings: Vec<Siblings>,
    retiring: Option<Retiring>,
    slots: Vec<Option<Sequence>>,
    to_clear: Vec<u32>,
    /// `(slot, cells to keep)` of sequences whose context was shifted.
    to_truncate: Vec<(u32, usize)>,
    /// What each slot's cells hold, with prefix caching on.
    prefix: Option<PrefixCache>,
    /// Prefixes to copy between slots, and free slots whose cells the KV pool needs back
    /// (see `make_room`), before the next step, in this order.
    kv_moves: Vec<KvMove>,
    /// The workers' block tables, as the moves above and the steps leave them.
    ledger: KvLedger,
    rotation: usize,
    /// Lanes of the model being served (1: every step carries every sequence).
    lanes: usize,
    /// How a step is cut over the workers of the model being served.
    step: StepShape,
}

impl Scheduler {
    pub fn new(
        shared: Arc<Shared>,
        inbox: Inbox,
        stop: CancellationToken,
        model: Arc<ModelFile>,
        setup: Setup,
        retry_every: Duration,
        grace: Duration,
    ) -> Self {
        let Inbox { requests, control } = inbox;
        // Cached-prefix sequences are slots too: they never run, they keep cells.
        let n_seq = setup.shape.n_seq + setup.shape.cached_seqs;
        let setup_ubatch = setup.shape.ubatch;
        let ring = kv_ring(model.config(), setup.shape.ctx_per_seq, setup.shape.ubatch);
        let prefix = setup.prefix_cache.then(|| PrefixCache::new(n_seq, ring));
        let ledger = KvLedger::new(setup.shape);
        Self {
            shared,
            requests,
            stop,
            model,
            setup,
            retry_every,
            control,
            epoch: 0,
            grace,
            held: None,
            siblings: Vec::new(),
            retiring: None,
            slots: (0..n_seq).map(|_| None).collect(),
            to_clear: Vec::new(),
            to_truncate: Vec::new(),
            prefix,
            kv_moves: Vec::new(),
            ledger,
            rotation: 0,
            lanes: 1,
            step: StepShape::new(setup_ubatch, 1, 1),
        }
    }

    /// Serves until stopped, loading again whenever a worker is lost or the worker list
    /// changes. `first` is the first load, or why it failed (then loading is retried).
    pub async fn run(mut self, first: Result<LoadedModel, Loss>) {
        let mut step = match first {
            Ok(model) => Step::Serve(model),
            Err(reason) => Step::Recover(reason),
        };
        loop {
            let replace = match step {
                Step::Serve(model) => match self.serve(model).await {
                    Ended::Stopped => break,
                    Ended::Lost(reason) => {
                        step = Step::Recover(reason);
                        continue;
                    }
                    Ended::Replaced(r) => r,
                },
                Step::Recover(reason) => match self.recover(reason).await {
                    Ok(Some(m)) => {
                        step = Step::Serve(m);
                        continue;
                    }
                    Ok(None) => break,
                    Err(r) => r,
                },
                Step::Idle => match self.idle().await {
                    Some(r) => r,
                    None => break,
                },
            };
            step = self.switch(replace).map_or(Step::Idle, Step::Serve);
        }
        let reason = "the coordinator has shut down";
        self.shared
            .set_health(Health::Unavailable(reason.to_string()));
        self.requests.close();
        let mut held = self.held.take();
        let error = GenError::Unavailable(reason.to_string());
        while let Some(a) = held.take().or_else(|| self.requests.try_recv().ok()) {
            a.refuse(&error);
        }
    }

    fn active(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// Takes the request out of slot `i`: its cells are kept for prefix reuse, or cleared
    /// before the next step without it. The caller sends its last event afterwards, so a
    /// client that sees it sees the counters already updated.
    fn free(&mut self, i: usize) -> Option<Sequence> {
        let seq = self.slots[i].take();
        if let Some(seq) = &seq {
            match &mut self.prefix {
                Some(prefix) => prefix.release(i, &seq.tokens[..seq.fed]),
                None => self.to_clear.push(seq.slot),
            }
        }
        self.shared.running.store(self.active(), Ordering::Relaxed);
        seq
    }

    /// Ends cancelled requests (receiver dropped) and those past their deadline, but none
    /// of a lane that is `busy` (in flight: its step's output will come back for them).
    fn reap(&mut self, busy: &[bool]) {
        self.reap_siblings();
        let now = Instant::now();
        for i in 0..self.slots.len() {
            let Some(seq) = &self.slots[i] else { continue };
            if busy.get(seq.lane).copied().unwrap_or(false) {
                continue;
            }
            let cancelled = seq.events.is_closed();
            if !cancelled && seq.deadline.is_none_or(|d| now < d) {
                continue;
            }
            if let Some(seq) = self.free(i)
                && !cancelled
            {
                seq.send(Err(GenError::Timeout(format!(
                    "the deadline passed after {} generated tokens",
                    seq.generated
                ))));
            }
        }
    }

    /// Gives a choice a free slot, or ends it at once when there is nothing to do; the
    /// slot it took.
    fn start(&mut self, choice: Choice) -> Option<usize> {
        let Choice { req, events } = choice;
        if req.deadline.is_some_and(|d| Instant::now() >= d) {
            let _ = events.try_send(Err(GenError::Timeout(
                "the deadline passed while the request was queued".into(),
            )));
            return None;
        }
        if req.max_tokens == 0 && req.prompt_logprobs.is_none() && req.embed.is_none() {
            let _ = events.try_send(Ok(GenEvent::Done {
                finish: FinishReason::Length,
                prompt_tokens: req.prompt.len(),
                completion_tokens: 0,
            }));
            return None;
        }
        // Scoring or embedding the prompt needs the rows of its positions: nothing is
        // reused.
        let reused: &[u32] = match (req.prompt_logprobs, req.embed) {
            (None, None) => &req.prompt,
            _ => &[],
        };
        let most = req.prompt.len() + req.max_tokens;
        let Some((i, cached)) = self.place(reused, most) else {
            let _ = events.try_send(Err(GenError::Internal(
                "no free sequence slot for an admitted request".into(),
            )));
            return None;
        };
        let lane = self.quietest_lane();
        self.slots[i] = Some(Sequence {
            slot: i as u32,
            lane,
            prompt_len: req.prompt.len(),
            tokens: req.prompt,
            fed: cached,
            generated: 0,
            dropped: 0,
            max_tokens: req.max_tokens,
            sampler: Sampler::new(req.sampling),
            deadline: req.deadline,
            stop_tokens: req.stop_tokens,
            events,
            logprobs: req.logprobs,
            prompt_logprobs: req.prompt_logprobs,
            prompt_scores: req.prompt_logprobs.map(|_| vec![None]),
            scored: None,
            constraint: req.constraint,
            needs_logits: false,
            embed: req.embed.map(Embedding::new),
        });
        self.shared.running.store(self.active(), Ordering::Relaxed);
        Some(i)
    }

    /// A free slot for `prompt`, of a request that may reach `most` positions, and how many
    /// of its first tokens that slot's cells will hold before the next step (copies between
    /// slots queued for it).
    fn place(&mut self, prompt: &[u32], most: usize) -> Option<(usize, usize)> {
        let Some(prefix) = &mut self.prefix else {
            return Some((self.slots.iter().position(Option::is_none)?, 0));
        };
        let keep = self.setup.context_shift.map(|s| s.keep);
        let p = prefix.place(prompt, &slot_uses(&self.slots, keep))?;
        tracing::debug!(
            slot = p.slot,
            cached = p.cached,
            held_before = p.held_before,
            copy_from = ?p.copy_from,
            prompt = prompt.len(),
            "prefix cache placement"
        );
        // The copy goes first: evictions to make room may take its source.
        if let Some(from) = p.copy_from {
            self.queue_kv_move(KvMove::Copy {
                from: from as u32,
                to: p.slot as u32,
                cells: p.cached as u32,
            });
        }
        self.make_room(&p, most);
        self.shared
            .prefix_hit_tokens
            .fetch_add(p.cached as u64, Ordering::Relaxed);
        Some((p.slot, p.cached))
    }

    /// Queues `m` for every worker before the next step, and makes it in the ledger now.
    fn queue_kv_move(&mut self, m: KvMove) {
        self.ledger.apply(m);
        self.kv_moves.push(m);
        self.publish_kv_blocks();
    }

    /// With cached-prefix sequences sharing the workers' KV pool (`ServeShape::cached_seqs`),
    /// keeps the blocks the running sequences may still claim within the pool's free ones
    /// once the request placed at `p` (reaching `most` positions) starts: each may write up
    /// to its prompt and `max_tokens` (within the context), past the whole blocks it holds.
    /// While they do not fit, the least recently used cached slot gives its cells up; the
    /// blocks it shares with other slots stay theirs, which the ledger knows. The running
    /// sequences alone always fit (at most `--parallel` of them), so this never waits.
    fn make_room(&mut self, p: &Placement, most: usize) {
        let shape = self.setup.shape;
        if self.prefix.is_none() || shape.cached_seqs == 0 {
            return;
        }
        // The slot's cells past the reused prompt are stale: let their blocks go now (a
        // copy into the slot empties it on the workers anyway).
        if p.copy_from.is_none() && p.held_before > p.cached {
            self.queue_kv_move(KvMove::Truncate {
                slot: p.slot as u32,
                keep: p.cached as u32,
            });
        }
        let blocks = |n: usize| kv_blocks_per_seq(n.min(shape.ctx_per_seq));
        // A partly written last block counts as still to claim: it may be shared, and a
        // write into it then takes a copy.
        let to_claim =
            |end: usize, fed: usize| blocks(end).saturating_sub(fed / KV_BLOCK_CELLS as usize);
        let needed: usize = self
            .slots
            .iter()
            .flatten()
            .map(|s| to_claim(s.prompt_len + s.max_tokens, s.fed))
            .sum::<usize>()
            + to_claim(most, p.cached);
        let keep = self.setup.context_shift.map(|s| s.keep);
        let uses = slot_uses(&self.slots, keep);
        while needed > self.ledger.counts().1 {
            let Some(prefix) = &mut self.prefix else {
                return;
            };
            let Some(i) = prefix.eviction_candidate(&uses, p.slot) else {
                break;
            };
            prefix.forget(i);
            self.queue_kv_move(KvMove::Truncate {
                slot: i as u32,
                keep: 0,
            });
            self.shared.prefix_evictions.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Before a step: makes the queued copies between slots and gives the KV pool back
    /// what evicted slots held, on every worker (the ledger has them already).
    async fn flush_kv_moves(&mut self, stages: &[LoadedStage]) -> Result<(), Loss> {
        apply_kv_moves(stages, &mut self.kv_moves).await
    }

    /// A step's batches claim the blocks their tokens write, as on the workers.
    fn claim_blocks(&mut self, batches: &[Batch]) {
        for b in batches {
            self.ledger.write(&b.tokens);
        }
        self.publish_kv_blocks();
    }

    fn publish_kv_blocks(&self) {
        let (total, free) = self.ledger.counts();
        self.shared.kv_blocks.store(total, Ordering::Relaxed);
        self.shared.kv_blocks_free.store(free, Ordering::Relaxed);
    }

    fn admit(&mut self) {
        self.start_ready_siblings();
        let epoch = self.epoch;
        let startable = self
            .held
            .as_ref()
            .is_some_and(|a| a.epoch == epoch && self.fits(a));
        if startable && let Some(a) = self.held.take() {
            self.start_choices(a);
        }
        while self.held.is_none() && self.free_slots() > 0 {
            match self.requests.try_recv() {
                Ok(a) => self.take_in(a),
                Err(_) => break,
            }
        }
    }

    /// Fails every running request and forgets their slots.
    fn fail_all(&mut self, error: &GenError) {
        self.fail_waiting(error);
        for slot in &mut self.slots {
            if let Some(seq) = slot.take() {
                seq.send(Err(error.clone()));
            }
        }
        self.to_clear.clear();
        self.to_truncate.clear();
        // The sessions, and the cells they held, end with the model.
        self.kv_moves.clear();
        if let Some(prefix) = &mut self.prefix {
            prefix.clear();
        }
        self.shared.running.store(0, Ordering::Relaxed);
    }

    async fn serve(&mut self, mut loaded: LoadedModel) -> Ended {
        let stages = loaded.stages.clone();
        self.ledger.reset();
        self.publish_kv_blocks();
        let n = stages.len();
        self.lanes = self
            .setup
            .lanes
            .unwrap_or(n)
            .clamp(1, self.setup.shape.n_seq.max(1));
        self.step = StepShape::new(self.setup.shape.ubatch, n, self.setup.prefill_chunk);
        let ended = if self.lanes == 1 {
            self.serve_steps(&stages, &mut loaded).await
        } else {
            self.serve_lanes(&stages, &mut loaded).await
        };
        // A model being retired is not loaded again when it is lost meanwhile; stopping
        // while retiring drops the replacement, which the front hears of.
        let ended = match (self.retiring.take(), ended) {
            (Some(retiring), Ended::Lost(_)) => Ended::Replaced(retiring.replace),
            (_, ended) => ended,
        };
        let reason = match &ended {
            Ended::Stopped => "the coordinator is shutting down".to_string(),
            Ended::Lost(r) => format!("{r}; the model is not served until it is loaded again"),
            Ended::Replaced(_) => "the model was replaced or unloaded".to_string(),
        };
        if !matches!(ended, Ended::Replaced(_)) {
            self.shared.set_health(Health::Unavailable(reason.clone()));
        }
        self.fail_all(&GenError::Unavailable(reason));
        loaded.close().await;
        ended
    }

    /// Serves with one lane: each step carries every sequence through the workers, then
    /// every sequence is sampled before the next step starts.
    async fn serve_steps(&mut self, stages: &[LoadedStage], loaded: &mut LoadedModel) -> Ended {
        let stop = self.stop.clone();
        loop {
            if let Err(reason) = self.tidy(stages, &[]).await {
                return Ended::Lost(reason);
            }
            if self.retired()
                && let Some(retiring) = self.retiring.take()
            {
                return Ended::Replaced(retiring.replace);
            }
            if self.active() == 0 {
                tokio::select! {
                    () = stop.cancelled() => return Ended::Stopped,
                    reason = loaded.lost() => return Ended::Lost(Loss::SessionEnded(reason)),
                    reason = self.setup.workers_changed() => return Ended::Lost(Loss::WorkersChanged(reason)),
                    Some(replace) = self.control.recv() => self.begin_retire(replace),
                    next = self.requests.recv(), if self.held.is_none() => match next {
                        Some(a) => self.take_in(a),
                        None => return Ended::Stopped,
                    },
                }
                continue;
            }
            if let Err(reason) = self.flush_kv_moves(stages).await {
                return Ended::Lost(reason);
            }
            let chunks = build_step(&self.slots, 0, self.step, self.rotation);
            self.rotation = self.rotation.wrapping_add(1);
            let groups = self.groups(chunks, stages.len());
            self.claim_blocks(&groups);
            let masks = pick::start_masks(&mut self.slots);
            let began = std::time::Instant::now();
            let results = tokio::select! {
                () = stop.cancelled() => return Ended::Stopped,
                reason = loaded.lost() => return Ended::Lost(Loss::SessionEnded(reason)),
                reason = self.setup.workers_changed() => return Ended::Lost(Loss::WorkersChanged(reason)),
                r = run_pipeline(stages, &groups) => r,
            };
            let passed = began.elapsed();
            for (i, e) in pick::finish_masks(&mut self.slots, masks).await {
                if let Some(seq) = self.free(i) {
                    seq.send(Err(e));
                }
            }
            let applied = results.and_then(|outputs| {
                groups
                    .iter()
                    .zip(outputs)
                    .try_for_each(|(b, out)| self.apply(b, &out))
            });
            if let Err(reason) = applied {
                return Ended::Lost(blame(loaded, reason));
            }
            // A step's shape and where its time went (TETHER_LOG=tether_coordinator::scheduler=trace).
            tracing::trace!(
                tokens = groups.iter().map(|b| b.tokens.len()).sum::<usize>(),
                sampled = groups.iter().map(|b| b.sample_for.len()).sum::<usize>(),
                groups = groups.len(),
                running = self.active(),
                pipeline_us = passed.as_micros() as u64,
                after_us = (began.elapsed() - passed).as_micros() as u64,
                "step"
            );
        }
    }

    /// Between steps: takes replacements in, ends the cancelled and late requests of lanes
    /// not `busy`, forgets the cells of shifted and freed sequences on every worker, and
    /// admits waiting requests.
    async fn tidy(&mut self, stages: &[LoadedStage], busy: &[bool]) -> Result<(), Loss> {
        while let Ok(replace) = self.control.try_recv() {
            self.begin_retire(replace);
        }
        self.reap(busy);
        for &(slot, keep) in &self.to_truncate {
            self.ledger
                .keep(slot, u32::try_from(keep).unwrap_or(u32::MAX));
        }
        for &slot in &self.to_clear {
            self.ledger.keep(slot, 0);
        }
        self.publish_kv_blocks();
        truncate_slots(stages, &mut self.to_truncate).await?;
        clear_slots(stages, &mut self.to_clear).await?;
        self.admit();
        self.shared
            .held
            .store(usize::from(self.held.is_some()), Ordering::Relaxed);
        Ok(())
    }

    /// The forward passes of a step's `chunks`: one chunk is cut into `groups` groups of
    /// sequences; a row that needs every logit goes alone, so the others still come
    /// reduced, and so do the embedding requests' rows, which want normed hidden states;
    /// each asks the last worker for what its rows need.
    fn groups(&self, mut chunks: Vec<Batch>, groups: usize) -> Vec<Batch> {
        let chunks = match chunks.len() {
            1 => split_batch(chunks.remove(0), groups),
            _ => chunks,
        };
        let slots = &self.slots;
        let mut out: Vec<Batch> = chunks
            .into_iter()
            .flat_map(|g| split_off(g, |i| slots[i].as_ref().is_some_and(|s| s.needs_logits)))
            .flat_map(|g| split_off(g, |i| slots[i].as_ref().is_some_and(|s| s.embed.is_some())))
            .collect();
        for g in &mut out {
            g.rows = rows_wanted(slots, g);
        }
        out
    }

    /// The lane with the fewest sequences (the first of them on a tie).
    fn quietest_lane(&self) -> usize {
        let counts = self.lane_counts();
        (0..self.lanes).min_by_key(|&l| counts[l]).unwrap_or(0)
    }

    /// Sequences per lane.
    fn lane_counts(&self) -> Vec<usize> {
        let lanes = self.lanes.max(1);
        let mut counts = vec![0; lanes];
        for seq in self.slots.iter().flatten() {
            counts[seq.lane.min(lanes - 1)] += 1;
        }
        counts
    }

    /// Loads again every `retry_every` until it works or the coordinator stops; requests
    /// meanwhile are refused.
    /// `Err` carries a replacement that came meanwhile (the lost model is not loaded again).
    async fn recover(&mut self, reason: Loss) -> Result<Option<LoadedModel>, Replace> {
        let stop = self.stop.clone();
        let every = self.retry_every;
        loop {
            let wait = tokio::time::sleep(every);
            tokio::pin!(wait);
            loop {
                tokio::select! {
                    () = stop.cancelled() => return Ok(None),
                    () = &mut wait => break,
                    Some(replace) = self.control.recv() => return Err(replace),
                    next = self.requests.recv(), if self.held.is_none() => match next {
                        Some(a) if a.epoch > self.epoch => self.held = Some(a),
                        Some(a) => a.refuse(&GenError::Unavailable(self.shared.health_text())),
                        None => return Ok(None),
                    },
                }
            }
            tracing::info!("loading the model again after: {reason}");
            let attempt = tokio::select! {
                () = stop.cancelled() => return Ok(None),
                r = self.setup.connect_and_load(&self.model, false) => r,
            };
            match attempt {
                Ok((loaded, plan)) => {
                    tracing::info!("model loaded again:\n{plan}");
                    *self.shared.plan.lock().unwrap_or_else(|e| e.into_inner()) = Some(plan);
                    self.shared.set_health(Health::Ready);
                    return Ok(Some(loaded));
                }
                Err(e) => {
                    tracing::warn!("loading again failed: {e}");
                    self.shared.set_health(Health::Unavailable(format!(
                        "{reason}; loading again failed: {e}; retrying every {} s",
                        every.as_secs_f64()
                    )));
                }
            }
        }
    }
}

impl Shared {
    fn health_text(&self) -> String {
        match self.health() {
            Health::Ready => "the model is being loaded again".to_string(),
            Health::Unavailable(why) => why,
        }
    }
}

/// Why serving stopped when a call failed with `reason`: a lost session shuts every data
/// link, so the call that fails first may be on a worker that is still up; the loss,
/// recorded before, is then the cause.
fn blame(loaded: &LoadedModel, reason: Loss) -> Loss {
    loaded.lost_reason().map_or(reason, Loss::SessionEnded)
}
