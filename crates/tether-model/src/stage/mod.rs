//! [`Stage`]: a contiguous block of layers on one backend, optionally with the embedding
//! and the output head — what a worker holds for a session.
//!
//! Every byte of device memory (weights, KV cache, scratch for one micro-batch) is
//! allocated in [`Stage::new`]; loading and running allocate nothing more.

mod decode;
mod forward;
mod handoff;
mod kv_ops;
mod layout;
mod load;
mod moe;

use std::collections::HashMap;
use std::sync::Arc;

use tether_compute::{Backend, DeviceBuffer};
use tether_gguf::{GgmlType, TensorInfo};

use crate::arch::{self, OUTPUT, OUTPUT_NORM, ROPE_FREQS, TOKEN_EMBD, TensorSpec};
use crate::config::ModelConfig;
use crate::error::{ModelError, compute};
use crate::kv::KvState;
use crate::plan::{HANDOFF_SLOTS, kv_cache_bytes, kv_ring, kv_table_bytes, scratch_sizes};

pub use crate::kv::BatchToken;
pub use decode::{StepInput, StepOutput};

/// Which part of the model a stage holds and how much KV cache and scratch it gets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageSpec {
    /// First layer held.
    pub first_layer: usize,
    /// One past the last layer held.
    pub last_layer: usize,
    /// Whether the stage holds the token embedding ([`Stage::embed`]).
    pub has_embed: bool,
    /// Whether the stage holds the final norm and output head ([`Stage::logits`]).
    pub has_head: bool,
    /// KV cells per sequence (the longest context a sequence can reach).
    pub ctx_per_seq: usize,
    /// Number of sequences with cells of their own: the paged pool holds blocks for
    /// `n_seq` whole contexts.
    pub n_seq: usize,
    /// Sequences beyond `n_seq` (ids `n_seq..n_seq + cached_seqs`) with a block table but
    /// no cells of their own: they hold prefixes in blocks of the same pool, so together
    /// the sequences never hold more than `n_seq` contexts (the caller sees to it; a
    /// batch that would need a block the pool does not have is refused).
    pub cached_seqs: usize,
    /// Most tokens processed in one step; scratch is sized for it.
    pub ubatch: usize,
    /// Element type of the K cache: F16, Q8_0 or Q4_0 (llama.cpp's `-ctk`).
    pub cache_k: GgmlType,
    /// Element type of the V cache: F16, Q8_0 or Q4_0 (llama.cpp's `-ctv`); for now it
    /// must equal `cache_k`, since the backends' attention reads one cache type.
    pub cache_v: GgmlType,
}

impl StageSpec {
    /// A stage holding every one of `n_layer` layers, the embedding and the head: what one
    /// process needs to run a whole model (`Generator`, `tether bench`).
    pub fn whole_model(
        n_layer: usize,
        ctx_per_seq: usize,
        n_seq: usize,
        ubatch: usize,
        cache_k: GgmlType,
        cache_v: GgmlType,
    ) -> Self {
        Self {
            first_layer: 0,
            last_layer: n_layer,
            has_embed: true,
            has_head: true,
            ctx_per_seq,
            n_seq,
            cached_seqs: 0,
            ubatch,
            cache_k,
            cache_v,
        }
    }
}

/// The element types a KV cache can be stored as.
pub const KV_CACHE_TYPES: [GgmlType; 3] = [GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0];

/// A tensor a stage will hold: its name, type and shape as in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSlot {
    /// GGUF name.
    pub name: String,
    /// Element type.
    pub ty: GgmlType,
    /// Dims in ggml order.
    pub dims: Vec<u64>,
    /// Size of its data.
    pub bytes: u64,
}

/// One weight on the device and which byte ranges of it have been written.
struct Weight<Buf> {
    name: String,
    ty: GgmlType,
    /// Values per row (`dims[0]`).
    row_len: usize,
    buf: Buf,
    /// Sorted, merged, half-open ranges written so far.
    written: Vec<(u64, u64)>,
    /// Handed to `Backend::finish_weight`, which may have changed its layout: no more
    /// writes.
    finished: bool,
}

impl<Buf> Weight<Buf> {
    /// This weight as an operand of a product: `rows` rows of `cols` values of its type.
    fn matrix(&self, rows: usize, cols: usize) -> tether_compute::Weight<'_, Buf> {
        tether_compute::Weight::new(&self.buf, self.ty, rows, cols)
    }
}

