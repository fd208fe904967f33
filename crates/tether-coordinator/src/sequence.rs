//! One running request in its sequence slot, and how a step's batch is made from all of
//! them: decode tokens first (one per generating sequence), then prompt chunks, never more
//! than `ubatch` tokens in all.

use crate::api::{ContextShift, FinishReason, GenError, GenEvent, TokenLogProb};
use crate::constraint::Constraint;
use std::time::Instant;
use tether_model::{Sampler, StopReason, StopRules, Verdict};
use tether_protocol::TokenPos;
use tokio::sync::mpsc;

/// Where a request's events go.
pub(crate) type Events = mpsc::Sender<Result<GenEvent, GenError>>;

/// A request holding a sequence slot.
pub(crate) struct Sequence {
    /// The slot (KV sequence index on every worker).
    pub slot: u32,
    /// The lane whose steps carry it; 0 with one lane.
    pub lane: usize,
    /// Prompt, then generated tokens.
    pub tokens: Vec<u32>,
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Tokens already in the KV cache (positions `0..fed`).
    pub fed: usize,
    /// Tokens generated.
    pub generated: usize,
    /// Tokens dropped by context shifts.
    pub dropped: usize,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// The request's sampler.
    pub sampler: Sampler,
    /// When the request gives up.
    pub deadline: Option<Instant>,
    /// The request's own tokens that end it as an end-of-generation token does.
    pub stop_tokens: Vec<u32>,
    /// The request's event channel (sized so that every event fits).
    pub events: Events,
    /// Alternatives to report with each generated token's log-probability, if asked.
    pub logprobs: Option<usize>,
    /// Alternatives to report with each prompt token's log-probability, if the prompt is
    /// scored.
    pub prompt_logprobs: Option<usize>,
    /// The prompt's scores so far (the first token's is `None`), until they are sent.
    pub prompt_scores: Option<Vec<Option<TokenLogProb>>>,
    /// The log-probability of the token [`Sequence::accept`] takes next, when reported.
    pub scored: Option<TokenLogProb>,
    /// The grammar the generated tokens follow, if any.
    pub constraint: Option<Constraint>,
    /// None of the top candidates of the last row was allowed by the grammar: the last
    /// token is fed again for a row of every logit.
    pub needs_logits: bool,
}

/// Candidates a constrained row asks for at least: the more, the rarer a row none of whose
/// candidates the grammar allows (which costs a step of its own for every logit).
const CONSTRAINED_CANDIDATES: usize = 64;

/// What a logits row of a batch is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RowUse {
    /// The next token of the sequence in this slot is sampled from it.
    Sample(usize),
    /// It scores the prompt token after it, of the sequence in this slot.
    Score(usize),
}

/// What a sampled token did to its sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Feed it next step.
    Continue,
    /// The context was shifted: the sequence's cells past this many must be forgotten on
    /// every worker before its next step, which feeds the kept tail again.
    Shifted(usize),
    /// The request is over.
    Finish(FinishReason),
}

impl Sequence {
    /// Whether the tokens of the next feed still count as prompt tokens.
    pub fn prompt_part(&self, take: usize) -> usize {
        if self.dropped > 0 || self.needs_logits {
            return 0;
        }
        self.prompt_len.saturating_sub(self.fed).min(take)
    }

    /// Takes a sampled token by the generator's [`StopRules`]: an end-of-generation token
    /// ends the request unsent; otherwise it is sent, and `max_tokens` or a full context
    /// (`ctx` cells) ends the request, unless `shift` lets a full context drop old tokens.
    pub fn accept(
        &mut self,
        token: u32,
        is_eog: bool,
        ctx: usize,
        shift: Option<ContextShift>,
    ) -> Next {
        let rules = StopRules {
            max_tokens: self.max_tokens,
            ctx,
        };
        let verdict = rules.on_sampled(is_eog, self.generated, self.tokens.len());
        if verdict == Verdict::Discard {
            return Next::Finish(FinishReason::Stop);
        }
        self.tokens.push(token);
        self.generated += 1;
        let event = match self.scored.take() {
            Some(scored) => GenEvent::Scored(scored),
            None => GenEvent::Token(token),
        };
        self.send(Ok(event));
        match verdict {
            Verdict::KeepAndEnd(StopReason::ContextFull) => {
                match shift.and_then(|s| self.shift(s.keep)) {
                    Some(kept) => Next::Shifted(kept),
                    None => Next::Finish(FinishReason::Length),
                }
            }
            Verdict::KeepAndEnd(_) => Next::Finish(FinishReason::Length),
            Verdict::Keep | Verdict::Discard => Next::Continue,
        }
    }

