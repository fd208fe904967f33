//! Lanes: with a lane per worker, groups of sequences go through the workers on their own.
//! Their greedy tokens equal the single-process generator's and those of one lane, with
//! prompts cut into chunks smaller than the micro-batch; a request cancelled while its lane
//! is in flight ends alone; a worker lost while lanes are in flight fails every running
//! request, and the model is loaded again.

mod support;

use std::time::{Duration, Instant};
use support::{TempDir, cluster, collect, generate, greedy, prompt, reference, tiny_model};
use tether_coordinator::api::{GenError, GenEvent, Generation};

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
    assert_eq!(c.coordinator.stats().running, 0);
    support::wait_until_loaded_again(&c.coordinator, 1).await;
    let (tokens, end) = generate(&c.coordinator, &prompts[0], 12).await;
    assert!(end.is_ok(), "{end:?}");
    assert_eq!(tokens, reference(&path, &prompts[0], 12, 512));
    c.coordinator.shutdown().await;
    c.workers.shutdown().await;
}
