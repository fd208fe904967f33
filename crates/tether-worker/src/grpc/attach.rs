//! The Attach stream: one session per stream. The task here relays heartbeats both ways and
//! ends the session the moment the stream ends or fails; when the session ends for another
//! reason (reaper, kill, shutdown) it tells the client why and closes the stream.

use crate::registry::SessionRegistry;
use crate::session::SessionTicket;
use std::sync::Arc;
use tether_proto::v1 as pb;
use tether_protocol::EndReason;
use tether_protocol::grpc::reason_to_proto;
use tokio::sync::mpsc;
use tokio::time::MissedTickBehavior;
use tonic::{Status, Streaming};

/// Events queued to one client; small, since heartbeats are the only steady traffic.
pub(crate) const EVENT_QUEUE: usize = 8;

fn event(kind: pb::attach_event::Kind) -> Result<pb::AttachEvent, Status> {
    Ok(pb::AttachEvent { kind: Some(kind) })
}

/// Follows one session until it ends; owns ending it when the stream goes away.
pub(crate) async fn pump_session(
    registry: Arc<SessionRegistry>,
    ticket: SessionTicket,
    mut inbound: Streaming<pb::AttachRequest>,
    outbound: mpsc::Sender<Result<pb::AttachEvent, Status>>,
) {
    let id = ticket.id;
    let mut beat = tokio::time::interval(ticket.lease.heartbeat_interval);
    beat.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut beat_seq = 0u64;
    let client_ended = loop {
        tokio::select! {
            biased;
            () = ticket.cancel.cancelled() => break None,
            () = outbound.closed() => break Some(EndReason::Disconnected),
            message = inbound.message() => match message {
                Ok(Some(pb::AttachRequest { kind: Some(pb::attach_request::Kind::Heartbeat(_)) })) => {
                    // An error means the session just ended; the cancel branch reports it.
                    let _ = registry.heartbeat(id);
                }
                Ok(Some(pb::AttachRequest { kind: Some(pb::attach_request::Kind::Close(_)) })) => {
                    break Some(EndReason::Closed);
                }
                Ok(Some(other)) => {
                    tracing::warn!(session = %id, message = ?other, "unexpected message on an open session stream; ending it");
                    let _ = outbound.try_send(Err(Status::invalid_argument(
                        "only heartbeat and close may follow open on an Attach stream",
                    )));
                    break Some(EndReason::Disconnected);
                }
                Ok(None) => break Some(EndReason::Disconnected),
                Err(status) => {
                    tracing::debug!(session = %id, %status, "session stream failed");
                    break Some(EndReason::Disconnected);
                }
            },
            _ = beat.tick() => {
                beat_seq += 1;
                let hb = pb::attach_event::Kind::Heartbeat(pb::Heartbeat { seq: beat_seq });
                // A full queue means the client is not reading; its heartbeats decide its fate.
                if let Err(mpsc::error::TrySendError::Closed(_)) = outbound.try_send(event(hb)) {
                    break Some(EndReason::Disconnected);
                }
            }
        }
    };
    let end = match client_ended {
        Some(reason) => registry.end(id, reason),
        None => None,
    };
    // Whoever ended the session recorded how it ended.
    if let Some(end) = end.or_else(|| ticket.end.get().copied()) {
        let ended = pb::attach_event::Kind::Ended(pb::Ended {
            reason: reason_to_proto(end.reason) as i32,
            bytes_freed: end.bytes_freed,
        });
        let _ = outbound.try_send(event(ended));
    }
}
