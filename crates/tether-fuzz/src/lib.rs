//! Fuzzing for tether's untrusted-input decoders: GGUF files and every gRPC request the
//! worker takes. Each [`Target`] is an ordinary function over bytes, so the cargo-fuzz
//! binaries under `fuzz/` and the stable replay test (`tests/fuzz_corpus.rs`) run the same
//! code. Worker targets drive the real service handlers of an in-process worker
//! ([`rig::Rig`]). [`seeds`] writes the committed corpus under `fuzz/corpus/`; [`mutate`]
//! is the seeded mutator of the stable loop.

pub mod gguf_target;
pub mod model;
pub mod mutate;
pub mod rig;
pub mod seeds;
pub mod target;
pub mod worker_targets;

pub use target::Target;

/// A bug found by a fuzz input: what broke, in words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding(pub String);

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Finding {}
