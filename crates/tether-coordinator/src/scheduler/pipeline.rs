//! The scheduler's calls over the workers: KV bookkeeping of freed and shifted slots, and
//! batches moved through the workers in layer order by stage loops ([`stage_loops`]): a
//! stream of lanes' batches while a model serves, or one step's groups
//! ([`run_pipeline`]).

use crate::api::TokenLogProb;
use crate::handoff::{HANDOFF_MIN_TOKENS, SlotLease};
use crate::load::LoadedStage;
use crate::loss::Loss;
use crate::sequence::{Batch, RowUse, Sequence};
use crate::stage_call::{self, Pending};
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;
use tether_protocol::{ForwardCall, ForwardInput, ForwardOutput, MAX_TOP_K, Rows};
use tokio::sync::mpsc;

/// KV calls a step's bookkeeping keeps in flight at once.
const KV_CALLS_AT_ONCE: usize = 32;

/// Forgets the KV cells of freed slots on every worker. The calls go out together: when a
/// lane's sequences end on one step, one after the other they held up its next step by a
/// gRPC round trip each (64 sequences over two workers: 128).
pub(super) async fn clear_slots(stages: &[LoadedStage], slots: &mut Vec<u32>) -> Result<(), Loss> {
    let mut calls = Vec::with_capacity(slots.len() * stages.len());
    for seq in slots.drain(..) {
        calls.extend(stages.iter().map(|st| st.client.kv_clear(st.session, seq)));
    }
    all_of(calls).await
}

/// Forgets the cells of shifted sequences past their kept prefix on every worker, the
/// calls together as in [`clear_slots`].
pub(super) async fn truncate_slots(
    stages: &[LoadedStage],
    slots: &mut Vec<(u32, usize)>,
) -> Result<(), Loss> {
    let mut calls = Vec::with_capacity(slots.len() * stages.len());
    for (seq, keep) in slots.drain(..) {
        let keep = u32::try_from(keep)
            .map_err(|_| Loss::Internal(format!("{keep} cells do not fit a u32")))?;
        calls.extend(
            stages
                .iter()
                .map(|st| st.client.kv_truncate(st.session, seq, keep)),
        );
    }
    all_of(calls).await
}

/// Runs `calls`, [`KV_CALLS_AT_ONCE`] at a time; the first error.
async fn all_of<F>(calls: Vec<F>) -> Result<(), Loss>
where
    F: Future<Output = Result<(), tether_client::ClientError>>,
{
    use futures::StreamExt;
    let mut results = futures::stream::iter(calls).buffer_unordered(KV_CALLS_AT_ONCE);
    while let Some(r) = results.next().await {
        r.map_err(Loss::Call)?;
    }
    Ok(())
}

/// What the last worker returned for a batch's logits rows.
pub(super) enum RowsOut {
    /// `[rows][n_vocab]`, for the sequences' samplers.
    Logits(Vec<f32>),
    /// One greedy token per row.
    ArgMax(Vec<u32>),
    /// Row r's most likely candidates are `candidates[starts[r]..starts[r + 1]]`.
    Top {
        starts: Vec<usize>,
        candidates: Vec<(u32, f32)>,
    },
    /// As `Top`, with each row's `(log-sum-exp, target logit)`.
    Scored {
        starts: Vec<usize>,
        candidates: Vec<(u32, f32)>,
        scores: Vec<(f32, f32)>,
    },
    /// `[rows][n_embd]` normed hidden states, for embeddings.
    Embeddings(Vec<f32>),
}

impl RowsOut {
    /// `token`'s log-probability in row `row` (of a `v`-token vocabulary) with the row's
    /// `n` most likely alternatives. From every logit, or from what the worker reduced: the
    /// token is then among the row's candidates (sampled from them) or its target.
    pub(super) fn log_prob(&self, row: usize, v: usize, token: u32, n: usize) -> TokenLogProb {
        let (lse, logit, top) = match self {
            RowsOut::Logits(l) => {
                let logits = &l[row * v..(row + 1) * v];
                let mut top = Vec::new();
                tether_model::sampling::top_candidates(logits, n, &mut top);
                let logit = logits.get(token as usize).copied().unwrap_or(f32::NAN);
                (tether_model::sampling::logsumexp(logits), logit, top)
            }
            RowsOut::Scored {
                starts,
                candidates,
                scores,
            } => {
                let cands = &candidates[starts[row]..starts[row + 1]];
                let (lse, target) = scores[row];
                let logit = cands.iter().find(|c| c.0 == token).map_or(target, |c| c.1);
                (lse, logit, cands[..n.min(cands.len())].to_vec())
            }
            // Never asked for with log-probabilities (`rows_wanted`).
            RowsOut::ArgMax(_) | RowsOut::Top { .. } | RowsOut::Embeddings(_) => {
                (f32::NAN, f32::NAN, Vec::new())
            }
        };
        TokenLogProb {
            token,
            logprob: logit - lse,
            top: top.into_iter().map(|(id, l)| (id, l - lse)).collect(),
        }
    }
}

