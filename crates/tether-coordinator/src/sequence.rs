//! One running request in its sequence slot, and how a step's batch is made from all of
//! them: decode tokens first (one per generating sequence), then prompt chunks, never more
//! than `ubatch` tokens in all.

use crate::api::{ContextShift, FinishReason, GenError, GenEvent, Pooling, TokenLogProb};
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
    /// The pooled embedding being summed, when the request embeds its prompt.
    pub embed: Option<Embedding>,
}

/// An embedding being pooled: the sum of its rows' normed hidden states so far.
pub(crate) struct Embedding {
    pub pooling: Pooling,
    pub sum: Vec<f32>,
    pub rows: usize,
}

impl Embedding {
    pub fn new(pooling: Pooling) -> Self {
        Self {
            pooling,
            sum: Vec::new(),
            rows: 0,
        }
    }

    /// Whether the prompt position `p` (of `len`) is one of the pooled rows.
    fn pools(&self, p: usize, len: usize) -> bool {
        match self.pooling {
            Pooling::Mean => true,
            Pooling::Cls => p == 0,
            Pooling::Last => p + 1 == len,
        }
    }

    /// Adds a row.
    pub fn add(&mut self, row: &[f32]) {
        if self.sum.is_empty() {
            self.sum = row.to_vec();
        } else {
            self.sum.iter_mut().zip(row).for_each(|(s, r)| *s += r);
        }
        self.rows += 1;
    }

    /// The pooled vector: the mean of the rows added.
    pub fn pooled(&self) -> Vec<f32> {
        let n = self.rows.max(1) as f32;
        self.sum.iter().map(|s| s / n).collect()
    }
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
    /// Its normed hidden state is pooled into the embedding of the sequence in this slot.
    Embed(usize),
}

impl RowUse {
    /// The slot of the sequence the row belongs to.
    pub fn slot(self) -> usize {
        match self {
            RowUse::Sample(i) | RowUse::Score(i) | RowUse::Embed(i) => i,
        }
    }
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
                if seq
                    .embed
                    .as_ref()
                    .is_some_and(|e| e.pools(p, seq.prompt_len))
                {
                    batch.logits_rows.push((batch.tokens.len() - 1) as u32);
                    batch.uses.push(RowUse::Embed(i));
                    batch.targets.push(0);
                }
            }
            if done + take == seq.tokens.len() && seq.embed.is_none() {
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
mod tests;
