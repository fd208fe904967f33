//! The contract between the generation engine and its front ends (HTTP API, `tether run`):
//! token ids in, token ids out. Text (detokenization, stop strings, chat templates) is the
//! front end's business, so the engine stays a scheduler of sequences.

use std::sync::Arc;
use std::time::Instant;
use tether_model::SamplingParams;
use tether_model::tokenizer::Tokenizer;
use tokio::sync::mpsc;

/// One generation request.
#[derive(Clone, Debug)]
pub struct GenRequest {
    /// Prompt token ids (BOS already added when the model wants it); never empty.
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// How to sample.
    pub sampling: SamplingParams,
    /// When the request gives up; the engine ends it with [`GenError::Timeout`].
    pub deadline: Option<Instant>,
    /// More token ids that end the request as an end-of-generation token does (vLLM's
    /// `stop_token_ids`): not sent, finish `Stop`.
    pub stop_tokens: Vec<u32>,
    /// The [`Generation::model_epoch`] the prompt was made for: when the model was
    /// replaced since, the request is refused (its tokens belong to the other model's
    /// tokenizer). `None`: whichever model serves.
    pub model_epoch: Option<u64>,
    /// Report each generated token's log-probability with this many most likely
    /// alternatives (0..=[`MAX_LOGPROBS`]): tokens then come as [`GenEvent::Scored`].
    pub logprobs: Option<usize>,
    /// Score the prompt first, each token after the first with this many alternatives
    /// (0..=[`MAX_LOGPROBS`]), in one [`GenEvent::Prompt`]. The prompt is then prefilled in
    /// full, not taken from the prefix cache, since every position's logits are needed.
    pub prompt_logprobs: Option<usize>,
    /// The grammar the generated tokens must follow: only tokens it allows are drawn, and
    /// the request ends (`Stop`) once it is complete.
    pub constraint: Option<crate::constraint::Constraint>,
    /// Embed the prompt instead of generating: its hidden states after the output norm,
    /// pooled this way, come as one [`GenEvent::Embedding`] (`max_tokens` is ignored and
    /// nothing is generated). The prompt is prefilled in full, not taken from the prefix
    /// cache, since the pooled rows are needed.
    pub embed: Option<Pooling>,
}

/// How an embedding pools a prompt's hidden states (GGUF's `{arch}.pooling_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// The mean of every position's.
    Mean,
    /// The first position's (BERT's CLS token).
    Cls,
    /// The last position's (decoder embedding models such as Qwen3-Embedding).
    Last,
}

impl Pooling {
    /// The pooling a GGUF `pooling_type` value names; `None` for none (0), rank (4) and
    /// values this server does not know.
    pub fn from_gguf(value: u32) -> Option<Pooling> {
        match value {
            1 => Some(Pooling::Mean),
            2 => Some(Pooling::Cls),
            3 => Some(Pooling::Last),
            _ => None,
        }
    }

    /// Its name on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Last => "last",
        }
    }
}

impl std::str::FromStr for Pooling {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "mean" => Ok(Pooling::Mean),
            "cls" => Ok(Pooling::Cls),
            "last" => Ok(Pooling::Last),
            other => Err(format!("unknown pooling {other:?}; use mean, cls or last")),
        }
    }
}

impl GenRequest {
    /// A greedy request of at most `max_tokens` after `prompt`: no deadline, no extra stop
    /// tokens, no log-probabilities, no grammar, for whichever model serves.
    pub fn greedy(prompt: &[u32], max_tokens: usize) -> Self {
        Self {
            prompt: prompt.to_vec(),
            max_tokens,
            sampling: SamplingParams::greedy(),
            deadline: None,
            stop_tokens: Vec::new(),
            model_epoch: None,
            logprobs: None,
            prompt_logprobs: None,
            constraint: None,
            embed: None,
        }
    }
}

/// Most alternatives a token's log-probability comes with (OpenAI's limit).
pub const MAX_LOGPROBS: usize = 20;

/// A token's log-probability and the most likely tokens at its position, under the model's
/// own distribution: the softmax of the raw logits at temperature 1, before any sampling
/// setting (temperature, penalties, biases, top-k/p) changes it, as vLLM reports by default.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogProb {
    /// The token.
    pub token: u32,
    /// Its log-probability (natural log).
    pub logprob: f32,
    /// The most likely tokens at its position, `(id, log-probability)`, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or one of the request's stop tokens was sampled (not
    /// sent as a token), or the front end matched a stop string.
    Stop,
    /// `max_tokens` reached, or the context is full.
    Length,
}