/// What the last worker should return for `batch`'s logits rows: arg-max tokens when every
/// row samples greedily, the top k candidates when every row's sampler needs no more than
/// its k most likely tokens (k the largest of them), else every logit. A 128k vocabulary's
/// logits are 512 KiB a row on the network; 40 candidates are 320 bytes.
///
/// Rows that report log-probabilities (or score the prompt) ask for
/// [`Rows::LogProbs`] instead: the candidates both the samplers and the reports need, with
/// each row's log-sum-exp, reduced on the worker too.
pub(super) fn rows_wanted(slots: &[Option<Sequence>], batch: &Batch) -> Rows {
    if batch.logits_rows.is_empty() {
        return Rows::Logits;
    }
    // Embedding sequences go in batches of their own (`Scheduler::groups`).
    if batch.uses.iter().any(|u| matches!(u, RowUse::Embed(_))) {
        return Rows::Embeddings;
    }
    let samplers = || batch.sample_for.iter().map(|&i| slots[i].as_ref());
    let mut reported = 0;
    let mut scored = false;
    for &use_ in &batch.uses {
        let Some(seq) = slots[use_.slot()].as_ref() else {
            continue;
        };
        let n = match use_ {
            RowUse::Sample(_) => seq.logprobs,
            RowUse::Score(_) => seq.prompt_logprobs,
            RowUse::Embed(_) => None,
        };
        if let Some(n) = n {
            scored = true;
            reported = reported.max(n as u32);
        }
    }
    if !scored && samplers().all(|s| s.is_some_and(Sequence::samples_greedily)) {
        return Rows::ArgMax;
    }
    let mut k = reported;
    for s in samplers() {
        match s.and_then(Sequence::candidates_needed) {
            Some(n) if n as u64 <= u64::from(MAX_TOP_K) => k = k.max(n as u32),
            _ => return Rows::Logits,
        }
    }
    if scored {
        Rows::LogProbs(k)
    } else {
        Rows::Top(k.max(1))
    }
}

/// A batch after one worker: the next worker's input, or (after the last) its rows.
enum Passed {
    Next(ForwardInput),
    Rows(RowsOut),
}

/// What worker `i` of `stages` is asked for `b` with input `x`: the last returns what the
/// batch's logits rows want (with the token ids [`Rows::LogProbs`] rows score), the others
/// their hidden states.
fn asked(
    stages: &[LoadedStage],
    i: usize,
    b: &Batch,
    x: ForwardInput,
    slot: Option<&SlotLease>,
) -> ForwardCall {
    let last = i + 1 == stages.len();
    let rows = match slot {
        _ if last => b.rows,
        Some(s) => Rows::HandOff(s.slot()),
        None => Rows::Logits,
    };
    let targets = match rows {
        Rows::LogProbs(_) => b.targets.clone(),
        _ => Vec::new(),
    };
    ForwardCall {
        tokens: b.tokens.clone(),
        input: x,
        logits_rows: if last {
            b.logits_rows.clone()
        } else {
            Vec::new()
        },
        rows,
        targets,
    }
}

/// Whether worker `i` hands `b`'s hidden states to the next one's GPU: it can
/// ([`LoadedStage::handoff`]), the batch is large enough to gain, and the next worker
/// takes it in one decode step (see `tether_model::StepInput::Lent`).
fn hands_off(stages: &[LoadedStage], i: usize, b: &Batch) -> bool {
    let n = b.tokens.len();
    stages[i].handoff.is_some()
        && n >= HANDOFF_MIN_TOKENS
        && stages[i..].iter().take(2).all(|st| n <= st.spec.ubatch)
        && b.rows != Rows::Embeddings
        && b.logits_rows.windows(2).all(|w| w[0] < w[1])
}

/// Runs `b` over worker `i` of `stages` with input `x`; `alone` as [`stage_call::forward`].
async fn pass(
    stages: &[LoadedStage],
    i: usize,
    b: &Batch,
    x: ForwardInput,
    slot: Option<&SlotLease>,
    alone: bool,
) -> Result<Passed, Loss> {
    let began = Instant::now();
    let out = stage_call::forward(&stages[i], asked(stages, i, b, x, slot), alone)
        .await
        .map_err(Loss::Call)?;
    passed(stages, i, b, out, began)
}

/// Sends `b` to worker `i` of `stages` with input `x`; [`finish`] takes its output.
async fn send(
    stages: &[LoadedStage],
    i: usize,
    b: &Batch,
    x: ForwardInput,
    slot: Option<&SlotLease>,
) -> Result<(Pending, Instant), Loss> {
    let began = Instant::now();
    let pending = stage_call::send(&stages[i], asked(stages, i, b, x, slot))
        .await
        .map_err(Loss::Call)?;
    Ok((pending, began))
}

