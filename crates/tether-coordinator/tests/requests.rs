//! Request lifecycle through the coordinator: cancelling by dropping the receiver frees the
//! slot, deadlines end with Timeout, and `max_tokens = 0` ends at once.

mod support;

use std::time::{Duration, Instant};
use support::{TempDir, cluster, collect, generate, greedy, prompt, reference, tiny_model};
use tether_coordinator::api::{FinishReason, GenError, GenEvent, Generation};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_deadline_and_zero_tokens() {
    let dir = TempDir::new("requests");
    let path = tiny_model(&dir, 31);
    let c = cluster(&path, 2, |cfg| {
        cfg.parallel = 1;
        cfg.ctx_per_seq = 512;
    })
    .await;
    let e = &c.coordinator;
    let p = prompt(&path, "Once upon a time");

    // One slot: a cancelled request must give it back, or the next one never runs.
    let mut rx = e.submit(greedy(&p, 200)).expect("submit");
    let first = rx.recv().await;
    assert!(matches!(first, Some(Ok(GenEvent::Token(_)))), "{first:?}");
    drop(rx);
    let expected = reference(&path, &p, 8, 512);
    let (tokens, end) = generate(e, &p, 8).await;
    assert_eq!(end, Ok(FinishReason::Length));
    assert_eq!(tokens, expected, "a reused slot starts from an empty cache");

    // 480 tokens cannot pass through two workers in 20 ms.
    let mut req = greedy(&p, 480);
    req.deadline = Some(Instant::now() + Duration::from_millis(20));
    let (tokens, end) = collect(e.submit(req).expect("submit")).await;
    assert!(matches!(end, Err(GenError::Timeout(_))), "{end:?}");
    assert!(tokens.len() < 480);

    let (tokens, end) = generate(e, &p, 0).await;
    assert!(tokens.is_empty());
    assert_eq!(end, Ok(FinishReason::Length));

    let stats = e.stats();
    assert_eq!((stats.running, stats.queued), (0, 0));
    c.coordinator.shutdown().await;
    assert!(matches!(
        c.coordinator.submit(greedy(&p, 4)),
        Err(GenError::Unavailable(_))
    ));
    c.workers.shutdown().await;
}
