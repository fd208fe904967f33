//! Placement: which worker holds which contiguous part of the model.
//!
//! The model is seen as a row of units — the embedding, each layer, the output head — and
//! the row is cut into one contiguous piece per worker so that each piece's bytes are in
//! proportion to the worker's weight (its free memory, or the `--split` list), the way
//! llama.cpp splits layers by free memory. Each piece is then planned exactly with
//! [`tether_model::plan_stage`] (weights + KV cache + scratch) and checked against the
//! worker's free memory.

use std::fmt;
use tether_gguf::{GgmlType, TensorInfo};
use tether_model::{ModelConfig, StagePlan, StageSpec, plan_stage};
use tether_protocol::BlockSpec;

/// A worker that may receive a part of the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerCapacity {
    /// The worker's address.
    pub addr: String,
    /// Bytes a session may still reserve there (from Hello).
    pub free_bytes: u64,
}

/// The serving shape every block is planned for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServeShape {
    /// KV cells per sequence.
    pub ctx_per_seq: usize,
    /// Sequences served at once.
    pub n_seq: usize,
    /// Sequences beyond `n_seq` that keep cached prefixes for the prefix cache.
    pub cached_seqs: usize,
    /// Most tokens in one forward pass.
    pub ubatch: usize,
    /// Element type of the K cache (F16, Q8_0 or Q4_0).
    pub cache_k: GgmlType,
    /// Element type of the V cache (F16, Q8_0 or Q4_0).
    pub cache_v: GgmlType,
}

/// One worker's part of the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// The worker's address.
    pub addr: String,
    /// The block it loads.
    pub spec: BlockSpec,
    /// What the block will hold.
    pub bytes: StagePlan,
    /// The worker's free bytes when planned.
    pub free_bytes: u64,
    /// Tensors of the block, in the order to send them.
    pub tensors: Vec<String>,
}

/// Every worker's part, in layer order: the first holds the embedding, the last the head.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The parts, in layer order.
    pub assignments: Vec<Assignment>,
}

/// Why no plan could be made.
#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    /// No worker was given.
    #[error("no workers to place the model on; give at least one worker")]
    NoWorkers,
    /// The split list does not match the workers.
    #[error(
        "--split has {given} weights for {workers} workers; give one non-negative weight per worker, not all zero"
    )]
    BadSplit {
        /// Weights given.
        given: usize,
        /// Workers.
        workers: usize,
    },
    /// More workers than pieces of the model.
    #[error(
        "{workers} workers but the model has only {units} parts (embedding, {layers} layers, head); use fewer workers"
    )]
    TooManyWorkers {
        /// Workers.
        workers: usize,
        /// Parts of the model.
        units: usize,
        /// Layers.
        layers: usize,
    },
    /// The model file lacks a tensor a block needs, or the shape is invalid.
    #[error("planning layers {first}..{last} of the model: {detail}")]
    Model {
        /// First layer of the block.
        first: usize,
        /// One past its last layer.
        last: usize,
        /// The model's message.
        detail: String,
    },
    /// A worker cannot hold its part.
    #[error(
        "worker {addr} cannot hold layers {first}..{last}{extra}: it needs {needed} bytes ({weights} weights + {kv} KV + {scratch} scratch) and has {free} free; give it less with --split, lower --ctx/--parallel, or add workers"
    )]
    DoesNotFit {
        /// The worker.
        addr: String,
        /// First layer.
        first: usize,
        /// One past the last layer.
        last: usize,
        /// " + embedding + head" as the block has them.
        extra: String,
        /// Bytes the block needs.
        needed: u64,
        /// Of which weights.
        weights: u64,
        /// Of which KV cache.
        kv: u64,
        /// Of which scratch.
        scratch: u64,
        /// Bytes free there.
        free: u64,
    },
}

/// The model-side tensor list of a block.
pub fn block_tensors(
    cfg: &ModelConfig,
    tensors: &[TensorInfo],
    spec: &BlockSpec,
) -> Result<Vec<tether_model::TensorSlot>, PlacementError> {
    tether_model::required_tensors(cfg, &StageSpec::from(spec), tensors).map_err(|e| {
        PlacementError::Model {
            first: spec.first_layer,
            last: spec.last_layer,
            detail: e.to_string(),
        }
    })
}

