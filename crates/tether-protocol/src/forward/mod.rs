//! The forward call: what a coordinator asks a block to run and what comes back, and the
//! check a client makes of every reply. Its two codecs are [`grpc`] (the control plane's
//! Forward RPC) and [`crate::link::frame`] (the data link's frames).

pub mod grpc;

use crate::error::WorkerError;
pub use tether_compute::SharedArea;

/// One token of a batch: its sequence and position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenPos {
    /// Sequence index, below `n_seq`.
    pub seq: u32,
    /// Position in the sequence, below `ctx_per_seq`.
    pub pos: u32,
}

/// The input of a forward pass.
#[derive(Clone, Debug, PartialEq)]
pub enum ForwardInput {
    /// Hidden states `[tokens][n_embd]`.
    Hidden(Vec<f32>),
    /// Token ids, one per token (only for a block with the embedding table).
    TokenIds(Vec<u32>),
    /// Hidden states `[tokens][n_embd]` the previous block left on its device
    /// ([`Rows::HandOff`]), copied from there device to device.
    Lent(SharedArea),
}

/// The output of a forward pass.
#[derive(Clone, Debug, PartialEq)]
pub enum ForwardOutput {
    /// Hidden states `[tokens][n_embd]`.
    Hidden(Vec<f32>),
    /// Logits `[rows][n_vocab]` of the rows asked for.
    Logits(Vec<f32>),
    /// The arg-max token of each row asked for, when the call asked for that instead of
    /// logits (found on the stage's device, or by the registry from returned logits).
    ArgMax(Vec<u32>),
    /// The most likely `(id, logit)` candidates of each row asked for, highest first
    /// (`counts[r]` of them for row r, one row after the other), when the call asked for
    /// them instead of logits.
    Top {
        /// Candidates per row.
        counts: Vec<u32>,
        /// The candidates.
        candidates: Vec<(u32, f32)>,
    },
    /// What [`Rows::LogProbs`] asks for: each row's top candidates as in
    /// [`ForwardOutput::Top`], and a `(log-sum-exp, target logit)` pair a row (the target's
    /// logit NaN when the call named no targets). A logit `l` of row r has the
    /// log-probability `l - scores[r].0` under the model's softmax at temperature 1.
    Scored {
        /// Candidates per row (0 when the call asked for none).
        counts: Vec<u32>,
        /// The candidates, highest first within each row.
        candidates: Vec<(u32, f32)>,
        /// `(log-sum-exp, target logit)` per row.
        scores: Vec<(f32, f32)>,
    },
    /// What [`Rows::Embeddings`] asks for: each row's hidden state after the output norm,
    /// `[rows][n_embd]`, the vectors an embedding pools.
    Embeddings(Vec<f32>),
    /// What [`Rows::HandOff`] asks for: where on its device the block left the hidden
    /// states, for the next block to copy.
    Lent(SharedArea),
}

/// What a forward returns for its logits rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Rows {
    /// Every logit.
    #[default]
    Logits,
    /// Each row's arg-max token.
    ArgMax,
    /// Each row's `k` most likely candidates (1..=[`MAX_TOP_K`]).
    Top(u32),
    /// What log-probabilities need, computed where the logits are: each row's `k` most
    /// likely candidates (0..=[`MAX_TOP_K`]), its log-sum-exp, and the logit of the call's
    /// target for the row ([`ForwardCall::targets`]).
    LogProbs(u32),
    /// Each row's hidden state after the output norm instead of its logits.
    Embeddings,
    /// With no logits rows: leave the hidden states in the block's hand-off slot `n` on its
    /// device and return where ([`ForwardOutput::Lent`]). The caller takes slot `n` back
    /// only once the next block has answered the call that copied from it. With no
    /// tokens, a probe: the slot's area, nothing run.
    HandOff(u32),
}

/// Most candidates a row may ask for.
pub const MAX_TOP_K: u32 = 1024;

/// One forward pass request.
#[derive(Clone, Debug, PartialEq)]
pub struct ForwardCall {
    /// The tokens of the batch.
    pub tokens: Vec<TokenPos>,
    /// Hidden states or token ids.
    pub input: ForwardInput,
    /// Rows whose logits to return; empty = return hidden states.
    pub logits_rows: Vec<u32>,
    /// What to return for the logits rows.
    pub rows: Rows,
    /// With [`Rows::LogProbs`]: empty, or one token id a logits row whose logit to return
    /// (a prompt's next token, to score the prompt). Empty otherwise.
    pub targets: Vec<u32>,
}

/// Checks that a forward reply is what was asked for (`rows` for `logits_rows` rows): its
/// kind, and one arg-max token or one candidate count (within k) per logits row.
pub fn check_reply(
    logits_rows: usize,
    rows: Rows,
    out: ForwardOutput,
) -> Result<ForwardOutput, WorkerError> {
    let n = logits_rows;
    let bad = |what: String| Err(WorkerError::Internal(format!("the worker returned {what}")));
    match (&out, rows) {
        (ForwardOutput::Lent(_), Rows::HandOff(_)) if n == 0 => Ok(out),
        (ForwardOutput::Hidden(_), _) if n == 0 => Ok(out),
        (ForwardOutput::Logits(_), Rows::Logits) if n > 0 => Ok(out),
        (ForwardOutput::Embeddings(e), Rows::Embeddings) if n > 0 && e.len() % n == 0 => Ok(out),
        (ForwardOutput::Embeddings(e), Rows::Embeddings) => {
            bad(format!("{} embedding values for {n} rows", e.len()))
        }
        (ForwardOutput::ArgMax(ids), Rows::ArgMax) if ids.len() == n => Ok(out),
        (ForwardOutput::ArgMax(ids), Rows::ArgMax) => {
            bad(format!("{} arg-max tokens for {n} logits rows", ids.len()))
        }
        (ForwardOutput::Top { counts, candidates }, Rows::Top(k)) => {
            let total: u64 = counts.iter().map(|&c| u64::from(c)).sum();
            if counts.len() == n
                && counts.iter().all(|&c| c <= k)
                && total == candidates.len() as u64
            {
                Ok(out)
            } else {
                bad(format!(
                    "top-{k} counts {counts:?} for {n} rows and {} candidates",
                    candidates.len()
                ))
            }
        }
        (
            ForwardOutput::Scored {
                counts,
                candidates,
                scores,
            },
            Rows::LogProbs(k),
        ) => {
            let total: u64 = counts.iter().map(|&c| u64::from(c)).sum();
            if counts.len() == n
                && scores.len() == n
                && counts.iter().all(|&c| c <= k)
                && total == candidates.len() as u64
            {
                Ok(out)
            } else {
                bad(format!(
                    "log-probabilities with top-{k} counts {counts:?} and {} scores for {n} \
                     rows and {} candidates",
                    scores.len(),
                    candidates.len()
                ))
            }
        }
        _ => bad("the wrong kind of output for the request".into()),
    }
}
