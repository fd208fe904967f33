//! `tether plan`: what each worker would hold for a model, before anything is loaded —
//! layers, weights, KV cache, scratch and total bytes — against each worker's free memory.
//! The split is the coordinator's own placement (`tether_coordinator::placement::place`)
//! and the bytes come from the planner the workers reserve with
//! (`tether_model::plan_stage`), so the plan is what `tether run`/`serve` would load.

use crate::cmd::cache_args::CacheArgs;
use crate::ctl::units::human_bytes;
use anyhow::{Context, Result, bail};
use clap::Args;
use std::path::PathBuf;
use tether_client::{ClientOptions, WorkerClient};
use tether_compute::{Backend, CpuBackend, KV_BLOCK_CELLS};
use tether_coordinator::engine::cached_prefix_slots;
use tether_coordinator::placement::{ServeShape, WorkerCapacity, place};
use tether_gguf::GgufFile;
use tether_model::kv_ring;
use tether_model::plan::kv_blocks_per_seq;
use tether_model::{ModelConfig, StagePlan};
use tether_protocol::BlockSpec;

/// Arguments of `tether plan`.
#[derive(Args, Debug)]
pub struct PlanArgs {
    /// The GGUF model file.
    #[arg(long)]
    pub model: PathBuf,
    /// Plan for N workers on this machine, sharing its free memory, the model split evenly
    /// between them (default 1 when no --worker is given).
    #[arg(long, value_name = "N", conflicts_with = "workers")]
    pub local_workers: Option<usize>,
    /// A running worker (host:port), in layer order; repeat for more. The model is split in
    /// proportion to each worker's free bytes.
    #[arg(long = "worker", value_name = "ADDR")]
    pub workers: Vec<String>,
    #[command(flatten)]
    pub worker_link: crate::cmd::worker_link::WorkerLinkArgs,
    /// Share of the model per worker, e.g. `3,1` (as `tether run --split`).
    #[arg(long, value_delimiter = ',')]
    pub split: Option<Vec<f64>>,
    /// KV cells per sequence (default: the model's training context, at most 4096).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Sequences served at once, each with its own --ctx cells.
    #[arg(long, default_value_t = 4)]
    pub parallel: usize,
    /// Most tokens in one forward pass (sizes the scratch buffers).
    #[arg(long, default_value_t = 512)]
    pub ubatch: usize,
    /// Cached-prefix sequences beyond --parallel, as `serve --cached-prefixes` (default:
    /// serve's, 3 x --parallel, or none for a model with sliding-window rings); they cost
    /// the workers a block table each.
    #[arg(long, value_name = "N")]
    pub cached_prefixes: Option<usize>,
    #[command(flatten)]
    pub cache: CacheArgs,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One worker's part of the plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerPlan {
    /// `local N` or the worker's address.
    pub name: String,
    /// The layers and serving shape of its block.
    pub spec: BlockSpec,
    /// Bytes the block holds.
    pub bytes: StagePlan,
    /// Bytes free for it there.
    pub free_bytes: u64,
}

impl WorkerPlan {
    /// Whether the block fits in the free bytes.
    pub fn fits(&self) -> bool {
        self.bytes.total_bytes <= self.free_bytes
    }
}

/// Prints the plan of `args.model` over the workers asked for.
pub fn run(args: PlanArgs) -> Result<()> {
    if args.parallel == 0 || args.ubatch == 0 || args.ctx == Some(0) {
        bail!("--ctx, --parallel and --ubatch must all be at least 1");
    }
    let file =
        GgufFile::open(&args.model).with_context(|| format!("reading {}", args.model.display()))?;
    let cfg = ModelConfig::from_gguf(&file)
        .with_context(|| format!("reading the hyper-parameters of {}", args.model.display()))?;
    let ctx = args.ctx.unwrap_or_else(|| cfg.default_context());
    let ring = kv_ring(&cfg, ctx, args.ubatch).is_some();
    let cached_seqs = cached_prefix_slots(args.cached_prefixes, true, args.parallel, ring)
        .map_err(anyhow::Error::msg)?;
    let shape = ServeShape {
        ctx_per_seq: ctx,
        n_seq: args.parallel,
        cached_seqs,
        ubatch: args.ubatch,
        cache_k: args.cache.k(),
        cache_v: args.cache.v(),
    };
    let (names, free, shared) = if args.workers.is_empty() {
        let n = args.local_workers.unwrap_or(1);
        let backend = CpuBackend::new(Some(1)).context("starting the cpu backend")?;
        let host = backend
            .memory_info()
            .context("reading this machine's free memory")?;
        let names = (0..n).map(|i| format!("local {i}")).collect();
        (names, vec![host.free; n], true)
    } else {
        let free = remote_free_bytes(&args.workers, &args.worker_link.client_options()?)?;
        (args.workers.clone(), free, false)
    };
    // Local workers share one memory, so their equal free bytes split the model evenly.
    let workers = plan_workers(&file, &cfg, shape, &names, &free, args.split.as_deref())?;
    let file_weights: u64 = file.tensors().iter().map(|t| t.bytes).sum();
    if args.json {
        let value = plan_json(&workers, file_weights, shared);
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        print_table(&args, &cfg, shape, &workers, file_weights, shared);
    }
    Ok(())
}

