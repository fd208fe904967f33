//! Lanes: with a lane per worker, groups of sequences go through the workers on their own.
//! Their greedy tokens equal the single-process generator's and those of one lane, with
//! prompts cut into chunks smaller than the micro-batch; log-probabilities of the prompt and
//! of generated tokens come back through lanes as through one worker; a model swapped while
//! lanes are in flight finishes their requests (or, past the grace, ends them with a clear
//! error) before the new model serves; a request cancelled while its lane is in flight ends
//! alone; a worker lost while lanes are in flight fails every running request, and the
//! model is loaded again.

mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::{TempDir, cluster, collect, generate, greedy, prompt, reference, tiny_model};
use tether_compute::CpuBackend;
use tether_coordinator::api::{FinishReason, GenError, GenEvent, Generation, TokenLogProb};
use tether_coordinator::{Coordinator, ModelChangeError, ModelChangeReport, ModelLoad};
use tether_gguf::GgufFile;
use tether_model::Generator;

const TEXTS: [&str; 6] = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog and then it ran far into the woods where",
    "Hello",
    "In a village far away lived a little robot who liked to",
    "Tom and Lily went to the park. They saw a big tree and a",
    "The sun",
];

fn prompts(path: &std::path::Path) -> Vec<Vec<u32>> {
    TEXTS.iter().map(|t| prompt(path, t)).collect()
}

/// Generation lengths that differ, so requests end while others' lanes are in flight.
fn lengths() -> impl Iterator<Item = usize> {
    (0..TEXTS.len()).map(|i| 14 + 5 * i)
}

