//! Failures: a worker that refuses Prepare leaves nothing loaded anywhere; a worker lost
//! mid-generation fails the in-flight requests, and the model is loaded again over the
//! workers that remain.

mod support;

use std::time::Duration;
use support::{TempDir, cluster, collect, generate, greedy, prompt, reference, tiny_model};
use tether_client::{AdminClient, ClientOptions, WorkerClient};
use tether_coordinator::api::{GenError, GenEvent, Generation, Health};
use tether_coordinator::load::{LoadError, LoadOptions, load_plan};
use tether_coordinator::placement::{ServeShape, WorkerCapacity, place};
use tether_coordinator::{Coordinator, CoordinatorConfig, CoordinatorError, ModelFile};
use tether_protocol::BearerToken;
use tether_worker::embedded::LocalWorker;

/// Sessions and bytes of the worker at `addr`, asking with `token` (an embedded cluster's).
async fn sessions_and_bytes(addr: &str, token: Option<&BearerToken>) -> (u32, u64) {
    let token = token.map(|t| t.expose().to_string());
    let mut admin = AdminClient::connect(addr, token, &ClientOptions::default())
        .await
        .expect("admin connect");
    let status = admin.status().await.expect("status");
    (status.sessions, status.session_bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_prepare_aborts_everywhere() {
    let dir = TempDir::new("refused");
    let path = tiny_model(&dir, 21);
    let big = Some(1 << 30);
    let workers = vec![
        LocalWorker::start(0, Some(1), big, None)
            .await
            .expect("worker 0"),
        LocalWorker::start(1, Some(1), Some(10_000), None)
            .await
            .expect("worker 1"),
        LocalWorker::start(2, Some(1), big, None)
            .await
            .expect("worker 2"),
    ];
    let addrs: Vec<String> = workers.iter().map(|w| w.addr().to_string()).collect();
    let small = addrs[1].clone();
    let model = ModelFile::open(&path).expect("model");

    // Placement would refuse the small worker itself; tell it every worker is large so the
    // refusal comes from the worker's Prepare.
    let capacity: Vec<WorkerCapacity> = addrs
        .iter()
        .map(|a| WorkerCapacity {
            addr: a.clone(),
            free_bytes: u64::MAX,
        })
        .collect();
    let shape = ServeShape {
        ctx_per_seq: 128,
        n_seq: 2,
        cached_seqs: 0,
        ubatch: 8,
        cache_k: tether_gguf::GgmlType::F16,
        cache_v: tether_gguf::GgmlType::F16,
    };
    let plan = place(
        model.config(),
        model.gguf().tensors(),
        shape,
        &capacity,
        None,
    )
    .expect("plan");
    let mut clients = Vec::new();
    for a in &addrs {
        clients.push(
            WorkerClient::connect(a, &ClientOptions::default())
                .await
                .expect("connect"),
        );
    }
    let err = match load_plan(&model, &plan, &clients, &LoadOptions::default()).await {
        Ok(_) => panic!("a worker with 10 kB cannot load its block"),
        Err(e) => e,
    };
    assert!(matches!(err, LoadError::Refused { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains(&small), "the message names {small}: {text}");
    for a in &addrs {
        assert_eq!(
            sessions_and_bytes(a, None).await,
            (0, 0),
            "worker {a} keeps something"
        );
    }

    // Through the coordinator, placement refuses first and names the same worker.
    let config = CoordinatorConfig {
        ctx_per_seq: 128,
        ubatch: 8,
        ..CoordinatorConfig::new(&model, addrs.clone())
    };
    let err = match Coordinator::start(model, config).await {
        Ok(_) => panic!("the coordinator cannot start"),
        Err(e) => e,
    };
    assert!(matches!(err, CoordinatorError::Placement(_)), "{err}");
    assert!(err.to_string().contains(&small), "{err}");
    for a in &addrs {
        assert_eq!(
            sessions_and_bytes(a, None).await,
            (0, 0),
            "worker {a} keeps something"
        );
    }
    for w in workers {
        w.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_worker_fails_requests_and_the_model_comes_back() {
    let dir = TempDir::new("lost");
    let path = tiny_model(&dir, 22);
    let mut c = cluster(&path, 2, |cfg| {
        cfg.ctx_per_seq = 512;
        cfg.retry_every = Duration::from_millis(1500);
    })
    .await;
    let prompt = prompt(&path, "Once upon a time");
    let mut rx = c.coordinator.submit(greedy(&prompt, 500)).expect("submit");
    let first = tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .expect("a first token");
    assert!(matches!(first, Some(Ok(GenEvent::Token(_)))), "{first:?}");
    let lost = c.workers.workers.remove(1);
    let lost_addr = lost.addr().to_string();
    lost.shutdown().await;

    let (_, end) = collect(rx).await;
    match end {
        Err(GenError::Unavailable(why)) => assert!(why.contains(&lost_addr), "{why}"),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    match c.coordinator.health() {
        Health::Unavailable(why) => assert!(why.contains(&lost_addr), "{why}"),
        Health::Ready => panic!("health must say the model is not served"),
    }
    assert!(matches!(
        c.coordinator.submit(greedy(&prompt, 4)),
        Err(GenError::Unavailable(_))
    ));
    // The remaining worker is the whole model now, and is loaded again.
    let (remaining, _) =
        sessions_and_bytes(c.workers.workers[0].addr(), Some(c.workers.token())).await;
    assert!(remaining <= 1);
    support::wait_until_loaded_again(&c.coordinator, 1).await;
    let expected = reference(&path, &prompt, 16, 512);
    let (tokens, end) = generate(&c.coordinator, &prompt, 16).await;
    assert!(end.is_ok(), "{end:?}");
    assert_eq!(tokens, expected);
    c.coordinator.shutdown().await;
    let (sessions, bytes) =
        sessions_and_bytes(c.workers.workers[0].addr(), Some(c.workers.token())).await;
    assert_eq!((sessions, bytes), (0, 0), "shutdown closes every session");
    c.workers.shutdown().await;
}
