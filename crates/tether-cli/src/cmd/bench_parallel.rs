//! `tether bench --parallel 1,4,16`: many sequences decoding at once, in one process, as
//! llama-batched-bench measures it: N sequences each take a prompt of `-p` tokens (their
//! prompts together in micro-batches), then `-n` decode steps of N tokens, one a sequence,
//! each sequence fed its own greedy token. Rows give the prompt rate and the aggregate
//! decode rate (every sequence's tokens over the decode time).

use crate::cmd::bench::{BenchArgs, Rate, rate};
use crate::cmd::local::{AnyBackend, DEMO_LABEL, load_stage, open_backend};
use anyhow::{Result, bail};
use std::time::Instant;
use tether_compute::Backend;
use tether_model::{BatchToken, Stage, StepInput, StepOutput};

/// Prints a row per count of sequences.
pub fn run(args: &BenchArgs, counts: &[usize]) -> Result<()> {
    let most = counts.iter().copied().max().unwrap_or(0);
    if counts.contains(&0) || most == 0 {
        bail!("--parallel takes counts of sequences of at least 1, e.g. 1,4,16");
    }
    if args.n_gen == 0 {
        bail!("--parallel measures decoding: give -n above 0");
    }
    if args.device.ubatch < most {
        bail!(
            "--ubatch {} is smaller than {most} sequences: a decode step takes one token of each",
            args.device.ubatch
        );
    }
    // Cells per sequence: its prompt and every decoded token.
    let need = (args.n_prompt + args.n_gen).max(1);
    let mut dev = args.device.clone();
    dev.ctx = Some(dev.ctx.unwrap_or(need).max(need));
    match open_backend(&dev)? {
        AnyBackend::Cpu(b) => measure(args, counts, b, &dev, need, most),
        AnyBackend::Cuda(b) => measure(args, counts, b, &dev, need, most),
    }
}

fn measure<B: Backend>(
    args: &BenchArgs,
    counts: &[usize],
    backend: std::sync::Arc<B>,
    dev: &crate::cmd::local::DeviceArgs,
    need: usize,
    most: usize,
) -> Result<()> {
    let (model, _file, mut stage, ctx) =
        load_stage(backend, &args.model, dev, args.cache, need, most)?;
    if model.is_demo {
        eprintln!("{DEMO_LABEL}");
    }
    let name = model.path.display().to_string();
    if !args.json {
        println!(
            "model: {name} | {:.2} GiB on {} | up to {most} sequences of {ctx} cells | ubatch {}",
            stage.bytes() as f64 / (1u64 << 30) as f64,
            dev.device,
            dev.ubatch
        );
        println!(
            "| sequences | pp{} t/s | tg{} t/s | ± | t/s a sequence | tg t/s with prompts |",
            args.n_prompt, args.n_gen
        );
        println!("|---:|---:|---:|---:|---:|---:|");
    }
    for &n in counts {
        let (mut pp, mut tg, mut both) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..=args.repetitions {
            let (p, g) = once(&mut stage, args, n)?;
            // The first run of each count warms it up (graphs recorded, kernels loaded).
            if i > 0 {
                pp.push(p);
                tg.push(g);
                both.push(p + g);
            }
        }
        let pp = (args.n_prompt > 0).then(|| rate(&pp, n * args.n_prompt));
        let tg = rate(&tg, n * args.n_gen);
        // What a server's generated t/s compares with: its clients' prompts take time too.
        let with_prompts = rate(&both, n * args.n_gen);
        report(args, &name, &dev.device, n, pp, tg, with_prompts);
    }
    Ok(())
}

fn report(
    args: &BenchArgs,
    model: &str,
    device: &str,
    n: usize,
    pp: Option<Rate>,
    tg: Rate,
    with_prompts: Rate,
) {
    if args.json {
        let row = serde_json::json!({
            "model": model, "device": device, "sequences": n,
            "n_prompt": args.n_prompt, "n_gen": args.n_gen,
            "prompt_tokens_per_second": pp.as_ref().map(|r| r.mean),
            "tokens_per_second": tg.mean, "stddev": tg.stddev,
            "tokens_per_second_with_prompts": with_prompts.mean,
            "repetitions": args.repetitions,
        });
        println!("{row}");
    } else {
        let pp = pp.map_or("-".into(), |r| format!("{:.2}", r.mean));
        println!(
            "| {n} | {pp} | {:.2} | {:.2} | {:.2} | {:.2} |",
            tg.mean,
            tg.stddev,
            tg.mean / n as f64,
            with_prompts.mean
        );
    }
}

/// One run of `n` sequences from empty caches: seconds for the prompts and for the decode
/// steps.
fn once<B: Backend>(stage: &mut Stage<B>, args: &BenchArgs, n: usize) -> Result<(f64, f64)> {
    let vocab = stage.config().n_vocab.max(2) as u64;
    let e = stage.config().n_embd;
    let ub = args.device.ubatch;
    for seq in 0..n as u32 {
        stage.kv_clear(seq)?;
    }
    // Deterministic pseudo-random ids, different for each sequence: speed does not depend
    // on which ids they are; token 0 is avoided only because it is often padding.
    let id = |seq: usize, i: usize| {
        (1 + (((seq * 7919 + i) as u64 * 2_654_435_761) >> 7) % (vocab - 1)) as u32
    };
    let prompt: Vec<(u32, BatchToken)> = (0..n)
        .flat_map(|seq| {
            (0..args.n_prompt).map(move |i| {
                let at = BatchToken {
                    seq: seq as u32,
                    pos: i as u32,
                };
                (id(seq, i), at)
            })
        })
        .collect();
    let started = Instant::now();
    let mut hidden = vec![0.0f32; ub.min(prompt.len()) * e];
    for chunk in prompt.chunks(ub) {
        let ids: Vec<u32> = chunk.iter().map(|c| c.0).collect();
        let batch: Vec<BatchToken> = chunk.iter().map(|c| c.1).collect();
        let h = &mut hidden[..chunk.len() * e];
        stage.embed(&ids, h)?;
        stage.forward(&batch, h)?;
    }
    let prompt_secs = started.elapsed().as_secs_f64();
    let mut ids: Vec<u32> = (0..n).map(|seq| id(seq, args.n_prompt)).collect();
    let mut next = vec![0u32; n];
    let started = Instant::now();
    for step in 0..args.n_gen {
        let batch: Vec<BatchToken> = (0..n as u32)
            .map(|seq| BatchToken {
                seq,
                pos: (args.n_prompt + step) as u32,
            })
            .collect();
        stage.decode_step(StepInput::Ids(&ids), &batch, StepOutput::ArgMax(&mut next))?;
        std::mem::swap(&mut ids, &mut next);
    }
    Ok((prompt_secs, started.elapsed().as_secs_f64()))
}
