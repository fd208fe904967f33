//! The scheduler task: owns the loaded model, gives each request a sequence slot, runs each
//! step's batch of every active sequence through the workers (cut into groups of sequences
//! that are in flight on different workers at once), samples, and reports. When a
//! worker's session ends it fails the in-flight requests, closes the other sessions and
//! loads again in the background over the workers that answer.

use crate::api::{FinishReason, GenError, GenEvent, GenRequest, Health};
use crate::engine::Setup;
use crate::load::{LoadedModel, LoadedStage};
use crate::loss::Loss;
use crate::model_file::ModelFile;
use crate::placement::Plan;
use crate::prefix::{CellCopy, PrefixCache, copy_cells, slot_uses};
use crate::sequence::{Batch, Events, Next, Sequence, build_step, split_batch};
use crate::stage_call;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tether_model::Sampler;
use tether_protocol::{ForwardInput, ForwardOutput, MAX_TOP_K, Rows};
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

    /// Ends cancelled requests (receiver dropped) and those past their deadline.
    fn reap(&mut self) {
        let now = Instant::now();
        for i in 0..self.slots.len() {
            let Some(seq) = &self.slots[i] else { continue };
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
        self.slots[i] = Some(Sequence {
            slot: i as u32,
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
        let stop = self.stop.clone();
        let ended = loop {
            self.reap();
            if let Err(reason) = truncate_slots(&stages, &mut self.to_truncate).await {
                break Ended::Lost(reason);
            }
            if let Err(reason) = clear_slots(&stages, &mut self.to_clear).await {
                break Ended::Lost(reason);
            }
            self.admit();
            if self.active() == 0 {
                tokio::select! {
                    () = stop.cancelled() => break Ended::Stopped,
                    reason = loaded.lost() => break Ended::Lost(Loss::SessionEnded(reason)),
                    reason = self.setup.workers_changed() => break Ended::Lost(Loss::WorkersChanged(reason)),
                    next = self.requests.recv() => match next {
                        Some(a) => self.start(a),
                        None => break Ended::Stopped,
                    },
                }
                continue;
            }
            if let Err(reason) = copy_cells(&stages, &mut self.to_copy).await {
                break Ended::Lost(reason);
            }
            let mut chunks = build_step(
                &self.slots,
                self.setup.shape.ubatch,
                self.rotation,
                stages.len(),
            );
            self.rotation = self.rotation.wrapping_add(1);
            let mut groups = match chunks.len() {
                1 => split_batch(chunks.remove(0), stages.len()),
                _ => chunks,
            };
            for g in &mut groups {
                g.rows = rows_wanted(&self.slots, g);
            }
            let results = tokio::select! {
                () = stop.cancelled() => break Ended::Stopped,
                reason = loaded.lost() => break Ended::Lost(Loss::SessionEnded(reason)),
                reason = self.setup.workers_changed() => break Ended::Lost(Loss::WorkersChanged(reason)),
                r = run_pipeline(&stages, &groups) => r,
            };
            let applied = results.and_then(|outputs| {
                groups
                    .iter()
                    .zip(outputs)
                    .try_for_each(|(b, out)| self.apply(b, &out))
            });
            if let Err(reason) = applied {
                // A lost session shuts every data link, so the call that fails first may be
                // on a worker that is still up: the loss, recorded before, is the cause.
                break Ended::Lost(loaded.lost_reason().map_or(reason, Loss::SessionEnded));
            }
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

/// What the last worker returned for a batch's logits rows.
enum RowsOut {
    /// `[rows][n_vocab]`, for the sequences' samplers.
    Logits(Vec<f32>),
    /// One greedy token per row.
    ArgMax(Vec<u32>),
    /// Row r's most likely candidates are `candidates[starts[r]..starts[r + 1]]`.
    Top {
        starts: Vec<usize>,
        candidates: Vec<(u32, f32)>,
    },
}

/// What the last worker should return for `batch`'s logits rows: arg-max tokens when every
/// row samples greedily, the top k candidates when every row's sampler needs no more than
/// its k most likely tokens (k the largest of them), else every logit. A 128k vocabulary's
/// logits are 512 KiB a row on the network; 40 candidates are 320 bytes.
fn rows_wanted(slots: &[Option<Sequence>], batch: &Batch) -> Rows {
    if batch.logits_rows.is_empty() {
        return Rows::Logits;
    }
    let samplers = || batch.sample_for.iter().map(|&i| slots[i].as_ref());
    if samplers().all(|s| s.is_some_and(|s| s.sampler.is_greedy())) {
        return Rows::ArgMax;
    }
    let mut k = 0;
    for s in samplers() {
        match s.and_then(|s| s.sampler.candidates_needed(&s.tokens)) {
            Some(n) if n as u64 <= u64::from(MAX_TOP_K) => k = k.max(n as u32),
            _ => return Rows::Logits,
        }
    }
    Rows::Top(k.max(1))
}

/// Runs `groups` through the workers in layer order as a pipeline: each worker takes the
/// groups in order (a later group of a sequence needs the cells of an earlier one) and
/// passes each on as soon as it is done, so group k+1 runs on one worker while group k
/// runs on the next. Returns what each group's logits rows asked for, in order.
async fn run_pipeline(stages: &[LoadedStage], groups: &[Batch]) -> Result<Vec<RowsOut>, Loss> {
    let (first, mut rx) = mpsc::unbounded_channel::<(usize, ForwardInput)>();
    let mut workers = Vec::with_capacity(stages.len());
    let last = stages.len().saturating_sub(1);
    let alone = groups.len() == 1;
    for (i, st) in stages.iter().enumerate() {
        let (tx, next) = mpsc::unbounded_channel();
        let mut input = std::mem::replace(&mut rx, next);
        workers.push(async move {
            let mut logits = Vec::new();
            while let Some((k, x)) = input.recv().await {
                let b = &groups[k];
                let rows: &[u32] = if i == last { &b.logits_rows } else { &[] };
                let want = if i == last { b.rows } else { Rows::Logits };
                let out = stage_call::forward(st, &b.tokens, x, rows, want, alone)
                    .await
                    .map_err(Loss::Call)?;
                match out {
                    ForwardOutput::Hidden(h) if i < last => {
                        // The next worker gone means another worker failed; its error wins.
                        let _ = tx.send((k, ForwardInput::Hidden(h)));
                    }
                    ForwardOutput::Logits(l) if i == last && want == Rows::Logits => {
                        logits.push(RowsOut::Logits(l))
                    }
                    ForwardOutput::ArgMax(t) if i == last && want == Rows::ArgMax => {
                        logits.push(RowsOut::ArgMax(t))
                    }
                    ForwardOutput::Top { counts, candidates }
                        if i == last && matches!(want, Rows::Top(_)) =>
                    {
                        let mut starts = Vec::with_capacity(counts.len() + 1);
                        starts.push(0);
                        for c in counts {
                            starts.push(starts[starts.len() - 1] + c as usize);
                        }
                        logits.push(RowsOut::Top { starts, candidates })
                    }
                    ForwardOutput::Hidden(_) if rows.is_empty() => {
                        logits.push(RowsOut::Logits(Vec::new()))
                    }
                    _ => {
                        return Err(Loss::BadReply(format!(
                            "worker {} returned the wrong kind of output",
                            st.client.addr()
                        )));
                    }
                }
            }
            Ok::<_, Loss>(logits)
        });
    }
    for (k, b) in groups.iter().enumerate() {
        let _ = first.send((k, ForwardInput::TokenIds(b.ids.clone())));
    }
    drop(first);
    let mut outputs = futures::future::try_join_all(workers).await?;
    let logits = outputs.pop().unwrap_or_default();
    if logits.len() != groups.len() {
        return Err(Loss::Internal(format!(
            "the pipeline returned logits for {} of {} groups",
            logits.len(),
            groups.len()
        )));
    }
    Ok(logits)
}