fn remote_free_bytes(addrs: &[String], options: &ClientOptions) -> Result<Vec<u64>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let mut free = Vec::with_capacity(addrs.len());
        for addr in addrs {
            let client = WorkerClient::connect(addr, options)
                .await
                .with_context(|| format!("asking worker {addr} for its free memory"))?;
            free.push(client.info().free_bytes);
        }
        Ok(free)
    })
}

/// Places the model over `names` as the coordinator would — by `split` when given, else in
/// proportion to `free` — and plans each block; a block that does not fit is reported, not
/// refused, so the whole plan can be printed.
pub fn plan_workers(
    file: &GgufFile,
    cfg: &ModelConfig,
    shape: ServeShape,
    names: &[String],
    free: &[u64],
    split: Option<&[f64]>,
) -> Result<Vec<WorkerPlan>> {
    let by_free: Vec<f64> = free.iter().map(|&f| f as f64).collect();
    // The coordinator falls back to equal shares when no worker reports free memory.
    let weights = match split {
        Some(s) => s.to_vec(),
        None if free.iter().all(|&f| f == 0) => vec![1.0; names.len()],
        None => by_free,
    };
    let unbounded: Vec<WorkerCapacity> = names
        .iter()
        .map(|name| WorkerCapacity {
            addr: name.clone(),
            free_bytes: u64::MAX,
        })
        .collect();
    let plan = place(cfg, file.tensors(), shape, &unbounded, Some(&weights))
        .context("placing the model on the workers")?;
    Ok(plan
        .assignments
        .into_iter()
        .zip(free)
        .map(|(a, &free_bytes)| WorkerPlan {
            name: a.addr,
            spec: a.spec,
            bytes: a.bytes,
            free_bytes,
        })
        .collect())
}

fn parts(spec: &BlockSpec) -> String {
    let mut s = format!("{}..{}", spec.first_layer, spec.last_layer);
    if spec.has_embed {
        s.push_str(" +embd");
    }
    if spec.has_head {
        s.push_str(" +head");
    }
    s
}

/// Whether the plan fits: on one machine the local workers share its free memory.
fn plan_fits(workers: &[WorkerPlan], shared: bool) -> bool {
    if shared {
        let total: u64 = workers.iter().map(|w| w.bytes.total_bytes).sum();
        workers.first().is_some_and(|w| total <= w.free_bytes)
    } else {
        workers.iter().all(WorkerPlan::fits)
    }
}

