//! The client side of a session: the Attach stream, heartbeats, and learning how it ended.

use crate::{ClientError, ClientOptions, WorkerClient, connect_rpc};
use std::time::Duration;
use tether_proto::PROTOCOL_VERSION;
use tether_proto::v1 as pb;
use tether_protocol::grpc::reason_from_proto;
use tether_protocol::{EndReason, Lease, SessionEnd, SessionId};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_stream::wrappers::ReceiverStream;

/// How to open a session.
#[derive(Clone, Debug)]
pub struct AttachOptions {
    /// Who is attaching, for the worker's logs.
    pub client_name: String,
    /// The lease asked for (the worker may clamp it).
    pub lease: Lease,
    /// Send heartbeats. `false` makes a zombie: the stream stays open but the lease runs out
    /// (for trying the reaper by hand).
    pub heartbeat: bool,
}

/// An open session. Dropping it drops the stream, which ends the session on the worker.
pub struct Session {
    id: SessionId,
    lease: Lease,
    ended: watch::Receiver<Option<SessionEnd>>,
    close: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl WorkerClient {
    /// Opens a session; returns once the worker has sent its id. The session's stream and
    /// heartbeats run on a connection of their own on the lease thread (see
    /// [`crate::lease_thread`]), not on the caller's runtime.
    pub async fn attach(&self, options: AttachOptions) -> Result<Session, ClientError> {
        let addr = self.addr.clone();
        let handle = crate::lease_thread::lease_runtime()
            .map_err(|e| ClientError::protocol("attach", &addr, e))?;
        let (opened_tx, opened_rx) = oneshot::channel();
        let (ended_tx, ended) = watch::channel(None);
        let (close_tx, close_rx) = oneshot::channel();
        let client_options = self.options.clone();
        let task = handle.spawn(async move {
            match open(&addr, &client_options, &options).await {
                Ok((id, lease, tx, inbound)) => {
                    // The caller gave up waiting: dropping the stream ends the session.
                    if opened_tx.send(Ok((id, lease))).is_ok() {
                        let heartbeat = options.heartbeat;
                        run_session(id, lease, heartbeat, tx, inbound, ended_tx, close_rx).await;
                    }
                }
                Err(e) => {
                    let _ = opened_tx.send(Err(e));
                }
            }
        });
        let (id, lease) = opened_rx.await.map_err(|_| {
            ClientError::protocol("attach", &self.addr, "the lease thread dropped the attach")
        })??;
        Ok(Session {
            id,
            lease,
            ended,
            close: Some(close_tx),
            task,
        })
    }
}

type Opened = (
    SessionId,
    Lease,
    mpsc::Sender<pb::AttachRequest>,
    tonic::Streaming<pb::AttachEvent>,
);

/// Connects and opens the Attach stream; returns once the worker has sent the session's id.
async fn open(
    addr: &str,
    client_options: &ClientOptions,
    options: &AttachOptions,
) -> Result<Opened, ClientError> {
    let (tx, rx) = mpsc::channel(8);
    let open = pb::attach_request::Kind::Open(pb::Open {
        protocol_version: PROTOCOL_VERSION,
        client_name: options.client_name.clone(),
        heartbeat_interval_ms: millis(options.lease.heartbeat_interval),
        ttl_ms: millis(options.lease.ttl),
    });
    tx.try_send(pb::AttachRequest { kind: Some(open) })
        .map_err(|_| ClientError::protocol("attach", addr, "request queue closed"))?;
    let mut rpc = connect_rpc(addr, client_options).await?;
    let mut inbound = rpc
        .attach(ReceiverStream::new(rx))
        .await
        .map_err(|s| ClientError::rpc("attach", addr, &s))?
        .into_inner();
    let first = inbound
        .message()
        .await
        .map_err(|s| ClientError::rpc("attach", addr, &s))?;
    let Some(pb::AttachEvent {
        kind: Some(pb::attach_event::Kind::Opened(opened)),
    }) = first
    else {
        return Err(ClientError::protocol(
            "attach",
            addr,
            "the worker's first event was not Opened",
        ));
    };
    let id =
        SessionId::parse(&opened.session_id).map_err(|e| ClientError::domain("attach", addr, e))?;
    let lease = Lease {
        heartbeat_interval: Duration::from_millis(opened.heartbeat_interval_ms.max(1).into()),
        ttl: Duration::from_millis(opened.ttl_ms.max(1).into()),
    };
    Ok((id, lease, tx, inbound))
}

fn millis(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

async fn run_session(
    id: SessionId,
    lease: Lease,
    heartbeat: bool,
    tx: mpsc::Sender<pb::AttachRequest>,
    mut inbound: tonic::Streaming<pb::AttachEvent>,
    ended: watch::Sender<Option<SessionEnd>>,
    mut close: oneshot::Receiver<()>,
) {
    let mut beat = tokio::time::interval(lease.heartbeat_interval);
    beat.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut seq = 0u64;
    let mut closing = false;
    let mut last_heard = Instant::now();
    let end = loop {
        // A worker silent for a whole TTL is gone, whatever TCP says.
        let silence = tokio::time::sleep_until(last_heard + lease.ttl);
        tokio::select! {
            result = &mut close, if !closing => {
                // The `Session` was dropped: dropping the stream ends the session.
                if result.is_err() {
                    break SessionEnd { reason: EndReason::Disconnected, bytes_freed: 0 };
                }
                closing = true;
                let close = pb::attach_request::Kind::Close(pb::Close {});
                if tx.send(pb::AttachRequest { kind: Some(close) }).await.is_err() {
                    break SessionEnd { reason: EndReason::Disconnected, bytes_freed: 0 };
                }
            }
            _ = beat.tick(), if heartbeat && !closing => {
                seq += 1;
                let hb = pb::attach_request::Kind::Heartbeat(pb::Heartbeat { seq });
                let _ = tx.try_send(pb::AttachRequest { kind: Some(hb) });
            }
            () = silence => {
                tracing::warn!(session = %id, "worker silent for the whole lease; treating the session as lost");
                break SessionEnd { reason: EndReason::Disconnected, bytes_freed: 0 };
            }
            event = inbound.message() => match event {
                Ok(Some(pb::AttachEvent { kind: Some(pb::attach_event::Kind::Ended(e)) })) => {
                    let reason = reason_from_proto(e.reason).unwrap_or(EndReason::Disconnected);
                    break SessionEnd { reason, bytes_freed: e.bytes_freed };
                }
                Ok(Some(_)) => last_heard = Instant::now(),
                Ok(None) | Err(_) => break SessionEnd { reason: EndReason::Disconnected, bytes_freed: 0 },
            },
        }
    };
    tracing::debug!(session = %id, reason = %end.reason, "session ended");
    let _ = ended.send(Some(end));
}

impl Session {
    /// The session's id.
    pub fn id(&self) -> SessionId {
        self.id
    }

    /// The lease in force.
    pub fn lease(&self) -> Lease {
        self.lease
    }

    /// How the session ended, if it has.
    pub fn end(&self) -> Option<SessionEnd> {
        *self.ended.borrow()
    }

    /// Waits until the session ends, whoever ends it.
    pub async fn ended(&mut self) -> SessionEnd {
        match self.ended.wait_for(Option::is_some).await {
            Ok(end) => end.unwrap_or(SessionEnd {
                reason: EndReason::Disconnected,
                bytes_freed: 0,
            }),
            Err(_) => SessionEnd {
                reason: EndReason::Disconnected,
                bytes_freed: 0,
            },
        }
    }

    /// Closes the session and waits for the worker to confirm it freed everything.
    pub async fn close(mut self) -> SessionEnd {
        if let Some(close) = self.close.take() {
            let _ = close.send(());
        }
        self.ended().await
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Dropping the stream ends the session on the worker (reason: disconnected).
        self.task.abort();
    }
}