/// Submits every prompt at once and reads each to its end.
async fn all_at_once(engine: &impl Generation, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let receivers: Vec<_> = prompts
        .iter()
        .zip(lengths())
        .map(|(p, n)| engine.submit(greedy(p, n)).expect("submit"))
        .collect();
    let mut out = Vec::new();
    for (i, rx) in receivers.into_iter().enumerate() {
        let (tokens, end) = collect(rx).await;
        assert!(end.is_ok(), "request {i}: {end:?}");
        out.push(tokens);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_equal_one_lane_and_the_generator() {
    let dir = TempDir::new("lanes-equal");
    let path = tiny_model(&dir, 31);
    let prompts = prompts(&path);
    assert!(
        prompts.iter().any(|p| p.len() > 8),
        "a prompt longer than ubatch"
    );
    let expected: Vec<Vec<u32>> = prompts
        .iter()
        .zip(lengths())
        .map(|(p, n)| reference(&path, p, n, 256))
        .collect();
    // (workers, lanes): one worker; two with a lane each; two with one lane; three with
    // two lanes (a spare worker splits a lane's step into groups).
    for (workers, lanes) in [(1, None), (2, None), (2, Some(1)), (3, Some(2))] {
        let c = cluster(&path, workers, |cfg| {
            cfg.parallel = 4;
            cfg.pipeline_lanes = lanes;
            // Prompt chunks of 2 tokens: a long prompt crosses the workers in pieces.
            cfg.prefill_chunk = 2;
        })
        .await;
        let got = all_at_once(&c.coordinator, &prompts).await;
        for (i, (g, want)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g, want, "request {i}, {workers} workers, lanes {lanes:?}");
        }
        let stats = c.coordinator.stats();
        let generated: usize = expected.iter().map(Vec::len).sum();
        assert_eq!(stats.generated_tokens, generated as u64);
        let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
        assert_eq!(
            stats.prompt_tokens + stats.prefix_hit_tokens,
            prompt_tokens as u64
        );
        assert_eq!(stats.running, 0);
        c.coordinator.shutdown().await;
        c.workers.shutdown().await;
    }
}

/// `log_softmax(logits after tokens[..=p])` for every p but the last, in f64, from the
/// single-process model: row p scores `tokens[p + 1]`.
fn log_softmax_rows(path: &Path, tokens: &[u32]) -> Vec<Vec<f64>> {
    let file = GgufFile::open(path).expect("open model");
    let backend = Arc::new(CpuBackend::new(Some(1)).expect("cpu backend"));
    let mut generator = Generator::from_file(backend, &file, 256, 64).expect("generator");
    let logits = generator
        .eval_logits(&tokens[..tokens.len() - 1])
        .expect("logits");
    let v = logits.len() / (tokens.len() - 1);
    logits
        .chunks(v)
        .map(|row| {
            let max = row
                .iter()
                .fold(f64::NEG_INFINITY, |m, &l| m.max(f64::from(l)));
            let sum: f64 = row.iter().map(|&l| (f64::from(l) - max).exp()).sum();
            let lse = max + sum.ln();
            row.iter().map(|&l| f64::from(l) - lse).collect()
        })
        .collect()
}

/// Checks one reported score against the reference row: the token's log-probability, and
/// `n` alternatives that are the row's most likely tokens at their values, best first.
fn check_score(got: &TokenLogProb, token: u32, n: usize, row: &[f64], what: &str) {
    assert_eq!(got.token, token, "{what}");
    let want = row[token as usize];
    assert!(
        (f64::from(got.logprob) - want).abs() < 2e-3,
        "{what}: {} against {want}",
        got.logprob
    );
    assert_eq!(got.top.len(), n, "{what}: {:?}", got.top);
    let mut best = row.to_vec();
    best.sort_by(|a, b| b.total_cmp(a));
    for (j, &(id, lp)) in got.top.iter().enumerate() {
        let lp = f64::from(lp);
        assert!(
            (row[id as usize] - lp).abs() < 2e-3 && (best[j] - lp).abs() < 2e-3,
            "{what}: alternative {j} ({id} at {lp}) against the row's best {}",
            best[j]
        );
    }
}

/// What one request with log-probabilities returned: the prompt's scores, the generated
/// tokens' scores, and how it ended.
type Scored = (
    Option<Vec<Option<TokenLogProb>>>,
    Vec<TokenLogProb>,
    FinishReason,
);

async fn read_scored(mut rx: tokio::sync::mpsc::Receiver<Result<GenEvent, GenError>>) -> Scored {
    let (mut prompt, mut tokens) = (None, Vec::new());
    loop {
        let event = tokio::time::timeout(Duration::from_secs(60), rx.recv())
            .await
            .expect("an event within 60 s");
        match event {
            Some(Ok(GenEvent::Prompt(p))) => {
                assert!(
                    prompt.is_none() && tokens.is_empty(),
                    "the prompt comes first"
                );
                prompt = Some(p);
            }
            Some(Ok(GenEvent::Scored(t))) => tokens.push(t),
            Some(Ok(GenEvent::Done {
                finish,
                completion_tokens,
                ..
            })) => {
                assert_eq!(completion_tokens, tokens.len());
                return (prompt, tokens, finish);
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_carry_log_probabilities_as_one_worker_does() {
    let dir = TempDir::new("lanes-logprobs");
    let path = tiny_model(&dir, 34);
    let prompts = prompts(&path);
    // (prompt alternatives, token alternatives, max_tokens) per request: scored prompts
    // longer than a chunk, one with no generated tokens, one scoring only its tokens.
    let asks = [
        (Some(2), Some(3), 9),
        (Some(1), Some(2), 12),
        (None, Some(4), 10),
        (Some(3), None, 0),
        (Some(0), Some(0), 7),
        (None, Some(1), 5),
    ];
    for (workers, lanes) in [(1, None), (2, None), (3, Some(2))] {
        let c = cluster(&path, workers, |cfg| {
            cfg.parallel = 4;
            cfg.pipeline_lanes = lanes;
            cfg.prefill_chunk = 2;
        })
        .await;
        let receivers: Vec<_> = prompts
            .iter()
            .zip(asks)
            .map(|(p, (prompt_n, token_n, max_tokens))| {
                let mut req = greedy(p, max_tokens);
                req.prompt_logprobs = prompt_n;
                req.logprobs = token_n;
                c.coordinator.submit(req).expect("submit")
            })
            .collect();
        for (i, (rx, (prompt_n, token_n, max_tokens))) in
            receivers.into_iter().zip(asks).enumerate()
        {
            let what = format!("request {i}, {workers} workers, lanes {lanes:?}");
            let (scored_prompt, tokens, _) = read_scored(rx).await;
            let p = &prompts[i];
            let generated = reference(&path, p, max_tokens, 256);
            let all: Vec<u32> = p.iter().chain(&generated).copied().collect();
            let rows = log_softmax_rows(&path, &all);
            match (prompt_n, scored_prompt) {
                (None, None) => {}
                (Some(n), Some(scores)) => {
                    assert_eq!(scores.len(), p.len(), "{what}");
                    assert!(scores[0].is_none(), "{what}: nothing precedes the first");
                    for (q, s) in scores.iter().enumerate().skip(1) {
                        let s = s.as_ref().expect("a prompt token's score");
                        check_score(s, p[q], n, &rows[q - 1], &format!("{what}, prompt {q}"));
                    }
                }
                (want, got) => panic!("{what}: prompt scores {got:?}, asked {want:?}"),
            }
            match token_n {
                Some(n) => {
                    let ids: Vec<u32> = tokens.iter().map(|t| t.token).collect();
                    assert_eq!(ids, generated, "{what}");
                    for (j, t) in tokens.iter().enumerate() {
                        let row = &rows[p.len() - 1 + j];
                        check_score(t, generated[j], n, row, &format!("{what}, token {j}"));
                    }
                }
                None => assert!(tokens.is_empty(), "{what}: no tokens were asked for"),
            }
        }
        assert_eq!(c.coordinator.stats().running, 0);
        c.coordinator.shutdown().await;
        c.workers.shutdown().await;
    }
}

type Events = tokio::sync::mpsc::Receiver<Result<GenEvent, GenError>>;

/// Submits greedy `max_tokens` of each prompt and waits until each has its first token, so
/// every lane is running.
async fn running(
    engine: &impl Generation,
    model: &Path,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> Vec<(u32, Events)> {
    // End-of-generation tokens banned, as `ignore_eos` does: each request runs its
    // `max_tokens`, however fast the lanes generate.
    let file = GgufFile::open(model).expect("open model");
    let bans: Vec<(u32, f32)> = support::end_of_generation(&file)
        .into_iter()
        .map(|t| (t, f32::NEG_INFINITY))
        .collect();
    let mut out = Vec::new();
    for p in prompts {
        let mut request = greedy(p, max_tokens);
        request.sampling.logit_bias = bans.clone();
        let mut rx = engine.submit(request).expect("submit");
        let first = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .expect("a first token");
        let Some(Ok(GenEvent::Token(t))) = first else {
            panic!("{first:?}");
        };
        out.push((t, rx));
    }
    out
}

/// Loads `path` beside the served model and switches to it, on a task of its own.
fn swap_to(
    coordinator: &Arc<Coordinator>,
    path: &Path,
) -> tokio::task::JoinHandle<Result<ModelChangeReport, ModelChangeError>> {
    let coordinator = Arc::clone(coordinator);
    let load = ModelLoad {
        path: path.to_path_buf(),
        id: None,
        unload_first: false,
    };
    tokio::spawn(async move { coordinator.load_model(load).await })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_swapped_while_lanes_are_in_flight_drains_them_first() {
    let (dir_a, dir_b) = (TempDir::new("lanes-swap-a"), TempDir::new("lanes-swap-b"));
    let (a, b) = (tiny_model(&dir_a, 35), tiny_model(&dir_b, 36));
    let prompts_a = prompts(&a);
    // Within the grace: every request admitted for the old model ends as it would have.
    let c = cluster(&a, 2, |cfg| {
        cfg.parallel = 4;
        cfg.prefill_chunk = 2;
    })
    .await;
    let coordinator = Arc::new(c.coordinator);
    let inflight = running(coordinator.as_ref(), &a, &prompts_a[..4], 24).await;
    let swap = swap_to(&coordinator, &b);
    for (i, (first, rx)) in inflight.into_iter().enumerate() {
        let (tokens, end) = support::collect_after(vec![first], rx).await;
        assert!(end.is_ok(), "request {i}: {end:?}");
        assert_eq!(tokens, reference(&a, &prompts_a[i], 24, 256), "request {i}");
    }
    let report = swap.await.expect("swap task").expect("swap");
    assert!(!report.outage, "{report:?}");
    let prompts_b = prompts(&b);
    let (tokens, end) = generate(coordinator.as_ref(), &prompts_b[0], 12).await;
    assert!(end.is_ok(), "{end:?}");
    assert_eq!(
        tokens,
        reference(&b, &prompts_b[0], 12, 256),
        "the new model"
    );
    for w in &c.workers.workers {
        assert_eq!(
            w.status().sessions,
            1,
            "only the new model's session is left"
        );
    }
    coordinator.shutdown().await;
    c.workers.shutdown().await;

    // Past the grace: no lane's next step starts, and once none is in flight the requests
    // left end with an error that says why; the new model then serves.
    let c = cluster(&a, 2, |cfg| {
        cfg.parallel = 4;
        cfg.ctx_per_seq = 2048;
        cfg.retire_grace = Duration::from_millis(300);
    })
    .await;
    let coordinator = Arc::new(c.coordinator);
    let inflight = running(coordinator.as_ref(), &a, &prompts_a[..4], 2000).await;
    let report = swap_to(&coordinator, &b)
        .await
        .expect("swap task")
        .expect("swap");
    assert!(!report.outage, "{report:?}");
    for (i, (first, rx)) in inflight.into_iter().enumerate() {
        let (tokens, end) = support::collect_after(vec![first], rx).await;
        match end {
            Err(GenError::Unavailable(why)) => assert!(why.contains("replaced"), "{i}: {why}"),
            // A fast machine may finish it within the grace.
            Ok(_) => assert_eq!(tokens.len(), 2000, "request {i}"),
            other => panic!("request {i}: {other:?}"),
        }
        let n = tokens.len().min(16);
        assert_eq!(
            tokens[..n],
            reference(&a, &prompts_a[i], n, 2048)[..],
            "request {i}"
        );
    }
    assert_eq!(coordinator.stats().running, 0);
    let (tokens, end) = generate(coordinator.as_ref(), &prompts_b[1], 12).await;
    assert!(end.is_ok(), "{end:?}");
    assert_eq!(tokens, reference(&b, &prompts_b[1], 12, 2048));
    coordinator.shutdown().await;
    c.workers.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_cancelled_in_flight_ends_alone() {
    let dir = TempDir::new("lanes-cancel");
    let path = tiny_model(&dir, 32);
    let prompts = prompts(&path);
    let c = cluster(&path, 2, |cfg| {
        cfg.parallel = 4;
        cfg.prefill_chunk = 2;
        cfg.ctx_per_seq = 512;
    })
    .await;
    let long = c
        .coordinator
        .submit(greedy(&prompts[1], 400))
        .expect("submit");
    let keep: Vec<_> = prompts[2..5]
        .iter()
        .map(|p| c.coordinator.submit(greedy(p, 24)).expect("submit"))
        .collect();
    let mut long = long;
    for _ in 0..3 {
        let event = tokio::time::timeout(Duration::from_secs(30), long.recv()).await;
        assert!(
            matches!(event, Ok(Some(Ok(GenEvent::Token(_))))),
            "{event:?}"
        );
    }
    drop(long);
    for (i, rx) in keep.into_iter().enumerate() {
        let (tokens, end) = collect(rx).await;
        assert!(end.is_ok(), "request {i}: {end:?}");
        assert_eq!(
            tokens,
            reference(&path, &prompts[2 + i], 24, 512),
            "request {i}"
        );
    }
    // The cancelled sequence's slot is freed and reused.
    let started = Instant::now();
    while c.coordinator.stats().running > 0 {
        assert!(started.elapsed() < Duration::from_secs(30), "not reaped");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let later: Vec<_> = (0..4)
        .map(|i| {
            c.coordinator
                .submit(greedy(&prompts[i], 10))
                .expect("submit")
        })
        .collect();
    for (i, rx) in later.into_iter().enumerate() {
        let (tokens, end) = collect(rx).await;
        assert!(end.is_ok(), "later request {i}: {end:?}");
        assert_eq!(tokens, reference(&path, &prompts[i], 10, 512), "later {i}");
    }
    c.coordinator.shutdown().await;
    c.workers.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_lost_with_lanes_in_flight_fails_them_and_the_model_comes_back() {
    let dir = TempDir::new("lanes-lost");
    let path = tiny_model(&dir, 33);
    let prompts = prompts(&path);
    let mut c = cluster(&path, 2, |cfg| {
        cfg.parallel = 4;
        cfg.ctx_per_seq = 512;
        cfg.retry_every = Duration::from_millis(1000);
    })
    .await;
    let mut running: Vec<_> = prompts[..4]
        .iter()
        .map(|p| c.coordinator.submit(greedy(p, 500)).expect("submit"))
        .collect();
    for rx in &mut running {
        let first = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .expect("a first token");
        assert!(matches!(first, Some(Ok(GenEvent::Token(_)))), "{first:?}");
    }
    let lost = c.workers.workers.remove(0);
    let lost_addr = lost.addr().to_string();
    lost.shutdown().await;
    for (i, rx) in running.into_iter().enumerate() {
        let (_, end) = collect(rx).await;
        match end {
            Err(GenError::Unavailable(why)) => assert!(why.contains(&lost_addr), "{i}: {why}"),
            other => panic!("request {i}: expected Unavailable, got {other:?}"),
        }
    }
    // The count drops just after the failed requests hear of it.
    let started = Instant::now();
    while c.coordinator.stats().running > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "still counted running"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    support::wait_until_loaded_again(&c.coordinator, 1).await;
    let (tokens, end) = generate(&c.coordinator, &prompts[0], 12).await;
    assert!(end.is_ok(), "{end:?}");
    assert_eq!(tokens, reference(&path, &prompts[0], 12, 512));
    c.coordinator.shutdown().await;
    c.workers.shutdown().await;
}