/// Indices into `Stage::weights` of one layer's tensors.
struct LayerWeights {
    attn_norm: usize,
    wq: usize,
    wk: usize,
    wv: usize,
    bias: Option<[usize; 3]>,
    /// Per-head norm weights of Q and K (Qwen3, Gemma 3).
    qk_norm: Option<[usize; 2]>,
    /// Norms of the attention and the feed-forward outputs (Gemma).
    post_norms: Option<[usize; 2]>,
    wo: usize,
    ffn_norm: usize,
    ffn: FfnWeights,
}

/// Indices into `Stage::weights` of one layer's feed-forward.
enum FfnWeights {
    Dense {
        gate: usize,
        up: usize,
        down: usize,
    },
    /// Router and stacked experts (`stage/moe.rs`).
    Moe(moe::MoeWeights),
}

/// Activation buffers of the layers.
struct LayerScratch<Buf> {
    q: Buf,
    attn: Buf,
    k: Buf,
    v: Buf,
    gate: Buf,
    up: Buf,
    act: Buf,
}

/// All activation buffers of a stage.
struct Scratch<Buf> {
    hidden: Buf,
    normed: Option<Buf>,
    layer: Option<LayerScratch<Buf>>,
    logits: Option<Buf>,
    /// Router and expert buffers of MoE layers.
    moe: Option<moe::MoeBuffers<Buf>>,
    /// Where micro-batches' output is handed to the next stage (`ScratchSizes::handoff`).
    handoff: Vec<Buf>,
}

/// A block of layers with its weights, KV cache and scratch on one backend.
pub struct Stage<B: Backend> {
    /// The copies of a load in flight; first, so that a stage dropped mid-load waits for
    /// them before its weights are freed.
    uploads: Option<B::Uploads>,
    backend: Arc<B>,
    cfg: ModelConfig,
    spec: StageSpec,
    weights: Vec<Weight<B::Buffer>>,
    by_name: HashMap<String, usize>,
    /// Fused file tensors held as several weights: the file name's parts, each as (weight
    /// index, its first byte in the file tensor).
    parts: HashMap<String, Vec<(usize, u64)>>,
    layers: Vec<LayerWeights>,
    embd: Option<usize>,
    out_norm: Option<usize>,
    output: Option<usize>,
    rope_freqs: Option<usize>,
    /// `(K, V)` cache per layer of the stage.
    kv_cache: Vec<(B::Buffer, B::Buffer)>,
    /// The device's copy of the paged pool's block tables (see [`KvState::blocks`]); `None`
    /// for a stage without layers.
    kv_table: Option<B::Buffer>,
    scratch: Scratch<B::Buffer>,
    kv: KvState,
    allocs: u64,
    loaded: bool,
    /// Decode steps the backend recorded for replay; dropped with the stage.
    replays: B::Replays,
}

fn check_spec(cfg: &ModelConfig, spec: &StageSpec) -> Result<(), ModelError> {
    let bad = |why: String| Err(ModelError::InvalidArgument(why));
    if spec.first_layer > spec.last_layer || spec.last_layer > cfg.n_layer {
        return bad(format!(
            "layers [{}, {}) are not a range inside the model's {} layers",
            spec.first_layer, spec.last_layer, cfg.n_layer
        ));
    }
    if spec.ubatch == 0 || spec.n_seq == 0 || spec.ctx_per_seq == 0 {
        return bad(format!(
            "ubatch ({}), n_seq ({}) and ctx_per_seq ({}) must all be at least 1",
            spec.ubatch, spec.n_seq, spec.ctx_per_seq
        ));
    }
    if spec.cached_seqs > 0 && kv_ring(cfg, spec.ctx_per_seq, spec.ubatch).is_some() {
        return bad(format!(
            "{} cached-prefix sequences: a model whose sliding-window layers keep a ring \
             keeps it per sequence, outside the shared pool; ask for none",
            spec.cached_seqs
        ));
    }
    check_cache_types(cfg, spec.cache_k, spec.cache_v)
}

