//! Data links: a plain framed TCP socket per session beside the gRPC service, for the
//! latency-bound forward calls of decoding. gRPC stays the control plane (sessions,
//! leases, loading, KV operations, admin); a link only runs forward passes on a session
//! that gRPC opened, holds nothing of it, and dies with it.

mod client;
mod frame;
mod server;
mod wire;

pub use client::DataLink;
pub use server::{DataOptions, DataPlane};

#[cfg(test)]
mod frame_tests;
