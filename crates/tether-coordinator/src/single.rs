//! A [`Generation`] engine that runs the whole model in this process on the CPU, one request
//! at a time: the fallback when no workers are configured, and the engine the HTTP tests run
//! against.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc as std_mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tether_compute::CpuBackend;
use tether_gguf::GgufFile;
use tether_model::tokenizer::Tokenizer;
use tether_model::{Generator, Sampler, StopReason};
use tokio::sync::mpsc;

use crate::api::{
    EngineStats, FinishReason, GenError, GenEvent, GenRequest, Generation, Health, ModelInfo,
};

/// Events buffered per request before the generating thread waits for the reader.
const EVENT_BUFFER: usize = 64;

/// How long the generating thread sleeps while the reader's buffer is full.
const SEND_RETRY: Duration = Duration::from_millis(1);

/// How to load a [`SingleProcessEngine`].
#[derive(Clone, Debug)]
pub struct SingleOptions {
    /// Context cells for the one sequence; `None` takes the model's training context.
    pub ctx: Option<usize>,
    /// Prompt tokens per forward micro-batch.
    pub ubatch: usize,
    /// CPU threads; `None` uses one per core.
    pub threads: Option<usize>,
    /// Requests that may wait while one runs; more get [`GenError::Busy`].
    pub queue: usize,
    /// The model's id in the API; `None` takes the file stem.
    pub model_id: Option<String>,
}

impl Default for SingleOptions {
    fn default() -> Self {
        Self {
            ctx: Some(2048),
            ubatch: 64,
            threads: None,
            queue: 4,
            model_id: None,
        }
    }
}

