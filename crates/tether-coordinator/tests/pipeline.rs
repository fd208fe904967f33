//! Generation through embedded workers over loopback gRPC equals the single-process
//! generator token for token, alone and with concurrent requests.

mod support;

use support::{TempDir, cluster, generate, prompt, reference, stories260k, tiny_model};
use tether_coordinator::api::{FinishReason, GenError, GenRequest, Generation};
use tether_gguf::GgmlType;
use tether_model::{SamplingParams, SynthShape};

async fn check_through_workers(path: &std::path::Path, text: &str, n_tokens: usize) {
    let prompt = prompt(path, text);
    let expected = reference(path, &prompt, n_tokens, 256);
    assert!(!expected.is_empty(), "the reference generated nothing");
    for n in 1..=3 {
        let c = cluster(path, n, |_| {}).await;
        let plan = c.coordinator.plan().expect("a plan");
        assert_eq!(plan.assignments.len(), n, "{plan}");
        let (tokens, end) = generate(&c.coordinator, &prompt, n_tokens).await;
        assert_eq!(tokens, expected, "{n} workers, plan:\n{plan}");
        let finish = end.expect("no error");
        if tokens.len() == n_tokens {
            assert_eq!(finish, FinishReason::Length);
        } else {
            assert_eq!(finish, FinishReason::Stop);
        }
        c.coordinator.shutdown().await;
        c.workers.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_tokens_equal_the_single_process_generator() {
    let dir = TempDir::new("equal");
    let path = tiny_model(&dir, 11);
    // A prompt longer than the micro-batch (8) makes the prefill run in chunks.
    check_through_workers(&path, "Once upon a time there was a little robot who", 40).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qwen2_shape_with_k_quants_also_matches() {
    // Biases, NEOX rope and a tied output head take other paths through the stages.
    let dir = TempDir::new("qwen2");
    let path = support::synth_model(&dir, SynthShape::TinyQwen2, GgmlType::Q4K, 14);
    check_through_workers(&path, "Hello there, how are you today? I am", 24).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qwen3_shape_with_q_k_norms_also_matches() {
    // Per-head q/k norms and heads wider than n_embd / n_head split over the workers.
    let dir = TempDir::new("qwen3");
    let path = support::synth_model(&dir, SynthShape::TinyQwen3, GgmlType::Q4K, 15);
    check_through_workers(&path, "Hello there, how are you today? I am", 24).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quantized_kv_caches_through_two_workers_equal_the_generator() {
    let dir = TempDir::new("kv-quant");
    let path = tiny_model(&dir, 15);
    let prompt = prompt(&path, "Once upon a time there was a little robot who");
    for cache in [GgmlType::Q8_0, GgmlType::Q4_0] {
        let expected = support::reference_with_cache(&path, &prompt, 24, 256, cache);
        let c = cluster(&path, 2, |cfg| {
            cfg.cache_k = cache;
            cfg.cache_v = cache;
        })
        .await;
        let plan = c.coordinator.plan().expect("a plan");
        assert_eq!(plan.assignments.len(), 2, "{plan}");
        for a in &plan.assignments {
            assert_eq!((a.spec.cache_k, a.spec.cache_v), (cache, cache), "{plan}");
        }
        let (tokens, end) = generate(&c.coordinator, &prompt, 24).await;
        end.expect("no error");
        assert_eq!(tokens, expected, "{cache} cache, plan:\n{plan}");
        c.coordinator.shutdown().await;
        c.workers.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_tokens_equal_the_generator_with_and_without_penalties() {
    // The last worker sends only the top candidates (k, plus the penalty window's distinct
    // tokens when there are penalties); the generator samples from every logit.
    let dir = TempDir::new("sampled");
    let path = tiny_model(&dir, 16);
    let prompt = prompt(&path, "Once upon a time there was a little robot who");
    let penalized = |repeat_penalty, repeat_last_n, top_k, seed| SamplingParams {
        temperature: 1.2,
        top_k,
        repeat_penalty,
        repeat_last_n,
        seed,
        ..SamplingParams::default()
    };
    let chains = [
        SamplingParams::default(),
        penalized(1.1, 64, 40, 3),
        penalized(4.0, 16, 3, 4),
        SamplingParams {
            temperature: 0.0,
            ..penalized(2.0, 8, 40, 5)
        },
        SamplingParams {
            frequency_penalty: 1.5,
            presence_penalty: 0.5,
            ..penalized(1.0, 32, 10, 6)
        },
    ];
    let c = cluster(&path, 2, |_| {}).await;
    for params in chains {
        let expected =
            support::reference_sampled(&path, &prompt, 32, 256, GgmlType::F16, params.clone());
        let request = GenRequest {
            sampling: params.clone(),
            ..support::greedy(&prompt, 32)
        };
        let (tokens, end) = support::collect(c.coordinator.submit(request).expect("submit")).await;
        end.expect("no error");
        assert_eq!(tokens, expected, "{params:?}");
    }
    c.coordinator.shutdown().await;
    c.workers.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn biased_and_held_back_tokens_through_workers_equal_the_generator() {
    // Bans and negative biases keep the top-candidates path (k widened by the biased
    // tokens), a positive bias asks for every logit, a held-back token widens k only for
    // the first draws: each must give what the generator gives from every logit.
    let dir = TempDir::new("biased");
    let path = tiny_model(&dir, 16);
    let prompt = prompt(&path, "Once upon a time there was a little robot who");
    let greedy = reference(&path, &prompt, 32, 256);
    let mut favorites: Vec<u32> = greedy.iter().copied().take(6).collect();
    favorites.sort_unstable();
    favorites.dedup();
    let banned: Vec<(u32, f32)> = favorites.iter().map(|&t| (t, f32::NEG_INFINITY)).collect();
    let lowered: Vec<(u32, f32)> = favorites.iter().map(|&t| (t, -1.5)).collect();
    let sampled = |temperature, top_k, logit_bias| SamplingParams {
        temperature,
        top_k,
        seed: 8,
        logit_bias,
        ..SamplingParams::default()
    };
    let chains = [
        sampled(0.0, 40, banned.clone()),
        sampled(1.1, 20, lowered.clone()),
        sampled(0.9, 10, banned.clone()),
        sampled(0.0, 40, vec![(favorites[0], -3.0), (greedy[7], 2.5)]),
        SamplingParams {
            held_back: favorites.clone(),
            min_tokens: 5,
            ..SamplingParams::greedy()
        },
    ];
    let c = cluster(&path, 2, |_| {}).await;
    for params in chains {
        let expected =
            support::reference_sampled(&path, &prompt, 32, 256, GgmlType::F16, params.clone());
        let request = GenRequest {
            sampling: params.clone(),
            ..support::greedy(&prompt, 32)
        };
        let (tokens, end) = support::collect(c.coordinator.submit(request).expect("submit")).await;
        end.expect("no error");
        assert_eq!(tokens, expected, "{params:?}");
        if params.logit_bias == banned {
            assert!(tokens.iter().all(|t| !favorites.contains(t)), "{tokens:?}");
        }
        if params.min_tokens > 0 {
            assert!(
                tokens[..5].iter().all(|t| !favorites.contains(t)),
                "{tokens:?}"
            );
        }
    }
    c.coordinator.shutdown().await;
    c.workers.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stories260k_through_workers_equals_the_generator() {
    let Some(path) = stories260k() else { return };
    check_through_workers(&path, "Once upon a time", 48).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_equal_each_alone() {
    let dir = TempDir::new("concurrent");
    let path = tiny_model(&dir, 12);
    let texts = [
        "Once upon a time",
        "The quick brown fox jumps over the lazy dog and",
        "Hello",
        "In a village far away lived",
    ];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| prompt(&path, t)).collect();
    let expected: Vec<Vec<u32>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| reference(&path, p, 20 + 3 * i, 256))
        .collect();
    let c = cluster(&path, 2, |cfg| cfg.parallel = 4).await;
    let receivers: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            c.coordinator
                .submit(support::greedy(p, 20 + 3 * i))
                .expect("submit")
        })
        .collect();
    let mut results = Vec::new();
    for rx in receivers {
        results.push(support::collect(rx).await);
    }
    for (i, ((tokens, end), want)) in results.into_iter().zip(&expected).enumerate() {
        assert!(end.is_ok(), "request {i}: {end:?}");
        assert_eq!(&tokens, want, "request {i} differs from its run alone");
    }
    let stats = c.coordinator.stats();
    let generated: usize = expected.iter().map(Vec::len).sum();
    assert_eq!(stats.generated_tokens, generated as u64);
    assert_eq!(stats.running, 0);
    c.coordinator.shutdown().await;
    c.workers.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_and_a_full_queue_are_refused() {
    let dir = TempDir::new("refuse");
    let path = tiny_model(&dir, 13);
    let c = cluster(&path, 1, |cfg| {
        cfg.parallel = 1;
        cfg.queue_depth = 1;
        cfg.ctx_per_seq = 32;
    })
    .await;
    let e = &c.coordinator;
    assert!(matches!(
        e.submit(support::greedy(&[], 4)),
        Err(GenError::InvalidRequest(_))
    ));
    assert!(matches!(
        e.submit(support::greedy(&[1; 33], 4)),
        Err(GenError::InvalidRequest(_))
    ));
    assert!(matches!(
        e.submit(support::greedy(&[100_000], 4)),
        Err(GenError::InvalidRequest(_))
    ));
    // One running, one queued: the next is Busy. The scheduler may not yet have taken the
    // first from the queue, so keep submitting until the queue answers Busy.
    let mut held = Vec::new();
    let mut busy = false;
    for _ in 0..3 {
        match e.submit(support::greedy(&[1, 2, 3], 30)) {
            Ok(rx) => held.push(rx),
            Err(GenError::Busy(_)) => {
                busy = true;
                break;
            }
            Err(other) => panic!("unexpected {other:?}"),
        }
    }
    assert!(busy, "a queue of 1 behind 1 slot must fill");
    // The context (32) ends a long request with Length.
    for rx in held {
        let (tokens, end) = support::collect(rx).await;
        assert_eq!(end, Ok(FinishReason::Length));
        assert!(tokens.len() <= 30);
    }
    let (tokens, end) = generate(e, &[1; 30], 10).await;
    assert_eq!(end, Ok(FinishReason::Length));
    assert_eq!(
        tokens.len(),
        3,
        "positions 30 and 31 fill the context of 32"
    );
    c.coordinator.shutdown().await;
    c.workers.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_progress_reaches_each_workers_tensor_bytes() {
    let dir = TempDir::new("progress");
    let path = tiny_model(&dir, 5);
    let progress = std::sync::Arc::new(tether_coordinator::LoadProgress::default());
    let sink = std::sync::Arc::clone(&progress);
    let c = cluster(&path, 2, move |cfg| cfg.load.progress = Some(sink)).await;
    let plan = c.coordinator.plan().expect("a plan");
    let file = tether_gguf::GgufFile::open(&path).expect("open model");
    let seen = progress.snapshot();
    assert_eq!(seen.len(), 2, "{seen:?}");
    for (w, a) in seen.iter().zip(&plan.assignments) {
        let expected: u64 = a
            .tensors
            .iter()
            .map(|t| file.tensor(t).expect("planned tensor").bytes)
            .sum();
        assert_eq!(w.addr, a.addr);
        assert_eq!((w.sent, w.total), (expected, expected), "{w:?}");
    }
    c.coordinator.shutdown().await;
    c.workers.shutdown().await;
}
