//! Asking a worker's `grpc.health.v1.Health` service whether it takes sessions.

use crate::diagnose::Link;
use crate::{ClientError, ClientOptions, connect_channel};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// What the health service said about a service name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    /// Up and taking sessions.
    Serving,
    /// Up but draining or shutting down: attach elsewhere.
    NotServing,
    /// The worker did not say.
    Unknown,
}

/// Checks the health of `service` ("" for the whole worker) on the worker at `addr`.
pub async fn check_health(
    addr: &str,
    service: &str,
    options: &ClientOptions,
) -> Result<Health, ClientError> {
    let channel = connect_channel(addr, options).await?;
    let reply = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.to_string(),
        })
        .await
        .map_err(|s| Link::of(options).call_failed("health check", addr, &s))?
        .into_inner();
    Ok(match ServingStatus::try_from(reply.status) {
        Ok(ServingStatus::Serving) => Health::Serving,
        Ok(ServingStatus::NotServing) => Health::NotServing,
        _ => Health::Unknown,
    })
}
