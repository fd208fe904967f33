//! Prefix caching through embedded workers: requests that share the start of their prompt
//! with an earlier or a running one reuse its KV cells, and generate exactly the tokens of
//! a full prefill (the single-process generator's), on one and two workers; few slots
//! force eviction; reuse is counted, and off with `prefix_cache: false`.

mod support;

use support::{Cluster, TempDir, cluster, collect, generate, greedy, reference, tiny_model};
use tether_coordinator::api::{FinishReason, GenError, GenEvent, Generation};

const CTX: usize = 256;

/// `n` token ids from `seed`, clear of the low ids a tokenizer keeps for control tokens.
fn ids(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 3 + (i * 37 + seed * 101) % 250)
        .collect()
}

fn cat(parts: &[&[u32]]) -> Vec<u32> {
    parts.concat()
}

fn hits(c: &impl Generation) -> u64 {
    c.stats().prefix_hit_tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reused_prefixes_give_the_tokens_of_a_full_prefill() {
    let dir = TempDir::new("prefix-equal");
    let path = tiny_model(&dir, 21);
    // A 70-token "system prompt": two whole blocks of 32 and 6 tokens more.
    let system = ids(1, 70);
    let first = cat(&[&system, &ids(2, 10)]);
    let off_block = cat(&[&system, &ids(3, 12)]);
    let at_block = cat(&[&system[..64], &ids(4, 9)]);
    let inside_block = cat(&[&system[..40], &ids(5, 7)]);
    let unrelated = ids(6, 30);
    let n = 12;
    let first_out = reference(&path, &first, n, CTX);
    // The next turn of a chat: the first exchange and a new message.
    let turn = cat(&[&first, &first_out, &ids(7, 8)]);
    let waves: Vec<Vec<Vec<u32>>> = vec![
        vec![first.clone(), off_block.clone()],
        vec![turn, at_block, first.clone(), inside_block],
        vec![unrelated, off_block, first],
    ];
    let expected: Vec<Vec<Vec<u32>>> = waves
        .iter()
        .map(|w| w.iter().map(|p| reference(&path, p, n, CTX)).collect())
        .collect();
    for workers in [1, 2] {
        // Cached-prefix slots (the default), none, and no prefix cache.
        for (prefix_cache, cached) in [(true, None), (true, Some(0)), (false, None)] {
            let c = cluster(&path, workers, |cfg| {
                cfg.parallel = 2;
                cfg.prefix_cache = prefix_cache;
                cfg.cached_prefixes = cached;
            })
            .await;
            for (w, (wave, want)) in waves.iter().zip(&expected).enumerate() {
                // More requests than slots at once: they queue, interleave and evict.
                let running: Vec<_> = wave
                    .iter()
                    .map(|p| c.coordinator.submit(greedy(p, n)).expect("submit"))
                    .collect();
                for (k, (rx, want)) in running.into_iter().zip(want).enumerate() {
                    let (tokens, end) = collect(rx).await;
                    end.expect("no error");
                    assert_eq!(
                        &tokens, want,
                        "{workers} workers, prefix cache {prefix_cache}, wave {w} request {k}"
                    );
                }
                blocks_agree(&c).await;
            }
            let reused = hits(&c.coordinator);
            if prefix_cache {
                assert!(reused >= 70, "{workers} workers: {reused} tokens reused");
            } else {
                assert_eq!(reused, 0, "{workers} workers: reuse while off");
            }
            c.coordinator.shutdown().await;
            c.workers.shutdown().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_requests_prefix_is_shared_into_another_slot() {
    let dir = TempDir::new("prefix-copy");
    let path = tiny_model(&dir, 22);
    let system = ids(1, 70);
    let long = cat(&[&system, &ids(2, 30)]);
    let other = cat(&[&system, &ids(3, 5)]);
    let long_out = reference(&path, &long, 120, CTX);
    assert_eq!(
        long_out.len(),
        120,
        "the long request must still run when the other comes"
    );
    let other_out = reference(&path, &other, 10, CTX);
    for workers in [1, 2] {
        let c = cluster(&path, workers, |cfg| cfg.parallel = 2).await;
        let mut long_rx = c.coordinator.submit(greedy(&long, 120)).expect("submit");
        // Once the first token is out, the long prompt is in its slot's cells.
        let first = long_rx.recv().await.expect("an event").expect("a token");
        let (tokens, end) = generate(&c.coordinator, &other, 10).await;
        end.expect("no error");
        assert_eq!(tokens, other_out, "{workers} workers");
        assert_eq!(
            hits(&c.coordinator),
            70,
            "{workers} workers: the 70 shared tokens, the last block's 6 copied on write"
        );
        let mut rest = vec![match first {
            GenEvent::Token(t) => t,
            other => panic!("expected a token, got {other:?}"),
        }];
        // Tokens until Done, which ends the loop.
        while let GenEvent::Token(t) = long_rx.recv().await.expect("an event").expect("no error") {
            rest.push(t);
        }
        assert_eq!(
            rest, long_out,
            "{workers} workers: the source goes on untouched"
        );
        c.coordinator.shutdown().await;
        c.workers.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_slot_evicts_and_a_prompt_over_the_context_is_refused() {
    let dir = TempDir::new("prefix-evict");
    let path = tiny_model(&dir, 23);
    let a = ids(1, 50);
    let b = ids(2, 50);
    let (a_out, b_out) = (reference(&path, &a, 8, CTX), reference(&path, &b, 8, CTX));
    let c = cluster(&path, 1, |cfg| {
        cfg.parallel = 1;
        cfg.cached_prefixes = Some(0);
    })
    .await;
    let mut reused = Vec::new();
    for (prompt, want) in [(&a, &a_out), (&a, &a_out), (&b, &b_out), (&a, &a_out)] {
        let (tokens, end) = generate(&c.coordinator, prompt, 8).await;
        end.expect("no error");
        assert_eq!(&tokens, want);
        reused.push(hits(&c.coordinator));
    }
    // The same prompt again reuses all but its last token; `b` evicts `a`.
    assert_eq!(reused, vec![0, 49, 49, 49]);
    let err = c
        .coordinator
        .submit(greedy(&ids(3, CTX + 1), 4))
        .expect_err("a prompt over the context");
    assert!(matches!(err, GenError::InvalidRequest(_)), "{err:?}");
    let (_, end) = generate(&c.coordinator, &a, 4).await;
    assert_eq!(
        end,
        Ok(FinishReason::Length),
        "still serving after the refusal"
    );
    c.coordinator.shutdown().await;
    c.workers.shutdown().await;
}

fn evictions(c: &impl Generation) -> u64 {
    c.stats().prefix_evictions
}

/// Checks that the coordinator's `/metrics` block counts are every worker's own, once the
/// moves queued after the last request (clearing its slot) have reached the workers.
async fn blocks_agree(c: &Cluster) {
    let counts = || {
        let stats = c.coordinator.stats();
        let ours = (stats.kv_blocks as u64, stats.kv_blocks_free as u64);
        let theirs: Vec<(u64, u64)> = c
            .workers
            .workers
            .iter()
            .map(|w| match w.sessions().as_slice() {
                [s] => (s.kv_blocks, s.kv_blocks_free),
                other => panic!("one session a worker, got {}", other.len()),
            })
            .collect();
        (ours, theirs)
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        let (ours, theirs) = counts();
        if theirs.iter().all(|t| *t == ours) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the coordinator counts {ours:?} blocks (pool, free), the workers {theirs:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Runs `prompt` to 8 greedy tokens, checks them against a full prefill, and returns how
/// many of its tokens came from cached cells.
async fn reused(c: &Cluster, path: &std::path::Path, prompt: &[u32]) -> u64 {
    let want = reference(path, prompt, 8, CTX);
    let before = hits(&c.coordinator);
    let (tokens, end) = generate(&c.coordinator, prompt, 8).await;
    end.expect("no error");
    assert_eq!(tokens, want, "{} prompt tokens", prompt.len());
    blocks_agree(c).await;
    hits(&c.coordinator) - before
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_prefixes_outlive_their_slot_until_the_pool_needs_their_blocks() {
    let dir = TempDir::new("prefix-cached");
    let path = tiny_model(&dir, 24);
    // One running sequence (a pool of 256 cells: 8 blocks) and two cached-prefix ones.
    let c = cluster(&path, 1, |cfg| {
        cfg.parallel = 1;
        cfg.cached_prefixes = Some(2);
    })
    .await;
    // Two short conversations fit the pool together: the first comes back to its cells
    // though the second ran in between, in the one running slot.
    let (a, b) = (ids(1, 50), ids(2, 50));
    assert_eq!(reused(&c, &path, &a).await, 0);
    assert_eq!(reused(&c, &path, &b).await, 0);
    assert_eq!(
        reused(&c, &path, &a).await,
        49,
        "a's cells outlived b's request"
    );
    assert_eq!(evictions(&c.coordinator), 0);
    // Two long ones do not: 158 positions take 5 of the 8 blocks, so running the second
    // gives up the older cached prefixes, least recently used first, and the first is
    // prefilled again.
    let (x, y) = (ids(3, 150), ids(4, 150));
    assert_eq!(reused(&c, &path, &x).await, 0);
    assert_eq!(reused(&c, &path, &y).await, 0);
    assert!(evictions(&c.coordinator) >= 1);
    assert_eq!(reused(&c, &path, &x).await, 0, "x was evicted for y");
    assert_eq!(
        reused(&c, &path, &x).await,
        149,
        "x is cached again (y was evicted for it)"
    );
    c.coordinator.shutdown().await;
    c.workers.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_that_share_a_system_prompt_keep_their_own_cells() {
    let dir = TempDir::new("prefix-system");
    let path = tiny_model(&dir, 25);
    // Two conversations open with the same 70-token system prompt (two blocks and part of
    // a third).
    let system = ids(1, 70);
    let a = cat(&[&system, &ids(2, 40)]);
    let b = cat(&[&system, &ids(3, 40)]);
    for workers in [1, 2] {
        let c = cluster(&path, workers, |cfg| {
            cfg.parallel = 1;
            cfg.cached_prefixes = Some(2);
        })
        .await;
        assert_eq!(reused(&c, &path, &a).await, 0);
        assert_eq!(
            reused(&c, &path, &b).await,
            70,
            "{workers} workers: b shares a's system prompt"
        );
        // Each next turn finds its whole first turn: b did not take a's cells.
        for (first, seed) in [(&a, 4), (&b, 5)] {
            let next = cat(&[first, &ids(seed, 10)]);
            assert_eq!(
                reused(&c, &path, &next).await,
                first.len() as u64,
                "{workers} workers"
            );
        }
        assert_eq!(evictions(&c.coordinator), 0);
        c.coordinator.shutdown().await;
        c.workers.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_two_slots_share_are_counted_once_when_making_room() {
    let dir = TempDir::new("prefix-shared-room");
    let path = tiny_model(&dir, 26);
    // One running sequence: a pool of 8 blocks. Two conversations of 5 blocks each that
    // share a 3-block system prompt hold 7 of them together, so both stay cached.
    let system = ids(1, 96);
    let a = cat(&[&system, &ids(2, 40)]);
    let b = cat(&[&system, &ids(3, 40)]);
    let c = cluster(&path, 1, |cfg| {
        cfg.parallel = 1;
        cfg.cached_prefixes = Some(2);
    })
    .await;
    assert_eq!(reused(&c, &path, &a).await, 0);
    assert_eq!(reused(&c, &path, &b).await, 96);
    for (first, seed) in [(&a, 4), (&b, 5)] {
        let next = cat(&[first, &ids(seed, 10)]);
        assert_eq!(reused(&c, &path, &next).await, first.len() as u64);
    }
    assert_eq!(evictions(&c.coordinator), 0, "nothing had to go");
    let free = c.coordinator.stats().kv_blocks_free;
    assert_eq!(free, 1, "5 + 5 blocks, 3 of them shared, in a pool of 8");
    c.coordinator.shutdown().await;
    c.workers.shutdown().await;
}
