//! Metrics, health and unaccounted bytes with the fake model: every series moves when the
//! thing it counts happens, and health follows drain and shutdown.

use crate::load::PrepareBegin;
use crate::registry::{RegistryConfig, SessionRegistry};
use crate::server::{ServerOptions, serve};
use crate::stage::{PlannedStage, StageFactory};
use crate::staging::TensorDigest;
use crate::testing::{FakeFactory, LAYER_TENSOR_BYTES, N_EMBD};
use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tether_protocol::ForwardCall;
use tether_protocol::Result;
use tether_protocol::TxnId;
use tether_protocol::{BlockSpec, ForwardInput, TokenPos};
use tether_protocol::{EndReason, Lease};
use tokio_util::sync::CancellationToken;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// The value of one series (name with its labels, as printed) in exposition text.
pub(crate) fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

fn registry(limit: u64) -> Arc<SessionRegistry> {
    Arc::new(SessionRegistry::new(
        Arc::new(FakeFactory { free: 1 << 30 }),
        limit,
        RegistryConfig::default(),
    ))
}

fn lease() -> Lease {
    Lease {
        heartbeat_interval: Duration::from_millis(200),
        ttl: Duration::from_secs(5),
    }
}

fn begin(session: crate::SessionId, txn: TxnId) -> PrepareBegin {
    let data = vec![7u8; LAYER_TENSOR_BYTES as usize];
    PrepareBegin {
        session,
        txn,
        gguf_header: b"fake-gguf".to_vec(),
        gguf_file_bytes: 9,
        spec: BlockSpec {
            first_layer: 0,
            last_layer: 2,
            has_embed: false,
            has_head: false,
            ctx_per_seq: 16,
            n_seq: 1,
            cached_seqs: 0,
            ubatch: 4,
            cache_k: tether_gguf::GgmlType::F16,
            cache_v: tether_gguf::GgmlType::F16,
        },
        tensors: (0..2)
            .map(|i| TensorDigest {
                name: format!("blk.{i}.w"),
                bytes: LAYER_TENSOR_BYTES,
                crc32: crc32fast::hash(&data),
            })
            .collect(),
        decision_timeout: None,
        local_path: None,
        same_file: None,
    }
}

async fn prepare(reg: &Arc<SessionRegistry>, session: crate::SessionId) -> (TxnId, u64) {
    let txn = TxnId::new_random();
    let mut upload = reg.begin_prepare(begin(session, txn)).await.unwrap();
    let data = vec![7u8; LAYER_TENSOR_BYTES as usize];
    for i in 0..2 {
        upload.accept(&format!("blk.{i}.w"), 0, &data).unwrap();
    }
    (txn, upload.finish().unwrap().0)
}

fn txn_series(op: &str, result: &str) -> String {
    format!("tether_txn_total{{op=\"{op}\",result=\"{result}\"}}")
}

