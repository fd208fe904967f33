//! Decode steps: a few tokens through the stage with the hidden states kept on the device
//! from the input to the output, one transfer each way, and the layers replayed.

use tether_compute::argmax::{score_row, top_candidates};
use tether_compute::{Backend, DeviceBuffer, SharedArea, score_rows_scratch, top_rows_scratch};

use super::Stage;
use super::forward::{as_bytes_mut, head_scratch_missing, need_len};
use super::handoff::handed_over;
use crate::error::{ModelError, compute};
use crate::kv::BatchToken;

/// What a decode step starts from; `V` is the backend's opened lent allocation
/// ([`Backend::Borrowed`]).
pub enum StepInput<'a, V = std::convert::Infallible> {
    /// One token id per token: the stage must hold the embedding table.
    Ids(&'a [u32]),
    /// `[tokens][n_embd]` hidden states from the stage before.
    Hidden(&'a [f32]),
    /// `[tokens][n_embd]` hidden states the stage before left in a hand-off slot on its
    /// device ([`StepOutput::Slot`]), copied device to device from the allocation `V`
    /// opened. Only for steps of more than 8 tokens: a replayed step (8 and under) would
    /// repeat the copy it recorded, from wherever that one came from.
    Lent(&'a V, &'a SharedArea),
}

impl<V> Clone for StepInput<'_, V> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<V> Copy for StepInput<'_, V> {}

impl<V> std::fmt::Debug for StepInput<'_, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StepInput::Ids(ids) => write!(f, "Ids({} tokens)", ids.len()),
            StepInput::Hidden(h) => write!(f, "Hidden({} values)", h.len()),
            StepInput::Lent(_, area) => write!(f, "Lent({} bytes)", area.len),
        }
    }
}

