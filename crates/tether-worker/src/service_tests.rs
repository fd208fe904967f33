//! The gRPC edge end to end in one process: a real server on a loopback port, the domain
//! client, the fake model.

use crate::registry::{RegistryConfig, SessionRegistry};
use crate::server::{ServerOptions, serve};
use crate::testing::{FakeFactory, LAYER_TENSOR_BYTES, N_EMBD};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tether_client::{
    AdminClient, AttachOptions, ClientOptions, ErrorKind, LoadRequest, Session, TensorSource,
    WorkerClient,
};
use tether_protocol::TxnId;
use tether_protocol::{BlockSpec, ForwardInput, ForwardOutput, Rows, TokenPos};
use tether_protocol::{EndReason, Lease};
use tokio_util::sync::CancellationToken;

struct Tensors(HashMap<String, Vec<u8>>);

impl TensorSource for Tensors {
    fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        self.0.get(name).map(Vec::as_slice)
    }
}

struct Harness {
    addr: String,
    stop: CancellationToken,
    done: tokio::task::JoinHandle<()>,
}

async fn start(limit: u64) -> Harness {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let registry = Arc::new(SessionRegistry::new(
        Arc::new(FakeFactory { free: 1 << 30 }),
        limit,
        RegistryConfig::default(),
    ));
    let stop = CancellationToken::new();
    let options = ServerOptions {
        reap_period: Duration::from_millis(20),
        max_message_bytes: 1 << 20,
        ..ServerOptions::default()
    };
    let signal = stop.clone().cancelled_owned();
    let done = tokio::spawn(async move {
        serve(listener, registry, options, signal).await.unwrap();
    });
    Harness { addr, stop, done }
}

fn lease(ttl_ms: u64) -> Lease {
    Lease {
        heartbeat_interval: Duration::from_millis(ttl_ms / 5),
        ttl: Duration::from_millis(ttl_ms),
    }
}

fn load_request() -> (LoadRequest, Arc<dyn TensorSource>) {
    let spec = BlockSpec {
        first_layer: 0,
        last_layer: 3,
        has_embed: false,
        has_head: false,
        ctx_per_seq: 8,
        n_seq: 1,
        cached_seqs: 0,
        ubatch: 4,
        cache_k: tether_gguf::GgmlType::F16,
        cache_v: tether_gguf::GgmlType::F16,
    };
    let names: Vec<String> = (0..3).map(|i| format!("blk.{i}.w")).collect();
    let source = Tensors(
        names
            .iter()
            .map(|n| (n.clone(), vec![3u8; LAYER_TENSOR_BYTES as usize]))
            .collect(),
    );
    let req = LoadRequest {
        txn: TxnId::new_random(),
        gguf_header: b"fake-gguf".to_vec(),
        gguf_file_bytes: 9,
        spec,
        tensors: names,
        decision_timeout: None,
        chunk_bytes: 10,
        local_path: None,
        same_file: None,
    };
    (req, Arc::new(source))
}

/// A client of `addr` and a heartbeating session named `name` with a `ttl_ms` lease.
async fn attached(addr: &str, name: &str, ttl_ms: u64) -> (WorkerClient, Session) {
    let client = WorkerClient::connect(addr, &ClientOptions::default())
        .await
        .unwrap();
    let session = client
        .attach(AttachOptions {
            client_name: name.into(),
            lease: lease(ttl_ms),
            heartbeat: true,
        })
        .await
        .unwrap();
    (client, session)
}

async fn admin(addr: &str) -> AdminClient {
    AdminClient::connect(addr, None, &ClientOptions::default())
        .await
        .unwrap()
}

