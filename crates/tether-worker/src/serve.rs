//! Serving a committed block: forward passes and KV-cache operations. Every input is checked
//! against the block's shape before the block sees it, so a bad request changes nothing.

use crate::registry::{SessionRegistry, unknown_session};
use crate::session::{OwnedStage, ServingSlot, SessionState};
use crate::stage::StageShape;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tether_protocol::SessionId;
use tether_protocol::{ForwardCall, ForwardInput, ForwardOutput, MAX_TOP_K, Rows};
use tether_protocol::{Result, WorkerError};

/// Runs `work` on the block in `slot`, on the calling thread.
fn on_slot<T>(
    slot: ServingSlot,
    what: &str,
    work: impl FnOnce(&mut OwnedStage) -> Result<T>,
) -> Result<T> {
    let result = match slot.lock() {
        Ok(mut staged) => {
            let result = work(&mut staged);
            staged.kv_pool.set(staged.stage.kv_pool());
            result
        }
        Err(_) => Err(WorkerError::Internal(format!(
            "{what}: an earlier operation on this session's block panicked; end the session and load again"
        ))),
    };
    // A session that ended while this ran was freed by the registry before its block
    // was: this reference kept it. Free it now and give the heap back, as the registry
    // did for the rest of the session.
    if Arc::strong_count(&slot) == 1 {
        drop(slot);
        crate::heap::return_freed_heap();
    }
    result
}

/// Checks `call` against the block and runs it; returns the output and how long it took.
fn forward_on(staged: &mut OwnedStage, call: ForwardCall) -> Result<(ForwardOutput, Duration)> {
    let shape = staged.stage.shape();
    check_forward(&shape, &call)?;
    let started = Instant::now();
    let output = staged.stage.forward(
        &call.tokens,
        call.input,
        &call.logits_rows,
        call.rows,
        &call.targets,
    )?;
    let output = match (output, call.rows) {
        // A 128k vocabulary takes ~11 us a row here.
        (ForwardOutput::Logits(l), Rows::ArgMax) => ForwardOutput::ArgMax(
            l.chunks(shape.n_vocab.max(1))
                .map(tether_model::sampling::greedy)
                .collect(),
        ),
        (ForwardOutput::Logits(l), Rows::Top(k)) => {
            let (counts, candidates) = top_rows(&l, shape.n_vocab, k);
            ForwardOutput::Top { counts, candidates }
        }
        (ForwardOutput::Logits(l), Rows::LogProbs(k)) => {
            scored_rows(&l, shape.n_vocab, k, &call.targets)
        }
        (other, _) => other,
    };
    Ok((output, started.elapsed()))
}

impl SessionRegistry {
    fn serving_slot(&self, session: SessionId, what: &str) -> Result<ServingSlot> {
        let inner = self.lock();
        let s = inner
            .sessions
            .get(&session)
            .ok_or_else(|| unknown_session(session))?;
        match &s.state {
            SessionState::Serving { slot, .. } => Ok(Arc::clone(slot)),
            SessionState::Open => Err(WorkerError::FailedPrecondition(format!(
                "{what}: session {session} has no committed layer block; Prepare and Commit one first"
            ))),
        }
    }