/// Checks that a model of `cfg` can keep its KV cache as `cache_k`/`cache_v`: each one of
/// [`KV_CACHE_TYPES`], both the same, and for block types a `head_dim` of whole blocks.
pub fn check_cache_types(
    cfg: &ModelConfig,
    cache_k: GgmlType,
    cache_v: GgmlType,
) -> Result<(), ModelError> {
    let bad = |why: String| Err(ModelError::InvalidArgument(why));
    for (which, ty) in [("K", cache_k), ("V", cache_v)] {
        if !KV_CACHE_TYPES.contains(&ty) {
            return bad(format!(
                "{which} cache type {ty} is not supported: use f16, q8_0 or q4_0"
            ));
        }
        if !cfg.head_dim.is_multiple_of(ty.block_elems()) {
            return bad(format!(
                "{which} cache type {ty} needs a head_dim that is a multiple of {}, this model's is {}: use f16",
                ty.block_elems(),
                cfg.head_dim
            ));
        }
    }
    if cache_k != cache_v {
        return bad(format!(
            "K cache type {cache_k} with V cache type {cache_v} is not supported yet: give both the same type"
        ));
    }
    Ok(())
}

fn needed(cfg: &ModelConfig, spec: &StageSpec) -> Vec<TensorSpec> {
    arch::stage_tensors(
        cfg,
        spec.first_layer,
        spec.last_layer,
        spec.has_embed,
        spec.has_head,
    )
}

/// The tensors a stage of `spec` needs, with types and sizes taken from `file_tensors`;
/// errors name a missing or misshapen tensor. It reads only the file's tensor table, so
/// planners without a backend (the coordinator, `tether plan`) ask it too.
pub fn required_tensors(
    cfg: &ModelConfig,
    spec: &StageSpec,
    file_tensors: &[TensorInfo],
) -> Result<Vec<TensorSlot>, ModelError> {
    check_spec(cfg, spec)?;
    needed(cfg, spec)
        .iter()
        .map(|s| {
            let t = arch::check_tensor(s, file_tensors)?;
            Ok(TensorSlot {
                name: t.name.clone(),
                ty: t.ty,
                dims: t.dims.clone(),
                bytes: slot_bytes(&t.name, t.ty, &t.dims)?,
            })
        })
        .collect()
}