/// What a decode step writes, one row per token.
#[derive(Debug)]
pub enum StepOutput<'a> {
    /// `[tokens][n_embd]` hidden states for the stage after.
    Hidden(&'a mut [f32]),
    /// `[tokens][n_vocab]` logits: the stage must hold the output head.
    Logits(&'a mut [f32]),
    /// Each token's arg-max logit ([`crate::sampling::greedy`]), found on the device so
    /// that only the ids are downloaded: the stage must hold the output head.
    ArgMax(&'a mut [u32]),
    /// Each token's `k` most likely candidates ([`crate::sampling::top_candidates`]),
    /// selected on the device so that only they are downloaded: the stage must hold the
    /// output head.
    Top(usize, &'a mut [Vec<(u32, f32)>]),
    /// What log-probabilities need, reduced on the device: each token's `k` most likely
    /// candidates (none for k = 0) and `(log-sum-exp, logit of its target)`
    /// ([`tether_compute::argmax::score_row`]; `targets` empty or one a token). The stage
    /// must hold the output head.
    Scored {
        k: usize,
        targets: &'a [u32],
        top: &'a mut [Vec<(u32, f32)>],
        scores: &'a mut [(f32, f32)],
    },
    /// `[tokens][n_embd]` hidden states left in hand-off slot `n` (`0..HANDOFF_SLOTS`) of
    /// this stage's device, for the stage after to copy ([`StepInput::Lent`]); the slot's
    /// lent range is written to the `Option`. The caller must not name the slot again
    /// until the stage after has finished its copy. Only for steps of more than 8 tokens,
    /// like [`StepInput::Lent`].
    Slot(usize, &'a mut Option<SharedArea>),
}

/// Where a step's input comes from, once checked.
enum Source<'a, V> {
    /// The embedding table (its weight index) and the ids to look up.
    Table(usize, &'a [u32]),
    Host(&'a [f32]),
    Lent(&'a V, &'a SharedArea),
}

/// Where a step's output goes, once checked; the head as (norm, output) weight indices.
enum Sink<'a> {
    Hidden(&'a mut [f32]),
    Slot(usize, &'a mut Option<SharedArea>),
    Logits((usize, usize), &'a mut [f32]),
    ArgMax((usize, usize), &'a mut [u32]),
    Top((usize, usize), usize, &'a mut [Vec<(u32, f32)>]),
    Scored(
        (usize, usize),
        usize,
        &'a [u32],
        &'a mut [Vec<(u32, f32)>],
        &'a mut [(f32, f32)],
    ),
}

impl<B: Backend> Stage<B> {
    /// Most tokens [`Stage::decode_step`] takes in one call: a micro-batch. Steps of up to
    /// 8 tokens replay from recorded graphs; larger ones (many sequences decoding at once)
    /// are issued op by op, and still keep their hidden states, logits and selection on
    /// the device.
    pub fn decode_step_tokens(&self) -> usize {
        self.spec.ubatch
    }

    /// A decode step: `input` (one row per token of `batch`, at most
    /// [`Stage::decode_step_tokens`]) through every layer into `out`, each token's keys and
    /// values written into its cells. Between the input's upload (or embedding lookup) and
    /// the output's download nothing leaves the device. On bad input, or when the stage
    /// lacks the embedding or head the step needs, nothing changes.
    pub fn decode_step(
        &mut self,
        input: StepInput<'_, B::Borrowed>,
        batch: &[BatchToken],
        out: StepOutput<'_>,
    ) -> Result<(), ModelError> {
        let backend = self.backend.clone();
        backend.scope(|| self.decode_step_in_scope(input, batch, None, out))
    }

    /// [`Stage::decode_step`] whose head runs over the tokens `rows` names (increasing
    /// indices into `batch`) only: `out` holds one row per entry of `rows`. For a batch of
    /// prompt chunks beside decode tokens, where only the decode tokens and each prompt's
    /// last token need logits: the head and the selection stay on the device as in a
    /// decode step. `out` may not be [`StepOutput::Hidden`], which takes every token.
    pub fn decode_step_rows(
        &mut self,
        input: StepInput<'_, B::Borrowed>,
        batch: &[BatchToken],
        rows: &[u32],
        out: StepOutput<'_>,
    ) -> Result<(), ModelError> {
        if matches!(out, StepOutput::Hidden(_) | StepOutput::Slot(..)) {
            return Err(ModelError::InvalidArgument(
                "a decode step's hidden-state output takes every token, not chosen rows".into(),
            ));
        }
        let n = batch.len();
        let increasing = rows.windows(2).all(|w| w[0] < w[1]);
        if !increasing || rows.last().is_some_and(|&r| r as usize >= n) {
            return Err(ModelError::InvalidArgument(format!(
                "a decode step's rows must be increasing indices below its {n} tokens"
            )));
        }
        let backend = self.backend.clone();
        backend.scope(|| self.decode_step_in_scope(input, batch, Some(rows), out))
    }

    /// A decode step of a stage that holds the whole model, from token ids to logits.
    pub fn decode_logits(
        &mut self,
        ids: &[u32],
        batch: &[BatchToken],
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        self.decode_step(StepInput::Ids(ids), batch, StepOutput::Logits(out))
    }

    fn decode_step_in_scope(
        &mut self,
        input: StepInput<'_, B::Borrowed>,
        batch: &[BatchToken],
        rows: Option<&[u32]>,
        out: StepOutput<'_>,
    ) -> Result<(), ModelError> {
        self.check_loaded()?;
        let (e, v, n) = (self.cfg.n_embd, self.cfg.n_vocab, batch.len());
        // Rows of the output: every token's, or the chosen ones'.
        let m = rows.map_or(n, <[u32]>::len);
        let most = self.decode_step_tokens();
        if n > most {
            return Err(ModelError::InvalidArgument(format!(
                "a decode step takes at most {most} tokens, {n} given"
            )));
        }
        // Every check before anything runs, so that a failed step changes nothing.
        let source = match input {
            StepInput::Ids(ids) => {
                need_len("the token list", ids.len(), n)?;
                self.check_ids(ids)?;
                let table = self.embd.ok_or_else(|| {
                    ModelError::FailedPrecondition(
                        "this stage does not hold the token embedding".into(),
                    )
                })?;
                Source::Table(table, ids)
            }
            StepInput::Hidden(h) => {
                need_len("the hidden-state buffer", h.len(), n * e)?;
                Source::Host(h)
            }
            StepInput::Lent(view, area) => {
                handed_over(n)?;
                if area.len != 4 * (n * e) as u64 {
                    return Err(ModelError::InvalidArgument(format!(
                        "the lent hidden states hold {} bytes, {} expected",
                        area.len,
                        4 * n * e
                    )));
                }
                Source::Lent(view, area)
            }
        };
        let sink = match out {
            StepOutput::Hidden(h) => {
                need_len("the hidden-state output", h.len(), n * e)?;
                Sink::Hidden(h)
            }
            StepOutput::Slot(slot, area) => {
                handed_over(n)?;
                self.check_slot(slot)?;
                Sink::Slot(slot, area)
            }
            StepOutput::Logits(l) => {
                need_len("the logits buffer", l.len(), m * v)?;
                Sink::Logits(self.head_weights()?, l)
            }
            StepOutput::ArgMax(ids) => {
                need_len("the arg-max output", ids.len(), m)?;
                Sink::ArgMax(self.head_weights()?, ids)
            }
            StepOutput::Top(k, out_rows) => {
                need_len("the candidate rows", out_rows.len(), m)?;
                if k == 0 {
                    return Err(ModelError::InvalidArgument(
                        "top candidates: k must be at least 1".into(),
                    ));
                }
                Sink::Top(self.head_weights()?, k, out_rows)
            }
            StepOutput::Scored {
                k,
                targets,
                top,
                scores,
            } => {
                need_len("the candidate rows", top.len(), m)?;
                need_len("the score rows", scores.len(), m)?;
                if !targets.is_empty() {
                    need_len("the targets", targets.len(), m)?;
                    self.check_ids(targets)?;
                }
                Sink::Scored(self.head_weights()?, k, targets, top, scores)
            }
        };
        let lens = self.kv.check_batch(batch)?;
        if n == 0 {
            return Ok(());
        }
        self.claim_cells(batch)?;
        self.layers_on_device(batch, |stage| match source {
            Source::Table(t, ids) => {
                let w = &stage.weights[t];
                stage
                    .backend
                    .get_rows(&w.buf, w.ty, e, ids, &mut stage.scratch.hidden)
                    .map_err(compute("embedding lookup"))?;
                match stage.cfg.embed_scale {
                    Some(f) => stage
                        .backend
                        .scale(&mut stage.scratch.hidden, ids.len() * e, f)
                        .map_err(compute("embedding scale")),
                    None => Ok(()),
                }
            }
            Source::Host(h) => stage.upload_hidden(h),
            Source::Lent(view, area) => stage
                .backend
                .copy_shared(view, area, &mut stage.scratch.hidden)
                .map_err(compute("copying lent hidden states")),
        })?;
        self.kv.commit(lens);
        if let Some(rows) = rows {
            if rows.is_empty() {
                // Only the cells were wanted (a prompt's micro-batch before its last).
                return Ok(());
            }
            self.gather_rows(rows)?;
        }
        let n = m;
        match sink {
            Sink::Hidden(h) => self
                .backend
                .download(&self.scratch.hidden, 0, as_bytes_mut(h))
                .map_err(compute("downloading hidden states")),
            Sink::Slot(slot, area) => {
                *area = Some(self.fill_slot(slot, 4 * n * e)?);
                Ok(())
            }
            Sink::Logits((norm, head), l) => self.head_on_device(norm, head, n, l),
            Sink::ArgMax((norm, head), ids) => {
                self.head_into_scratch(norm, head, n)?;
                let s = &mut self.scratch;
                let logits = s.logits.as_ref().ok_or_else(head_scratch_missing)?;
                // The hidden states are spent once the head has read them: their buffer
                // takes the ids.
                self.backend
                    .argmax_rows(logits, v, &mut s.hidden, ids)
                    .map_err(compute("arg-max of the logits"))
            }
            Sink::Top((norm, head), k, rows) => {
                if top_rows_scratch(n, k).is_none_or(|b| b > self.scratch.hidden.bytes()) {
                    // Too little scratch for k candidates a row (a narrow model, whose
                    // logits are few): the host selects from every logit.
                    let mut all = vec![0.0f32; n * v];
                    self.head_on_device(norm, head, n, &mut all)?;
                    for (row, out) in all.chunks(v.max(1)).zip(rows.iter_mut()) {
                        top_candidates(row, k, out);
                    }
                    return Ok(());
                }
                self.head_into_scratch(norm, head, n)?;
                let s = &mut self.scratch;
                let logits = s.logits.as_ref().ok_or_else(head_scratch_missing)?;
                self.backend
                    .top_rows(logits, v, k, &mut s.hidden, rows)
                    .map_err(compute("top candidates of the logits"))
            }
            Sink::Scored((norm, head), k, targets, top, scores) => {
                let room = self.scratch.hidden.bytes();
                let fits = |b: Option<usize>| b.is_some_and(|b| b <= room);
                if !fits(top_rows_scratch(n, k)) || !fits(score_rows_scratch(n)) {
                    let mut all = vec![0.0f32; n * v];
                    self.head_on_device(norm, head, n, &mut all)?;
                    for (r, row) in all.chunks(v.max(1)).enumerate() {
                        top_candidates(row, k, &mut top[r]);
                        scores[r] = score_row(row, targets.get(r).copied());
                    }
                    return Ok(());
                }
                self.head_into_scratch(norm, head, n)?;
                let s = &mut self.scratch;
                let logits = s.logits.as_ref().ok_or_else(head_scratch_missing)?;
                if k > 0 {
                    self.backend
                        .top_rows(logits, v, k, &mut s.hidden, top)
                        .map_err(compute("top candidates of the logits"))?;
                } else {
                    top.iter_mut().for_each(Vec::clear);
                }
                self.backend
                    .score_rows(logits, v, targets, &mut s.hidden, scores)
                    .map_err(compute("log-sum-exp of the logits"))
            }
        }
    }

    /// Moves the hidden states of `rows` (increasing) to the front of `scratch.hidden`, in
    /// order, for the head. Row `j` takes row `rows[j] >= j`, and copies run in order on
    /// one stream, so no copy reads a row an earlier one wrote.
    fn gather_rows(&mut self, rows: &[u32]) -> Result<(), ModelError> {
        let row = self.cfg.n_embd * 4;
        for (j, &r) in rows.iter().enumerate() {
            let r = r as usize;
            if r != j {
                self.backend
                    .copy_within(&mut self.scratch.hidden, r * row, j * row, row)
                    .map_err(compute("gathering the rows for the head"))?;
            }
        }
        Ok(())
    }

    /// The output norm's and head's weight indices.
    fn head_weights(&self) -> Result<(usize, usize), ModelError> {
        match (self.out_norm, self.output) {
            (Some(norm), Some(head)) => Ok((norm, head)),
            _ => Err(ModelError::FailedPrecondition(
                "this stage does not hold the output head".into(),
            )),
        }
    }
}
