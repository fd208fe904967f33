//! The data link's side of the wire: a plain framed socket per session beside the gRPC
//! service, for the latency-bound forward calls of decoding. [`frame`] encodes and decodes
//! every frame, [`wire`] reads whole frames off a socket, [`conn`] is the socket itself
//! (TCP, or an abstract Unix socket on one host). The worker's acceptor and the client's
//! link are built on these.

pub mod conn;
pub mod frame;
pub mod wire;

use crate::error::WorkerError;
use crate::forward::ForwardCall;
use crate::ids::SessionId;

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
