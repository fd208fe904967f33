//! The gRPC edge: the only place tonic and prost types meet the worker's domain.

pub mod admin;
mod attach;
pub mod auth;
pub mod health;
pub mod worker;

pub use admin::AdminService;
pub use auth::{AdminAuth, WorkerAuth};
pub use health::HealthService;
pub use worker::WorkerService;
