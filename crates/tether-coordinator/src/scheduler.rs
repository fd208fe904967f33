//! The scheduler task: owns the loaded model, gives each request a sequence slot, runs each
//! step's batch of every active sequence through the workers (cut into groups of sequences
//! that are in flight on different workers at once), samples, and reports. When a
//! worker's session ends it fails the in-flight requests, closes the other sessions and
//! loads again in the background over the workers that answer.

mod lanes;

use crate::api::{FinishReason, GenError, GenEvent, GenRequest, Health};
use crate::engine::Setup;
use crate::load::{LoadedModel, LoadedStage};
use crate::loss::Loss;
use crate::model_file::ModelFile;
use crate::pipeline::{RowsOut, rows_wanted, run_pipeline};
use crate::placement::Plan;
use crate::prefix::{CellCopy, PrefixCache, copy_cells, slot_uses};
use crate::sequence::{Batch, Events, Next, Sequence, StepShape, build_step, split_batch};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tether_model::Sampler;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// A request accepted by `submit`, waiting for a slot.
pub(crate) struct Admitted {
    pub req: GenRequest,
    pub events: Events,
}

/// What the engine's front and the scheduler share.
pub(crate) struct Shared {
    pub health: Mutex<Health>,
    pub plan: Mutex<Option<Plan>>,
    pub running: AtomicUsize,
    pub generated_tokens: AtomicU64,
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens whose KV cells were reused instead of prefilled.
    pub prefix_hit_tokens: AtomicU64,
}

impl Shared {
    pub fn new(plan: Option<Plan>, health: Health) -> Self {
        Self {
            health: Mutex::new(health),
            plan: Mutex::new(plan),
            running: AtomicUsize::new(0),
            generated_tokens: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            prefix_hit_tokens: AtomicU64::new(0),
        }
    }

