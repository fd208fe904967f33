//! Registry behaviour with the fake model: sessions end however they end and give every
//! byte back.

use crate::load::PrepareBegin;
use crate::registry::{RegistryConfig, SessionRegistry};
use crate::staging::TensorDigest;
use crate::testing::{FakeFactory, LAYER_TENSOR_BYTES, N_EMBD};
use std::sync::Arc;
use std::time::Duration;
use tether_protocol::ForwardCall;
use tether_protocol::TxnId;
use tether_protocol::WorkerError;
use tether_protocol::{BlockSpec, ForwardInput, ForwardOutput, TokenPos};
use tether_protocol::{EndReason, Lease};
use tokio::time::Instant;

fn registry(limit: u64) -> Arc<SessionRegistry> {
    Arc::new(SessionRegistry::new(
        Arc::new(FakeFactory { free: 1 << 30 }),
        limit,
        RegistryConfig::default(),
    ))
}

fn lease(ttl_ms: u64) -> Lease {
    Lease {
        heartbeat_interval: Duration::from_millis(ttl_ms / 4),
        ttl: Duration::from_millis(ttl_ms),
    }
}

fn spec() -> BlockSpec {
    BlockSpec {
        first_layer: 0,
        last_layer: 2,
        has_embed: false,
        has_head: false,
        ctx_per_seq: 16,
        n_seq: 2,
        cached_seqs: 0,
        ubatch: 8,
        cache_k: tether_gguf::GgmlType::F16,
        cache_v: tether_gguf::GgmlType::F16,
    }
}

fn begin(session: crate::SessionId, txn: TxnId) -> PrepareBegin {
    let data = vec![7u8; LAYER_TENSOR_BYTES as usize];
    let tensors = (0..2)
        .map(|i| TensorDigest {
            name: format!("blk.{i}.w"),
            bytes: LAYER_TENSOR_BYTES,
            crc32: crc32fast::hash(&data),
        })
        .collect();
    PrepareBegin {
        session,
        txn,
        gguf_header: b"fake-gguf".to_vec(),
        gguf_file_bytes: 9,
        spec: spec(),
        tensors,
        decision_timeout: None,
        local_path: None,
        same_file: None,
    }
}

async fn load(reg: &Arc<SessionRegistry>, session: crate::SessionId) -> TxnId {
    let txn = TxnId::new_random();
    let mut upload = reg.begin_prepare(begin(session, txn)).await.unwrap();
    let data = vec![7u8; LAYER_TENSOR_BYTES as usize];
    for i in 0..2 {
        upload.accept(&format!("blk.{i}.w"), 0, &data).unwrap();
    }
    upload.finish().unwrap();
    txn
}

#[tokio::test]
async fn close_after_load_returns_every_byte() {
    let reg = registry(1 << 20);
    let ticket = reg.open("test", lease(1000)).unwrap();
    let txn = load(&reg, ticket.id).await;
    assert!(reg.status().session_bytes > 0);
    reg.commit(ticket.id, txn).unwrap();
    let out = reg
        .forward(
            ticket.id,
            ForwardCall {
                tokens: vec![TokenPos { seq: 0, pos: 0 }],
                input: ForwardInput::Hidden(vec![1.0; N_EMBD]),
                logits_rows: vec![],
                rows: crate::Rows::Logits,
                targets: Vec::new(),
            },
        )
        .await
        .unwrap();
    assert_eq!(
        out,
        ForwardOutput::Hidden(vec![3.0; N_EMBD]),
        "two fake layers add 2"
    );
    let end = reg.end(ticket.id, EndReason::Closed).unwrap();
    assert!(end.bytes_freed > 0);
    assert!(ticket.cancel.is_cancelled());
    assert_eq!(reg.status().session_bytes, 0);
    assert_eq!(reg.status().counters.closed, 1);
    assert!(
        reg.end(ticket.id, EndReason::Closed).is_none(),
        "ending twice is a no-op"
    );
}