    /// Drops the oldest half of the tokens after the first `keep` (as llama.cpp's context
    /// shift does) and rewinds `fed` to the kept prefix; `None` when nothing can be dropped.
    fn shift(&mut self, keep: usize) -> Option<usize> {
        let past = self.tokens.len() - 1;
        let keep = keep.min(past);
        let drop = (past - keep) / 2;
        if drop == 0 {
            return None;
        }
        self.tokens.drain(keep..keep + drop);
        self.dropped += drop;
        self.fed = self.fed.min(keep);
        Some(self.fed)
    }

    /// Whether the next choice is the arg-max of the raw logits, which a worker may take.
    pub fn samples_greedily(&self) -> bool {
        self.sampler.is_greedy() && self.constraint.is_none() && !self.needs_logits
    }

    /// How many of its row's most likely candidates the next choice needs; `None`: every
    /// logit.
    pub fn candidates_needed(&self) -> Option<usize> {
        if self.needs_logits {
            return None;
        }
        let n = self.sampler.candidates_needed(&self.tokens)?;
        Some(match self.constraint {
            Some(_) => n.max(CONSTRAINED_CANDIDATES),
            None => n,
        })
    }

    /// The row of the last token had no candidate the grammar allows: feed that token
    /// again (its cells are written again with the same values) for every logit.
    pub fn fetch_logits(&mut self) {
        self.fed = self.fed.saturating_sub(1);
        self.needs_logits = true;
    }

    /// Forgets every fed token, so the sequence is prefilled again from position 0 (after a
    /// context shift the cells cannot serve); returns the positions its cells keep: none.
    pub fn restart(&mut self) -> usize {
        self.fed = 0;
        0
    }

    /// Whether the next feed's prompt positions are logits rows that score the prompt.
    fn scores_prompt(&self) -> bool {
        self.prompt_scores.is_some() && self.dropped == 0
    }

    /// Sends the prompt's scores, once they are all in (before the first token).
    pub fn send_prompt_scores(&mut self) {
        if let Some(scores) = self.prompt_scores.take() {
            self.send(Ok(GenEvent::Prompt(scores)));
        }
    }

    /// Sends the final event.
    pub fn finish(&self, finish: FinishReason) {
        self.send(Ok(GenEvent::Done {
            finish,
            prompt_tokens: self.prompt_len,
            completion_tokens: self.generated,
        }));
    }

    /// Sends an event; the channel holds every event a request can produce, so this only
    /// fails when the receiver is gone (the request is then cancelled at the next step).
    pub fn send(&self, event: Result<GenEvent, GenError>) {
        let _ = self.events.try_send(event);
    }
}

/// One forward pass over every worker.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Batch {
    /// Sequence and position of each token.
    pub tokens: Vec<TokenPos>,
    /// Token ids, for the first worker.
    pub ids: Vec<u32>,
    /// Rows (indices into `tokens`) whose logits to return.
    pub logits_rows: Vec<u32>,
    /// What each logits row is for.
    pub uses: Vec<RowUse>,
    /// The slot each sampling row samples for, in row order.
    pub sample_for: Vec<usize>,
    /// `(slot index, tokens fed)` per sequence in the batch.
    pub fed: Vec<(usize, usize)>,
    /// What the last worker returns for the logits rows: every logit, or only what the
    /// rows' samplers need (arg-max tokens, the top candidates).
    pub rows: tether_protocol::Rows,
    /// With [`tether_protocol::Rows::LogProbs`]: empty, or the token id each logits row
    /// scores (a prompt's next token).
    pub targets: Vec<u32>,
}

/// Prompt chunks a step is cut into per worker when the model spans several, so that the
/// workers overlap (chunk k+1 on one worker while chunk k is on the next).
pub(crate) const CHUNKS_PER_STAGE: usize = 4;

