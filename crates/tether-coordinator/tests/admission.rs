//! What the coordinator refuses and how its requests end: prompts that do not fit, the
//! `length` ends of `max_tokens` and of a full context, a full queue, a passed deadline, and
//! dropping the engine while a reader stalls.

mod support;

use std::time::{Duration, Instant};
use support::{Cluster, TempDir, cluster, greedy, tiny_model};
use tether_coordinator::api::{FinishReason, GenError, GenEvent, Generation, Health};
use tokio::sync::mpsc;

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

/// One worker and one sequence slot of `ctx` cells, with `queue` requests waiting for it.
async fn one_slot(dir: &TempDir, ctx: usize, queue: usize) -> Cluster {
    let path = tiny_model(dir, 7);
    cluster(&path, 1, |cfg| {
        cfg.ctx_per_seq = ctx;
        cfg.parallel = 1;
        cfg.queue_depth = queue;
    })
    .await
}

/// Waits until the scheduler runs `n` requests.
async fn until_running(e: &impl Generation, n: usize) {
    let started = Instant::now();
    while e.stats().running != n {
        assert!(started.elapsed() < Duration::from_secs(20), "never ran {n}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_longer_than_context_is_an_invalid_request() {
    let dir = TempDir::new("admission-long");
    let c = one_slot(&dir, 16, 1).await;
    let e = &c.coordinator;
    let err = e.submit(greedy(&[1; 17], 4)).expect_err("refused");
    assert!(matches!(err, GenError::InvalidRequest(_)), "{err:?}");
    let err = e.submit(greedy(&[], 4)).expect_err("refused");
    assert!(matches!(err, GenError::InvalidRequest(_)), "{err:?}");
    c.coordinator.shutdown().await;
    c.workers.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_tokens_and_a_full_context_end_with_length() {
    let dir = TempDir::new("admission-length");
    let c = one_slot(&dir, 16, 1).await;
    let e = &c.coordinator;
    let prompt = [1, 300, 301, 302];
    let (tokens, end) = drain(e.submit(greedy(&prompt, 3)).expect("accepted")).await;
    let want = GenEvent::Done {
        finish: FinishReason::Length,
        prompt_tokens: 4,
        completion_tokens: 3,
    };
    assert_eq!((tokens.len(), end), (3, Some(Ok(want))));

    // The last token is sampled from the last cell and need not be stored.
    let (tokens, end) = drain(e.submit(greedy(&prompt, 100)).expect("accepted")).await;
    let want = GenEvent::Done {
        finish: FinishReason::Length,
        prompt_tokens: 4,
        completion_tokens: 16 - 4 + 1,
    };
    assert_eq!((tokens.len(), end), (13, Some(Ok(want))));
    // The second prompt's first three tokens come from the first one's cells (prefix
    // caching); its last token still runs to give the first token's logits.
    assert_eq!(e.stats().prefix_hit_tokens, 3);
    assert_eq!(e.stats().prompt_tokens, 8 - 3);
    assert_eq!(e.stats().generated_tokens, 16);
    c.coordinator.shutdown().await;
    c.workers.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_is_busy_and_dropping_the_receiver_frees_the_engine() {
    let dir = TempDir::new("admission-busy");
    let c = one_slot(&dir, 2048, 1).await;
    let e = &c.coordinator;
    // Not read: it holds the slot until its receiver is dropped.
    let first = e.submit(greedy(&[1, 300], 2000)).expect("accepted");
    until_running(e, 1).await;
    let queued = e.submit(greedy(&[1, 300], 2)).expect("queued");
    let err = e.submit(greedy(&[1, 300], 2)).expect_err("busy");
    assert!(matches!(err, GenError::Busy(_)), "{err:?}");
    drop(first);
    let started = Instant::now();
    let second = loop {
        match e.submit(greedy(&[1, 300], 2)) {
            Ok(rx) => break rx,
            Err(GenError::Busy(_)) if started.elapsed() < Duration::from_secs(20) => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(other) => panic!("the engine was not freed: {other:?}"),
        }
    };
    for rx in [queued, second] {
        let (tokens, end) = drain(rx).await;
        assert_eq!(tokens.len(), 2);
        assert!(matches!(end, Some(Ok(GenEvent::Done { .. }))), "{end:?}");
    }
    assert!(e.stats().generated_tokens < 2000);
    assert_eq!(e.health(), Health::Ready);
    c.coordinator.shutdown().await;
    c.workers.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_engine_ends_a_request_whose_reader_stalls() {
    let dir = TempDir::new("admission-drop");
    let Cluster {
        coordinator: e,
        workers,
    } = one_slot(&dir, 2048, 1).await;
    let stalled = e.submit(greedy(&[1, 300], 2000)).expect("accepted");
    until_running(&e, 1).await;
    let waiting = e.submit(greedy(&[1, 300], 2)).expect("queued");
    let started = Instant::now();
    drop(e);
    let (tokens, end) = drain(stalled).await;
    assert!(started.elapsed() < Duration::from_secs(20));
    assert!(tokens.len() < 2000);
    assert!(!matches!(end, Some(Ok(_))), "{end:?}");
    // A queued request is told the engine went away; it never ran.
    let (tokens, end) = drain(waiting).await;
    assert!(tokens.is_empty());
    assert!(
        matches!(end, Some(Err(GenError::Unavailable(_)))),
        "{end:?}"
    );
    workers.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passed_deadline_ends_with_timeout() {
    let dir = TempDir::new("admission-deadline");
    let c = one_slot(&dir, 64, 1).await;
    let mut req = greedy(&[1, 300], 40);
    req.deadline = Some(Instant::now());
    let (_, end) = drain(c.coordinator.submit(req).expect("accepted")).await;
    assert!(matches!(end, Some(Err(GenError::Timeout(_)))), "{end:?}");
    c.coordinator.shutdown().await;
    c.workers.shutdown().await;
}
