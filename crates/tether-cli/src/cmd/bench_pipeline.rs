//! `tether bench --pipeline 1,2`: the cost of splitting a model over workers — prompt and
//! decode tokens/s through the coordinator with 1, 2, ... embedded workers (real gRPC on
//! loopback) on the device `--device` names, measured in one run, the counts taking turns
//! repetition by repetition, so the rows compare as a ratio. With `--parallel N`, N
//! requests run at once and the rows are their aggregate rates.

use crate::cmd::bench::BenchArgs;
use crate::cmd::local::DEMO_LABEL;
use crate::device::gpus_named;
use anyhow::{Context, Result, bail};
use std::time::Instant;
use tether_client::ClientOptions;
use tether_coordinator::api::{GenEvent, GenRequest, Generation};
use tether_coordinator::{Coordinator, CoordinatorConfig, ModelFile};
use tether_worker::embedded::{LocalOptions, LocalWorkers};

/// Prints a `ppN` row (with -p above 0) and a `tgN` row per worker count, each with its
/// ratio to the first count.
pub fn run(args: &BenchArgs, counts: &[usize]) -> Result<()> {
    if counts.is_empty() || counts.contains(&0) {
        bail!("--pipeline takes worker counts of at least 1, e.g. 1,2");
    }
    if args.n_gen == 0 {
        bail!("--pipeline measures generation: give -n above 0");
    }
    let sequences = match args.parallel.as_deref() {
        None => 1,
        Some(&[n]) if n > 0 => n,
        Some(_) => bail!("with --pipeline, --parallel takes one count of sequences, e.g. 64"),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let resolved = args.model.resolve()?;
    if resolved.is_demo {
        eprintln!("{DEMO_LABEL}");
    }
    let model = ModelFile::open(&resolved.path)?;
    println!(
        "model: {} | through the coordinator | {sequences} sequence(s) at once | ctx {} | \
         ubatch {} | prefill chunks of at least {}",
        resolved.path.display(),
        ctx(args),
        args.device.ubatch,
        args.prefill_chunk
    );
    println!(
        "| test | workers | t/s | ± | vs {} worker(s) | ms/token in blocks | ms/token between |",
        counts[0]
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let samples = runtime.block_on(measure_interleaved(args, &model, counts, sequences))?;
    let rows: Vec<_> = counts
        .iter()
        .zip(samples)
        .map(|(&n, samples)| {
            let pp: Vec<f64> = samples.iter().map(|s| s.0).collect();
            let tg: Vec<f64> = samples.iter().map(|s| s.1).collect();
            let inside = samples.iter().map(|s| s.2).sum::<f64>() / samples.len().max(1) as f64;
            (n, pp, tg, inside)
        })
        .collect();
    let tables = [
        (format!("pp{}", args.n_prompt), 1, args.n_prompt > 0),
        (format!("tg{}", args.n_gen), 2, true),
    ];
    for (name, column, shown) in tables {
        if !shown {
            continue;
        }
        let mut first = None;
        for (n, pp, tg, inside) in &rows {
            let samples = if column == 1 { pp } else { tg };
            let mean = samples.iter().sum::<f64>() / samples.len() as f64;
            let var =
                samples.iter().map(|s| (s - mean) * (s - mean)).sum::<f64>() / samples.len() as f64;
            let base = *first.get_or_insert(mean);
            // Where a decode token's time goes: running the blocks, and everything else
            // (sockets, threads, the coordinator).
            let split = if column == 2 {
                let per_token = 1e3 / mean;
                format!("{inside:.3} | {:.3}", per_token - inside)
            } else {
                "| ".into()
            };
            println!(
                "| {name} | {n} | {mean:.2} | {:.2} | {:.3} | {split} |",
                var.sqrt(),
                mean / base
            );
        }
    }
    Ok(())
}

/// Context cells: the prompt, the generated tokens and a little room.
fn ctx(args: &BenchArgs) -> usize {
    args.n_prompt + args.n_gen + 2
}

/// Prompt rates (prompt tokens over the time to the first token), decode rates (tokens/s
/// after the first token) and ms a token inside the blocks, of `repetitions` greedy
/// generations through each count of embedded workers, after one warm-up each. Every
/// count's workers stay loaded and the repetitions take turns (1, 2, 1, 2, ...), so a
/// machine that drifts during the run moves every row alike instead of the last one.
async fn measure_interleaved(
    args: &BenchArgs,
    model: &std::sync::Arc<ModelFile>,
    counts: &[usize],
    sequences: usize,
) -> Result<Vec<Vec<(f64, f64, f64)>>> {
    let mut setups = Vec::with_capacity(counts.len());
    for &n in counts {
        setups.push(Setup::start(args, model, n, sequences).await?);
    }
    let vocab = model.config().n_vocab.max(2) as u64;
    // Any ids work for timing; token 0 is avoided only because it is often padding.
    let prompt: Vec<u32> = (0..args.n_prompt.max(1) as u64)
        .map(|i| (1 + i * 7919 % (vocab - 1)) as u32)
        .collect();
    let mut rates = vec![Vec::new(); setups.len()];
    let mut failed = None;
    'runs: for i in 0..=args.repetitions {
        for (setup, rates) in setups.iter().zip(rates.iter_mut()) {
            let sample = match sequences {
                1 => setup.generate(args, &prompt).await,
                _ => setup.generate_many(args, &prompt, sequences).await,
            };
            match sample {
                // The first round warms every setup up.
                Ok(sample) if i > 0 => rates.push(sample),
                Ok(_) => {}
                Err(e) => {
                    failed = Some(e);
                    break 'runs;
                }
            }
        }
    }
    for setup in setups {
        setup.shutdown().await;
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(rates),
    }
}

/// `n` embedded workers and a coordinator that has loaded the model over them.
struct Setup {
    n: usize,
    workers: LocalWorkers,
    coordinator: Coordinator,
}

impl Setup {
    async fn start(
        args: &BenchArgs,
        model: &std::sync::Arc<ModelFile>,
        n: usize,
        sequences: usize,
    ) -> Result<Self> {
        // The workers share the GPUs `--device` names in turn (two on `cuda:0` both use
        // GPU 0); with none named they are cpu workers.
        let options = LocalOptions {
            threads: args.device.threads,
            max_memory: None,
            gpus: gpus_named(&args.device.device)?,
            cuda: tether_compute::CudaTuning::from_env(),
            ..LocalOptions::default()
        };
        let workers = LocalWorkers::start(n, &options).await?;
        let mut config = CoordinatorConfig {
            ctx_per_seq: ctx(args),
            parallel: sequences,
            queue_depth: sequences.max(1),
            pipeline_lanes: args.pipeline_lanes,
            prefill_chunk: args.prefill_chunk,
            ubatch: args.device.ubatch,
            cache_k: args.cache.k(),
            cache_v: args.cache.v(),
            client: ClientOptions::with_token(workers.token().clone()),
            // Every repetition sends the same prompt: a cached prefix would skip the
            // prefill this bench measures.
            prefix_cache: false,
            ..CoordinatorConfig::new(model, workers.addrs())
        };
        config.load.data_links = !args.grpc_forward;
        let coordinator = Coordinator::start(model.clone(), config).await?;
        Ok(Self {
            n,
            workers,
            coordinator,
        })
    }

    /// One greedy generation: its prompt rate, decode rate and ms a token in the blocks.
    async fn generate(&self, args: &BenchArgs, prompt: &[u32]) -> Result<(f64, f64, f64)> {
        let n = self.n;
        let submitted = Instant::now();
        let mut events = self
            .coordinator
            .submit(GenRequest::greedy(prompt, args.n_gen))?;
        let workers = &self.workers;
        let (mut first, mut tokens, mut inside_from) = (None, 0usize, workers.forward_time());
        loop {
            match events.recv().await {
                Some(Ok(GenEvent::Token(_))) => {
                    if first.is_none() {
                        first = Some(Instant::now());
                        inside_from = workers.forward_time();
                    }
                    tokens += 1;
                }
                Some(Ok(GenEvent::Done { .. })) => break,
                Some(Ok(GenEvent::Scored(_) | GenEvent::Prompt(_) | GenEvent::Embedding(_))) => {
                    bail!("the engine sent log-probabilities that were not asked for")
                }
                Some(Err(e)) => bail!("generation through {n} worker(s) failed: {e}"),
                None => bail!("the engine stopped without finishing"),
            }
        }
        let Some(first) = first else {
            bail!("no token was generated through {n} worker(s)");
        };
        if tokens < 2 {
            bail!(
                "generation ended after {tokens} token(s); use a model that does not stop at once"
            );
        }
        let pp = prompt.len() as f64 / (first - submitted).as_secs_f64();
        let decode = (tokens - 1) as f64;
        let inside = (workers.forward_time() - inside_from).as_secs_f64() * 1e3 / decode;
        Ok((pp, decode / first.elapsed().as_secs_f64(), inside))
    }

    /// `sequences` greedy generations at once: their aggregate prompt rate (every prompt
    /// token over the time until every sequence has its first token), aggregate decode rate
    /// (the tokens generated after that over the time until the last one) and ms of block
    /// time per generated token.
    async fn generate_many(
        &self,
        args: &BenchArgs,
        prompt: &[u32],
        sequences: usize,
    ) -> Result<(f64, f64, f64)> {
        let n = self.n;
        let submitted = Instant::now();
        let inside_from = self.workers.forward_time();
        let mut streams = Vec::with_capacity(sequences);
        for _ in 0..sequences {
            streams.push(
                self.coordinator
                    .submit(GenRequest::greedy(prompt, args.n_gen))?,
            );
        }
        // Each stream on its own task, so a token's time is when it came, not when a loop
        // over the streams got to it.
        let readers: Vec<_> = streams
            .into_iter()
            .map(|mut events| {
                tokio::spawn(async move {
                    let mut times = Vec::new();
                    loop {
                        match events.recv().await {
                            Some(Ok(GenEvent::Token(_))) => times.push(Instant::now()),
                            Some(Ok(GenEvent::Done { .. })) => return Ok(times),
                            Some(Ok(
                                GenEvent::Scored(_) | GenEvent::Prompt(_) | GenEvent::Embedding(_),
                            )) => {
                                return Err("the engine sent log-probabilities that were \
                                            not asked for"
                                    .into());
                            }
                            Some(Err(e)) => return Err(e.to_string()),
                            None => return Err("the engine stopped without finishing".into()),
                        }
                    }
                })
            })
            .collect();
        let mut times = Vec::with_capacity(sequences);
        for reader in readers {
            match reader.await.context("a stream's reader failed")? {
                Ok(t) if t.len() >= 2 => times.push(t),
                Ok(t) => bail!(
                    "a generation ended after {} token(s); use a model that does not stop at once",
                    t.len()
                ),
                Err(e) => bail!("generation through {n} worker(s) failed: {e}"),
            }
        }
        let all_first = times.iter().map(|t| t[0]).max().unwrap_or(submitted);
        let end = times
            .iter()
            .filter_map(|t| t.last().copied())
            .max()
            .unwrap_or(all_first);
        let after: usize = times
            .iter()
            .map(|t| t.iter().filter(|&&at| at > all_first).count())
            .sum();
        let generated: usize = times.iter().map(Vec::len).sum();
        let pp = (prompt.len() * sequences) as f64 / (all_first - submitted).as_secs_f64();
        let decode = after as f64 / (end - all_first).as_secs_f64().max(1e-9);
        let inside =
            (self.workers.forward_time() - inside_from).as_secs_f64() * 1e3 / generated as f64;
        Ok((pp, decode, inside))
    }

    async fn shutdown(self) {
        self.coordinator.shutdown().await;
        self.workers.shutdown().await;
    }
}