/// What a step takes of its sequences, and how it is cut into forward passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StepShape {
    /// Most tokens in one forward pass.
    pub ubatch: usize,
    /// Most prompt tokens in one forward pass (decode tokens come first, within `ubatch`).
    pub prompt_chunk: usize,
    /// Most forward passes a step is cut into.
    pub chunks: usize,
}

impl StepShape {
    /// One pass of up to `ubatch` tokens a step over one worker; over `stages` workers,
    /// [`CHUNKS_PER_STAGE`] prompt chunks per worker of `ubatch / (4 * stages)` tokens, but
    /// no fewer than `min_chunk` (a GPU pass of few tokens costs nearly what a larger one
    /// does, so tiny chunks would lose more than the overlap gains).
    pub fn new(ubatch: usize, stages: usize, min_chunk: usize) -> Self {
        if stages <= 1 {
            return Self {
                ubatch,
                prompt_chunk: ubatch,
                chunks: 1,
            };
        }
        let chunks = CHUNKS_PER_STAGE * stages;
        Self {
            ubatch,
            prompt_chunk: (ubatch / chunks).max(min_chunk).clamp(1, ubatch.max(1)),
            chunks,
        }
    }
}

/// Makes the next step's batch from the sequences in `slots`, starting the rotation at
/// `start` so no sequence waits forever when `ubatch` is smaller than the demand (the
/// first of [`build_step`]'s chunks).
#[cfg(test)]
fn build_batch(slots: &[Option<Sequence>], ubatch: usize, start: usize) -> Batch {
    let mut fed: Vec<usize> = slots
        .iter()
        .map(|s| s.as_ref().map_or(0, |s| s.fed))
        .collect();
    fill_batch(slots, 0, ubatch, ubatch, start, &mut fed)
}

/// Makes a step's batches of the sequences of `lane`: the first as [`build_batch`] (with
/// at most `shape.prompt_chunk` prompt tokens), then, while prompts have tokens left and
/// there are fewer than `shape.chunks`, more prompt chunks that go on where the one before
/// stopped. Sent through the workers in order, chunk k+1 runs on an earlier worker while
/// chunk k runs on a later one, so a long prompt fills the pipeline instead of crossing
/// the workers one at a time.
pub(crate) fn build_step(
    slots: &[Option<Sequence>],
    lane: usize,
    shape: StepShape,
    start: usize,
) -> Vec<Batch> {
    let mut fed: Vec<usize> = slots
        .iter()
        .map(|s| s.as_ref().map_or(0, |s| s.fed))
        .collect();
    let (ubatch, prompt) = (shape.ubatch, shape.prompt_chunk);
    let mut out = vec![fill_batch(slots, lane, ubatch, prompt, start, &mut fed)];
    while out.len() < shape.chunks {
        let next = fill_batch(slots, lane, ubatch, prompt, start, &mut fed);
        if next.tokens.is_empty() {
            break;
        }
        out.push(next);
    }
    out
}

/// One batch of at most `ubatch` tokens, at most `prompt_cap` of them prompt tokens, of the
/// sequences of `lane`, as if each sequence had `fed[i]` tokens in its cache; advances
/// `fed` past what it takes.
fn fill_batch(
    slots: &[Option<Sequence>],
    lane: usize,
    ubatch: usize,
    prompt_cap: usize,
    start: usize,
    fed: &mut [usize],
) -> Batch {
    let mut batch = Batch::default();
    let mut budget = ubatch;
    let n = slots.len();
    for decode_pass in [true, false] {
        if !decode_pass {
            budget = budget.min(prompt_cap);
        }
        for k in 0..n {
            let i = (start + k) % n;
            let Some(seq) = slots[i].as_ref().filter(|s| s.lane == lane) else {
                continue;
            };
            let done = fed[i];
            let to_feed = seq.tokens.len() - done;
            // One token a step once the prompt is in; a tail fed again after a context
            // shift goes with the prompt chunks.
            let decoding = done >= seq.prompt_len && to_feed <= 1;
            if decoding != decode_pass || to_feed == 0 || budget == 0 {
                continue;
            }
            let take = to_feed.min(budget);
            budget -= take;
            let scoring = seq.scores_prompt();
            for p in done..done + take {
                batch.tokens.push(TokenPos {
                    seq: seq.slot,
                    pos: p as u32,
                });
                batch.ids.push(seq.tokens[p]);
                if scoring && p + 1 < seq.prompt_len {
                    batch.logits_rows.push((batch.tokens.len() - 1) as u32);
                    batch.uses.push(RowUse::Score(i));
                    batch.targets.push(seq.tokens[p + 1]);
                }
            }
            if done + take == seq.tokens.len() {
                batch.logits_rows.push((batch.tokens.len() - 1) as u32);
                batch.uses.push(RowUse::Sample(i));
                batch.sample_for.push(i);
                // Any valid id: a sampling row's target logit is not read.
                batch.targets.push(0);
            }
            batch.fed.push((i, take));
            fed[i] = done + take;
        }
    }
    if !batch.uses.iter().any(|u| matches!(u, RowUse::Score(_))) {
        batch.targets.clear();
    }
    batch
}