/// The output of `b` sent to worker `i` by [`send`].
async fn finish(
    stages: &[LoadedStage],
    i: usize,
    b: &Batch,
    (pending, began): (Pending, Instant),
) -> Result<Passed, Loss> {
    let out = pending.output().await.map_err(Loss::Call)?;
    passed(stages, i, b, out, began)
}

/// Checks that worker `i` returned what `b` asked of it.
fn passed(
    stages: &[LoadedStage],
    i: usize,
    b: &Batch,
    out: ForwardOutput,
    began: Instant,
) -> Result<Passed, Loss> {
    let last = i + 1 == stages.len();
    let want = if last { b.rows } else { Rows::Logits };
    // A pipeline's timeline, pass by pass (TETHER_LOG=tether_coordinator::scheduler=trace).
    tracing::trace!(
        worker = i,
        tokens = b.tokens.len(),
        since_us = since_start(began),
        took_us = began.elapsed().as_micros() as u64,
        "pass"
    );
    Ok(match out {
        ForwardOutput::Hidden(h) if !last => Passed::Next(ForwardInput::Hidden(h)),
        ForwardOutput::Lent(area) if !last => Passed::Next(ForwardInput::Lent(area)),
        ForwardOutput::Logits(l) if last && want == Rows::Logits => {
            Passed::Rows(RowsOut::Logits(l))
        }
        ForwardOutput::Embeddings(e) if last && want == Rows::Embeddings => {
            Passed::Rows(RowsOut::Embeddings(e))
        }
        ForwardOutput::ArgMax(t) if last && want == Rows::ArgMax => {
            Passed::Rows(RowsOut::ArgMax(t))
        }
        ForwardOutput::Top { counts, candidates } if last && matches!(want, Rows::Top(_)) => {
            let starts = row_starts(&counts);
            Passed::Rows(RowsOut::Top { starts, candidates })
        }
        ForwardOutput::Scored {
            counts,
            candidates,
            scores,
        } if last && matches!(want, Rows::LogProbs(_)) => {
            let starts = row_starts(&counts);
            Passed::Rows(RowsOut::Scored {
                starts,
                candidates,
                scores,
            })
        }
        ForwardOutput::Hidden(_) if !last || b.logits_rows.is_empty() => {
            Passed::Rows(RowsOut::Logits(Vec::new()))
        }
        _ => {
            return Err(Loss::BadReply(format!(
                "worker {} returned the wrong kind of output",
                stages[i].client.addr()
            )));
        }
    })
}

/// Runs `groups` through the workers in layer order as a pipeline ([`stage_loops`]): group
/// k+1 runs on one worker while group k runs on the next. Returns what each group's logits
/// rows asked for, in order.
pub(super) async fn run_pipeline(
    stages: &[LoadedStage],
    groups: &[Batch],
) -> Result<Vec<RowsOut>, Loss> {
    let (jobs, mut done, loops) = stage_loops(stages);
    let alone = groups.len() == 1;
    for (k, b) in groups.iter().enumerate() {
        jobs.send(Job {
            lane: 0,
            k,
            batch: Arc::new(b.clone()),
            alone,
        });
    }
    drop(jobs);
    let collect = async {
        let mut outputs: Vec<Option<RowsOut>> = (0..groups.len()).map(|_| None).collect();
        while let Some(out) = done.recv().await {
            let (_, k, rows) = out?;
            if let Some(slot) = outputs.get_mut(k) {
                *slot = Some(rows);
            }
        }
        let returned = outputs.iter().filter(|o| o.is_some()).count();
        if returned != groups.len() {
            return Err(Loss::Internal(format!(
                "the pipeline returned logits for {returned} of {} groups",
                groups.len()
            )));
        }
        Ok(outputs.into_iter().flatten().collect())
    };
    let ((), outputs) = tokio::join!(loops, collect);
    outputs
}

/// One batch of a lane's step on its way through the stage loops.
pub(super) struct Job {
    /// The lane whose step it belongs to.
    pub lane: usize,
    /// Its place among the step's batches.
    pub k: usize,
    pub batch: Arc<Batch>,
    /// Nothing else is in flight (see [`stage_call::forward`]).
    pub alone: bool,
}

/// A batch that left the last worker (lane, place, rows), or the error that stopped a loop.
pub(super) type Done = Result<(usize, usize, RowsOut), Loss>;

/// A batch's input to a worker, with the previous worker's hand-off slot it is copied
/// from (held until this worker has answered).
type Input = (Job, ForwardInput, Option<SlotLease>);

/// Where a lane's batches enter the first worker.
pub(super) struct Jobs(mpsc::UnboundedSender<Input>);