    async fn with_stage<T: Send + 'static>(
        &self,
        session: SessionId,
        what: &'static str,
        work: impl FnOnce(&mut OwnedStage) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let slot = self.serving_slot(session, what)?;
        self.run_blocking(what, move || on_slot(slot, what, work))
            .await
    }

    /// Runs the session's block over a batch.
    pub async fn forward(&self, session: SessionId, call: ForwardCall) -> Result<ForwardOutput> {
        let (output, took) = self
            .with_stage(session, "forward", move |staged| forward_on(staged, call))
            .await?;
        self.metrics.observe_forward(took);
        Ok(output)
    }

    /// Runs the session's block over a batch on the calling thread (a data link's), counted
    /// as in-flight work that shutdown waits for.
    pub(crate) fn forward_here(
        &self,
        session: SessionId,
        call: ForwardCall,
    ) -> Result<ForwardOutput> {
        let slot = self.serving_slot(session, "forward")?;
        let _in_flight = self.tracker().token();
        let (output, took) = on_slot(slot, "forward", |staged| forward_on(staged, call))?;
        self.metrics.observe_forward(took);
        Ok(output)
    }

    /// Forgets every KV cell of `seq`.
    pub async fn kv_clear(&self, session: SessionId, seq: u32) -> Result<()> {
        self.with_stage(session, "kv clear", move |staged| {
            check_seq(&staged.stage.shape(), seq)?;
            staged.stage.kv_clear(seq)
        })
        .await
    }

    /// Keeps the first `length` positions of `seq`.
    pub async fn kv_truncate(&self, session: SessionId, seq: u32, length: u32) -> Result<()> {
        self.with_stage(session, "kv truncate", move |staged| {
            let shape = staged.stage.shape();
            check_seq(&shape, seq)?;
            if length as usize > shape.spec.ctx_per_seq {
                return Err(WorkerError::InvalidArgument(format!(
                    "kv truncate: length {length} is beyond the {} cells of a sequence",
                    shape.spec.ctx_per_seq
                )));
            }
            staged.stage.kv_truncate(seq, length)
        })
        .await
    }

    /// Makes `dst` hold the first `length` positions of `src`.
    pub async fn kv_copy(&self, session: SessionId, src: u32, dst: u32, length: u32) -> Result<()> {
        self.with_stage(session, "kv copy", move |staged| {
            let shape = staged.stage.shape();
            check_seq(&shape, src)?;
            check_seq(&shape, dst)?;
            if src == dst {
                return Err(WorkerError::InvalidArgument(format!(
                    "kv copy: sequence {src} cannot be copied onto itself"
                )));
            }
            if length as usize > shape.spec.ctx_per_seq {
                return Err(WorkerError::InvalidArgument(format!(
                    "kv copy: length {length} is beyond the {} cells of a sequence",
                    shape.spec.ctx_per_seq
                )));
            }
            staged.stage.kv_copy(src, dst, length)
        })
        .await
    }
}

fn check_seq(shape: &StageShape, seq: u32) -> Result<()> {
    let n = shape.spec.n_seq + shape.spec.cached_seqs;
    if seq as usize >= n {
        return Err(WorkerError::InvalidArgument(format!(
            "sequence {seq} does not exist: the block serves {n} sequences (0..{n})"
        )));
    }
    Ok(())
}

/// Each row's `k` most likely candidates of `logits` (`[rows][n_vocab]`): counts a row and
/// the candidates.
fn top_rows(logits: &[f32], n_vocab: usize, k: u32) -> (Vec<u32>, Vec<(u32, f32)>) {
    let mut counts = Vec::new();
    let mut candidates = Vec::new();
    let mut row = Vec::with_capacity(k as usize);
    for l in logits.chunks(n_vocab.max(1)) {
        tether_model::sampling::top_candidates(l, k as usize, &mut row);
        counts.push(row.len() as u32);
        candidates.extend_from_slice(&row);
    }
    (counts, candidates)
}

/// [`top_rows`] with each row's log-sum-exp and target logit, from every logit.
fn scored_rows(logits: &[f32], n_vocab: usize, k: u32, targets: &[u32]) -> ForwardOutput {
    let (counts, candidates) = top_rows(logits, n_vocab, k);
    let scores = logits
        .chunks(n_vocab.max(1))
        .enumerate()
        .map(|(r, row)| tether_compute::argmax::score_row(row, targets.get(r).copied()))
        .collect();
    ForwardOutput::Scored {
        counts,
        candidates,
        scores,
    }
}

