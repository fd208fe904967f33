//! The token guards end to end in one process: a real server with `token` set on a loopback
//! port, calls with no token, a wrong one and the right one, on every service.

use crate::registry::{RegistryConfig, SessionRegistry};
use crate::server::{ServerOptions, serve};
use crate::testing::FakeFactory;
use std::sync::Arc;
use std::time::Duration;
use tether_client::{AdminClient, AttachOptions, ClientOptions, ErrorKind, Health, WorkerClient};
use tether_proto::PROTOCOL_VERSION;
use tether_proto::v1 as pb;
use tether_protocol::BearerToken;
use tether_protocol::{EndReason, Lease};
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "data-plane-s3cret";

struct Guarded {
    addr: String,
    registry: Arc<SessionRegistry>,
    stop: CancellationToken,
    done: tokio::task::JoinHandle<()>,
}

async fn start(admin_token: Option<&str>) -> Guarded {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let registry = Arc::new(SessionRegistry::new(
        Arc::new(FakeFactory { free: 1 << 30 }),
        1 << 20,
        RegistryConfig::default(),
    ));
    let stop = CancellationToken::new();
    let options = ServerOptions {
        admin_token: admin_token.map(str::to_string),
        token: BearerToken::parse(Some(TOKEN)).unwrap(),
        ..ServerOptions::default()
    };
    let signal = stop.clone().cancelled_owned();
    let serving = Arc::clone(&registry);
    let done = tokio::spawn(async move {
        serve(listener, serving, options, signal).await.unwrap();
    });
    Guarded {
        addr,
        registry,
        stop,
        done,
    }
}

fn with_token(token: &str) -> ClientOptions {
    ClientOptions {
        token: BearerToken::parse(Some(token)).unwrap(),
        ..ClientOptions::default()
    }
}

fn attach_options() -> AttachOptions {
    AttachOptions {
        client_name: "auth-test".into(),
        lease: Lease {
            heartbeat_interval: Duration::from_millis(200),
            ttl: Duration::from_secs(2),
        },
        heartbeat: true,
    }
}

/// An Attach stream sent straight through the generated client (no Hello first), with the
/// given `authorization` value.
async fn raw_attach(addr: &str, authorization: Option<&str>) -> tonic::Status {
    let mut rpc = pb::worker_client::WorkerClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let open = pb::AttachRequest {
        kind: Some(pb::attach_request::Kind::Open(pb::Open {
            protocol_version: PROTOCOL_VERSION,
            client_name: "raw".into(),
            heartbeat_interval_ms: 200,
            ttl_ms: 2000,
        })),
    };
    let mut request = tonic::Request::new(tokio_stream::iter(vec![open]));
    if let Some(value) = authorization {
        request
            .metadata_mut()
            .insert("authorization", value.parse().unwrap());
    }
    match rpc.attach(request).await {
        Ok(_) => panic!("an Attach with authorization {authorization:?} was admitted"),
        Err(status) => status,
    }
}

#[tokio::test]
async fn without_the_token_no_call_opens_a_session_or_reserves_a_byte() {
    let g = start(None).await;
    let missing = raw_attach(&g.addr, None).await;
    assert_eq!(missing.code(), tonic::Code::Unauthenticated, "{missing:?}");
    assert!(missing.message().contains("--worker-token"), "{missing:?}");
    let wrong = raw_attach(&g.addr, Some("Bearer guess")).await;
    assert_eq!(wrong.code(), tonic::Code::Unauthenticated, "{wrong:?}");
    assert!(!wrong.message().contains(TOKEN), "{wrong:?}");
    let err = WorkerClient::connect(&g.addr, &ClientOptions::default())
        .await
        .err()
        .expect("Hello without a token must be refused");
    assert_eq!(err.kind(), ErrorKind::Unauthenticated, "{err}");
    let err = WorkerClient::connect(&g.addr, &with_token("data-plane-s3creT"))
        .await
        .err()
        .expect("Hello with a wrong token must be refused");
    assert_eq!(err.kind(), ErrorKind::Unauthenticated, "{err}");
    let status = g.registry.status();
    assert_eq!(
        (
            status.sessions,
            status.session_bytes,
            status.counters.opened
        ),
        (0, 0, 0)
    );
    g.stop.cancel();
    g.done.await.unwrap();
}

#[tokio::test]
async fn the_right_token_opens_a_session_and_health_stays_open() {
    let g = start(None).await;
    let health = tether_client::check_health(&g.addr, "", &ClientOptions::default())
        .await
        .unwrap();
    assert_eq!(health, Health::Serving);
    let client = WorkerClient::connect(&g.addr, &with_token(TOKEN))
        .await
        .unwrap();
    let session = client.attach(attach_options()).await.unwrap();
    assert_eq!(g.registry.status().sessions, 1);
    // Without --admin-token, admin calls take the data-plane token.
    let refused = AdminClient::connect(&g.addr, None, &ClientOptions::default())
        .await
        .unwrap()
        .status()
        .await
        .unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Unauthenticated, "{refused}");
    let mut admin = AdminClient::connect(&g.addr, Some(TOKEN.into()), &ClientOptions::default())
        .await
        .unwrap();
    assert_eq!(admin.status().await.unwrap().sessions, 1);
    assert_eq!(session.close().await.reason, EndReason::Closed);
    g.stop.cancel();
    g.done.await.unwrap();
}

#[tokio::test]
async fn an_admin_token_of_its_own_is_the_only_one_admin_calls_take() {
    let g = start(Some("admin-s3cret")).await;
    let mut with_data =
        AdminClient::connect(&g.addr, Some(TOKEN.into()), &ClientOptions::default())
            .await
            .unwrap();
    let err = with_data.status().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unauthenticated, "{err}");
    let mut with_admin = AdminClient::connect(
        &g.addr,
        Some("admin-s3cret".into()),
        &ClientOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(with_admin.status().await.unwrap().sessions, 0);
    // The admin token is not a data-plane token.
    let err = WorkerClient::connect(&g.addr, &with_token("admin-s3cret"))
        .await
        .err()
        .expect("the admin token must not open sessions");
    assert_eq!(err.kind(), ErrorKind::Unauthenticated, "{err}");
    g.stop.cancel();
    g.done.await.unwrap();
}
