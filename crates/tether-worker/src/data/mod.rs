//! Data links: a plain framed TCP socket per session beside the gRPC service, for the
//! latency-bound forward calls of decoding. gRPC stays the control plane (sessions,
//! leases, loading, KV operations, admin); a link only runs forward passes on a session
//! that gRPC opened, holds nothing of it, and dies with it.

mod client;
mod conn;
mod frame;
mod server;
mod wire;

pub use client::{DataLink, LinkTarget};
pub use server::{DEFAULT_HELLO_WITHIN, DEFAULT_MAX_UNAUTHENTICATED, DataOptions, DataPlane};

use crate::error::WorkerError;
use crate::ids::SessionId;
use crate::registry::SessionRegistry;
use crate::serve::ForwardCall;
use crate::stage::ForwardOutput;

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

/// The session a hello frame's body names, or why it is refused; for the fuzz targets.
pub fn hello_session(body: &[u8]) -> Result<SessionId, WorkerError> {
    frame::decode_hello(body).map(|h| h.session)
}

/// A forward request frame's body (no length prefix), as a client sends it; for seeds.
pub fn request_body(call: &ForwardCall) -> Vec<u8> {
    frame::encode_forward(call)[4..].to_vec()
}

/// A hello frame's body (no length prefix); for seeds.
pub fn hello_body(session: SessionId, token: &[u8]) -> Vec<u8> {
    frame::encode_hello(session, token)[4..].to_vec()
}

#[cfg(test)]
mod frame_tests;
#[cfg(test)]
mod wire_tests;