/// Cuts `batch` into at most `groups` batches of whole sequences. Sent through the workers
/// at once, they form a pipeline: while one group runs on a later worker, the next runs on
/// an earlier one. Sequences are disjoint, so the order the workers see them in is free.
pub(crate) fn split_batch(batch: Batch, groups: usize) -> Vec<Batch> {
    let groups = groups.min(batch.fed.len());
    if groups <= 1 {
        return vec![batch];
    }
    partition(batch, groups, |k, _| k % groups)
}

/// Moves the sequences whose slot `apart` picks out of `batch` into a batch of their own
/// after it (each batch may then ask the worker for a different kind of rows).
pub(crate) fn split_off(batch: Batch, apart: impl Fn(usize) -> bool) -> Vec<Batch> {
    let picked = batch.fed.iter().filter(|&&(i, _)| apart(i)).count();
    if picked == 0 || picked == batch.fed.len() {
        return vec![batch];
    }
    partition(batch, 2, |_, i| usize::from(apart(i)))
}

/// Cuts `batch` into `groups` batches of whole sequences, the k-th sequence (of slot i)
/// going to batch `assign(k, i)`.
fn partition(batch: Batch, groups: usize, assign: impl Fn(usize, usize) -> usize) -> Vec<Batch> {
    let mut out = vec![Batch::default(); groups];
    let mut offset = 0;
    let mut row = 0;
    for (k, &(i, take)) in batch.fed.iter().enumerate() {
        let g = &mut out[assign(k, i)];
        let base = g.tokens.len();
        g.tokens
            .extend_from_slice(&batch.tokens[offset..offset + take]);
        g.ids.extend_from_slice(&batch.ids[offset..offset + take]);
        // The sequence's rows: prompt scores, then its sampling row at its last token.
        while let Some(&r) = batch
            .logits_rows
            .get(row)
            .filter(|&&r| (r as usize) < offset + take)
        {
            g.logits_rows.push((base + r as usize - offset) as u32);
            g.uses.push(batch.uses[row]);
            if let RowUse::Sample(slot) = batch.uses[row] {
                g.sample_for.push(slot);
            }
            if let Some(&t) = batch.targets.get(row) {
                g.targets.push(t);
            }
            row += 1;
        }
        g.fed.push((i, take));
        offset += take;
    }
    for g in &mut out {
        if !g.uses.iter().any(|u| matches!(u, RowUse::Score(_))) {
            g.targets.clear();
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_model::SamplingParams;

    fn seq(
        slot: u32,
        prompt: usize,
        fed: usize,
    ) -> (Sequence, mpsc::Receiver<Result<GenEvent, GenError>>) {
        let (tx, rx) = mpsc::channel(16);
        let s = Sequence {
            slot,
            lane: 0,
            tokens: (0..prompt as u32).map(|t| t + 100 * slot).collect(),
            prompt_len: prompt,
            fed,
            generated: 0,
            dropped: 0,
            max_tokens: 3,
            sampler: Sampler::new(SamplingParams::greedy()),
            deadline: None,
            stop_tokens: Vec::new(),
            events: tx,
            logprobs: None,
            prompt_logprobs: None,
            prompt_scores: None,
            scored: None,
            constraint: None,
            needs_logits: false,
        };
        (s, rx)
    }

    #[test]
    fn decode_tokens_come_first_and_prompts_are_chunked() {
        let (mut a, _ra) = seq(0, 5, 5);
        a.tokens.push(7); // a sampled token waiting to be fed
        let (b, _rb) = seq(1, 10, 0);
        let slots = vec![Some(b), None, Some(a)];
        let batch = build_batch(&slots, 4, 0);
        assert_eq!(batch.tokens[0], TokenPos { seq: 0, pos: 5 });
        assert_eq!(batch.ids[0], 7);
        assert_eq!(batch.tokens.len(), 4, "ubatch caps the batch");
        assert_eq!(batch.ids[1..], [100, 101, 102]);
        assert_eq!(
            batch.logits_rows,
            vec![0],
            "the unfinished prompt asks no logits"
        );
        assert_eq!(batch.sample_for, vec![2]);
        assert_eq!(batch.fed, vec![(2, 1), (0, 3)]);
    }

    #[test]
    fn the_last_prompt_chunk_asks_for_logits() {
        let (b, _rb) = seq(1, 6, 4);
        let batch = build_batch(&[Some(b)], 8, 0);
        assert_eq!(batch.tokens.len(), 2);
        assert_eq!(batch.tokens[1], TokenPos { seq: 1, pos: 5 });
        assert_eq!(batch.logits_rows, vec![1]);
    }

    #[test]
    fn rotation_serves_everyone() {
        let (a, _ra) = seq(0, 3, 0);
        let (b, _rb) = seq(1, 3, 0);
        let slots = vec![Some(a), Some(b)];
        assert_eq!(build_batch(&slots, 3, 0).fed, vec![(0, 3)]);
        assert_eq!(build_batch(&slots, 3, 1).fed, vec![(1, 3)]);
    }

    #[test]
    fn split_keeps_sequences_whole_and_rows_aligned() {
        let (mut a, _ra) = seq(0, 2, 2);
        a.tokens.push(7);
        let (b, _rb) = seq(1, 3, 0);
        let (c, _rc) = seq(2, 4, 2);
        let whole = build_batch(&[Some(a), Some(b), Some(c)], 16, 0);
        let parts = split_batch(whole.clone(), 2);
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].fed, vec![(0, 1), (2, 2)]);
        assert_eq!(parts[1].fed, vec![(1, 3)]);
        assert_eq!(parts[0].ids, vec![7, 202, 203]);
        assert_eq!(parts[0].logits_rows, vec![0, 2]);
        assert_eq!(parts[0].sample_for, vec![0, 2]);
        assert_eq!(parts[1].logits_rows, vec![2]);
        assert_eq!(parts[1].tokens[0], TokenPos { seq: 1, pos: 0 });
        let rows: usize = parts.iter().map(|p| p.logits_rows.len()).sum();
        assert_eq!(rows, whole.logits_rows.len());
        assert_eq!(split_batch(whole.clone(), 1), vec![whole]);
    }

    #[test]
    fn split_off_moves_picked_sequences_to_a_batch_of_their_own() {
        let (mut a, _ra) = seq(0, 2, 1);
        a.fetch_logits();
        let (mut b, _rb) = seq(1, 2, 2);
        b.tokens.push(9);
        let (c, _rc) = seq(2, 3, 0);
        let whole = build_batch(&[Some(a), Some(b), Some(c)], 16, 0);
        let parts = split_off(whole.clone(), |i| i == 0);
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].fed, vec![(1, 1), (2, 3)]);
        assert_eq!(parts[0].sample_for, vec![1, 2]);
        assert_eq!(parts[0].logits_rows, vec![0, 3]);
        assert_eq!(parts[1].fed, vec![(0, 2)], "fed again from where it was");
        assert_eq!(parts[1].sample_for, vec![0]);
        assert_eq!(parts[1].logits_rows, vec![1]);
        assert_eq!(split_off(whole.clone(), |_| false), vec![whole.clone()]);
        assert_eq!(split_off(whole.clone(), |_| true), vec![whole]);
    }

    #[test]
    fn accept_follows_the_generator_rules() {
        let (mut s, mut rx) = seq(0, 2, 2);
        assert_eq!(
            s.accept(9, true, 16, None),
            Next::Finish(FinishReason::Stop)
        );
        assert!(
            rx.try_recv().is_err(),
            "an end-of-generation token is not sent"
        );
        assert_eq!(s.accept(5, false, 16, None), Next::Continue);
        assert_eq!(rx.try_recv().unwrap(), Ok(GenEvent::Token(5)));
        assert_eq!(
            s.accept(6, false, 3, None),
            Next::Finish(FinishReason::Length),
            "context full"
        );
        let (mut s, _rx) = seq(0, 2, 2);
        s.accept(1, false, 16, None);
        s.accept(1, false, 16, None);
        assert_eq!(
            s.accept(1, false, 16, None),
            Next::Finish(FinishReason::Length)
        );
        assert_eq!(s.generated, 3);
    }

    #[test]
    fn a_full_context_shifts_and_feeds_the_kept_tail_again() {
        // Prompt of 6 in a context of 8; keep 2.
        let (mut s, _rx) = seq(0, 6, 6);
        s.max_tokens = 100;
        let shift = Some(ContextShift { keep: 2 });
        assert_eq!(s.accept(50, false, 8, shift), Next::Continue);
        s.fed += 1;
        assert_eq!(s.accept(51, false, 8, shift), Next::Continue);
        s.fed += 1;
        // 9 tokens, 8 fed: full. Of the 6 after the kept 2, the oldest 3 go.
        assert_eq!(s.accept(52, false, 8, shift), Next::Shifted(2));
        assert_eq!(s.tokens, vec![0, 1, 5, 50, 51, 52]);
        assert_eq!((s.fed, s.dropped, s.generated), (2, 3, 3));
        assert_eq!(s.prompt_part(4), 0, "fed again, not prompt");
        // The tail goes with the prompt chunks and asks for logits at its end.
        let batch = build_batch(&[Some(s)], 16, 0);
        assert_eq!(batch.ids, vec![5, 50, 51, 52]);
        assert_eq!(batch.tokens[0], TokenPos { seq: 0, pos: 2 });
        assert_eq!(batch.logits_rows, vec![3]);
    }

    #[test]
    fn a_step_chunks_a_long_prompt_for_the_pipeline() {
        let (mut a, _ra) = seq(0, 2, 2);
        a.tokens.push(7);
        let (b, _rb) = seq(1, 10, 1);
        let slots = vec![Some(a), Some(b)];
        let shape = |chunks| StepShape {
            ubatch: 4,
            prompt_chunk: 4,
            chunks,
        };
        let chunks = build_step(&slots, 0, shape(3), 0);
        assert_eq!(chunks.len(), 3);
        assert_eq!(chunks[0].fed, vec![(0, 1), (1, 3)], "decode first");
        assert_eq!(chunks[1].fed, vec![(1, 4)]);
        assert_eq!(chunks[1].tokens[0], TokenPos { seq: 1, pos: 4 });
        assert_eq!(chunks[2].fed, vec![(1, 2)]);
        assert_eq!(chunks[2].tokens[1], TokenPos { seq: 1, pos: 9 });
        assert_eq!(chunks[0].sample_for, vec![0]);
        assert!(chunks[1].logits_rows.is_empty());
        assert_eq!(
            chunks[2].logits_rows,
            vec![1],
            "logits where the prompt ends"
        );
        assert_eq!(
            build_step(&slots, 0, shape(8), 0).len(),
            3,
            "no empty chunks"
        );
        assert_eq!(
            build_step(&slots, 0, shape(1), 0),
            vec![build_batch(&slots, 4, 0)]
        );
        assert!(
            build_step(&slots, 1, shape(3), 0)[0].tokens.is_empty(),
            "lane 1 is empty"
        );
    }

    #[test]
    fn prompt_chunks_are_capped_but_decode_tokens_are_not() {
        let decoding: Vec<_> = (0..3)
            .map(|i| {
                let (mut s, rx) = seq(i, 2, 2);
                s.tokens.push(7);
                (s, rx)
            })
            .collect();
        let (long, _rl) = seq(3, 9, 0);
        let mut slots: Vec<_> = decoding.into_iter().map(|(s, _)| Some(s)).collect();
        slots.push(Some(long));
        let shape = StepShape {
            ubatch: 8,
            prompt_chunk: 2,
            chunks: 8,
        };
        let chunks = build_step(&slots, 0, shape, 0);
        assert_eq!(chunks[0].fed, vec![(0, 1), (1, 1), (2, 1), (3, 2)]);
        let prompt: Vec<usize> = chunks[1..].iter().map(|c| c.tokens.len()).collect();
        assert_eq!(
            prompt,
            vec![2, 2, 2, 1],
            "the rest of the prompt in chunks of 2"
        );
        assert_eq!(chunks[4].logits_rows, vec![0]);
    }

    #[test]
    fn a_step_shape_cuts_prompts_only_over_several_workers() {
        let one = StepShape::new(512, 1, 64);
        assert_eq!((one.prompt_chunk, one.chunks), (512, 1));
        let two = StepShape::new(512, 2, 64);
        assert_eq!((two.prompt_chunk, two.chunks), (64, 8));
        let floor = StepShape::new(512, 2, 128);
        assert_eq!((floor.prompt_chunk, floor.chunks), (128, 8));
        let small = StepShape::new(8, 2, 64);
        assert_eq!(small.prompt_chunk, 8, "never above ubatch");
    }

    #[test]
    fn a_shift_with_nothing_to_drop_ends_with_length() {
        let (mut s, _rx) = seq(0, 3, 3);
        s.max_tokens = 100;
        let keep_all = Some(ContextShift { keep: 3 });
        assert_eq!(
            s.accept(9, false, 3, keep_all),
            Next::Finish(FinishReason::Length)
        );
        let (mut s, _rx) = seq(0, 3, 3);
        s.max_tokens = 1;
        assert_eq!(
            s.accept(9, false, 3, Some(ContextShift { keep: 0 })),
            Next::Finish(FinishReason::Length),
            "max_tokens wins over a shift"
        );
    }

    #[test]
    fn a_scored_prompt_asks_for_every_position_with_the_next_token_as_target() {
        let (mut a, _ra) = seq(0, 2, 2);
        a.tokens.push(7);
        let (mut b, _rb) = seq(1, 5, 0);
        b.prompt_scores = Some(vec![None]);
        let slots = vec![Some(a), Some(b)];
        let first = build_batch(&slots, 4, 0);
        // The decode token of slot 0, then positions 0..3 of slot 1's prompt.
        assert_eq!(first.logits_rows, vec![0, 1, 2, 3]);
        assert_eq!(
            first.uses,
            vec![
                RowUse::Sample(0),
                RowUse::Score(1),
                RowUse::Score(1),
                RowUse::Score(1)
            ]
        );
        assert_eq!(
            first.targets,
            vec![0, 101, 102, 103],
            "the next prompt tokens"
        );
        assert_eq!(first.sample_for, vec![0]);
        let parts = split_batch(first, 2);
        assert_eq!(parts[0].uses, vec![RowUse::Sample(0)]);
        assert!(parts[0].targets.is_empty(), "no scores, no targets");
        assert_eq!(parts[1].logits_rows, vec![0, 1, 2]);
        assert_eq!(parts[1].targets, vec![101, 102, 103]);
        assert!(parts[1].sample_for.is_empty());
        // The last two: position 3 scores token 4, position 4 samples.
        let mut slots = slots;
        if let Some(b) = &mut slots[1] {
            b.fed = 3;
        }
        slots[0] = None;
        let last = build_batch(&slots, 4, 0);
        assert_eq!(last.logits_rows, vec![0, 1]);
        assert_eq!(last.uses, vec![RowUse::Score(1), RowUse::Sample(1)]);
        assert_eq!(last.targets, vec![104, 0]);
        let unscored = build_batch(&[Some(seq(1, 5, 0).0)], 8, 0);
        assert_eq!(unscored.logits_rows, vec![4], "only where the prompt ends");
        assert!(unscored.targets.is_empty());
    }
}
