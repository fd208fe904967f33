//! The `tether.v1.Admin` service and its token guard.

use super::convert::{session_to_proto, status_to_proto, to_status};
use crate::ids::SessionId;
use crate::registry::SessionRegistry;
use std::sync::Arc;
use tether_proto::v1 as pb;
use tonic::service::Interceptor;
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
}

/// Admits admin calls carrying `authorization: Bearer TOKEN` when a token is set.
#[derive(Clone)]
pub struct AdminAuth {
    token: Option<Arc<str>>,
}

impl AdminAuth {
    /// A guard for `token`; `None` admits every call.
    pub fn new(token: Option<String>) -> Self {
        Self {
            token: token.filter(|t| !t.is_empty()).map(Arc::from),
        }
    }
}

impl Interceptor for AdminAuth {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.token else {
            return Ok(request);
        };
        let given = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        match given {
            Some(token) if constant_time_eq(token.as_bytes(), expected.as_bytes()) => Ok(request),
            Some(_) => Err(Status::unauthenticated("admin token does not match")),
            None => Err(Status::unauthenticated(
                "this worker requires an admin token: pass --admin-token or set TETHER_ADMIN_TOKEN",
            )),
        }
    }
}

/// Compares without stopping at the first difference, so timing does not leak the token.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(auth: &mut AdminAuth, header: Option<&str>) -> Result<(), tonic::Code> {
        let mut req = Request::new(());
        if let Some(h) = header {
            req.metadata_mut()
                .insert("authorization", h.parse().unwrap());
        }
        auth.call(req).map(|_| ()).map_err(|s| s.code())
    }

    #[test]
    fn token_guard_admits_only_the_right_token() {
        let mut open = AdminAuth::new(None);
        assert_eq!(call(&mut open, None), Ok(()));
        let mut guarded = AdminAuth::new(Some("s3cret".into()));
        assert_eq!(call(&mut guarded, None), Err(tonic::Code::Unauthenticated));
        assert_eq!(
            call(&mut guarded, Some("Bearer nope")),
            Err(tonic::Code::Unauthenticated)
        );
        assert_eq!(call(&mut guarded, Some("Bearer s3cret")), Ok(()));
    }
}
