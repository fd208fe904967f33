//! Data links: a plain framed TCP socket per session beside the gRPC service, for the
//! latency-bound forward calls of decoding. gRPC stays the control plane (sessions,
//! leases, loading, KV operations, admin); a link only runs forward passes on a session
//! that gRPC opened, holds nothing of it, and dies with it.
//!
//! This is the worker's end; the frames are `tether_protocol::link`'s and the client's end
//! is `tether_client::DataLink`.

mod overlap;
mod server;

pub use server::{DEFAULT_HELLO_WITHIN, DEFAULT_MAX_UNAUTHENTICATED, DataOptions, DataPlane};

use crate::registry::SessionRegistry;
use tether_protocol::ForwardOutput;
use tether_protocol::SessionId;
use tether_protocol::WorkerError;
use tether_protocol::link::frame;

/// Serves one request frame's body on `session` as a link's thread does, and decodes the
/// reply frame as a client does: the output, the worker's refusal (as text), or `Err` when
/// the reply itself is malformed, which is a bug. For the fuzz targets.
pub fn serve_request(
    registry: &SessionRegistry,
    session: SessionId,
    body: &[u8],
) -> Result<Result<ForwardOutput, String>, WorkerError> {
    let (reply, _) = server::answer(registry, session, body);
    let len = reply
        .get(..4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    if len != Some((reply.len() - 4) as u32) {
        return Err(WorkerError::Internal(format!(
            "a {}-byte reply frame announces {len:?} bytes",
            reply.len()
        )));
    }
    Ok(frame::decode_output(&reply[4..])?.map_err(|r| format!("{:?}: {}", r.code, r.message)))
}
