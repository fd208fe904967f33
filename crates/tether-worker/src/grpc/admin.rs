//! The `tether.v1.Admin` service (its token guard is in `auth.rs`).

use crate::registry::SessionRegistry;
use std::sync::Arc;
use tether_proto::v1 as pb;
use tether_protocol::SessionId;
use tether_protocol::grpc::{session_to_proto, status_to_proto, to_status};
use tonic::{Request, Response, Status};

/// The admin service over a registry.
pub struct AdminService {
    registry: Arc<SessionRegistry>,
}

impl AdminService {
    /// A service answering from `registry`.
    pub fn new(registry: Arc<SessionRegistry>) -> Self {
        Self { registry }
    }
}

#[tonic::async_trait]
impl pb::admin_server::Admin for AdminService {
    async fn status(
        &self,
        _: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusReply>, Status> {
        Ok(Response::new(status_to_proto(&self.registry.status())))
    }

    async fn list_sessions(
        &self,
        _: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsReply>, Status> {
        let sessions = self
            .registry
            .sessions()
            .iter()
            .map(session_to_proto)
            .collect();
        Ok(Response::new(pb::ListSessionsReply { sessions }))
    }

    async fn kill_session(
        &self,
        request: Request<pb::KillSessionRequest>,
    ) -> Result<Response<pb::KillSessionReply>, Status> {
        let id = SessionId::parse(&request.get_ref().session_id).map_err(to_status)?;
        let end = self.registry.kill(id).map_err(to_status)?;
        Ok(Response::new(pb::KillSessionReply {
            bytes_freed: end.bytes_freed,
        }))
    }

    async fn drain(
        &self,
        _: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::DrainReply>, Status> {
        let sessions = self.registry.drain() as u32;
        Ok(Response::new(pb::DrainReply { sessions }))
    }

    async fn undrain(
        &self,
        _: Request<pb::UndrainRequest>,
    ) -> Result<Response<pb::UndrainReply>, Status> {
        let was_draining = self.registry.undrain().map_err(to_status)?;
        Ok(Response::new(pb::UndrainReply { was_draining }))
    }
}