/// Why a [`SingleProcessEngine`] could not start.
#[derive(Debug, thiserror::Error)]
pub enum SingleEngineError {
    /// The model file could not be read or run.
    #[error("loading '{path}' for in-process generation: {reason}")]
    Load {
        /// The model file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The generation thread could not be started.
    #[error("starting the generation thread: {0}")]
    Thread(String),
}

/// Counters shared between the engine handle and its thread.
#[derive(Default)]
struct Counters {
    queued: AtomicUsize,
    running: AtomicUsize,
    /// Requests accepted and not yet finished (queued + running), bounded by the queue.
    admitted: AtomicUsize,
    generated_tokens: AtomicU64,
    prompt_tokens: AtomicU64,
    /// Set when the thread has ended (a panic, or shutdown).
    stopped: AtomicBool,
    /// Asks the thread to cancel what runs and end.
    shutdown: AtomicBool,
}

/// One queued request.
struct Job {
    req: GenRequest,
    events: mpsc::Sender<Result<GenEvent, GenError>>,
}

/// Runs a whole model on the CPU in this process, one request at a time; the others wait
/// in a small queue.
pub struct SingleProcessEngine {
    info: ModelInfo,
    tokenizer: Arc<Tokenizer>,
    counters: Arc<Counters>,
    /// Most requests admitted at once: the running one and the queue.
    capacity: usize,
    jobs: Option<std_mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

/// What the loading thread hands back.
type Loaded = (ModelInfo, Arc<Tokenizer>);

impl SingleProcessEngine {
    /// Loads the model at `path` on a thread of its own, which then serves requests. Blocks
    /// until the model is loaded.
    pub fn load(path: &Path, opts: SingleOptions) -> Result<Self, SingleEngineError> {
        let counters = Arc::new(Counters::default());
        let capacity = opts.queue + 1;
        let (job_tx, job_rx) = std_mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = std_mpsc::channel::<Result<Loaded, SingleEngineError>>();
        let thread_counters = Arc::clone(&counters);
        let path_buf = path.to_path_buf();
        let thread = std::thread::Builder::new()
            .name("tether-single-gen".into())
            .spawn(move || {
                let loaded = load_model(&path_buf, &opts);
                let (generator, eog) = match loaded {
                    Ok(m) => {
                        let _ = ready_tx.send(Ok((m.info, m.tokenizer)));
                        (m.generator, m.eog)
                    }
                    Err(e) => {
                        thread_counters.stopped.store(true, Ordering::SeqCst);
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                serve_jobs(generator, &eog, &job_rx, &thread_counters);
                thread_counters.stopped.store(true, Ordering::SeqCst);
            })
            .map_err(|e| SingleEngineError::Thread(e.to_string()))?;
        let loaded = ready_rx.recv().map_err(|_| SingleEngineError::Load {
            path: path.to_path_buf(),
            reason: "the loading thread ended without an answer (it panicked)".into(),
        });
        let (info, tokenizer) = match loaded.and_then(|r| r) {
            Ok(v) => v,
            Err(e) => {
                let _ = thread.join();
                return Err(e);
            }
        };
        Ok(Self {
            info,
            tokenizer,
            counters,
            capacity,
            jobs: Some(job_tx),
            thread: Some(thread),
        })
    }
}

/// What the generation thread builds before serving.
struct LoadedModel {
    info: ModelInfo,
    generator: Generator<CpuBackend>,
    tokenizer: Arc<Tokenizer>,
    /// Every end-of-generation token id.
    eog: Vec<u32>,
}

/// Opens the file and builds the generator, the tokenizer and the list of end tokens.
fn load_model(path: &Path, opts: &SingleOptions) -> Result<LoadedModel, SingleEngineError> {
    let fail = |reason: String| SingleEngineError::Load {
        path: path.to_path_buf(),
        reason,
    };
    let file = GgufFile::open(path).map_err(|e| fail(e.to_string()))?;
    let cfg = tether_model::ModelConfig::from_gguf(&file).map_err(|e| fail(e.to_string()))?;
    let ctx = opts.ctx.unwrap_or(cfg.n_ctx_train).max(1);
    let tokenizer = Tokenizer::from_gguf(&file).map_err(|e| fail(e.to_string()))?;
    let backend = CpuBackend::new(opts.threads).map_err(|e| fail(e.to_string()))?;
    let generator = Generator::from_file(Arc::new(backend), &file, ctx, opts.ubatch.max(1))
        .map_err(|e| fail(e.to_string()))?;
    let eog: Vec<u32> = (0..tokenizer.vocab_size() as u32)
        .filter(|&id| tokenizer.is_eog(id))
        .collect();
    let id = opts.model_id.clone().unwrap_or_else(|| {
        path.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    });
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let info = ModelInfo {
        id,
        ctx_per_seq: ctx,
        created,
        chat_template: file.get_str("tokenizer.chat_template").map(str::to_owned),
    };
    Ok(LoadedModel {
        info,
        generator,
        tokenizer: Arc::new(tokenizer),
        eog,
    })
}

/// The generation thread's loop: one job at a time until the engine is dropped.
fn serve_jobs(
    mut generator: Generator<CpuBackend>,
    eog: &[u32],
    jobs: &std_mpsc::Receiver<Job>,
    counters: &Counters,
) {
    while let Ok(job) = jobs.recv() {
        counters.queued.fetch_sub(1, Ordering::SeqCst);
        if job.events.is_closed() || counters.shutdown.load(Ordering::SeqCst) {
            counters.admitted.fetch_sub(1, Ordering::SeqCst);
            continue;
        }
        if job.req.deadline.is_some_and(|d| Instant::now() >= d) {
            let _ = job.events.try_send(Err(GenError::Timeout(
                "the request's deadline passed while it waited in the queue".into(),
            )));
            counters.admitted.fetch_sub(1, Ordering::SeqCst);
            continue;
        }
        counters.running.store(1, Ordering::SeqCst);
        run_job(&mut generator, eog, job, counters);
        // Admission first, so a caller that sees `running == 0` can submit at once.
        counters.admitted.fetch_sub(1, Ordering::SeqCst);
        counters.running.store(0, Ordering::SeqCst);
    }
}

/// Runs one request, sending its events; stops early when the receiver is gone, the
/// deadline passes, or the engine shuts down.
fn run_job(generator: &mut Generator<CpuBackend>, eog: &[u32], job: Job, counters: &Counters) {
    let Job { req, events } = job;
    let mut sampler = Sampler::new(req.sampling.clone());
    let mut timed_out = false;
    let mut receiver_gone = false;
    let on_token = |tok: u32| {
        counters.generated_tokens.fetch_add(1, Ordering::Relaxed);
        if counters.shutdown.load(Ordering::SeqCst) {
            return false;
        }
        if req.deadline.is_some_and(|d| Instant::now() >= d) {
            timed_out = true;
            return false;
        }
        if !send_event(&events, Ok(GenEvent::Token(tok)), counters) {
            receiver_gone = true;
            return false;
        }
        true
    };
    counters
        .prompt_tokens
        .fetch_add(req.prompt.len() as u64, Ordering::Relaxed);
    let with_stops: Vec<u32>;
    let eog = if req.stop_tokens.is_empty() {
        eog
    } else {
        with_stops = eog.iter().chain(&req.stop_tokens).copied().collect();
        &with_stops
    };
    let result = generator.generate(&req.prompt, req.max_tokens, &mut sampler, eog, on_token);
    if receiver_gone {
        return;
    }
    let event = match result {
        Err(e) => Err(GenError::Internal(format!(
            "in-process generation failed: {e}"
        ))),
        Ok(_) if timed_out => Err(GenError::Timeout(
            "the request's deadline passed while generating".into(),
        )),
        Ok((_, StopReason::Callback)) => Err(GenError::Unavailable(
            "the in-process engine is shutting down".into(),
        )),
        Ok((tokens, reason)) => Ok(GenEvent::Done {
            finish: match reason {
                StopReason::EndOfGeneration => FinishReason::Stop,
                _ => FinishReason::Length,
            },
            prompt_tokens: req.prompt.len(),
            completion_tokens: tokens.len(),
        }),
    };
    let _ = send_event(&events, event, counters);
}

/// Sends `event`, waiting while the reader is behind; false when the reader is gone or the
/// engine shuts down. Polls rather than blocking, so a reader that stops reading without
/// hanging up cannot keep the engine from shutting down.
fn send_event(
    events: &mpsc::Sender<Result<GenEvent, GenError>>,
    event: Result<GenEvent, GenError>,
    counters: &Counters,
) -> bool {
    let mut event = event;
    loop {
        match events.try_send(event) {
            Ok(()) => return true,
            Err(mpsc::error::TrySendError::Closed(_)) => return false,
            Err(mpsc::error::TrySendError::Full(back)) => {
                if counters.shutdown.load(Ordering::SeqCst) {
                    return false;
                }
                event = back;
                std::thread::sleep(SEND_RETRY);
            }
        }
    }
}

impl Generation for SingleProcessEngine {
    fn model(&self) -> ModelInfo {
        self.info.clone()
    }

    fn tokenizer(&self) -> Arc<Tokenizer> {
        Arc::clone(&self.tokenizer)
    }

    fn health(&self) -> Health {
        if self.counters.stopped.load(Ordering::SeqCst) {
            Health::Unavailable("the in-process generation thread has stopped".into())
        } else {
            Health::Ready
        }
    }

    fn stats(&self) -> EngineStats {
        EngineStats {
            queued: self.counters.queued.load(Ordering::SeqCst),
            running: self.counters.running.load(Ordering::SeqCst),
            generated_tokens: self.counters.generated_tokens.load(Ordering::Relaxed),
            prompt_tokens: self.counters.prompt_tokens.load(Ordering::Relaxed),
        }
    }

    fn submit(
        &self,
        req: GenRequest,
    ) -> Result<mpsc::Receiver<Result<GenEvent, GenError>>, GenError> {
        let ctx = self.info.ctx_per_seq;
        if req.prompt.is_empty() {
            return Err(GenError::InvalidRequest("the prompt has no tokens".into()));
        }
        if req.prompt.len() > ctx {
            return Err(GenError::InvalidRequest(format!(
                "the prompt has {} tokens but the context holds {ctx}; shorten the prompt",
                req.prompt.len()
            )));
        }
        let vocab = self.tokenizer.vocab_size();
        if let Some(bad) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(GenError::InvalidRequest(format!(
                "prompt token id {bad} is outside the vocabulary of {vocab} tokens"
            )));
        }
        let Some(jobs) = &self.jobs else {
            return Err(GenError::Unavailable("the engine is shutting down".into()));
        };
        if self.counters.stopped.load(Ordering::SeqCst) {
            return Err(GenError::Unavailable(
                "the in-process generation thread has stopped".into(),
            ));
        }
        let admitted =
            self.counters
                .admitted
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                    (n < self.capacity).then_some(n + 1)
                });
        if admitted.is_err() {
            return Err(GenError::Busy(format!(
                "one request is generating and {} wait; retry later",
                self.capacity - 1
            )));
        }
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        // Counted before sending so the thread's decrement never runs first.
        self.counters.queued.fetch_add(1, Ordering::SeqCst);
        if jobs.send(Job { req, events: tx }).is_err() {
            self.counters.queued.fetch_sub(1, Ordering::SeqCst);
            self.counters.admitted.fetch_sub(1, Ordering::SeqCst);
            return Err(GenError::Unavailable(
                "the in-process generation thread has stopped".into(),
            ));
        }
        Ok(rx)
    }
}

impl Drop for SingleProcessEngine {
    /// Cancels the running request, drops the queued ones and waits for the thread.
    fn drop(&mut self) {
        self.counters.shutdown.store(true, Ordering::SeqCst);
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use tether_model::SamplingParams;

    use super::*;
    use crate::http::test_support::{engine, tiny_model};

    fn request(prompt: Vec<u32>, max_tokens: usize) -> GenRequest {
        GenRequest {
            prompt,
            max_tokens,
            sampling: SamplingParams::greedy(),
            deadline: None,
            stop_tokens: Vec::new(),
        }
    }

    /// Every event of a request, up to and including the end or an error.
    async fn drain(
        mut rx: mpsc::Receiver<Result<GenEvent, GenError>>,
    ) -> (Vec<u32>, Option<Result<GenEvent, GenError>>) {
        let mut tokens = Vec::new();
        while let Some(event) = rx.recv().await {
            match event {
                Ok(GenEvent::Token(t)) => tokens.push(t),
                end => return (tokens, Some(end)),
            }
        }
        (tokens, None)
    }

    #[tokio::test]
    async fn prompt_longer_than_context_is_an_invalid_request() {
        let e = engine(tiny_model(), 16, 1);
        let err = e.submit(request(vec![1; 17], 4)).expect_err("refused");
        assert!(matches!(err, GenError::InvalidRequest(_)), "{err:?}");
        let err = e.submit(request(vec![], 4)).expect_err("refused");
        assert!(matches!(err, GenError::InvalidRequest(_)), "{err:?}");
    }

    #[tokio::test]
    async fn max_tokens_and_a_full_context_end_with_length() {
        let e = engine(tiny_model(), 16, 1);
        let prompt = vec![1, 300, 301, 302];
        let (tokens, end) = drain(e.submit(request(prompt.clone(), 3)).expect("accepted")).await;
        let want = GenEvent::Done {
            finish: FinishReason::Length,
            prompt_tokens: 4,
            completion_tokens: 3,
        };
        assert_eq!((tokens.len(), end), (3, Some(Ok(want))));

        // The last token is sampled from the last cell and need not be stored.
        let (tokens, end) = drain(e.submit(request(prompt, 100)).expect("accepted")).await;
        let want = GenEvent::Done {
            finish: FinishReason::Length,
            prompt_tokens: 4,
            completion_tokens: 16 - 4 + 1,
        };
        assert_eq!((tokens.len(), end), (13, Some(Ok(want))));
        assert_eq!(e.stats().prompt_tokens, 8);
        assert_eq!(e.stats().generated_tokens, 16);
    }

    #[tokio::test]
    async fn full_queue_is_busy_and_dropping_the_receiver_frees_the_engine() {
        let e = engine(tiny_model(), 2048, 0);
        // Not read: the generating thread fills the event buffer, then waits.
        let first = e.submit(request(vec![1, 300], 2000)).expect("accepted");
        let err = e.submit(request(vec![1, 300], 2)).expect_err("busy");
        assert!(matches!(err, GenError::Busy(_)), "{err:?}");
        drop(first);
        let started = Instant::now();
        let second = loop {
            match e.submit(request(vec![1, 300], 2)) {
                Ok(rx) => break rx,
                Err(GenError::Busy(_)) if started.elapsed() < Duration::from_secs(20) => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err(other) => panic!("the engine was not freed: {other:?}"),
            }
        };
        let (tokens, end) = drain(second).await;
        assert_eq!(tokens.len(), 2);
        assert!(matches!(end, Some(Ok(GenEvent::Done { .. }))), "{end:?}");
        assert!(e.stats().generated_tokens < 2000);
        assert_eq!(e.health(), Health::Ready);
    }

    #[tokio::test]
    async fn dropping_the_engine_ends_a_request_whose_reader_stalls() {
        let e = engine(tiny_model(), 2048, 1);
        let stalled = e.submit(request(vec![1, 300], 2000)).expect("accepted");
        let waiting = e.submit(request(vec![1, 300], 2)).expect("queued");
        let started = Instant::now();
        while e.stats().running == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(e);
        assert!(started.elapsed() < Duration::from_secs(20));
        let (tokens, end) = drain(stalled).await;
        // With the reader's buffer full, the request may end without a last event.
        assert!(tokens.len() < 2000);
        assert!(!matches!(end, Some(Ok(_))), "{end:?}");
        let (tokens, end) = drain(waiting).await;
        assert_eq!((tokens.len(), end), (0, None));
    }

    #[tokio::test]
    async fn a_passed_deadline_ends_with_timeout() {
        let e = engine(tiny_model(), 64, 1);
        let mut req = request(vec![1, 300], 40);
        req.deadline = Some(Instant::now());
        let (_, end) = drain(e.submit(req).expect("accepted")).await;
        assert!(matches!(end, Some(Err(GenError::Timeout(_)))), "{end:?}");
    }
}