/// The block covering units `[a, b)` of a model of `n_layer` layers, where unit 0 is the
/// embedding, unit `j` in `1..=n_layer` layer `j - 1` and unit `n_layer + 1` the head.
fn block_of_units(a: usize, b: usize, n_layer: usize, shape: ServeShape) -> BlockSpec {
    BlockSpec {
        first_layer: a.saturating_sub(1).min(n_layer),
        last_layer: b.saturating_sub(1).min(n_layer),
        has_embed: a == 0,
        has_head: b == n_layer + 2,
        ctx_per_seq: shape.ctx_per_seq,
        n_seq: shape.n_seq,
        cached_seqs: shape.cached_seqs,
        ubatch: shape.ubatch,
        cache_k: shape.cache_k,
        cache_v: shape.cache_v,
    }
}

/// Bytes of each unit: its tensors, and for a layer its KV cache.
fn unit_bytes(
    cfg: &ModelConfig,
    tensors: &[TensorInfo],
    shape: ServeShape,
) -> Result<Vec<u64>, PlacementError> {
    let n = cfg.n_layer;
    (0..n + 2)
        .map(|u| {
            let spec = block_of_units(u, u + 1, n, shape);
            let slots = block_tensors(cfg, tensors, &spec)?;
            let plan = plan_stage(cfg, &StageSpec::from(&spec), &slots);
            Ok(plan.weights_bytes + plan.kv_bytes)
        })
        .collect()
}

/// Cuts `bytes` into `weights.len()` contiguous non-empty pieces whose sums follow the
/// weights; returns each piece's end.
fn cut(bytes: &[u64], weights: &[f64]) -> Vec<usize> {
    let m = bytes.len();
    let w = weights.len();
    let total_w: f64 = weights.iter().sum();
    let total_b: f64 = bytes.iter().map(|&b| b as f64).sum();
    let mut prefix = Vec::with_capacity(m + 1);
    prefix.push(0.0f64);
    for &b in bytes {
        prefix.push(prefix[prefix.len() - 1] + b as f64);
    }
    let mut ends = Vec::with_capacity(w);
    let mut cum_w = 0.0;
    let mut prev = 0usize;
    for (i, &wi) in weights.iter().enumerate() {
        cum_w += wi;
        let left = w - 1 - i;
        let end = if left == 0 {
            m
        } else {
            let target = total_b * cum_w / total_w;
            // The end whose prefix sum is nearest the target, leaving one unit per later
            // worker and taking at least one.
            let best = (0..=m)
                .min_by(|&x, &y| {
                    (prefix[x] - target)
                        .abs()
                        .total_cmp(&(prefix[y] - target).abs())
                })
                .unwrap_or(prev + 1);
            best.clamp(prev + 1, m - left)
        };
        ends.push(end);
        prev = end;
    }
    ends
}

/// Places the model over `workers` (in the order given) with weights `split`, or their free
/// bytes when `split` is `None`; every worker gets at least one part. Errors name the
/// worker that cannot hold what it was given.
pub fn place(
    cfg: &ModelConfig,
    tensors: &[TensorInfo],
    shape: ServeShape,
    workers: &[WorkerCapacity],
    split: Option<&[f64]>,
) -> Result<Plan, PlacementError> {
    if workers.is_empty() {
        return Err(PlacementError::NoWorkers);
    }
    let weights: Vec<f64> = match split {
        Some(s) => {
            let ok = s.len() == workers.len()
                && s.iter().all(|w| w.is_finite() && *w >= 0.0)
                && s.iter().sum::<f64>() > 0.0;
            if !ok {
                return Err(PlacementError::BadSplit {
                    given: s.len(),
                    workers: workers.len(),
                });
            }
            s.to_vec()
        }
        // Equal weights when nobody reports free memory, so a plan still exists to refuse.
        None if workers.iter().all(|w| w.free_bytes == 0) => vec![1.0; workers.len()],
        None => workers.iter().map(|w| w.free_bytes as f64).collect(),
    };
    let units = cfg.n_layer + 2;
    if workers.len() > units {
        return Err(PlacementError::TooManyWorkers {
            workers: workers.len(),
            units,
            layers: cfg.n_layer,
        });
    }
    let ends = cut(&unit_bytes(cfg, tensors, shape)?, &weights);
    let mut start = 0;
    let mut assignments = Vec::with_capacity(workers.len());
    for (worker, &end) in workers.iter().zip(&ends) {
        let spec = block_of_units(start, end, cfg.n_layer, shape);
        start = end;
        let slots = block_tensors(cfg, tensors, &spec)?;
        let bytes = plan_stage(cfg, &StageSpec::from(&spec), &slots);
        if bytes.total_bytes > worker.free_bytes {
            return Err(PlacementError::DoesNotFit {
                addr: worker.addr.clone(),
                first: spec.first_layer,
                last: spec.last_layer,
                extra: parts_suffix(&spec),
                needed: bytes.total_bytes,
                weights: bytes.weights_bytes,
                kv: bytes.kv_bytes,
                scratch: bytes.scratch_bytes,
                free: worker.free_bytes,
            });
        }
        assignments.push(Assignment {
            addr: worker.addr.clone(),
            spec,
            bytes,
            free_bytes: worker.free_bytes,
            tensors: slots.into_iter().map(|s| s.name).collect(),
        });
    }
    Ok(Plan { assignments })
}