impl<B: Backend> Stage<B> {
    /// Allocates every buffer of the stage: the tensors in `tensors` (as returned by
    /// [`required_tensors`]), the KV cache and the scratch. Weights start zeroed
    /// and must be written with [`Self::load_tensor`] before [`Self::finish_load`].
    pub fn new(
        backend: Arc<B>,
        cfg: ModelConfig,
        spec: StageSpec,
        tensors: &[TensorSlot],
    ) -> Result<Self, ModelError> {
        check_spec(&cfg, &spec)?;
        let specs = needed(&cfg, &spec);
        if tensors.len() != specs.len() {
            return Err(ModelError::InvalidArgument(format!(
                "{} tensors given for a stage that needs {}",
                tensors.len(),
                specs.len()
            )));
        }
        let infos: Vec<TensorInfo> = tensors
            .iter()
            .map(|t| TensorInfo {
                name: t.name.clone(),
                ty: t.ty,
                dims: t.dims.clone(),
                offset: 0,
                bytes: t.bytes,
            })
            .collect();
        for s in &specs {
            let t = arch::check_tensor(s, &infos)?;
            if slot_bytes(&t.name, t.ty, &t.dims)? != t.bytes {
                return Err(ModelError::InvalidArgument(format!(
                    "tensor '{}': {} bytes given, {} {:?} needs {}",
                    t.name,
                    t.bytes,
                    t.ty,
                    t.dims,
                    slot_bytes(&t.name, t.ty, &t.dims)?
                )));
            }
        }
        let kv = KvState::new(
            spec.n_seq + spec.cached_seqs,
            spec.ctx_per_seq,
            kv_ring(&cfg, spec.ctx_per_seq, spec.ubatch),
            spec.n_seq,
        )?;
        // Every buffer of the stage in one request, so a backend can reserve them together
        // (one device allocation per session: see `Backend::alloc_many`).
        let n_layers = spec.last_layer - spec.first_layer;
        let sizes = scratch_sizes(&cfg, &spec);
        let layout = layout::weight_layout(&cfg, tensors)?;
        let mut wanted: Vec<u64> = layout.iter().map(|l| l.bytes).collect();
        for l in spec.first_layer..spec.last_layer {
            wanted.extend([
                kv_cache_bytes(&cfg, &spec, l, spec.cache_k),
                kv_cache_bytes(&cfg, &spec, l, spec.cache_v),
            ]);
        }
        wanted.push(kv_table_bytes(&spec));
        wanted.extend([sizes.hidden, sizes.normed, sizes.logits]);
        if n_layers > 0 {
            wanted.extend([
                sizes.q, sizes.q, sizes.kv, sizes.kv, sizes.ff, sizes.ff, sizes.ff,
            ]);
        }
        let has_moe = n_layers > 0 && cfg.moe.is_some();
        if has_moe {
            wanted.extend(moe::MoeBuffers::<B::Buffer>::sizes(&sizes));
        }
        if sizes.handoff > 0 {
            wanted.extend([sizes.handoff; HANDOFF_SLOTS]);
        }
        let total: u64 = wanted.iter().sum();
        let as_usize: Vec<usize> = wanted
            .iter()
            .map(|&b| usize::try_from(b))
            .collect::<Result<_, _>>()
            .map_err(|_| {
                ModelError::InvalidArgument(format!(
                    "the stage's {total} bytes exceed the address space"
                ))
            })?;
        let allocs = wanted.iter().filter(|&&b| b > 0).count() as u64;
        let mut bufs = backend
            .alloc_many(&as_usize)
            .map_err(|source| ModelError::Compute {
                what: format!(
                    "allocating {total} bytes for the stage's {} buffers",
                    wanted.len()
                ),
                source,
            })?
            .into_iter();
        let mut next = || {
            bufs.next().ok_or_else(|| {
                ModelError::FailedPrecondition("the backend returned too few buffers".into())
            })
        };
        let mut weights = Vec::with_capacity(layout.len());
        let mut parts: HashMap<String, Vec<(usize, u64)>> = HashMap::new();
        for layout::WeightSlot {
            name,
            ty,
            row_len,
            part_of,
            ..
        } in layout
        {
            if let Some((file_name, start)) = part_of {
                parts
                    .entry(file_name)
                    .or_default()
                    .push((weights.len(), start));
            }
            weights.push(Weight {
                name,
                ty,
                row_len,
                buf: next()?,
                written: Vec::new(),
                finished: false,
            });
        }
        let mut kv_cache = Vec::with_capacity(n_layers);
        for _ in spec.first_layer..spec.last_layer {
            kv_cache.push((next()?, next()?));
        }
        let mut opt = |bytes: u64| -> Result<Option<B::Buffer>, ModelError> {
            let buf = next()?;
            Ok((bytes > 0).then_some(buf))
        };
        let kv_table = opt(kv_table_bytes(&spec))?;
        let hidden = opt(sizes.hidden)?;
        let normed = opt(sizes.normed)?;
        let logits = opt(sizes.logits)?;
        let layer = if n_layers > 0 {
            Some(LayerScratch {
                q: next()?,
                attn: next()?,
                k: next()?,
                v: next()?,
                gate: next()?,
                up: next()?,
                act: next()?,
            })
        } else {
            None
        };
        let moe_scratch = if has_moe {
            Some(moe::MoeBuffers::take(&mut next)?)
        } else {
            None
        };
        let handoff = if sizes.handoff > 0 {
            (0..HANDOFF_SLOTS)
                .map(|_| next())
                .collect::<Result<_, _>>()?
        } else {
            Vec::new()
        };
        let hidden = hidden.ok_or_else(|| {
            ModelError::InvalidArgument("a stage needs a non-empty hidden state".into())
        })?;
        let by_name: HashMap<String, usize> = weights
            .iter()
            .enumerate()
            .map(|(i, w)| (w.name.clone(), i))
            .collect();
        let idx = |name: &str| {
            by_name
                .get(name)
                .copied()
                .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
        };
        let mut layers = Vec::with_capacity(n_layers);
        for l in spec.first_layer..spec.last_layer {
            let n = |s: &str| idx(&arch::layer_tensor(l, s));
            let traits = cfg.arch.traits();
            let [wq, wk, wv] = if traits.fused_qkv {
                let qkv = arch::layer_tensor(l, arch::ATTN_QKV);
                let part = |p: &str| idx(&arch::part_name(&qkv, p));
                [part("q")?, part("k")?, part("v")?]
            } else {
                [
                    n("attn_q.weight")?,
                    n("attn_k.weight")?,
                    n("attn_v.weight")?,
                ]
            };
            let ffn = if cfg.moe.is_some() {
                FfnWeights::Moe(moe::MoeWeights::find(n)?)
            } else {
                let [gate, up] = if traits.fused_gate_up {
                    let up = arch::layer_tensor(l, "ffn_up.weight");
                    let part = |p: &str| idx(&arch::part_name(&up, p));
                    [part("gate")?, part("up")?]
                } else {
                    [n("ffn_gate.weight")?, n("ffn_up.weight")?]
                };
                FfnWeights::Dense {
                    gate,
                    up,
                    down: n("ffn_down.weight")?,
                }
            };
            layers.push(LayerWeights {
                attn_norm: n("attn_norm.weight")?,
                wq,
                wk,
                wv,
                bias: if cfg.arch.has_qkv_bias() {
                    Some([n("attn_q.bias")?, n("attn_k.bias")?, n("attn_v.bias")?])
                } else {
                    None
                },
                qk_norm: if cfg.arch.has_qk_norm() {
                    Some([n("attn_q_norm.weight")?, n("attn_k_norm.weight")?])
                } else {
                    None
                },
                post_norms: if traits.post_norms {
                    Some([n(arch::POST_ATTN_NORM)?, n(arch::POST_FFW_NORM)?])
                } else {
                    None
                },
                wo: n("attn_output.weight")?,
                ffn_norm: n("ffn_norm.weight")?,
                ffn,
            });
        }
        let embd = by_name.get(TOKEN_EMBD).copied().filter(|_| spec.has_embed);
        let out_norm = by_name.get(OUTPUT_NORM).copied();
        let output = if cfg.tied_output {
            by_name.get(TOKEN_EMBD)
        } else {
            by_name.get(OUTPUT)
        }
        .copied()
        .filter(|_| spec.has_head);
        let rope_freqs = by_name.get(ROPE_FREQS).copied();
        Ok(Self {
            backend,
            cfg,
            spec,
            weights,
            by_name,
            parts,
            layers,
            embd,
            out_norm,
            output,
            rope_freqs,
            kv_cache,
            kv_table,
            scratch: Scratch {
                hidden,
                normed,
                layer,
                logits,
                moe: moe_scratch,
                handoff,
            },
            kv,
            allocs,
            loaded: false,
            replays: B::Replays::default(),
            uploads: None,
        })
    }