/// The plan as one JSON object: `weights_bytes` counts every tensor of the file, the other
/// totals sum the workers.
pub fn plan_json(workers: &[WorkerPlan], file_weights: u64, shared: bool) -> serde_json::Value {
    let kv: u64 = workers.iter().map(|w| w.bytes.kv_bytes).sum();
    let scratch: u64 = workers.iter().map(|w| w.bytes.scratch_bytes).sum();
    let list: Vec<serde_json::Value> = workers
        .iter()
        .map(|w| {
            serde_json::json!({
                "worker": w.name,
                "layers": parts(&w.spec),
                "first_layer": w.spec.first_layer,
                "last_layer": w.spec.last_layer,
                "has_embed": w.spec.has_embed,
                "has_head": w.spec.has_head,
                "weights_bytes": w.bytes.weights_bytes,
                "kv_bytes": w.bytes.kv_bytes,
                "scratch_bytes": w.bytes.scratch_bytes,
                "total_bytes": w.bytes.total_bytes,
                "free_bytes": w.free_bytes,
                "fits": w.fits(),
            })
        })
        .collect();
    let first = workers.first().map(|w| w.spec);
    serde_json::json!({
        "ctx_per_seq": first.map_or(0, |s| s.ctx_per_seq),
        "parallel": first.map_or(0, |s| s.n_seq),
        "ubatch": first.map_or(0, |s| s.ubatch),
        "kv_block_cells": KV_BLOCK_CELLS,
        "kv_blocks": first.map_or(0, |s| s.n_seq * kv_blocks_per_seq(s.ctx_per_seq)),
        "cached_prefixes": first.map_or(0, |s| s.cached_seqs),
        "cache_type_k": first.map_or("f16", |s| s.cache_k.name()),
        "cache_type_v": first.map_or("f16", |s| s.cache_v.name()),
        "weights_bytes": file_weights,
        "kv_bytes": kv,
        "scratch_bytes": scratch,
        "total_bytes": file_weights + kv + scratch,
        "workers_total_bytes": workers.iter().map(|w| w.bytes.total_bytes).sum::<u64>(),
        "shared_memory": shared,
        "fits": plan_fits(workers, shared),
        "workers": list,
    })
}