#[tokio::test]
async fn load_forward_close_over_grpc_frees_everything() {
    let h = start(1 << 20).await;
    let (client, session) = attached(&h.addr, "t", 2000).await;
    let (req, source) = load_request();
    let txn = req.txn;
    assert!(client.prepare(session.id(), req, source).await.unwrap() > 0);
    let tokens = [TokenPos { seq: 0, pos: 0 }];
    let err = client
        .forward(
            session.id(),
            &tokens,
            &ForwardInput::Hidden(vec![0.0; N_EMBD]),
            &[],
            Rows::Logits,
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
    client.commit(session.id(), txn).await.unwrap();
    client.commit(session.id(), txn).await.unwrap();
    let out = client
        .forward(
            session.id(),
            &tokens,
            &ForwardInput::Hidden(vec![1.0; N_EMBD]),
            &[],
            Rows::Logits,
        )
        .await
        .unwrap();
    assert_eq!(out, ForwardOutput::Hidden(vec![4.0; N_EMBD]));
    let err = client
        .forward(
            session.id(),
            &tokens,
            &ForwardInput::Hidden(vec![1.0; 3]),
            &[],
            Rows::Logits,
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    let oversized = vec![0.0f32; (1 << 20) / 4 + 16];
    let err = client
        .forward(
            session.id(),
            &tokens,
            &ForwardInput::Hidden(oversized),
            &[],
            Rows::Logits,
        )
        .await
        .unwrap_err();
    assert!(
        matches!(
            err.kind(),
            ErrorKind::ResourceExhausted | ErrorKind::InvalidArgument | ErrorKind::Internal
        ),
        "{err}"
    );
    assert!(
        client
            .forward(
                session.id(),
                &tokens,
                &ForwardInput::Hidden(vec![1.0; N_EMBD]),
                &[],
                Rows::Logits,
            )
            .await
            .is_ok()
    );
    assert!(admin(&h.addr).await.status().await.unwrap().session_bytes > 0);
    let end = session.close().await;
    assert_eq!(end.reason, EndReason::Closed);
    assert!(end.bytes_freed > 0);
    let status = admin(&h.addr).await.status().await.unwrap();
    assert_eq!(
        (
            status.sessions,
            status.session_bytes,
            status.counters.closed
        ),
        (0, 0, 1)
    );
    h.stop.cancel();
    h.done.await.unwrap();
}

#[tokio::test]
async fn dropped_client_and_silent_client_both_end() {
    let h = start(1 << 20).await;
    let client = WorkerClient::connect(&h.addr, &ClientOptions::default())
        .await
        .unwrap();
    let dropped = client
        .attach(AttachOptions {
            client_name: "gone".into(),
            lease: lease(60_000),
            heartbeat: true,
        })
        .await
        .unwrap();
    let (req, source) = load_request();
    client.prepare(dropped.id(), req, source).await.unwrap();
    drop(dropped);
    let mut zombie = client
        .attach(AttachOptions {
            client_name: "zombie".into(),
            lease: lease(300),
            heartbeat: false,
        })
        .await
        .unwrap();
    let end = tokio::time::timeout(Duration::from_secs(2), zombie.ended())
        .await
        .unwrap();
    assert_eq!(end.reason, EndReason::Reaped);
    let status = admin(&h.addr).await.status().await.unwrap();
    assert_eq!((status.sessions, status.session_bytes), (0, 0));
    assert_eq!(
        (status.counters.disconnected, status.counters.reaped),
        (1, 1)
    );
    h.stop.cancel();
    h.done.await.unwrap();
}

#[tokio::test]
async fn over_limit_prepare_kill_and_shutdown() {
    let h = start(100).await;
    let (client, mut session) = attached(&h.addr, "big", 60_000).await;
    let (req, source) = load_request();
    let err = client.prepare(session.id(), req, source).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ResourceExhausted);
    assert!(
        err.to_string().contains("asked") && err.to_string().contains("free"),
        "{err}"
    );
    let mut a = admin(&h.addr).await;
    assert_eq!(a.status().await.unwrap().session_bytes, 0);
    let err = client
        .commit(crate::SessionId::new_random(), TxnId::new_random())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound);
    assert_eq!(a.sessions().await.unwrap().len(), 1);
    a.kill(session.id()).await.unwrap();
    assert_eq!(session.ended().await.reason, EndReason::Killed);
    let mut last = client
        .attach(AttachOptions {
            client_name: "last".into(),
            lease: lease(60_000),
            heartbeat: true,
        })
        .await
        .unwrap();
    h.stop.cancel();
    assert_eq!(last.ended().await.reason, EndReason::Shutdown);
    h.done.await.unwrap();
}

#[tokio::test]
async fn a_refused_local_read_is_marked_over_grpc_and_streaming_then_works() {
    let h = start(1 << 20).await;
    let (client, session) = attached(&h.addr, "local", 60_000).await;
    let (req, source) = load_request();
    let local = LoadRequest {
        local_path: Some("/models/m.gguf".into()),
        ..req.clone()
    };
    let err = client
        .prepare(session.id(), local, Arc::clone(&source))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LocalFileRefused, "{err}");
    assert!(err.to_string().contains("--model-dir"), "{err}");
    let mut a = admin(&h.addr).await;
    assert_eq!(a.status().await.unwrap().session_bytes, 0);
    let streamed = LoadRequest {
        txn: TxnId::new_random(),
        ..req.clone()
    };
    let txn = streamed.txn;
    assert!(
        client
            .prepare(session.id(), streamed, Arc::clone(&source))
            .await
            .unwrap()
            > 0
    );
    client.commit(session.id(), txn).await.unwrap();
    // Other FAILED_PRECONDITION answers (here: the session already serves) carry no mark.
    let again = LoadRequest {
        txn: TxnId::new_random(),
        ..req
    };
    let err = client
        .prepare(session.id(), again, source)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
    h.stop.cancel();
    h.done.await.unwrap();
}

