//! The layer block a session loads, as the coordinator asks for it and the worker plans it.

use tether_gguf::GgmlType;

/// The layer block a session asks to load, and the batch shape it will serve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSpec {
    /// First layer of the block.
    pub first_layer: usize,
    /// One past the last layer of the block (as `tether_model::StageSpec`); equal to
    /// `first_layer` for a block holding only the embedding or the head.
    pub last_layer: usize,
    /// The block also holds the token embedding table.
    pub has_embed: bool,
    /// The block also holds the output norm and head.
    pub has_head: bool,
    /// KV cells per sequence.
    pub ctx_per_seq: usize,
    /// Sequences served at once.
    pub n_seq: usize,
    /// Sequences beyond `n_seq` that only keep cached prefixes, in the same KV pool (as
    /// `tether_model::StageSpec`).
    pub cached_seqs: usize,
    /// Most tokens in one forward pass.
    pub ubatch: usize,
    /// Element type of the K cache (F16, Q8_0 or Q4_0; as `tether_model::StageSpec`).
    pub cache_k: GgmlType,
    /// Element type of the V cache (F16, Q8_0 or Q4_0).
    pub cache_v: GgmlType,
}
impl From<&BlockSpec> for tether_model::StageSpec {
    fn from(spec: &BlockSpec) -> Self {
        Self {
            first_layer: spec.first_layer,
            last_layer: spec.last_layer,
            has_embed: spec.has_embed,
            has_head: spec.has_head,
            ctx_per_seq: spec.ctx_per_seq,
            n_seq: spec.n_seq,
            cached_seqs: spec.cached_seqs,
            ubatch: spec.ubatch,
            cache_k: spec.cache_k,
            cache_v: spec.cache_v,
        }
    }
}