fn parts_suffix(spec: &BlockSpec) -> String {
    let mut s = String::new();
    if spec.has_embed {
        s.push_str(" + embedding");
    }
    if spec.has_head {
        s.push_str(" + head");
    }
    s
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for a in &self.assignments {
            writeln!(
                f,
                "{:<24} layers {:>3}..{:<3}{:<20} {:>14} bytes ({} weights + {} KV + {} scratch; {} free)",
                a.addr,
                a.spec.first_layer,
                a.spec.last_layer,
                parts_suffix(&a.spec),
                a.bytes.total_bytes,
                a.bytes.weights_bytes,
                a.bytes.kv_bytes,
                a.bytes.scratch_bytes,
                a.free_bytes,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_gguf::{GgmlType, GgufFile};
    use tether_model::{SynthShape, synthesize};

    fn tiny() -> (ModelConfig, Vec<TensorInfo>) {
        synth(SynthShape::Tiny)
    }

    fn synth(shape: SynthShape) -> (ModelConfig, Vec<TensorInfo>) {
        let dir = std::env::temp_dir().join(format!(
            "tether-placement-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tiny.gguf");
        synthesize(&path, shape, GgmlType::Q8_0, 3).unwrap();
        let file = GgufFile::open(&path).unwrap();
        let cfg = ModelConfig::from_gguf(&file).unwrap();
        let tensors = file.tensors().to_vec();
        let _ = std::fs::remove_dir_all(&dir);
        (cfg, tensors)
    }

    const SHAPE: ServeShape = ServeShape {
        ctx_per_seq: 64,
        n_seq: 2,
        cached_seqs: 0,
        ubatch: 16,
        cache_k: GgmlType::F16,
        cache_v: GgmlType::F16,
    };

    fn workers(free: &[u64]) -> Vec<WorkerCapacity> {
        free.iter()
            .enumerate()
            .map(|(i, &f)| WorkerCapacity {
                addr: format!("w{i}:1"),
                free_bytes: f,
            })
            .collect()
    }

    fn check_covers(plan: &Plan, n_layer: usize) {
        let a = &plan.assignments;
        assert!(a[0].spec.has_embed && a[0].spec.first_layer == 0);
        assert!(a[a.len() - 1].spec.has_head && a[a.len() - 1].spec.last_layer == n_layer);
        for pair in a.windows(2) {
            assert_eq!(pair[0].spec.last_layer, pair[1].spec.first_layer);
            assert!(!pair[0].spec.has_head && !pair[1].spec.has_embed);
        }
    }

    #[test]
    fn one_worker_gets_everything() {
        let (cfg, t) = tiny();
        let plan = place(&cfg, &t, SHAPE, &workers(&[u64::MAX]), None).unwrap();
        assert_eq!(plan.assignments.len(), 1);
        check_covers(&plan, cfg.n_layer);
        let whole: u64 = t.iter().map(|t| t.bytes).sum();
        assert_eq!(plan.assignments[0].bytes.weights_bytes, whole);
    }

    #[test]
    fn three_workers_cover_the_model_contiguously() {
        let (cfg, t) = tiny();
        let plan = place(&cfg, &t, SHAPE, &workers(&[1 << 40; 3]), None).unwrap();
        assert_eq!(plan.assignments.len(), 3);
        check_covers(&plan, cfg.n_layer);
        // Every tensor lands somewhere (rope_freqs is needed by every layer block).
        let mut placed: Vec<&str> = plan
            .assignments
            .iter()
            .flat_map(|a| a.tensors.iter().map(String::as_str))
            .collect();
        placed.sort_unstable();
        placed.dedup();
        let mut all: Vec<&str> = t.iter().map(|t| t.name.as_str()).collect();
        all.sort_unstable();
        assert_eq!(placed, all);
        let text = plan.to_string();
        assert!(text.contains("w0:1") && text.contains("w2:1") && text.contains("head"));
    }

    #[test]
    fn split_weights_move_layers() {
        let bytes = [10, 100, 100, 100, 100, 10];
        assert_eq!(cut(&bytes, &[1.0, 1.0]), vec![3, 6]);
        assert_eq!(cut(&bytes, &[3.0, 1.0]), vec![4, 6]);
        assert_eq!(
            cut(&bytes, &[1.0, 0.0]),
            vec![5, 6],
            "every worker gets a part"
        );
        assert_eq!(cut(&bytes, &[0.0, 1.0]), vec![1, 6]);
        assert_eq!(cut(&bytes, &[1.0, 1.0, 1.0]), vec![2, 4, 6]);
    }

    #[test]
    fn free_memory_decides_without_split() {
        let bytes = [10, 100, 100, 100, 100, 10];
        let free: Vec<f64> = vec![300.0, 100.0];
        assert_eq!(cut(&bytes, &free), vec![4, 6]);
    }

    #[test]
    fn a_worker_that_cannot_fit_is_named() {
        let (cfg, t) = tiny();
        let err = place(
            &cfg,
            &t,
            SHAPE,
            &workers(&[1 << 40, 1000]),
            Some(&[1.0, 1.0]),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("worker w1:1 cannot hold"), "{err}");
        assert!(err.contains("1000 free"), "{err}");
    }

    #[test]
    fn bad_inputs_are_refused() {
        let (cfg, t) = tiny();
        assert!(matches!(
            place(&cfg, &t, SHAPE, &[], None),
            Err(PlacementError::NoWorkers)
        ));
        assert!(matches!(
            place(&cfg, &t, SHAPE, &workers(&[1 << 40; 2]), Some(&[1.0])),
            Err(PlacementError::BadSplit { .. })
        ));
        assert!(matches!(
            place(&cfg, &t, SHAPE, &workers(&[1 << 40; 2]), Some(&[0.0, 0.0])),
            Err(PlacementError::BadSplit { .. })
        ));
        let many = workers(&vec![1 << 40; cfg.n_layer + 3]);
        assert!(matches!(
            place(&cfg, &t, SHAPE, &many, None),
            Err(PlacementError::TooManyWorkers { .. })
        ));
    }

    /// A mixture-of-experts layer is weighed with its stacked experts: the cut follows
    /// bytes, so a layer of experts counts as much as its tensors, not as one layer.
    #[test]
    fn moe_layers_weigh_their_experts() {
        let (cfg, t) = synth(SynthShape::TinyMixtral);
        let units = unit_bytes(&cfg, &t, SHAPE).unwrap();
        let size = |name: &str| t.iter().find(|x| x.name == name).unwrap().bytes;
        let experts: u64 = [
            "ffn_gate_exps",
            "ffn_up_exps",
            "ffn_down_exps",
            "ffn_gate_inp",
        ]
        .iter()
        .map(|s| size(&format!("blk.0.{s}.weight")))
        .sum();
        assert!(units[1] > experts, "{} <= {experts}", units[1]);
        assert!(experts > 4 * size("token_embd.weight"));
        // Free memory 3:1 gives the first worker the embedding and both layers.
        let plan = place(&cfg, &t, SHAPE, &workers(&[3 << 30, 1 << 30]), None).unwrap();
        check_covers(&plan, cfg.n_layer);
        assert_eq!(plan.assignments[0].spec.last_layer, 2);
        let plan = place(&cfg, &t, SHAPE, &workers(&[1 << 30, 1 << 30]), None).unwrap();
        assert_eq!(plan.assignments[0].spec.last_layer, 1, "one layer each");
    }
}
