//! `tether bench`: prompt-processing and generation speed, as llama-bench measures them
//! (`pp N`: N prompt tokens from an empty context; `tg N`: N tokens decoded one at a time).

use crate::cmd::bench_serve::{ServeBenchArgs, refuse_stray_flags};
use crate::cmd::cache_args::CacheArgs;
use crate::cmd::local::{AnyBackend, DEMO_LABEL, DeviceArgs, Loaded, load, open_backend};
use crate::model_source::ModelArgs;
use anyhow::{Result, bail};
use clap::Args;
use std::time::Instant;
use tether_compute::Backend;
use tether_model::{Sampler, SamplingParams};

/// Arguments of `tether bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
    /// Prompt tokens per `pp` test (0 skips it).
    #[arg(long = "n-prompt", short = 'p', default_value_t = 512)]
    pub n_prompt: usize,
    /// Generated tokens per `tg` test (0 skips it).
    #[arg(long = "n-gen", short = 'n', default_value_t = 128)]
    pub n_gen: usize,
    /// Measured repetitions of each test (after one warm-up).
    #[arg(long, short = 'r', default_value_t = 3)]
    pub repetitions: usize,
    /// Print one JSON object per test instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Instead, measure decode through the coordinator with these numbers of embedded
    /// workers (e.g. `1,2`) and print each one's ratio to the first. The workers take the
    /// GPUs `--device` names in turn (`cuda:0`: all on GPU 0; `cuda`: one per GPU), or the
    /// cpu.
    #[arg(long, value_delimiter = ',')]
    pub pipeline: Option<Vec<usize>>,
    /// Instead, measure these numbers of sequences decoding at once in this process (e.g.
    /// `1,4,16,64`), as llama-batched-bench does: each sequence takes a prompt of `-p`
    /// tokens, then `-n` decode steps take one token of every sequence; rows give the
    /// aggregate tokens/s. With --serve: the server's sequences (one count; default
    /// --clients). With --pipeline, one count: that many requests at once through
    /// the coordinator, rows giving their aggregate prompt and decode tokens/s.
    #[arg(long, value_delimiter = ',')]
    pub parallel: Option<Vec<usize>>,
    /// With --pipeline: send forward passes over gRPC instead of the workers' data links.
    #[arg(long, requires = "pipeline")]
    pub grpc_forward: bool,
    #[command(flatten)]
    pub serve: ServeBenchArgs,
    /// With --pipeline: lanes of sequences that go through the workers on their own
    /// (default: one per worker).
    #[arg(long, requires = "pipeline")]
    pub pipeline_lanes: Option<usize>,
    /// With --pipeline: fewest prompt tokens in one forward pass when a prompt is cut into
    /// chunks so that several workers overlap.
    #[arg(long, requires = "pipeline", default_value_t = tether_coordinator::engine::DEFAULT_PREFILL_CHUNK)]
    pub prefill_chunk: usize,
}

/// Mean and standard deviation of tokens per second over the repetitions.
pub(crate) struct Rate {
    pub(crate) mean: f64,
    pub(crate) stddev: f64,
}

/// The rate of `tokens` in each of `samples` seconds.
pub(crate) fn rate(samples: &[f64], tokens: usize) -> Rate {
    let tps: Vec<f64> = samples.iter().map(|s| tokens as f64 / s).collect();
    let mean = tps.iter().sum::<f64>() / tps.len() as f64;
    let var = tps.iter().map(|t| (t - mean) * (t - mean)).sum::<f64>() / tps.len() as f64;
    Rate {
        mean,
        stddev: var.sqrt(),
    }
}

/// Runs the tests and prints a row per test.
pub fn run(args: BenchArgs) -> Result<()> {
    if args.serve.chosen() {
        return crate::cmd::bench_serve::run(&args);
    }
    refuse_stray_flags(&args.serve)?;
    if args.repetitions == 0 {
        bail!("--repetitions must be at least 1");
    }
    if let Some(counts) = &args.pipeline {
        return crate::cmd::bench_pipeline::run(&args, counts);
    }
    if let Some(counts) = &args.parallel {
        return crate::cmd::bench_parallel::run(&args, counts);
    }
    let need = args.n_prompt.max(args.n_gen + 1).max(1);
    let mut dev = args.device.clone();
    dev.ctx = Some(dev.ctx.unwrap_or(need).max(need));
    match open_backend(&dev)? {
        AnyBackend::Cpu(b) => {
            // Which kernels ran belongs with the figures (`TETHER_CPU_ISA` may lower them).
            let isa = Some(b.isa().name());
            bench_on(
                &args,
                &dev,
                isa,
                load(b, &args.model, &dev, args.cache, need)?,
            )
        }
        AnyBackend::Cuda(b) => bench_on(
            &args,
            &dev,
            None,
            load(b, &args.model, &dev, args.cache, need)?,
        ),
    }
}

fn bench_on<B: Backend>(
    args: &BenchArgs,
    dev: &DeviceArgs,
    cpu_isa: Option<&str>,
    mut loaded: Loaded<B>,
) -> Result<()> {
    if loaded.model.is_demo {
        eprintln!("{DEMO_LABEL}");
    }
    let n_vocab = loaded.generator.stage().config().n_vocab as u64;
    let weights = loaded.generator.stage().bytes();
    // Deterministic pseudo-random prompt: speed does not depend on which ids they are.
    let prompt: Vec<u32> = (0..args.n_prompt as u64)
        .map(|i| ((i.wrapping_mul(2_654_435_761) >> 7) % n_vocab) as u32)
        .collect();
    let name = loaded.model.path.display().to_string();
    if !args.json {
        println!(
            "model: {name} | {:.2} GiB on {} | ctx {} | ubatch {}",
            weights as f64 / (1u64 << 30) as f64,
            match cpu_isa {
                Some(isa) => format!("{} ({isa} kernels)", dev.device),
                None => dev.device.clone(),
            },
            loaded.ctx,
            dev.ubatch
        );
        println!("| test | t/s | ± |");
        println!("|---|---:|---:|");
    }
    let report = |test: String, r: Rate| {
        if args.json {
            let row = serde_json::json!({
                "model": name, "device": dev.device, "cpu_isa": cpu_isa, "test": test,
                "tokens_per_second": r.mean, "stddev": r.stddev,
                "repetitions": args.repetitions, "ubatch": dev.ubatch,
            });
            println!("{row}");
        } else {
            println!("| {test} | {:.2} | {:.2} |", r.mean, r.stddev);
        }
    };
    if args.n_prompt > 0 {
        let mut samples = Vec::new();
        for i in 0..=args.repetitions {
            let t = Instant::now();
            loaded.generator.prefill_logits(&prompt)?;
            if i > 0 {
                samples.push(t.elapsed().as_secs_f64());
            }
        }
        report(
            format!("pp{}", args.n_prompt),
            rate(&samples, args.n_prompt),
        );
    }
    if args.n_gen > 0 {
        let mut samples = Vec::new();
        for i in 0..=args.repetitions {
            let mut sampler = Sampler::new(SamplingParams::greedy());
            let t = Instant::now();
            let (out, _) =
                loaded
                    .generator
                    .generate(&[1], args.n_gen, &mut sampler, &[], |_| true)?;
            if out.len() != args.n_gen {
                bail!(
                    "generation stopped after {} of {} tokens",
                    out.len(),
                    args.n_gen
                );
            }
            if i > 0 {
                samples.push(t.elapsed().as_secs_f64());
            }
        }
        report(format!("tg{}", args.n_gen), rate(&samples, args.n_gen));
    }
    Ok(())
}