    /// The model configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// What the stage holds.
    pub fn spec(&self) -> &StageSpec {
        &self.spec
    }

    /// The backend the stage runs on.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// Bytes of device memory the stage holds (every buffer it allocated).
    pub fn bytes(&self) -> u64 {
        let weights: usize = self.weights.iter().map(|w| w.buf.bytes()).sum();
        let kv: usize = self
            .kv_cache
            .iter()
            .map(|(k, v)| k.bytes() + v.bytes())
            .sum::<usize>()
            + self.kv_table.as_ref().map_or(0, |t| t.bytes());
        let s = &self.scratch;
        let mut scratch = s.hidden.bytes();
        scratch += s.normed.as_ref().map_or(0, |b| b.bytes());
        scratch += s.logits.as_ref().map_or(0, |b| b.bytes());
        if let Some(l) = &s.layer {
            scratch += [&l.q, &l.attn, &l.k, &l.v, &l.gate, &l.up, &l.act]
                .iter()
                .map(|b| b.bytes())
                .sum::<usize>();
        }
        scratch += s.moe.as_ref().map_or(0, moe::MoeBuffers::bytes);
        scratch += s.handoff.iter().map(|b| b.bytes()).sum::<usize>();
        (weights + kv + scratch) as u64
    }

    /// Number of device allocations the stage has made (all in [`Self::new`]).
    pub fn alloc_count(&self) -> u64 {
        self.allocs
    }

    fn synchronize(&self) -> Result<(), ModelError> {
        self.backend.synchronize().map_err(compute("synchronize"))
    }
}

/// Bytes of a tensor of `ty` and `dims`, or an error naming it.
fn slot_bytes(name: &str, ty: GgmlType, dims: &[u64]) -> Result<u64, ModelError> {
    let elems = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
    elems
        .filter(|_| {
            dims.first()
                .is_some_and(|d| d % ty.block_elems() as u64 == 0)
        })
        .and_then(|n| ty.bytes_for(n))
        .ok_or_else(|| ModelError::TensorType {
            name: name.to_string(),
            ty,
            reason: format!("dims {dims:?} are not whole {ty} blocks per row"),
        })
}
