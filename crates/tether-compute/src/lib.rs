//! Backend trait, cpu backend, device buffers.
//!
//! [`Backend`] is the one interface the model code drives; `cpu` is always present.

pub mod argmax;
pub mod backend;
pub mod cache_dir;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod moe;
mod operands;
pub mod rng;
pub mod rope;
mod shape_check;
pub mod shared;

pub use backend::{
    AttnShape, AttnSpan, Backend, DeviceBuffer, GateAct, KV_BLOCK_CELLS, KvCache, KvCacheMut,
    MemoryInfo, Qkv, Result, Rope, RopeParams, Scores, Weight, kv_cell, ring_cell,
    score_rows_scratch, top_rows_scratch,
};
pub use cache_dir::cache_root;
pub use cpu::{CpuBackend, CpuBuffer};
#[cfg(feature = "cuda")]
pub use cuda::{CudaBackend, CudaBuffer, CudaReplays, CudaTuning};
pub use error::ComputeError;
pub use shared::SharedArea;