#[tokio::test]
async fn a_heartbeat_far_shorter_than_the_lease_is_refused_naming_both() {
    let h = start(1 << 20).await;
    let client = WorkerClient::connect(&h.addr, &ClientOptions::default())
        .await
        .unwrap();
    let asked = |heartbeat_ms, ttl_ms| AttachOptions {
        client_name: "beats".into(),
        lease: Lease {
            heartbeat_interval: Duration::from_millis(heartbeat_ms),
            ttl: Duration::from_millis(ttl_ms),
        },
        heartbeat: true,
    };
    // 10 ms beats on a 600 s lease: 300 such sessions took a fifth of a core.
    let Err(err) = client.attach(asked(10, 600_000)).await else {
        panic!("a 10 ms heartbeat on a 600 s lease was granted");
    };
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    let text = err.to_string();
    assert!(
        text.contains("10ms") && text.contains("600s") && text.contains("10s"),
        "{text}"
    );
    // The floor is 50 ms however short the lease...
    let Err(err) = client.attach(asked(20, 2_000)).await else {
        panic!("a 20 ms heartbeat was granted");
    };
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    // ... and at or above it a lease is granted.
    let session = client.attach(asked(50, 2_000)).await.unwrap();
    assert_eq!(
        session.lease().heartbeat_interval,
        Duration::from_millis(50)
    );
    let session10 = client.attach(asked(10_000, 600_000)).await.unwrap();
    drop((session, session10));
    h.stop.cancel();
    h.done.await.unwrap();
}

#[tokio::test]
async fn a_prepare_stream_without_begin_is_closed_after_the_deadline() {
    let h = start(1 << 20).await;
    let mut rpc =
        tether_proto::v1::worker_client::WorkerClient::connect(format!("http://{}", h.addr))
            .await
            .unwrap();
    let started = std::time::Instant::now();
    let never = futures::stream::pending::<tether_proto::v1::PrepareRequest>();
    let answer = tokio::time::timeout(Duration::from_secs(30), rpc.prepare(never))
        .await
        .expect("the worker held a Prepare stream without Begin for 30 s");
    let status = answer.unwrap_err();
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status}");
    assert!(status.message().contains("no Begin"), "{status}");
    assert!(started.elapsed() < Duration::from_secs(15));
    h.stop.cancel();
    h.done.await.unwrap();
}

#[tokio::test]
async fn a_header_over_the_message_limit_names_the_limit() {
    let h = start(1 << 20).await;
    let options = ClientOptions {
        max_message_bytes: 1 << 20,
        ..ClientOptions::default()
    };
    let client = WorkerClient::connect(&h.addr, &options).await.unwrap();
    let session = client
        .attach(AttachOptions {
            client_name: "big".into(),
            lease: lease(2000),
            heartbeat: true,
        })
        .await
        .unwrap();
    let (mut req, source) = load_request();
    req.gguf_header = vec![0u8; 2 << 20];
    let err = client.prepare(session.id(), req, source).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ResourceExhausted, "{err}");
    assert!(err.to_string().contains("1048576"), "{err}");
    assert!(!err.to_string().contains("h2 protocol"), "{err}");
    // The session is still usable for a load that fits.
    let (req, source) = load_request();
    assert!(client.prepare(session.id(), req, source).await.unwrap() > 0);
    h.stop.cancel();
    h.done.await.unwrap();
}

#[tokio::test]
async fn kv_copy_over_grpc_checks_its_sequences() {
    let h = start(1 << 20).await;
    let (client, session) = attached(&h.addr, "t", 2000).await;
    let (mut req, source) = load_request();
    req.spec.n_seq = 2;
    let txn = req.txn;
    client.prepare(session.id(), req, source).await.unwrap();
    client.commit(session.id(), txn).await.unwrap();
    let tokens = [TokenPos { seq: 0, pos: 0 }, TokenPos { seq: 0, pos: 1 }];
    client
        .forward(
            session.id(),
            &tokens,
            &ForwardInput::Hidden(vec![1.0; 2 * N_EMBD]),
            &[],
            Rows::Logits,
        )
        .await
        .unwrap();
    client.kv_copy(session.id(), 0, 1, 2).await.unwrap();
    for (src, dst, len, why) in [
        (0, 1, 3, "more than the source holds"),
        (0, 0, 1, "onto itself"),
        (0, 2, 1, "no such destination"),
        (2, 0, 1, "no such source"),
        (0, 1, 9, "past the context"),
    ] {
        let err = client
            .kv_copy(session.id(), src, dst, len)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{why}: {err}");
    }
    let err = client
        .kv_copy(tether_protocol::SessionId::new_random(), 0, 1, 1)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    session.close().await;
    h.stop.cancel();
    h.done.await.unwrap();
}
