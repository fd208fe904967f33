//! Architectures, hyper-parameters, tokenizers, sampling, forward pass and the layer plan.

pub mod arch;
pub mod config;
mod config_extras;
pub mod error;
pub mod generate;
pub mod kv;
pub mod kv_blocks;
pub mod moe;
pub mod plan;
pub mod sampling;
pub mod stage;
pub mod stop;
pub mod synth;
pub mod tokenizer;

pub use arch::Arch;
pub use config::ModelConfig;
pub use error::ModelError;
pub use generate::{Generator, load_stage_from_file};
pub use kv::{BatchToken, KvRing};
pub use kv_blocks::KvBlocks;
pub use moe::MoeConfig;
pub use plan::{StagePlan, kv_ring, plan_stage};
pub use sampling::{Sampler, SamplingParams};
pub use stage::{
    KV_CACHE_TYPES, Stage, StageSpec, StepInput, StepOutput, TensorSlot, check_cache_types,
    required_tensors,
};
pub use stop::{StopReason, StopRules, Verdict};
pub use synth::{SynthShape, synthesize, synthesize_with};