impl Jobs {
    /// Sends `job` into the first worker's loop; false when that loop has stopped (a worker
    /// failed, and its error is on its way as a [`Done`]).
    pub fn send(&self, job: Job) -> bool {
        let ids = ForwardInput::TokenIds(job.batch.ids.clone());
        self.0.send((job, ids, None)).is_ok()
    }
}

/// A batch sent to a worker: what came back or is to, the slot its input was copied from,
/// and the slot its output is left in.
type InFlight = (
    Job,
    Result<Sent, Loss>,
    Option<SlotLease>,
    Option<SlotLease>,
);

/// A batch sent to a worker, its output not yet taken.
enum Sent {
    /// Sent; the output is taken in order.
    Pending((Pending, Instant)),
    /// Run to its end (a batch `alone`, which spins for its reply).
    Passed(Passed),
}

/// One loop per worker, each taking batches in the order they come (so a sequence's
/// batches reach a worker in the order they were sent) and handing each to the next worker
/// as soon as it is done; what leaves the last worker comes out of the returned receiver.
/// Over a data link a loop sends a worker's next batch while the worker still runs the one
/// before (at most two in flight), so the worker starts it as soon as it has answered:
/// without that, the worker idled while its output travelled to the coordinator and the
/// next input came back, a few milliseconds a pass for a prompt's hidden states.
/// The future runs every loop; it ends once the returned [`Jobs`] is dropped and the loops
/// have drained, or a loop has failed (its error is sent as the last [`Done`]).
pub(super) fn stage_loops(
    stages: &[LoadedStage],
) -> (
    Jobs,
    mpsc::UnboundedReceiver<Done>,
    impl Future<Output = ()> + '_,
) {
    let (jobs, mut hidden) = mpsc::unbounded_channel::<Input>();
    let (done_tx, done) = mpsc::unbounded_channel::<Done>();
    let mut loops = Vec::with_capacity(stages.len());
    for i in 0..stages.len() {
        let (tx, next) = mpsc::unbounded_channel::<Input>();
        let mut input = std::mem::replace(&mut hidden, next);
        let done = done_tx.clone();
        // One batch waits here while the one before it is taken: two in flight at most.
        let (in_flight, mut landed) = mpsc::channel::<InFlight>(1);
        let sending = async move {
            while let Some((job, x, read_from)) = input.recv().await {
                // The taking half gone means it failed; its error is sent.
                let Ok(permit) = in_flight.reserve().await else {
                    return;
                };
                // Waits for the next worker to have answered the pass that read the slot.
                let slot = match &stages[i].handoff {
                    Some(h) if hands_off(stages, i, &job.batch) => Some(h.take().await),
                    _ => None,
                };
                let b = &job.batch;
                let sent = if job.alone {
                    pass(stages, i, b, x, slot.as_ref(), true)
                        .await
                        .map(Sent::Passed)
                } else {
                    send(stages, i, b, x, slot.as_ref())
                        .await
                        .map(Sent::Pending)
                };
                let failed = sent.is_err();
                permit.send((job, sent, read_from, slot));
                if failed {
                    return;
                }
            }
        };
        let taking = async move {
            while let Some((job, sent, read_from, slot)) = landed.recv().await {
                let passed = match sent {
                    Ok(Sent::Passed(p)) => Ok(p),
                    Ok(Sent::Pending(p)) => finish(stages, i, &job.batch, p).await,
                    Err(e) => Err(e),
                };
                // This worker has copied its input: the previous one may refill the slot.
                drop(read_from);
                match passed {
                    Ok(Passed::Next(x)) => {
                        // A slot goes with the output only when the output is lent from it.
                        let slot = slot.filter(|_| matches!(x, ForwardInput::Lent(_)));
                        // The next loop gone means another worker failed; its error is sent.
                        let _ = tx.send((job, x, slot));
                    }
                    Ok(Passed::Rows(r)) => {
                        let _ = done.send(Ok((job.lane, job.k, r)));
                    }
                    Err(e) => {
                        let _ = done.send(Err(e));
                        return;
                    }
                }
            }
        };
        loops.push(async move {
            tokio::join!(sending, taking);
        });
    }
    drop(done_tx);
    let run = async move {
        futures::future::join_all(loops).await;
    };
    (Jobs(jobs), done, run)
}

/// Microseconds from this process's first pass to `t`: the passes' timeline.
fn since_start(t: std::time::Instant) -> u64 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    t.saturating_duration_since(*EPOCH.get_or_init(|| t))
        .as_micros() as u64
}

/// Where each row's candidates start, from the count of each, and where the last ends.
fn row_starts(counts: &[u32]) -> Vec<usize> {
    let mut starts = Vec::with_capacity(counts.len() + 1);
    starts.push(0);
    for &c in counts {
        starts.push(starts[starts.len() - 1] + c as usize);
    }
    starts
}
