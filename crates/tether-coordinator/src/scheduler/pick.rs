//! A sampling row's token: what the last worker returned for it, through the sequence's
//! sampler, and through its grammar when it has one.

use super::pipeline::RowsOut;
use crate::api::GenError;
use crate::constraint::{Constraint, ConstraintError, Picked};
use crate::sequence::Sequence;
use tether_model::tokenizer::Tokenizer;

/// The next token of `seq` from row `row` of `out` (rows of a `v`-token vocabulary), or
/// [`Picked::NeedLogits`] when the grammar allows none of the row's candidates.
pub(super) fn pick(
    seq: &mut Sequence,
    out: &RowsOut,
    row: usize,
    v: usize,
    tokenizer: &Tokenizer,
) -> Result<Picked, ConstraintError> {
    let Sequence {
        sampler,
        tokens,
        constraint,
        stop_tokens,
        logprobs,
        ..
    } = seq;
    let ends = |t: u32| tokenizer.is_eog(t) || stop_tokens.contains(&t);
    let Some(c) = constraint else {
        return Ok(Picked::Token(match out {
            RowsOut::Logits(l) => sampler.sample(&l[row * v..(row + 1) * v], tokens),
            RowsOut::ArgMax(ids) => ids[row],
            RowsOut::Top { starts, candidates }
            | RowsOut::Scored {
                starts, candidates, ..
            } => sampler.sample_top(&candidates[starts[row]..starts[row + 1]], tokens),
            // Embedding batches have no sampling rows (`Scheduler::apply` checks): fetch
            // the row's logits in a batch of its own.
            RowsOut::Embeddings(_) => return Ok(Picked::NeedLogits),
        }));
    };
    match out {
        RowsOut::Logits(l) => {
            match c.pick_full(sampler, &l[row * v..(row + 1) * v], tokens, &ends)? {
                Some(token) => Ok(Picked::Token(token)),
                None => Err(ConstraintError::Matcher(
                    "the grammar allows no token of the vocabulary here".into(),
                )),
            }
        }
        RowsOut::Top { starts, candidates }
        | RowsOut::Scored {
            starts, candidates, ..
        } => match c.pick_top(
            sampler,
            &candidates[starts[row]..starts[row + 1]],
            tokens,
            &ends,
        )? {
            // A token the grammar forces needs no logits to be drawn (JSON's punctuation
            // and keys, which a model may rank below its top candidates), unless its
            // log-probability is to be reported.
            Picked::NeedLogits if logprobs.is_none() => {
                Ok(c.forced(&ends)?.map_or(Picked::NeedLogits, Picked::Token))
            }
            picked => Ok(picked),
        },
        // Constrained rows never ask for arg-max tokens (`Sequence::samples_greedily`), nor
        // sit in embedding batches.
        RowsOut::ArgMax(_) | RowsOut::Embeddings(_) => Ok(Picked::NeedLogits),
    }
}

/// Grammars whose next mask is being computed on the blocking pool, taken out of their
/// sequences while a step runs on the workers (so the mask costs no time of its own).
pub(super) struct Masks {
    task: tokio::task::JoinHandle<Vec<(usize, Constraint)>>,
    slots: Vec<usize>,
}

/// Starts computing the next mask of every constrained sequence that lacks one.
pub(super) fn start_masks(slots: &mut [Option<Sequence>]) -> Option<Masks> {
    let taken: Vec<(usize, Constraint)> = slots
        .iter_mut()
        .enumerate()
        .filter_map(|(i, s)| {
            let s = s.as_mut()?;
            match &s.constraint {
                Some(c) if !c.is_prepared() => Some((i, s.constraint.take()?)),
                _ => None,
            }
        })
        .collect();
    if taken.is_empty() {
        return None;
    }
    let slots = taken.iter().map(|t| t.0).collect();
    let task = tokio::task::spawn_blocking(move || {
        let mut taken = taken;
        for (_, c) in &mut taken {
            c.prepare();
        }
        taken
    });
    Some(Masks { task, slots })
}

/// Gives the grammars back to their sequences (before the step's rows are drawn); returns
/// the slots whose grammar was lost (the task panicked), to be ended with the error.
pub(super) async fn finish_masks(
    slots: &mut [Option<Sequence>],
    masks: Option<Masks>,
) -> Vec<(usize, GenError)> {
    let Some(masks) = masks else {
        return Vec::new();
    };
    match masks.task.await {
        Ok(done) => {
            for (i, c) in done {
                if let Some(s) = &mut slots[i] {
                    s.constraint = Some(c);
                }
            }
            Vec::new()
        }
        Err(e) => masks
            .slots
            .into_iter()
            .map(|i| {
                let why = format!("computing the grammar's mask failed: {e}");
                (i, GenError::Internal(why))
            })
            .collect(),
    }
}