#[tokio::test]
async fn forward_before_commit_and_unknown_session_are_refused() {
    let reg = registry(1 << 20);
    let ticket = reg.open("test", lease(1000)).unwrap();
    let call = ForwardCall {
        tokens: vec![TokenPos { seq: 0, pos: 0 }],
        input: ForwardInput::Hidden(vec![0.0; N_EMBD]),
        logits_rows: vec![],
        rows: crate::Rows::Logits,
        targets: Vec::new(),
    };
    assert!(matches!(
        reg.forward(ticket.id, call.clone()).await,
        Err(WorkerError::FailedPrecondition(_))
    ));
    let txn = load(&reg, ticket.id).await;
    assert!(matches!(
        reg.forward(ticket.id, call.clone()).await,
        Err(WorkerError::FailedPrecondition(_))
    ));
    reg.commit(ticket.id, txn).unwrap();
    let bad_size = ForwardCall {
        input: ForwardInput::Hidden(vec![0.0; 3]),
        ..call.clone()
    };
    assert!(matches!(
        reg.forward(ticket.id, bad_size).await,
        Err(WorkerError::InvalidArgument(_))
    ));
    let bad_pos = ForwardCall {
        tokens: vec![TokenPos { seq: 0, pos: 16 }],
        ..call.clone()
    };
    assert!(matches!(
        reg.forward(ticket.id, bad_pos).await,
        Err(WorkerError::InvalidArgument(_))
    ));
    let bad_seq = ForwardCall {
        tokens: vec![TokenPos { seq: 2, pos: 0 }],
        ..call.clone()
    };
    assert!(matches!(
        reg.forward(ticket.id, bad_seq).await,
        Err(WorkerError::InvalidArgument(_))
    ));
    assert!(matches!(
        reg.forward(crate::SessionId::new_random(), call.clone())
            .await,
        Err(WorkerError::NotFound(_))
    ));
    assert!(
        reg.forward(ticket.id, call).await.is_ok(),
        "the session carries on after bad requests"
    );
}

#[tokio::test]
async fn prepare_over_the_limit_is_refused_with_nothing_staged() {
    let reg = registry(100);
    let ticket = reg.open("test", lease(1000)).unwrap();
    let err = reg
        .begin_prepare(begin(ticket.id, TxnId::new_random()))
        .await
        .err()
        .unwrap();
    assert!(
        matches!(err, WorkerError::ResourceExhausted { asked, free: 100, .. } if asked > 100),
        "{err:?}"
    );
    assert_eq!(reg.status().session_bytes, 0);
    assert_eq!(reg.sessions()[0].prepared_txns, 0);
    // The failed transaction does not block the next one.
    assert!(
        reg.begin_prepare(begin(ticket.id, TxnId::new_random()))
            .await
            .is_err()
    );
}

#[tokio::test]
async fn dropped_upload_frees_its_reservation() {
    let reg = registry(1 << 20);
    let ticket = reg.open("test", lease(1000)).unwrap();
    let upload = reg
        .begin_prepare(begin(ticket.id, TxnId::new_random()))
        .await
        .unwrap();
    assert!(reg.status().session_bytes > 0);
    drop(upload);
    assert_eq!(reg.status().session_bytes, 0);
    load(&reg, ticket.id).await;
}

#[tokio::test(start_paused = true)]
async fn silent_sessions_are_reaped_after_their_ttl() {
    let reg = registry(1 << 20);
    let quiet = reg.open("quiet", lease(500)).unwrap();
    let chatty = reg.open("chatty", lease(500)).unwrap();
    load(&reg, quiet.id).await;
    tokio::time::advance(Duration::from_millis(400)).await;
    reg.heartbeat(chatty.id).unwrap();
    assert_eq!(reg.reap_expired(Instant::now()), 0);
    tokio::time::advance(Duration::from_millis(100)).await;
    assert_eq!(reg.reap_expired(Instant::now()), 1);
    assert_eq!(quiet.end.get().map(|e| e.reason), Some(EndReason::Reaped));
    assert!(chatty.end.get().is_none());
    assert_eq!(reg.status().session_bytes, 0);
    assert_eq!(reg.status().counters.reaped, 1);
}

