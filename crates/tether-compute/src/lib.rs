//! Backend trait, cpu backend, device buffers.
//!
//! [`Backend`] is the one interface the model code drives; `cpu` is always present.

pub mod argmax;
pub mod backend;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod moe;
pub mod rope;
mod shape_check;

pub use backend::{
    AttnShape, AttnSpan, Backend, DeviceBuffer, GateAct, MemoryInfo, Result, RopeParams, ring_cell,
    score_rows_scratch, top_rows_scratch,
};
pub use cpu::{CpuBackend, CpuBuffer};
#[cfg(feature = "cuda")]
pub use cuda::{CudaBackend, CudaBuffer, CudaReplays};
pub use error::ComputeError;