/// Checks a forward request against the block's shape.
pub(crate) fn check_forward(shape: &StageShape, call: &ForwardCall) -> Result<()> {
    let n = call.tokens.len();
    let spec = &shape.spec;
    let handing =
        matches!(call.rows, Rows::HandOff(_)) || matches!(call.input, ForwardInput::Lent(_));
    // A hand-off's probe has no tokens: it opens or lends the slots and runs nothing.
    if (n == 0 && !handing) || n > spec.ubatch {
        return Err(WorkerError::InvalidArgument(format!(
            "forward: {n} tokens; a batch holds 1 to {} tokens (the block's ubatch)",
            spec.ubatch
        )));
    }
    for (i, t) in call.tokens.iter().enumerate() {
        check_seq(shape, t.seq)?;
        if t.pos as usize >= spec.ctx_per_seq {
            return Err(WorkerError::InvalidArgument(format!(
                "forward: token {i} at position {} is beyond the {} KV cells of sequence {}",
                t.pos, spec.ctx_per_seq, t.seq
            )));
        }
    }
    if !matches!(call.rows, Rows::Logits | Rows::HandOff(_)) && call.logits_rows.is_empty() {
        return Err(WorkerError::InvalidArgument(
            "forward: argmax and top_k reduce logits rows, and no logits rows were given".into(),
        ));
    }
    if let Rows::Top(k) = call.rows
        && (k == 0 || k > MAX_TOP_K)
    {
        return Err(WorkerError::InvalidArgument(format!(
            "forward: top_k {k} is outside 1..={MAX_TOP_K}"
        )));
    }
    if let Rows::LogProbs(k) = call.rows
        && k > MAX_TOP_K
    {
        return Err(WorkerError::InvalidArgument(format!(
            "forward: logprobs_k {k} is outside 0..={MAX_TOP_K}"
        )));
    }
    if !call.targets.is_empty() {
        if !matches!(call.rows, Rows::LogProbs(_)) || call.targets.len() != call.logits_rows.len() {
            return Err(WorkerError::InvalidArgument(format!(
                "forward: {} targets; give one per logits row ({}), and only with logprobs",
                call.targets.len(),
                call.logits_rows.len()
            )));
        }
        if let Some(bad) = call.targets.iter().find(|&&t| t as usize >= shape.n_vocab) {
            return Err(WorkerError::InvalidArgument(format!(
                "forward: target {bad} is outside the vocabulary of {} tokens",
                shape.n_vocab
            )));
        }
    }
    match &call.input {
        ForwardInput::Hidden(h) => {
            if h.len() != n * shape.n_embd {
                return Err(WorkerError::InvalidArgument(format!(
                    "forward: {} hidden values for {n} tokens of width {}; expected {}",
                    h.len(),
                    shape.n_embd,
                    n * shape.n_embd
                )));
            }
        }
        ForwardInput::Lent(area) => {
            if area.len != (n * shape.n_embd * 4) as u64 {
                return Err(WorkerError::InvalidArgument(format!(
                    "forward: {} bytes of lent hidden states for {n} tokens of width {}",
                    area.len, shape.n_embd
                )));
            }
        }
        ForwardInput::TokenIds(ids) => {
            if !spec.has_embed {
                return Err(WorkerError::InvalidArgument(
                    "forward: token ids sent to a block without the embedding table; send hidden states".into(),
                ));
            }
            if ids.len() != n {
                return Err(WorkerError::InvalidArgument(format!(
                    "forward: {} token ids for {n} tokens",
                    ids.len()
                )));
            }
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= shape.n_vocab) {
                return Err(WorkerError::InvalidArgument(format!(
                    "forward: token id {bad} is outside the vocabulary of {}",
                    shape.n_vocab
                )));
            }
        }
    }
    if matches!(call.rows, Rows::HandOff(_)) && (spec.has_head || !call.logits_rows.is_empty()) {
        return Err(WorkerError::InvalidArgument(
            "forward: a hand-off is asked of a block without the output head, with no logits \
             rows"
                .into(),
        ));
    }
    if !call.logits_rows.is_empty() {
        if !spec.has_head {
            return Err(WorkerError::InvalidArgument(
                "forward: logits asked of a block without the output head".into(),
            ));
        }
        // Each row costs n_vocab floats of output; rows beyond the batch's size can only be
        // repeats, and would let a short request size a huge allocation.
        if call.logits_rows.len() > n {
            return Err(WorkerError::InvalidArgument(format!(
                "forward: {} logits rows for a batch of {n} tokens; ask at most one per token",
                call.logits_rows.len()
            )));
        }
        if let Some(bad) = call.logits_rows.iter().find(|&&r| r as usize >= n) {
            return Err(WorkerError::InvalidArgument(format!(
                "forward: logits row {bad} is outside the batch of {n} tokens"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_protocol::{BlockSpec, TokenPos};

    fn shape() -> StageShape {
        StageShape {
            n_embd: 4,
            n_vocab: 10,
            spec: BlockSpec {
                first_layer: 0,
                last_layer: 1,
                has_embed: true,
                has_head: true,
                ctx_per_seq: 8,
                n_seq: 2,
                cached_seqs: 0,
                ubatch: 4,
                cache_k: tether_gguf::GgmlType::F16,
                cache_v: tether_gguf::GgmlType::F16,
            },
        }
    }

    #[test]
    fn logits_become_scored_rows_on_the_host() {
        let row = |shift: f32| -> Vec<f32> { (0..10).map(|i| i as f32 * 0.5 - shift).collect() };
        let logits = [row(0.0), row(3.0)].concat();
        let ForwardOutput::Scored {
            counts,
            candidates,
            scores,
        } = scored_rows(&logits, 10, 2, &[4, 0])
        else {
            panic!("not scored")
        };
        assert_eq!(counts, [2, 2]);
        assert_eq!(candidates[..2], [(9, 4.5), (8, 4.0)]);
        assert_eq!(candidates[2..], [(9, 1.5), (8, 1.0)]);
        let lse = |r: &[f32]| r.iter().map(|&l| f64::from(l).exp()).sum::<f64>().ln();
        assert!((f64::from(scores[0].0) - lse(&logits[..10])).abs() < 1e-6);
        assert!((f64::from(scores[1].0) - lse(&logits[10..])).abs() < 1e-6);
        assert_eq!((scores[0].1, scores[1].1), (2.0, -3.0));
    }

    #[test]
    fn targets_are_checked_against_the_rows_and_the_vocabulary() {
        let mut c = call(vec![1]);
        c.rows = Rows::LogProbs(0);
        c.targets = vec![3];
        assert!(check_forward(&shape(), &c).is_ok());
        c.targets = vec![10];
        assert!(
            check_forward(&shape(), &c).is_err(),
            "outside the vocabulary"
        );
        c.targets = vec![3, 3];
        assert!(check_forward(&shape(), &c).is_err(), "one a row");
        c.targets = vec![3];
        c.rows = Rows::Top(2);
        assert!(check_forward(&shape(), &c).is_err(), "only with logprobs");
        c.rows = Rows::LogProbs(MAX_TOP_K + 1);
        c.targets.clear();
        assert!(check_forward(&shape(), &c).is_err(), "k too large");
    }

    fn call(logits_rows: Vec<u32>) -> ForwardCall {
        ForwardCall {
            tokens: vec![TokenPos { seq: 0, pos: 0 }, TokenPos { seq: 0, pos: 1 }],
            input: ForwardInput::TokenIds(vec![1, 2]),
            logits_rows,
            rows: crate::Rows::Logits,
            targets: Vec::new(),
        }
    }

    #[test]
    fn logits_rows_are_bounded_by_the_batch() {
        assert!(check_forward(&shape(), &call(vec![0, 1])).is_ok());
        // Repeated rows: one varint byte each on the wire, n_vocab floats each of output.
        let err = check_forward(&shape(), &call(vec![0; 100_000]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("100000 logits rows") && err.contains("2 tokens"),
            "{err}"
        );
        assert!(check_forward(&shape(), &call(vec![2])).is_err());
    }
}
