//! Several choices of one prompt (`submit_choices`) through embedded workers: with one and
//! two workers (a lane each), every greedy choice generates the single-process generator's
//! tokens while the later ones copy the first one's prompt cells; a request of more
//! choices than slots is refused.

mod support;

use support::{TempDir, cluster, collect, greedy, reference, tiny_model};
use tether_coordinator::api::{GenError, Generation};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_choices_equal_the_generator_and_share_the_prompt_over_lanes() {
    let dir = TempDir::new("choices-lanes");
    let path = tiny_model(&dir, 41);
    // 70 tokens: the 69 before the last are shared (the last, partly filled block copied
    // on write), and each choice runs the last itself.
    let prompt: Vec<u32> = (0..70).map(|i| 3 + (i * 37 + 11) % 250).collect();
    let max_tokens = 10;
    let want = reference(&path, &prompt, max_tokens, 256);
    for workers in [1, 2] {
        let c = cluster(&path, workers, |cfg| cfg.parallel = 4).await;
        let engine = &c.coordinator;
        let before = engine.stats().prefix_hit_tokens;
        let receivers = engine
            .submit_choices(vec![greedy(&prompt, max_tokens); 3])
            .expect("submit");
        for (i, rx) in receivers.into_iter().enumerate() {
            let (tokens, end) = collect(rx).await;
            assert!(end.is_ok(), "{workers} workers, choice {i}: {end:?}");
            assert_eq!(tokens, want, "{workers} workers, choice {i}");
        }
        assert_eq!(
            engine.stats().prefix_hit_tokens - before,
            2 * 69,
            "{workers} workers: choices 1 and 2 share 69 prompt cells each"
        );
        let refused = engine.submit_choices(vec![greedy(&prompt, 2); 5]);
        assert!(
            matches!(&refused, Err(GenError::InvalidRequest(m)) if m.contains("--parallel")),
            "{:?}",
            refused.err()
        );
        c.coordinator.shutdown().await;
    }
}