#[tokio::test]
async fn metrics_follow_a_session_through_load_forward_and_close() {
    let reg = registry(1 << 20);
    let before = reg.prometheus_text();
    assert_eq!(sample(&before, "tether_sessions"), Some(0.0));
    assert_eq!(sample(&before, "tether_forward_seconds_count"), Some(0.0));
    assert_eq!(sample(&before, &txn_series("prepare", "ok")), Some(0.0));

    let ticket = reg.open("metrics-client", lease()).unwrap();
    let (txn, reserved) = prepare(&reg, ticket.id).await;
    reg.commit(ticket.id, txn).unwrap();
    // Commit is idempotent; the second one counts as ok too.
    reg.commit(ticket.id, txn).unwrap();
    for _ in 0..3 {
        reg.forward(
            ticket.id,
            ForwardCall {
                tokens: vec![TokenPos { seq: 0, pos: 0 }],
                input: ForwardInput::Hidden(vec![0.0; N_EMBD]),
                logits_rows: vec![],
                rows: crate::Rows::Logits,
                targets: Vec::new(),
            },
        )
        .await
        .unwrap();
    }
    let live = reg.prometheus_text();
    let session_series = format!(
        "tether_session_bytes{{session=\"{}\",client=\"metrics-client\"}}",
        ticket.id
    );
    assert_eq!(sample(&live, &session_series), Some(reserved as f64));
    assert_eq!(sample(&live, "tether_sessions"), Some(1.0));
    assert_eq!(sample(&live, &txn_series("prepare", "ok")), Some(1.0));
    assert_eq!(sample(&live, &txn_series("commit", "ok")), Some(2.0));
    assert_eq!(sample(&live, "tether_forward_seconds_count"), Some(3.0));
    assert_eq!(
        sample(&live, "tether_forward_seconds_bucket{le=\"+Inf\"}"),
        Some(3.0)
    );
    assert!(sample(&live, "tether_forward_seconds_sum").is_some_and(|s| s > 0.0));

    reg.end(ticket.id, EndReason::Closed).unwrap();
    let after = reg.prometheus_text();
    assert_eq!(sample(&after, &session_series), None, "{after}");
    assert_eq!(sample(&after, "tether_sessions"), Some(0.0));
    assert_eq!(
        sample(&after, "tether_sessions_ended_total{reason=\"closed\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample(&after, "tether_sessions_ended_total{reason=\"killed\"}"),
        Some(0.0)
    );
    assert_eq!(sample(&after, "tether_unaccounted_bytes"), Some(0.0));
}

#[tokio::test]
async fn refused_steps_are_counted_as_refused() {
    let reg = registry(64);
    let ticket = reg.open("refused", lease()).unwrap();
    // Two 64-byte layers and a KV cache do not fit in 64 bytes.
    assert!(
        reg.begin_prepare(begin(ticket.id, TxnId::new_random()))
            .await
            .is_err()
    );
    // Unknown session: refused before anything is staged.
    assert!(
        reg.begin_prepare(begin(crate::SessionId::new_random(), TxnId::new_random()))
            .await
            .is_err()
    );
    assert!(reg.commit(ticket.id, TxnId::new_random()).is_err());
    let unknown_abort = reg.abort(ticket.id, TxnId::new_random());
    let text = reg.prometheus_text();
    assert_eq!(sample(&text, &txn_series("prepare", "refused")), Some(2.0));
    assert_eq!(sample(&text, &txn_series("prepare", "ok")), Some(0.0));
    assert_eq!(sample(&text, &txn_series("commit", "refused")), Some(1.0));
    let abort_result = if unknown_abort.is_ok() {
        "ok"
    } else {
        "refused"
    };
    assert_eq!(sample(&text, &txn_series("abort", abort_result)), Some(1.0));
}

#[tokio::test]
async fn reaped_and_killed_sessions_are_counted_by_reason() {
    let reg = registry(1 << 20);
    let zombie = reg.open("zombie", lease()).unwrap();
    let victim = reg.open("victim", lease()).unwrap();
    reg.kill(victim.id).unwrap();
    let later = tokio::time::Instant::now() + Duration::from_secs(60);
    assert_eq!(reg.reap_expired(later), 1);
    let text = reg.prometheus_text();
    assert_eq!(sample(&text, "tether_reaped_total"), Some(1.0));
    assert_eq!(
        sample(&text, "tether_sessions_ended_total{reason=\"reaped\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "tether_sessions_ended_total{reason=\"killed\"}"),
        Some(1.0)
    );
    assert!(reg.end(zombie.id, EndReason::Closed).is_none());
}

/// The fake device, but its memory is this process's heap, as the cpu device's is.
struct HostFake(FakeFactory);

impl StageFactory for HostFake {
    fn device_name(&self) -> String {
        "host-fake".into()
    }
    fn memory_info(&self) -> Result<(u64, u64)> {
        self.0.memory_info()
    }
    fn holds_host_memory(&self) -> bool {
        true
    }
    fn plan(&self, h: &[u8], n: u64, spec: &BlockSpec) -> Result<Box<dyn PlannedStage>> {
        self.0.plan(h, n, spec)
    }
}

#[test]
fn memory_held_outside_sessions_shows_as_unaccounted_on_a_host_device() {
    if !cfg!(target_os = "linux") {
        return;
    }
    let reg = SessionRegistry::new(
        Arc::new(HostFake(FakeFactory { free: 1 << 30 })),
        1 << 20,
        RegistryConfig::default(),
    );
    let before = reg.status();
    assert!(before.baseline_rss_bytes > 0);
    // A leak: 128 MiB written outside any session. Other tests of this process allocate
    // and free (and trim the heap) at the same time, moving the process's resident memory
    // by tens of MiB, so the leak must show nearly whole in one of a few tries.
    let mut grew = Vec::new();
    let mut leak = Vec::new();
    for _ in 0..3 {
        let start = reg.status().unaccounted_bytes;
        leak = vec![1u8; 128 << 20];
        std::hint::black_box(&leak);
        grew.push(reg.status().unaccounted_bytes.saturating_sub(start));
        if grew.last().is_some_and(|&g| g >= 96 << 20) {
            break;
        }
        drop(std::mem::take(&mut leak));
    }
    assert!(
        grew.iter().any(|&g| g >= 96 << 20),
        "unaccounted grew by only {grew:?} bytes"
    );
    let text = reg.prometheus_text();
    assert!(
        sample(&text, "tether_unaccounted_bytes").is_some_and(|v| v >= (96u64 << 20) as f64),
        "{text}"
    );
    assert_eq!(
        sample(&text, "tether_process_resident_bytes{when=\"baseline\"}"),
        Some(before.baseline_rss_bytes as f64)
    );
    drop(leak);
}

/// The fake device shared with another process: the device's used bytes move with both,
/// the driver's per-process count (when `per_process`) only with this one.
struct SharedGpuFake {
    fake: FakeFactory,
    per_process: bool,
    others: std::sync::atomic::AtomicU64,
    own: std::sync::atomic::AtomicU64,
}

impl SharedGpuFake {
    const TOTAL: u64 = 80 << 30;
    fn new(per_process: bool) -> Self {
        Self {
            fake: FakeFactory { free: 1 << 30 },
            per_process,
            others: (3 << 30).into(),
            own: (500 << 20).into(),
        }
    }
}

impl StageFactory for SharedGpuFake {
    fn device_name(&self) -> String {
        "shared-gpu-fake".into()
    }
    fn memory_info(&self) -> Result<(u64, u64)> {
        use std::sync::atomic::Ordering::Relaxed;
        let used = self.others.load(Relaxed) + self.own.load(Relaxed);
        Ok((Self::TOTAL, Self::TOTAL - used))
    }
    fn process_device_bytes(&self) -> Option<u64> {
        self.per_process
            .then(|| self.own.load(std::sync::atomic::Ordering::Relaxed))
    }
    fn plan(&self, h: &[u8], n: u64, spec: &BlockSpec) -> Result<Box<dyn PlannedStage>> {
        self.fake.plan(h, n, spec)
    }
}

#[test]
fn another_process_on_the_gpu_is_not_unaccounted_when_the_driver_counts_per_process() {
    use std::sync::atomic::Ordering::Relaxed;
    use tether_protocol::MemorySource;
    let factory = Arc::new(SharedGpuFake::new(true));
    let reg = SessionRegistry::new(factory.clone(), 1 << 20, RegistryConfig::default());
    let start = reg.status();
    assert_eq!(start.memory_source, MemorySource::DriverPerProcess);
    assert_eq!(start.baseline_process_device_bytes, 500 << 20);
    // A second worker loads 20 GiB on the same GPU: not this worker's memory.
    factory.others.fetch_add(20 << 30, Relaxed);
    assert_eq!(reg.status().unaccounted_bytes, 0);
    // This process takes 300 MiB outside any session: that is a leak.
    factory.own.fetch_add(300 << 20, Relaxed);
    let leaked = reg.status();
    assert_eq!(leaked.unaccounted_bytes, 300 << 20);
    assert_eq!(leaked.process_device_bytes, 800 << 20);
    let text = reg.prometheus_text();
    assert_eq!(
        sample(&text, "tether_unaccounted_bytes"),
        Some((300u64 << 20) as f64)
    );
    assert_eq!(
        sample(
            &text,
            "tether_unaccounted_source{source=\"driver_per_process\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "tether_process_device_bytes{when=\"start\"}"),
        Some((500u64 << 20) as f64)
    );
    // Through the wire form and back, as tetherctl sees it.
    let back =
        tether_protocol::grpc::status_from_proto(tether_protocol::grpc::status_to_proto(&leaked));
    assert_eq!(back, leaked);
}

#[test]
fn without_a_per_process_count_the_device_used_bytes_are_what_is_unaccounted() {
    use std::sync::atomic::Ordering::Relaxed;
    use tether_protocol::MemorySource;
    let factory = Arc::new(SharedGpuFake::new(false));
    let reg = SessionRegistry::new(factory.clone(), 1 << 20, RegistryConfig::default());
    factory.others.fetch_add(1 << 30, Relaxed);
    let s = reg.status();
    assert_eq!(s.memory_source, MemorySource::DeviceUsed);
    assert_eq!(s.unaccounted_bytes, 1 << 30);
    assert_eq!(s.process_device_bytes, 0);
    assert!(
        !reg.prometheus_text()
            .contains("tether_process_device_bytes{")
    );
}

async fn health(
    client: &mut HealthClient<tonic::transport::Channel>,
    service: &str,
) -> std::result::Result<i32, tonic::Code> {
    client
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .map(|r| r.into_inner().status)
        .map_err(|s| s.code())
}

async fn next_status(watch: &mut tonic::Streaming<tonic_health::pb::HealthCheckResponse>) -> i32 {
    let next = tokio::time::timeout(Duration::from_secs(5), watch.next()).await;
    next.expect("the watch answers in time")
        .expect("the watch stays open")
        .expect("the watch sends a status")
        .status
}

#[tokio::test]
async fn health_is_serving_until_drain_and_watch_ends_at_shutdown() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let reg = registry(1 << 20);
    let stop = CancellationToken::new();
    let signal = stop.clone().cancelled_owned();
    let server = tokio::spawn(serve(
        listener,
        Arc::clone(&reg),
        ServerOptions::default(),
        signal,
    ));
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = HealthClient::new(channel);
    let serving = ServingStatus::Serving as i32;
    let not_serving = ServingStatus::NotServing as i32;
    assert_eq!(health(&mut client, "").await, Ok(serving));
    assert_eq!(health(&mut client, "tether.v1.Worker").await, Ok(serving));
    assert_eq!(
        health(&mut client, "no.such.Service").await,
        Err(tonic::Code::NotFound)
    );
    let mut watch = client
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = next_status(&mut watch).await;
    assert_eq!(first, serving);

    reg.drain();
    assert_eq!(health(&mut client, "").await, Ok(not_serving));
    assert_eq!(next_status(&mut watch).await, not_serving);

    stop.cancel();
    // The watch ends (after at most one more NOT_SERVING), and shutdown is not held up by it.
    let rest: Vec<i32> = tokio::time::timeout(Duration::from_secs(5), async {
        let mut statuses = Vec::new();
        while let Some(Ok(reply)) = watch.next().await {
            statuses.push(reply.status);
        }
        statuses
    })
    .await
    .expect("the watch stream ends at shutdown");
    assert!(rest.iter().all(|&s| s == not_serving), "{rest:?}");
    let report = tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("shutdown in time")
        .unwrap()
        .unwrap();
    assert!(report.finished_in_grace);
}