#[tokio::test(start_paused = true)]
async fn undecided_prepare_is_aborted_by_the_reaper() {
    let reg = registry(1 << 20);
    let ticket = reg.open("test", lease(60_000)).unwrap();
    let txn = load(&reg, ticket.id).await;
    assert!(reg.status().session_bytes > 0);
    tokio::time::advance(reg.config().decision_timeout).await;
    reg.heartbeat(ticket.id).unwrap();
    reg.reap_expired(Instant::now());
    assert_eq!(reg.status().session_bytes, 0);
    assert_eq!(reg.status().counters.txn_timed_out, 1);
    assert!(matches!(
        reg.commit(ticket.id, txn),
        Err(WorkerError::FailedPrecondition(_))
    ));
}

#[tokio::test]
async fn shutdown_ends_everything_and_refuses_new_sessions() {
    let reg = registry(1 << 20);
    let a = reg.open("a", lease(1000)).unwrap();
    let b = reg.open("b", lease(1000)).unwrap();
    load(&reg, a.id).await;
    assert_eq!(reg.shutdown(), 2);
    assert_eq!(a.end.get().map(|e| e.reason), Some(EndReason::Shutdown));
    assert!(b.cancel.is_cancelled());
    assert_eq!(reg.status().session_bytes, 0);
    assert!(matches!(
        reg.open("c", lease(1000)),
        Err(WorkerError::Unavailable(_))
    ));
}

#[tokio::test]
async fn drain_refuses_new_sessions_but_keeps_current_ones() {
    let reg = registry(1 << 20);
    let a = reg.open("a", lease(1000)).unwrap();
    assert_eq!(reg.drain(), 1);
    assert!(matches!(
        reg.open("b", lease(1000)),
        Err(WorkerError::Unavailable(_))
    ));
    reg.heartbeat(a.id).unwrap();
    assert!(reg.kill(a.id).is_ok());
    assert!(matches!(reg.kill(a.id), Err(WorkerError::NotFound(_))));
}

#[tokio::test]
async fn undrain_takes_sessions_again_but_not_after_shutdown() {
    let reg = registry(1 << 20);
    assert!(!reg.undrain().unwrap(), "it was not draining");
    reg.drain();
    assert!(reg.open("a", lease(1000)).is_err());
    assert!(reg.undrain().unwrap(), "it was draining");
    assert!(!reg.status().draining);
    reg.open("a", lease(1000)).unwrap();
    reg.shutdown();
    assert!(matches!(reg.undrain(), Err(WorkerError::Unavailable(_))));
    assert!(reg.open("b", lease(1000)).is_err());
}

#[tokio::test]
async fn lease_is_clamped_to_the_limits() {
    let reg = registry(1 << 20);
    let t = reg
        .open(
            "x",
            Lease {
                heartbeat_interval: Duration::from_secs(100),
                ttl: Duration::from_millis(1),
            },
        )
        .unwrap();
    assert_eq!(t.lease.ttl, reg.config().min_ttl);
    assert!(t.lease.heartbeat_interval <= t.lease.ttl / 2);
}

#[test]
fn session_limits_refuse_with_resource_exhausted_and_free_up_on_close() {
    let config = RegistryConfig {
        max_sessions: Some(3),
        max_sessions_per_client: Some(2),
        ..RegistryConfig::default()
    };
    let reg = SessionRegistry::new(Arc::new(FakeFactory { free: 1 << 30 }), 1 << 20, config);
    let a1 = reg.open("a", lease(1000)).unwrap();
    let _a2 = reg.open("a", lease(1000)).unwrap();
    let Err(err) = reg.open("a", lease(1000)) else {
        panic!("a third session of client a was admitted");
    };
    assert!(matches!(err, WorkerError::OverLimit(_)), "{err}");
    assert!(
        err.to_string().contains("--max-sessions-per-client 2"),
        "{err}"
    );
    let _b1 = reg.open("b", lease(1000)).unwrap();
    let Err(err) = reg.open("c", lease(1000)) else {
        panic!("a fourth session was admitted");
    };
    assert!(err.to_string().contains("--max-sessions 3"), "{err}");
    assert_eq!(reg.status().sessions, 3, "refusals open nothing");
    reg.end(a1.id, EndReason::Closed).expect("ended");
    reg.open("a", lease(1000)).expect("a slot is free again");
}

