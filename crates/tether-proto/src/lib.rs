//! Generated code for the `tether.v1` wire contract (proto/tether/v1/*.proto): messages,
//! tonic clients and servers. Nothing else lives here; domain code converts at the edge.

/// The protocol major version this build speaks; the `v1` in the package name.
pub const PROTOCOL_VERSION: u32 = 1;

/// Package `tether.v1`: the worker and admin services.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("tether.v1");
}
