//! Applying a step's output: every sequence of the batch moves forward, and the rows that
//! asked for logits are sampled (or take the worker's arg-max tokens).

use super::*;

impl Scheduler {
    /// Moves every sequence of `batch` forward and samples the rows that asked for logits
    /// (or takes the worker's arg-max tokens for them).
    pub(super) fn apply(&mut self, batch: &Batch, out: &RowsOut) -> Result<(), Loss> {
        let (v, e) = (self.model.config().n_vocab, self.model.config().n_embd);
        let rows = batch.logits_rows.len();
        match out {
            RowsOut::Embeddings(_) if batch.uses.iter().any(|u| !matches!(u, RowUse::Embed(_))) => {
                return Err(Loss::Internal(
                    "a batch of embedding rows carried other rows".into(),
                ));
            }
            RowsOut::Embeddings(x) if x.len() != rows * e => {
                return Err(Loss::BadReply(format!(
                    "the last worker returned {} embedding values for {rows} rows of {e}",
                    x.len()
                )));
            }
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
            | RowsOut::Scored {
                starts, candidates, ..
            } if starts.len() != rows + 1 || candidates.iter().any(|c| c.0 as usize >= v) => {
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
        let ring = kv_ring(self.model.config(), ctx, self.setup.shape.ubatch);
        let mut finished = Vec::new();
        let mut failed = Vec::new();
        for (row, &use_) in batch.uses.iter().enumerate() {
            let i = use_.slot();
            let Some(seq) = &mut self.slots[i] else {
                continue;
            };
            if let RowUse::Embed(_) = use_ {
                if let (Some(embedding), RowsOut::Embeddings(x)) = (&mut seq.embed, out) {
                    embedding.add(&x[row * e..(row + 1) * e]);
                }
                continue;
            }
            if let RowUse::Score(_) = use_ {
                let target = batch.targets.get(row).copied().unwrap_or(0);
                let n = seq.prompt_logprobs.unwrap_or(0);
                let scored = out.log_prob(row, v, target, n);
                if let Some(scores) = &mut seq.prompt_scores {
                    scores.push(Some(scored));
                }
                continue;
            }
            seq.send_prompt_scores();
            if seq.generated == 0 && seq.max_tokens == 0 {
                // Only the prompt's scores were asked for.
                finished.push((i, FinishReason::Length));
                continue;
            }
            let token = match pick::pick(seq, out, row, v, &tokenizer) {
                Ok(Picked::Token(token)) => token,
                Ok(Picked::NeedLogits) => {
                    seq.fetch_logits();
                    continue;
                }
                Err(e) => {
                    failed.push((i, e));
                    continue;
                }
            };
            seq.needs_logits = false;
            if let Some(n) = seq.logprobs {
                seq.scored = Some(out.log_prob(row, v, token, n));
            }
            let eog = tokenizer.is_eog(token) || seq.stop_tokens.contains(&token);
            // A grammar moves past every token kept; once complete it ends the request.
            let complete = match seq.constraint.as_mut().filter(|_| !eog) {
                Some(c) => match c.advance(token) {
                    Ok(complete) => complete,
                    Err(e) => {
                        failed.push((i, e));
                        continue;
                    }
                },
                None => false,
            };
            if !eog {
                self.shared.generated_tokens.fetch_add(1, Ordering::Relaxed);
            }
            let next = match seq.accept(token, eog, ctx, shift) {
                _ if complete => Next::Finish(FinishReason::Stop),
                next => next,
            };
            match next {
                Next::Continue => {}
                Next::Shifted(kept) => {
                    // A sliding-window ring holds the newest positions, not the window the
                    // kept prefix's successor needs: the shifted tokens are prefilled again
                    // from the start.
                    let kept = match ring {
                        Some(_) => seq.restart(),
                        None => kept,
                    };
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
        // An embedding is done once its prompt is in.
        for &(i, _) in &batch.fed {
            if let Some(seq) = &self.slots[i]
                && let Some(embedding) = &seq.embed
                && seq.fed >= seq.prompt_len
            {
                seq.send(Ok(GenEvent::Embedding(embedding.pooled())));
                finished.push((i, FinishReason::Stop));
            }
        }
        for (i, finish) in finished {
            if let Some(seq) = self.free(i) {
                seq.finish(finish);
            }
        }
        for (i, e) in failed {
            if let Some(seq) = self.free(i) {
                seq.send(Err(GenError::Internal(e.to_string())));
            }
        }
        Ok(())
    }
}
