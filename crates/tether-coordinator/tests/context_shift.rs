//! `--context-shift` through real workers: a generation longer than its context goes on,
//! and after each shift it continues exactly as a fresh run over the shortened text would
//! (kept prefix + newer half), computed here independently with the single-process
//! generator.

mod support;

use support::{TempDir, cluster, collect, greedy, prompt, reference, tiny_model};
use tether_coordinator::api::{ContextShift, FinishReason, Generation};
use tether_coordinator::{Coordinator, CoordinatorConfig, CoordinatorError, ModelFile};

const CTX: usize = 32;
const KEEP: usize = 4;

/// What the coordinator should produce: generate until the context is full, drop the
/// oldest half after the kept prefix, and go on from a fresh prefill of what is left.
fn expected(path: &std::path::Path, prompt: &[u32], n: usize) -> (Vec<u32>, usize) {
    let mut text = prompt.to_vec();
    let mut out = Vec::new();
    let mut shifts = 0;
    while out.len() < n {
        let room = CTX + 1 - text.len();
        let part = reference(path, &text, room.min(n - out.len()), 2 * CTX);
        let ended = part.len() < room.min(n - out.len());
        out.extend_from_slice(&part);
        text.extend_from_slice(&part);
        if ended || out.len() == n {
            break;
        }
        let past = text.len() - 1;
        let drop = (past - KEEP) / 2;
        text.drain(KEEP..KEEP + drop);
        shifts += 1;
    }
    (out, shifts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_past_the_context_shifts_and_matches_a_fresh_run() {
    let dir = TempDir::new("context-shift");
    let path = tiny_model(&dir, 31);
    let p = prompt(&path, "Once upon a time");
    let n = 90;
    let (want, shifts) = expected(&path, &p, n);
    assert!(
        shifts >= 2,
        "the test must cross the context more than once"
    );

    let c = cluster(&path, 2, |cfg| {
        cfg.parallel = 2;
        cfg.ctx_per_seq = CTX;
        cfg.context_shift = Some(ContextShift { keep: KEEP });
    })
    .await;
    // Two at once: the shifted sequence's cells must not disturb its neighbour's.
    let a = c.coordinator.submit(greedy(&p, n)).expect("submit");
    let b = c.coordinator.submit(greedy(&p, n)).expect("submit");
    let (ta, ea) = collect(a).await;
    let (tb, eb) = collect(b).await;
    let end = if want.len() == n {
        FinishReason::Length
    } else {
        FinishReason::Stop
    };
    assert_eq!((ea, eb), (Ok(end), Ok(end)));
    assert_eq!(ta, want, "tokens after {shifts} shifts");
    assert_eq!(tb, want);
    c.coordinator.shutdown().await;
    c.workers.shutdown().await;

    // Without the shift the same request ends when the context is full.
    let c = cluster(&path, 1, |cfg| cfg.ctx_per_seq = CTX).await;
    let (tokens, end) = collect(c.coordinator.submit(greedy(&p, n)).expect("submit")).await;
    assert_eq!(end, Ok(FinishReason::Length));
    assert_eq!(tokens[..], want[..CTX + 1 - p.len()]);
    c.coordinator.shutdown().await;
    c.workers.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keep_that_leaves_nothing_to_drop_is_refused_before_loading() {
    let dir = TempDir::new("context-shift-keep");
    let path = tiny_model(&dir, 32);
    let model = ModelFile::open(&path).expect("open model");
    let mut config = CoordinatorConfig::new(&model, vec!["127.0.0.1:1".to_string()]);
    config.ctx_per_seq = CTX;
    config.context_shift = Some(ContextShift { keep: CTX - 1 });
    match Coordinator::start(model, config).await {
        Err(CoordinatorError::Config(why)) => assert!(why.contains("--keep 31"), "{why}"),
        Err(e) => panic!("expected a config error, got {e}"),
        Ok(_) => panic!("a keep of ctx - 1 was accepted"),
    }
}
