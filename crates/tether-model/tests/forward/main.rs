//! The forward pass against an independent reference, and the stage's behaviour.

mod cache_types;
mod embeddings;
mod kv_copy;
mod moe_config;
mod new_archs;
mod reference_model;
mod ring_kv;
mod stage_behaviour;
mod support;
mod vs_reference;
