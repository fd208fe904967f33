//! The admin client behind `tetherctl`.

use crate::diagnose::Link;
use crate::{ClientError, ClientOptions, connect_channel};
use tether_proto::v1 as pb;
use tether_protocol::grpc::{session_from_proto, status_from_proto};
use tether_protocol::{SessionId, SessionSummary, WorkerStatus};
use tonic::transport::Channel;

/// A connection to one worker's admin service.
pub struct AdminClient {
    addr: String,
    rpc: pb::admin_client::AdminClient<Channel>,
    token: Option<String>,
    link: Link,
}

impl AdminClient {
    /// Connects to `addr`; `token` is sent with every call when given.
    pub async fn connect(
        addr: &str,
        token: Option<String>,
        options: &ClientOptions,
    ) -> Result<Self, ClientError> {
        let channel = connect_channel(addr, options).await?;
        Ok(Self {
            addr: addr.to_string(),
            rpc: pb::admin_client::AdminClient::new(channel),
            token,
            link: Link::of(options),
        })
    }

    fn request<T>(&self, op: &'static str, message: T) -> Result<tonic::Request<T>, ClientError> {
        let mut request = tonic::Request::new(message);
        if let Some(token) = &self.token {
            let value = format!("Bearer {token}").parse().map_err(|_| {
                ClientError::protocol(
                    op,
                    &self.addr,
                    "the admin token has characters not allowed in a header",
                )
            })?;
            request.metadata_mut().insert("authorization", value);
        }
        Ok(request)
    }

    /// Device memory, session bytes and counters.
    pub async fn status(&mut self) -> Result<WorkerStatus, ClientError> {
        let req = self.request("status", pb::StatusRequest {})?;
        let reply = self
            .rpc
            .status(req)
            .await
            .map_err(|s| self.link.call_failed("status", &self.addr, &s))?;
        Ok(status_from_proto(reply.into_inner()))
    }

    /// Every live session.
    pub async fn sessions(&mut self) -> Result<Vec<SessionSummary>, ClientError> {
        let req = self.request("sessions", pb::ListSessionsRequest {})?;
        let reply = self
            .rpc
            .list_sessions(req)
            .await
            .map_err(|s| self.link.call_failed("sessions", &self.addr, &s))?;
        Ok(reply
            .into_inner()
            .sessions
            .into_iter()
            .map(session_from_proto)
            .collect())
    }

    /// Ends a session now; returns the bytes freed.
    pub async fn kill(&mut self, session: SessionId) -> Result<u64, ClientError> {
        let req = self.request(
            "kill",
            pb::KillSessionRequest {
                session_id: session.to_string(),
            },
        )?;
        let reply = self
            .rpc
            .kill_session(req)
            .await
            .map_err(|s| self.link.call_failed("kill", &self.addr, &s))?;
        Ok(reply.into_inner().bytes_freed)
    }

    /// Refuses new sessions; returns how many are live.
    pub async fn drain(&mut self) -> Result<u32, ClientError> {
        let req = self.request("drain", pb::DrainRequest {})?;
        let reply = self
            .rpc
            .drain(req)
            .await
            .map_err(|s| self.link.call_failed("drain", &self.addr, &s))?;
        Ok(reply.into_inner().sessions)
    }

    /// Takes new sessions again after a drain; returns whether the worker was draining.
    pub async fn undrain(&mut self) -> Result<bool, ClientError> {
        let req = self.request("undrain", pb::UndrainRequest {})?;
        let reply = self
            .rpc
            .undrain(req)
            .await
            .map_err(|s| self.link.call_failed("undrain", &self.addr, &s))?;
        Ok(reply.into_inner().was_draining)
    }
}
