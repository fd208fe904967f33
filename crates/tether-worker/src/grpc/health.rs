//! The standard `grpc.health.v1.Health` service, so load balancers, Kubernetes probes and
//! `grpc_health_probe` see a worker that takes sessions as SERVING and one that drains or
//! shuts down as NOT_SERVING. It answers from the registry itself rather than from a status
//! table set by hand, so it cannot disagree with what `Attach` would do, and its Watch
//! streams end at shutdown instead of holding the server open.

use crate::registry::SessionRegistry;
use futures::{Stream, StreamExt as _};
use std::pin::Pin;
use std::sync::Arc;
use tether_proto::v1::{admin_server, worker_server};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::Health;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

/// The service names a worker answers for: "" (the whole server) and its two services.
pub const HEALTH_SERVICE_NAMES: [&str; 3] =
    ["", worker_server::SERVICE_NAME, admin_server::SERVICE_NAME];

/// Health of a worker's gRPC services.
pub struct HealthService {
    registry: Arc<SessionRegistry>,
    stop: CancellationToken,
}

impl HealthService {
    /// Answers from `registry`; Watch streams end when `stop` is cancelled.
    pub fn new(registry: Arc<SessionRegistry>, stop: CancellationToken) -> Self {
        Self { registry, stop }
    }
}

fn reply(accepting: bool) -> HealthCheckResponse {
    let status = if accepting {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    HealthCheckResponse {
        status: status as i32,
    }
}

fn is_known(service: &str) -> bool {
    HEALTH_SERVICE_NAMES.contains(&service)
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

/// Sends the current state, then every change, then NOT_SERVING once `stop` is cancelled.
fn watch_stream(rx: watch::Receiver<bool>, stop: CancellationToken) -> WatchStream {
    struct State {
        rx: watch::Receiver<bool>,
        stop: CancellationToken,
        last: Option<bool>,
    }
    let state = Some(State {
        rx,
        stop,
        last: None,
    });
    Box::pin(futures::stream::unfold(state, |state| async move {
        let mut s = state?;
        loop {
            if s.last.is_some() {
                tokio::select! {
                    () = s.stop.cancelled() => return Some((Ok(reply(false)), None)),
                    changed = s.rx.changed() => {
                        if changed.is_err() {
                            return Some((Ok(reply(false)), None));
                        }
                    }
                }
            }
            let accepting = *s.rx.borrow_and_update();
            // A drain followed by shutdown is one change to a watcher.
            if s.last != Some(accepting) {
                s.last = Some(accepting);
                return Some((Ok(reply(accepting)), Some(s)));
            }
        }
    }))
}

#[tonic::async_trait]
impl Health for HealthService {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        let service = &request.get_ref().service;
        if !is_known(service) {
            return Err(Status::not_found(format!(
                "this worker serves no service {service:?}; ask for \"\", {:?} or {:?}",
                worker_server::SERVICE_NAME,
                admin_server::SERVICE_NAME
            )));
        }
        Ok(Response::new(reply(*self.registry.accepting().borrow())))
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        if !is_known(&request.get_ref().service) {
            // As the protocol asks: say SERVICE_UNKNOWN and keep the call open until shutdown.
            let unknown = HealthCheckResponse {
                status: ServingStatus::ServiceUnknown as i32,
            };
            let stop = self.stop.clone();
            let stream = futures::stream::once(async move { Ok(unknown) }).chain(
                futures::stream::once(async move {
                    stop.cancelled_owned().await;
                    Err(Status::unavailable("the worker is shutting down"))
                }),
            );
            return Ok(Response::new(Box::pin(stream)));
        }
        Ok(Response::new(watch_stream(
            self.registry.accepting(),
            self.stop.clone(),
        )))
    }
}
