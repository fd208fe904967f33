//! The coordinator: placement of layers over workers, two-phase load, pipelined generation
//! with continuous batching, and the OpenAI-compatible HTTP API.

pub mod api;