#[tokio::test]
async fn a_session_ended_mid_upload_frees_its_block_before_it_is_reported_gone() {
    let reg = registry(1 << 20);
    let ticket = reg.open("test", lease(1000)).unwrap();
    let mut upload = reg
        .begin_prepare(begin(ticket.id, TxnId::new_random()))
        .await
        .unwrap();
    let data = vec![7u8; LAYER_TENSOR_BYTES as usize];
    upload.accept("blk.0.w", 0, &data).unwrap();
    let staged = reg.status().session_bytes;
    assert!(staged > 0);
    // The client went away mid-upload; its handler has not yet seen the end.
    let end = reg.end(ticket.id, EndReason::Disconnected).unwrap();
    assert_eq!(end.bytes_freed, staged);
    let status = reg.status();
    assert_eq!(
        (status.sessions, status.session_bytes),
        (0, 0),
        "the ended session's staged block must be freed when the end is reported"
    );
    let err = upload.accept("blk.1.w", 0, &data).unwrap_err();
    assert!(
        matches!(err, WorkerError::Aborted(_)) && err.to_string().contains("ended"),
        "{err}"
    );
    drop(upload);
    assert_eq!(reg.status().session_bytes, 0);
    assert_eq!(
        reg.metrics.txn_count(crate::metrics::TxnOp::Prepare, false),
        1,
        "the failed Prepare is counted once"
    );
}

#[tokio::test]
async fn a_session_ended_before_its_prepare_finishes_gets_no_vote() {
    let reg = registry(1 << 20);
    let ticket = reg.open("test", lease(1000)).unwrap();
    let mut upload = reg
        .begin_prepare(begin(ticket.id, TxnId::new_random()))
        .await
        .unwrap();
    let data = vec![7u8; LAYER_TENSOR_BYTES as usize];
    for i in 0..2 {
        upload.accept(&format!("blk.{i}.w"), 0, &data).unwrap();
    }
    reg.end(ticket.id, EndReason::Reaped).unwrap();
    assert!(matches!(upload.finish(), Err(WorkerError::Aborted(_))));
    let status = reg.status();
    assert_eq!((status.sessions, status.session_bytes), (0, 0));
    assert_eq!(
        reg.metrics.txn_count(crate::metrics::TxnOp::Prepare, false),
        1
    );
}

#[tokio::test]
async fn a_prepare_of_an_ended_session_reserves_nothing() {
    let reg = registry(1 << 20);
    let ticket = reg.open("test", lease(1000)).unwrap();
    let session_bytes = Arc::clone(&reg.lock().sessions[&ticket.id].bytes);
    reg.end(ticket.id, EndReason::Closed).unwrap();
    let err = reg
        .reserve_for(ticket.id, &session_bytes, 1024, "test")
        .unwrap_err();
    assert!(matches!(err, WorkerError::Aborted(_)), "{err}");
    assert_eq!(reg.status().session_bytes, 0);
}

#[tokio::test]
async fn an_ended_session_counts_while_something_else_still_holds_its_bytes() {
    let reg = registry(1 << 20);
    let ticket = reg.open("test", lease(1000)).unwrap();
    let session_bytes = Arc::clone(&reg.lock().sessions[&ticket.id].bytes);
    // What a block being built for a Prepare (or a forward pass in flight) holds.
    let held = reg
        .reserve_for(ticket.id, &session_bytes, 4096, "test")
        .unwrap();
    reg.end(ticket.id, EndReason::Disconnected).unwrap();
    let status = reg.status();
    assert_eq!((status.sessions, status.session_bytes), (1, 4096));
    drop(held);
    let status = reg.status();
    assert_eq!((status.sessions, status.session_bytes), (0, 0));
}