impl FinishReason {
    /// OpenAI's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What a running request reports, in order: tokens, then exactly one `Done` or an error.
#[derive(Clone, Debug, PartialEq)]
pub enum GenEvent {
    /// A generated token.
    Token(u32),
    /// A generated token with its log-probability, instead of [`GenEvent::Token`] when the
    /// request asked for `logprobs`.
    Scored(TokenLogProb),
    /// The prompt's tokens with their log-probabilities (`None` for the first, which
    /// nothing precedes), first of all events when the request asked for `prompt_logprobs`.
    Prompt(Vec<Option<TokenLogProb>>),
    /// The pooled embedding of the prompt (not normalized), before `Done`, when the
    /// request asked to embed.
    Embedding(Vec<f32>),
    /// The end.
    Done {
        /// Why it ended.
        finish: FinishReason,
        /// Prompt tokens processed.
        prompt_tokens: usize,
        /// Tokens generated.
        completion_tokens: usize,
    },
}

/// Why a request failed; each maps to one HTTP status.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GenError {
    /// The request is wrong (e.g. a prompt longer than the context): HTTP 400.
    #[error("{0}")]
    InvalidRequest(String),
    /// Every slot is taken and the queue is full: HTTP 429.
    #[error("{0}")]
    Busy(String),
    /// The model is not serving (a worker is gone, loading, shutting down): HTTP 503.
    #[error("{0}")]
    Unavailable(String),
    /// The deadline passed: HTTP 504.
    #[error("{0}")]
    Timeout(String),
    /// Anything else: HTTP 500.
    #[error("{0}")]
    Internal(String),
}

/// `--context-shift`: a generation that fills its context keeps its first `keep` tokens,
/// drops the oldest half of the rest and goes on, instead of ending with `length`. The
/// kept tail is fed again at its new positions (its cells are recomputed, not rotated), so
/// the model sees exactly the shortened text; the cost is one prefill of about half the
/// context per shift.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextShift {
    /// Tokens at the start (system prompt, instructions) that are never dropped.
    pub keep: usize,
}

/// Whether the engine serves now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    /// Serving.
    Ready,
    /// Not serving, and why (shown in 503 replies and `/health`).
    Unavailable(String),
}

/// What front ends need to know about the served model.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    /// The model's id in the API (file stem unless given).
    pub id: String,
    /// Context cells per sequence.
    pub ctx_per_seq: usize,
    /// The width of the hidden states, which an embedding has.
    pub n_embd: usize,
    /// Unix seconds when the model was loaded.
    pub created: u64,
    /// `tokenizer.chat_template` from the GGUF file.
    pub chat_template: Option<String>,
    /// The pooling the GGUF file names for embeddings (`{arch}.pooling_type`), if any.
    pub pooling: Option<Pooling>,
}

/// A model change in progress.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelChange {
    /// The model being loaded, or the one being unloaded.
    pub model: String,
    /// What happens now: `unloading`, `loading` or `switching` (the new model committed,
    /// the old one finishes its requests).
    pub phase: &'static str,
    /// Tensor bytes sent to (or read by) the workers so far.
    pub bytes_loaded: u64,
    /// Tensor bytes of the whole load.
    pub bytes_total: u64,
}

/// Counters the engine keeps for `/metrics`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Requests waiting for a sequence slot.
    pub queued: usize,
    /// Requests generating now.
    pub running: usize,
    /// Tokens generated since start.
    pub generated_tokens: u64,
    /// Prompt tokens processed since start.
    pub prompt_tokens: u64,
    /// Prompt tokens whose KV cells were reused from an earlier request instead of being
    /// processed (prefix caching); the hit rate is this over it plus `prompt_tokens`.
    pub prefix_hit_tokens: u64,
    /// Cached prefixes given up for room in the workers' KV pool (least recently used
    /// first).
    pub prefix_evictions: u64,
    /// Blocks in each worker's paged KV pool (0 before a model is loaded), and those that
    /// no sequence, running or cached, holds.
    pub kv_blocks: usize,
    pub kv_blocks_free: usize,
}

/// A generation engine: the coordinator's pipeline over workers, or anything else that
/// turns token ids into token ids.
pub trait Generation: Send + Sync + 'static {
    /// The served model.
    fn model(&self) -> ModelInfo;
    /// The model's tokenizer.
    fn tokenizer(&self) -> Arc<Tokenizer>;
    /// Whether requests can be served now.
    fn health(&self) -> Health;
    /// Counters for `/metrics`.
    fn stats(&self) -> EngineStats;
    /// Which load of a model serves: it changes whenever the model is replaced or
    /// unloaded, so front ends know to read [`Generation::model`] and the tokenizer again.
    fn model_epoch(&self) -> u64 {
        0
    }
    /// Whether a model is loaded at all (false after an unload).
    fn model_loaded(&self) -> bool {
        true
    }
    /// A model change in progress (load beside, unload, load after unload), for `/health`.
    fn model_change(&self) -> Option<ModelChange> {
        None
    }
    /// Starts a request. Events arrive on the receiver; dropping the receiver cancels the
    /// request and frees its sequence slot at the next step.
    fn submit(&self, req: GenRequest) -> Result<GenEvents, GenError>;
    /// Sequences served at once (`--parallel`): the most choices one request may have.
    fn parallel(&self) -> usize {
        1
    }
    /// Starts a request of several choices of one prompt (the API's `n`), each a sequence
    /// of its own with a receiver of its own, admitted together: every choice gets a slot
    /// or none waits holding one. The default serves one choice only.
    fn submit_choices(&self, reqs: Vec<GenRequest>) -> Result<Vec<GenEvents>, GenError> {
        match <[GenRequest; 1]>::try_from(reqs) {
            Ok([req]) => Ok(vec![self.submit(req)?]),
            Err(reqs) => Err(GenError::InvalidRequest(format!(
                "this engine serves one choice per request; {} were asked",
                reqs.len()
            ))),
        }
    }
}

/// The events of one submitted request (or one choice of it).
pub type GenEvents = mpsc::Receiver<Result<GenEvent, GenError>>;