    pub fn health(&self) -> Health {
        self.health
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set_health(&self, health: Health) {
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
}

/// The scheduler's state.
pub(crate) struct Scheduler {
    pub shared: Arc<Shared>,
    pub requests: mpsc::Receiver<Admitted>,
    pub stop: CancellationToken,
    pub model: Arc<ModelFile>,
    pub setup: Setup,
    pub retry_every: Duration,
    slots: Vec<Option<Sequence>>,
    to_clear: Vec<u32>,
    /// `(slot, cells to keep)` of sequences whose context was shifted.
    to_truncate: Vec<(u32, usize)>,
    /// What each slot's cells hold, with prefix caching on.
    prefix: Option<PrefixCache>,
    /// Prefixes to copy between slots before the next step.
    to_copy: Vec<CellCopy>,
    rotation: usize,
    /// Lanes of the model being served (1: every step carries every sequence).
    lanes: usize,
    /// How a step is cut over the workers of the model being served.
    step: StepShape,
}

impl Scheduler {
    pub fn new(
        shared: Arc<Shared>,
        requests: mpsc::Receiver<Admitted>,
        stop: CancellationToken,
        model: Arc<ModelFile>,
        setup: Setup,
        retry_every: Duration,
    ) -> Self {
        let n_seq = setup.shape.n_seq;
        let setup_ubatch = setup.shape.ubatch;
        let prefix = setup.prefix_cache.then(|| PrefixCache::new(n_seq));
        Self {
            shared,
            requests,
            stop,
            model,
            setup,
            retry_every,
            slots: (0..n_seq).map(|_| None).collect(),
            to_clear: Vec::new(),
            to_truncate: Vec::new(),
            prefix,
            to_copy: Vec::new(),
            rotation: 0,
            lanes: 1,
            step: StepShape::new(setup_ubatch, 1, 1),
        }
    }

    /// Serves until stopped, loading again whenever a worker is lost or the worker list
    /// changes. `first` is the first load, or why it failed (then loading is retried).
    pub async fn run(mut self, first: Result<LoadedModel, Loss>) {
        let mut loaded = first;
        loop {
            let reason = match loaded {
                Ok(model) => match self.serve(model).await {
                    Ended::Stopped => break,
                    Ended::Lost(reason) => reason,
                },
                Err(reason) => reason,
            };
            match self.recover(reason).await {
                Some(m) => loaded = Ok(m),
                None => break,
            }
        }
        let reason = "the coordinator has shut down";
        self.shared
            .set_health(Health::Unavailable(reason.to_string()));
        self.requests.close();
        while let Ok(a) = self.requests.try_recv() {
            let _ = a
                .events
                .try_send(Err(GenError::Unavailable(reason.to_string())));
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

    /// Gives a request a free slot, or ends it at once when there is nothing to do.
    fn start(&mut self, a: Admitted) {
        let Admitted { req, events } = a;
        if req.deadline.is_some_and(|d| Instant::now() >= d) {
            let _ = events.try_send(Err(GenError::Timeout(
                "the deadline passed while the request was queued".into(),
            )));
            return;
        }
        if req.max_tokens == 0 {
            let _ = events.try_send(Ok(GenEvent::Done {
                finish: FinishReason::Length,
                prompt_tokens: req.prompt.len(),
                completion_tokens: 0,
            }));
            return;
        }
        let Some((i, cached)) = self.place(&req.prompt) else {
            let _ = events.try_send(Err(GenError::Internal(
                "no free sequence slot for an admitted request".into(),
            )));
            return;
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
        });
        self.shared.running.store(self.active(), Ordering::Relaxed);
    }

    /// A free slot for `prompt` and how many of its first tokens that slot's cells will
    /// hold before the next step (copies between slots queued for it).
    fn place(&mut self, prompt: &[u32]) -> Option<(usize, usize)> {
        let Some(prefix) = &mut self.prefix else {
            return Some((self.slots.iter().position(Option::is_none)?, 0));
        };
        let keep = self.setup.context_shift.map(|s| s.keep);
        let p = prefix.place(prompt, &slot_uses(&self.slots, keep))?;
        if let Some(from) = p.copy_from {
            self.to_copy.push(CellCopy {
                from: from as u32,
                to: p.slot as u32,
                cells: p.cached as u32,
            });
        }
        self.shared
            .prefix_hit_tokens
            .fetch_add(p.cached as u64, Ordering::Relaxed);
        Some((p.slot, p.cached))
    }

    fn admit(&mut self) {
        while self.slots.iter().any(Option::is_none) {
            match self.requests.try_recv() {
                Ok(a) => self.start(a),
                Err(_) => break,
            }
        }
    }

    /// Fails every running request and forgets their slots.
    fn fail_all(&mut self, error: &GenError) {
        for slot in &mut self.slots {
            if let Some(seq) = slot.take() {
                seq.send(Err(error.clone()));
            }
        }
        self.to_clear.clear();
        self.to_truncate.clear();
        // The sessions, and the cells they held, end with the model.
        self.to_copy.clear();
        if let Some(prefix) = &mut self.prefix {
            prefix.clear();
        }
        self.shared.running.store(0, Ordering::Relaxed);
    }

    async fn serve(&mut self, mut loaded: LoadedModel) -> Ended {
        let stages = loaded.stages.clone();
        let n = stages.len();
        self.lanes = self
            .setup
            .lanes
            .unwrap_or(n)
            .clamp(1, self.slots.len().max(1));
        self.step = StepShape::new(self.setup.shape.ubatch, n, self.setup.prefill_chunk);
        let ended = if self.lanes == 1 {
            self.serve_steps(&stages, &mut loaded).await
        } else {
            self.serve_lanes(&stages, &mut loaded).await
        };
        let reason = match &ended {
            Ended::Stopped => "the coordinator is shutting down".to_string(),
            Ended::Lost(r) => format!("{r}; the model is not served until it is loaded again"),
        };
        self.shared.set_health(Health::Unavailable(reason.clone()));
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
            if self.active() == 0 {
                tokio::select! {
                    () = stop.cancelled() => return Ended::Stopped,
                    reason = loaded.lost() => return Ended::Lost(Loss::SessionEnded(reason)),
                    reason = self.setup.workers_changed() => return Ended::Lost(Loss::WorkersChanged(reason)),
                    next = self.requests.recv() => match next {
                        Some(a) => self.start(a),
                        None => return Ended::Stopped,
                    },
                }
                continue;
            }
            if let Err(reason) = copy_cells(stages, &mut self.to_copy).await {
                return Ended::Lost(reason);
            }
            let mut chunks = build_step(&self.slots, 0, self.step, self.rotation);
            self.rotation = self.rotation.wrapping_add(1);
            let mut groups = match chunks.len() {
                1 => split_batch(chunks.remove(0), stages.len()),
                _ => chunks,
            };
            for g in &mut groups {
                g.rows = rows_wanted(&self.slots, g);
            }
            let results = tokio::select! {
                () = stop.cancelled() => return Ended::Stopped,
                reason = loaded.lost() => return Ended::Lost(Loss::SessionEnded(reason)),
                reason = self.setup.workers_changed() => return Ended::Lost(Loss::WorkersChanged(reason)),
                r = run_pipeline(stages, &groups) => r,
            };
            let applied = results.and_then(|outputs| {
                groups
                    .iter()
                    .zip(outputs)
                    .try_for_each(|(b, out)| self.apply(b, &out))
            });
            if let Err(reason) = applied {
                return Ended::Lost(blame(loaded, reason));
            }
        }
    }

    /// Between steps: ends the cancelled and late requests of lanes not `busy`, forgets the
    /// cells of shifted and freed sequences on every worker, and admits waiting requests.
    async fn tidy(&mut self, stages: &[LoadedStage], busy: &[bool]) -> Result<(), Loss> {
        self.reap(busy);
        truncate_slots(stages, &mut self.to_truncate).await?;
        clear_slots(stages, &mut self.to_clear).await?;
        self.admit();
        Ok(())
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

    /// Moves every sequence of `batch` forward and samples the rows that asked for logits
    /// (or takes the worker's arg-max tokens for them).
    fn apply(&mut self, batch: &Batch, out: &RowsOut) -> Result<(), Loss> {
        let v = self.model.config().n_vocab;
        let rows = batch.logits_rows.len();
        match out {
            RowsOut::Logits(l) if l.len() != rows * v => {
                return Err(Loss::BadReply(format!(
                    "the last worker returned {} logits for {rows} rows of {v}",
                    l.len()
                )));
            }
            RowsOut::ArgMax(ids) if ids.len() != rows || ids.iter().any(|&t| t as usize >= v) => {
                return Err(Loss::BadReply(format!(
                    "the last worker returned {} arg-max tokens for {rows} rows of a \
                     {v}-token vocabulary, or one outside it",
                    ids.len()
                )));
            }
            RowsOut::Top { starts, candidates }
                if starts.len() != rows + 1 || candidates.iter().any(|c| c.0 as usize >= v) =>
            {
                return Err(Loss::BadReply(format!(
                    "the last worker returned candidates for {} rows where {rows} were asked \
                     for, or one outside the {v}-token vocabulary",
                    starts.len().saturating_sub(1)
                )));
            }
            _ => {}
        }
        for &(i, take) in &batch.fed {
            if let Some(seq) = &mut self.slots[i] {
                let prompt_part = seq.prompt_part(take);
                seq.fed += take;
                self.shared
                    .prompt_tokens
                    .fetch_add(prompt_part as u64, Ordering::Relaxed);
            }
        }
        let tokenizer = self.model.tokenizer();
        let ctx = self.setup.shape.ctx_per_seq;
        let shift = self.setup.context_shift;
        let mut finished = Vec::new();
        for (row, &i) in batch.sample_for.iter().enumerate() {
            let Some(seq) = &mut self.slots[i] else {
                continue;
            };
            let token = match out {
                RowsOut::Logits(l) => seq.sampler.sample(&l[row * v..(row + 1) * v], &seq.tokens),
                RowsOut::ArgMax(ids) => ids[row],
                RowsOut::Top { starts, candidates } => seq
                    .sampler
                    .sample_top(&candidates[starts[row]..starts[row + 1]], &seq.tokens),
            };
            let eog = tokenizer.is_eog(token) || seq.stop_tokens.contains(&token);
            if !eog {
                self.shared.generated_tokens.fetch_add(1, Ordering::Relaxed);
            }
            match seq.accept(token, eog, ctx, shift) {
                Next::Continue => {}
                Next::Shifted(kept) => {
                    tracing::debug!(
                        slot = seq.slot,
                        kept,
                        dropped = seq.dropped,
                        "context shifted"
                    );
                    self.to_truncate.push((seq.slot, kept));
                }
                Next::Finish(finish) => finished.push((i, finish)),
            }
        }
        for (i, finish) in finished {
            if let Some(seq) = self.free(i) {
                seq.finish(finish);
            }
        }
        Ok(())
    }

    /// Loads again every `retry_every` until it works or the coordinator stops; requests
    /// meanwhile are refused.
    async fn recover(&mut self, reason: Loss) -> Option<LoadedModel> {
        let stop = self.stop.clone();
        let every = self.retry_every;
        loop {
            let wait = tokio::time::sleep(every);
            tokio::pin!(wait);
            loop {
                tokio::select! {
                    () = stop.cancelled() => return None,
                    () = &mut wait => break,
                    next = self.requests.recv() => match next {
                        Some(a) => {
                            let _ = a.events.try_send(Err(GenError::Unavailable(self.shared.health_text())));
                        }
                        None => return None,
                    },
                }
            }
            tracing::info!("loading the model again after: {reason}");
            let attempt = tokio::select! {
                () = stop.cancelled() => return None,
                r = self.setup.connect_and_load(&self.model, false) => r,
            };
            match attempt {
                Ok((loaded, plan)) => {
                    tracing::info!("model loaded again:\n{plan}");
                    *self.shared.plan.lock().unwrap_or_else(|e| e.into_inner()) = Some(plan);
                    self.shared.set_health(Health::Ready);
                    return Some(loaded);
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

/// Forgets the KV cells of freed slots on every worker.
async fn clear_slots(stages: &[LoadedStage], slots: &mut Vec<u32>) -> Result<(), Loss> {
    for seq in slots.drain(..) {
        for st in stages {
            st.client
                .kv_clear(st.session, seq)
                .await
                .map_err(Loss::Call)?;
        }
    }
    Ok(())
}

/// Forgets the cells of shifted sequences past their kept prefix on every worker.
async fn truncate_slots(stages: &[LoadedStage], slots: &mut Vec<(u32, usize)>) -> Result<(), Loss> {
    for (seq, keep) in slots.drain(..) {
        let keep = u32::try_from(keep)
            .map_err(|_| Loss::Internal(format!("{keep} cells do not fit a u32")))?;
        for st in stages {
            st.client
                .kv_truncate(st.session, seq, keep)
                .await
                .map_err(Loss::Call)?;
        }
    }
    Ok(())
}

/// Why serving stopped when a call failed with `reason`: a lost session shuts every data
/// link, so the call that fails first may be on a worker that is still up; the loss,
/// recorded before, is then the cause.
fn blame(loaded: &LoadedModel, reason: Loss) -> Loss {
    loaded.lost_reason().map_or(reason, Loss::SessionEnded)
}