fn print_table(
    args: &PlanArgs,
    cfg: &ModelConfig,
    shape: ServeShape,
    workers: &[WorkerPlan],
    file_weights: u64,
    shared: bool,
) {
    println!(
        "{}: {} layers; {} cells x {} sequences, ubatch {}, KV cache K {} V {}",
        args.model.display(),
        cfg.n_layer,
        shape.ctx_per_seq,
        shape.n_seq,
        shape.ubatch,
        shape.cache_k,
        shape.cache_v
    );
    if let Some(w) = workers.first() {
        println!(
            "paged KV pool: {} blocks of {} cells ({} a sequence), shared by the {} running \
             and {} cached-prefix sequences",
            w.spec.n_seq * kv_blocks_per_seq(w.spec.ctx_per_seq),
            KV_BLOCK_CELLS,
            kv_blocks_per_seq(w.spec.ctx_per_seq),
            w.spec.n_seq,
            w.spec.cached_seqs
        );
    }
    println!(
        "{:<22} {:<16} {:>11} {:>11} {:>11} {:>11} {:>11}  fits",
        "worker", "layers", "weights", "kv", "scratch", "total", "free"
    );
    for w in workers {
        println!(
            "{:<22} {:<16} {:>11} {:>11} {:>11} {:>11} {:>11}  {}",
            w.name,
            parts(&w.spec),
            human_bytes(w.bytes.weights_bytes),
            human_bytes(w.bytes.kv_bytes),
            human_bytes(w.bytes.scratch_bytes),
            human_bytes(w.bytes.total_bytes),
            human_bytes(w.free_bytes),
            if w.fits() { "yes" } else { "no" }
        );
    }
    let kv: u64 = workers.iter().map(|w| w.bytes.kv_bytes).sum();
    let scratch: u64 = workers.iter().map(|w| w.bytes.scratch_bytes).sum();
    let total: u64 = workers.iter().map(|w| w.bytes.total_bytes).sum();
    println!(
        "{:<22} {:<16} {:>11} {:>11} {:>11} {:>11} {:>11}  {}",
        "all",
        "",
        human_bytes(file_weights),
        human_bytes(kv),
        human_bytes(scratch),
        human_bytes(total),
        "",
        if plan_fits(workers, shared) {
            "yes"
        } else {
            "no"
        }
    );
    if shared {
        println!("local workers share this machine's free memory; \"all\" must fit in it");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_gguf::GgmlType;
    use tether_model::Stage;

    #[test]
    fn json_totals_add_up() {
        let spec = BlockSpec {
            first_layer: 0,
            last_layer: 2,
            has_embed: true,
            has_head: false,
            ctx_per_seq: 8,
            n_seq: 2,
            cached_seqs: 0,
            ubatch: 4,
            cache_k: tether_gguf::GgmlType::Q8_0,
            cache_v: tether_gguf::GgmlType::Q8_0,
        };
        let plan = |w: u64, kv: u64, s: u64| StagePlan {
            weights_bytes: w,
            kv_bytes: kv,
            scratch_bytes: s,
            total_bytes: w + kv + s,
        };
        let workers = vec![
            WorkerPlan {
                name: "a".into(),
                spec,
                bytes: plan(100, 10, 1),
                free_bytes: 1000,
            },
            WorkerPlan {
                name: "b".into(),
                spec: BlockSpec {
                    first_layer: 2,
                    last_layer: 4,
                    has_embed: false,
                    has_head: true,
                    ..spec
                },
                bytes: plan(200, 20, 2),
                free_bytes: 100,
            },
        ];
        let v = plan_json(&workers, 290, false);
        assert_eq!(v["weights_bytes"], 290);
        assert_eq!(v["kv_bytes"], 30);
        assert_eq!(v["cache_type_k"], "q8_0");
        assert_eq!(v["scratch_bytes"], 3);
        assert_eq!(v["total_bytes"], 323);
        assert_eq!(v["workers"][1]["fits"], false);
        assert_eq!(v["fits"], false);
        // On one machine the sum must fit in the shared free memory.
        assert_eq!(plan_json(&workers[..1], 100, true)["fits"], true);
    }

    #[test]
    fn each_worker_plan_is_what_a_built_stage_holds() {
        let dir = std::env::temp_dir().join(format!(
            "tether-plan-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tiny.gguf");
        tether_model::synthesize(
            &path,
            tether_model::SynthShape::Tiny,
            tether_gguf::GgmlType::F32,
            5,
        )
        .unwrap();
        let file = GgufFile::open(&path).unwrap();
        let cfg = ModelConfig::from_gguf(&file).unwrap();
        let names = vec!["a".to_string(), "b".to_string()];
        let mut f16_kv = 0;
        for ty in [GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0] {
            let shape = ServeShape {
                ctx_per_seq: 32,
                n_seq: 2,
                cached_seqs: 0,
                ubatch: 8,
                cache_k: ty,
                cache_v: ty,
            };
            let workers = plan_workers(&file, &cfg, shape, &names, &[0, 0], None).unwrap();
            check_against_stages(&file, &cfg, &workers);
            // The caches alone: each worker's block table is a u32 for each of the 2
            // sequences' one block.
            let kv: u64 = workers.iter().map(|w| w.bytes.kv_bytes - 2 * 4).sum();
            if ty == GgmlType::F16 {
                f16_kv = kv;
            }
            // Blocks of 32 values: f16 takes 64 bytes, q8_0 34 and q4_0 18.
            let per_32 = ty.block_bytes() as u64 * 32 / ty.block_elems() as u64;
            assert_eq!(kv * 64, f16_kv * per_32, "{ty}");
        }
        let mixed = ServeShape {
            ctx_per_seq: 32,
            n_seq: 2,
            cached_seqs: 0,
            ubatch: 8,
            cache_k: GgmlType::Q8_0,
            cache_v: GgmlType::F16,
        };
        let err = plan_workers(&file, &cfg, mixed, &names, &[0, 0], None).unwrap_err();
        assert!(format!("{err:#}").contains("same type"), "{err:#}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn check_against_stages(file: &GgufFile, cfg: &ModelConfig, workers: &[WorkerPlan]) {
        assert_eq!(workers[0].spec.first_layer, 0);
        assert_eq!(workers[1].spec.last_layer, cfg.n_layer);
        assert_eq!(workers[0].spec.last_layer, workers[1].spec.first_layer);
        assert!(workers[0].spec.has_embed && workers[1].spec.has_head);
        let backend = std::sync::Arc::new(CpuBackend::new(Some(1)).unwrap());
        for w in workers {
            let spec = tether_model::StageSpec::from(&w.spec);
            let slots = tether_model::required_tensors(cfg, &spec, file.tensors()).unwrap();
            let stage =
                Stage::new(std::sync::Arc::clone(&backend), cfg.clone(), spec, &slots).unwrap();
            assert_eq!(stage.bytes(), w.bytes.total_bytes, "worker {}", w.name);
            assert!(w.bytes.kv_bytes > 0 && w.bytes.scratch_bytes > 0);
        }
        let file_weights: u64 = file.tensors().iter().map(|t| t.bytes).sum();
        let v = plan_json(workers, file_weights, true);
        assert_eq!(v["weights_bytes"], file_weights);
        assert_eq!(v["workers"].as_array().map(Vec::len), Some(2));
        assert_eq!(v["cache_type_k"], workers[0].spec.cache_k.name());
    }
}
