//! The coordinator's answer to a changed worker list (what `--worker-dns` publishes): the
//! running request ends with a clear error, the old worker's session is freed, and the
//! model is loaded again over the new list.

use crate::api::{GenError, GenEvent, GenRequest, Generation, Health};
use crate::{Coordinator, CoordinatorConfig, ModelFile};
use std::time::{Duration, Instant};
use tether_client::ClientOptions;
use tether_gguf::GgmlType;
use tether_model::SynthShape;
use tether_worker::embedded::{LocalOptions, LocalWorkers};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Polls `ready` every 20 ms for up to 30 s.
async fn wait_until(what: &str, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{what} within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_worker_list_moves_the_model_to_the_new_workers() {
    let dir = std::env::temp_dir().join(format!("tether-discovery-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir is writable");
    let path = dir.join("tiny.gguf");
    tether_model::synthesize(&path, SynthShape::Tiny, GgmlType::F32, 5).expect("tiny model");
    let options = LocalOptions {
        threads: Some(2),
        max_memory: Some(1 << 30),
        gpus: Vec::new(),
        ..LocalOptions::default()
    };
    let workers = LocalWorkers::start(2, &options).await.expect("workers");
    let (old, new) = (&workers.workers[0], &workers.workers[1]);
    let model = ModelFile::open(&path).expect("model opens");
    let mut config = CoordinatorConfig::new(&model, vec![old.addr().to_string()]);
    config.client = ClientOptions::with_token(workers.token().clone());
    config.ctx_per_seq = 256;
    config.ubatch = 8;
    config.retry_every = Duration::from_millis(50);
    let (list, list_rx) = watch::channel(config.workers.clone());
    let coordinator =
        Coordinator::start_over(model, config, list_rx, CancellationToken::new(), Vec::new())
            .await
            .expect("coordinator starts");
    assert_eq!(old.status().sessions, 1);

    let request = GenRequest::greedy(&[1, 17, 42], 240);
    let mut events = coordinator.submit(request).expect("submitted");
    let first = tokio::time::timeout(Duration::from_secs(30), events.recv()).await;
    assert!(
        matches!(first, Ok(Some(Ok(GenEvent::Token(_))))),
        "{first:?}"
    );
    list.send(vec![new.addr().to_string()])
        .expect("the coordinator watches the list");
    let ended = loop {
        match tokio::time::timeout(Duration::from_secs(30), events.recv()).await {
            Ok(Some(Ok(GenEvent::Token(_)))) => continue,
            other => break other,
        }
    };
    match ended {
        Ok(Some(Err(GenError::Unavailable(why)))) => {
            assert!(why.contains("worker list changed"), "{why}");
        }
        other => panic!("the running request should end with Unavailable: {other:?}"),
    }

    wait_until("the model on the new worker", || {
        coordinator.health() == Health::Ready
            && coordinator
                .plan()
                .is_some_and(|p| p.assignments.iter().all(|a| a.addr == new.addr()))
    })
    .await;
    wait_until("the old worker's session freed", || {
        old.status().sessions == 0
    })
    .await;
    assert_eq!(new.status().sessions, 1);

    coordinator.shutdown().await;
    workers.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}
