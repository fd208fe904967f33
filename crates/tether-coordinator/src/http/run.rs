//! One generation request as a sequence of text events: engine tokens through the text
//! assembler, with the deadline, stop strings and metrics applied. Dropping a [`Run`]
//! drops the engine's receiver, which cancels the request.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use super::AppState;
use super::error::ApiError;
use super::metrics::Metrics;
use super::prepare::Prepared;
use super::text::{TextAssembler, TextStep};
use crate::api::{FinishReason, GenEvent, GenEvents, GenRequest, TokenLogProb};

/// What a run produces, in order: text pieces, then one `End`.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum RunEvent {
    /// Text to show (never empty).
    Text(String),
    /// A generated token's log-probability, before its text (which may come later, or not
    /// at all when a stop string cuts it).
    LogProb(TokenLogProb),
    /// The prompt's tokens with their log-probabilities (`None` for the first), first of
    /// all when the prompt is scored.
    Prompt(Vec<(u32, Option<TokenLogProb>)>),
    /// The end.
    End {
        /// Why it ended.
        finish: FinishReason,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Generated tokens.
        completion_tokens: usize,
    },
}

/// A submitted request (one choice of it) being read.
pub(super) struct Run {
    events: Option<GenEvents>,
    assembler: TextAssembler,
    pending: VecDeque<RunEvent>,
    deadline: tokio::time::Instant,
    started: Instant,
    prompt_tokens: usize,
    completion_tokens: usize,
    first_token_seen: bool,
    metrics: Arc<Metrics>,
    /// The prompt, whose ids its scores are reported with.
    prompt_ids: Vec<u32>,
    /// Which choice of the request this is: the first one alone counts the prompt and
    /// times the request in the metrics.
    choice: usize,
}

impl Run {
    /// Submits the `prepared.n` choices of a request together, one run each, in choice
    /// order; `started` is when the HTTP request arrived.
    pub(super) fn start_choices(
        state: &AppState,
        prepared: Prepared,
        started: Instant,
    ) -> Result<Vec<Run>, ApiError> {
        let deadline = started + state.opts.request_timeout;
        let prompt_logprobs = prepared.echo.as_ref().and(prepared.logprobs);
        let requests = (0..prepared.n)
            .map(|choice| {
                let mut sampling = prepared.sampling.clone();
                sampling.seed = choice_seed(sampling.seed, choice);
                GenRequest {
                    prompt: prepared.prompt.clone(),
                    max_tokens: prepared.max_tokens,
                    sampling,
                    deadline: Some(deadline),
                    stop_tokens: prepared.stop_tokens.clone(),
                    model_epoch: Some(state.epoch),
                    logprobs: prepared.logprobs,
                    prompt_logprobs,
                    // A fresh grammar state per choice.
                    constraint: prepared.constraint.clone(),
                    embed: None,
                }
            })
            .collect();
        let receivers = state.engine.submit_choices(requests)?;
        let runs = receivers
            .into_iter()
            .enumerate()
            .map(|(choice, events)| Run {
                events: Some(events),
                assembler: TextAssembler::new(Arc::clone(&state.tokenizer), prepared.stops.clone())
                    .stops_after(prepared.min_tokens)
                    .showing(prepared.shown_tokens.clone()),
                pending: VecDeque::new(),
                deadline: deadline.into(),
                started,
                prompt_tokens: prepared.prompt.len(),
                completion_tokens: 0,
                first_token_seen: false,
                metrics: Arc::clone(&state.metrics),
                prompt_ids: prepared.prompt.clone(),
                choice,
            })
            .collect();
        Ok(runs)
    }

    /// The next event; `None` after the end or an error.
    pub(super) async fn next(&mut self) -> Option<Result<RunEvent, ApiError>> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(Ok(event));
            }
            let events = self.events.as_mut()?;
            let received = tokio::time::timeout_at(self.deadline, events.recv()).await;
            match received {
                Err(_) => {
                    self.events = None;
                    return Some(Err(ApiError::timeout(
                        "the request took longer than the server's request timeout",
                    )));
                }
                Ok(None) => {
                    self.events = None;
                    return Some(Err(ApiError::internal(
                        "the engine dropped the request before finishing it",
                    )));
                }
                Ok(Some(Err(e))) => {
                    self.events = None;
                    return Some(Err(e.into()));
                }
                Ok(Some(Ok(GenEvent::Token(id)))) => self.token(id),
                Ok(Some(Ok(GenEvent::Scored(scored)))) => {
                    let id = scored.token;
                    self.pending.push_back(RunEvent::LogProb(scored));
                    self.token(id);
                }
                // Completions never ask for embeddings.
                Ok(Some(Ok(GenEvent::Embedding(_)))) => {}
                Ok(Some(Ok(GenEvent::Prompt(scores)))) => {
                    let ids = std::mem::take(&mut self.prompt_ids);
                    self.pending
                        .push_back(RunEvent::Prompt(ids.into_iter().zip(scores).collect()));
                }
                Ok(Some(Ok(GenEvent::Done {
                    finish,
                    completion_tokens,
                    ..
                }))) => {
                    let step = self.assembler.finish();
                    self.queue(step, finish, completion_tokens);
                    // A Done always ends the run, matched stop string or not.
                    if self.events.is_some() {
                        self.end(finish, completion_tokens);
                    }
                }
            }
        }
    }

    /// Takes a generated token: its text through the assembler.
    fn token(&mut self, id: u32) {
        self.completion_tokens += 1;
        if !self.first_token_seen && self.choice == 0 {
            self.first_token_seen = true;
            self.metrics.observe_first_token(self.started.elapsed());
        }
        let step = self.assembler.push_token(id);
        self.queue(step, FinishReason::Stop, self.completion_tokens);
    }

    /// Queues the text of `step`; ends the run if it matched a stop string.
    fn queue(&mut self, step: TextStep, finish: FinishReason, completion_tokens: usize) {
        if !step.text.is_empty() {
            self.pending.push_back(RunEvent::Text(step.text));
        }
        if step.stopped {
            let finish = if finish == FinishReason::Length {
                // The stop string matched in the last text; the stop string is the reason.
                FinishReason::Stop
            } else {
                finish
            };
            self.end(finish, completion_tokens);
        }
    }

    /// Drops the receiver (cancelling the request if it still runs) and queues the end.
    fn end(&mut self, finish: FinishReason, completion_tokens: usize) {
        self.events = None;
        self.completion_tokens = completion_tokens;
        self.pending.push_back(RunEvent::End {
            finish,
            prompt_tokens: self.prompt_tokens,
            completion_tokens,
        });
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        if self.choice > 0 {
            self.metrics.count_tokens(0, self.completion_tokens);
            return;
        }
        self.metrics
            .count_tokens(self.prompt_tokens, self.completion_tokens);
        self.metrics.observe_duration(self.started.elapsed());
    }
}

/// The sampling seed of choice `choice` of a request seeded with `seed`: the seed itself
/// for the first (so `n` = 1 draws as before), a mix of both for the others, so choices
/// differ while a repeated request repeats each of them.
pub(super) fn choice_seed(seed: u64, choice: usize) -> u64 {
    if choice == 0 {
        return seed;
    }
    // SplitMix64's finalizer over the seed and the choice spread far apart.
    let mut z = seed ^ (choice as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
