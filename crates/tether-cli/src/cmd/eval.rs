//! `tether eval`: the logits of every position of a token sequence, for comparisons with
//! other implementations.

use crate::cmd::cache_args::CacheArgs;
use crate::cmd::local::{AnyBackend, DEMO_LABEL, DeviceArgs, Loaded, load, open_backend};
use crate::model_source::ModelArgs;
use anyhow::{Context, Result, bail};
use clap::Args;
use std::io::Write;
use std::path::PathBuf;
use tether_compute::Backend;

/// Arguments of `tether eval`.
#[derive(Args, Debug)]
pub struct EvalArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
    /// Token ids separated by commas or spaces (e.g. `1,450,4996`).
    #[arg(long)]
    pub tokens: String,
    /// Write the logits here: little-endian f32, `[n_tokens][n_vocab]`, row by row.
    #[arg(long)]
    pub logits_out: Option<PathBuf>,
}

/// Parses `1,2 3` into ids.
fn parse_tokens(text: &str) -> Result<Vec<u32>> {
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u32>()
                .with_context(|| format!("token id {s:?} is not a non-negative integer"))
        })
        .collect()
}

/// Prints the arg-max token of each position and optionally writes all logits.
pub fn run(args: EvalArgs) -> Result<()> {
    let tokens = parse_tokens(&args.tokens)?;
    if tokens.is_empty() {
        bail!("--tokens is empty");
    }
    let dev = &args.device;
    match open_backend(dev)? {
        AnyBackend::Cpu(b) => eval_on(
            &args,
            &tokens,
            load(b, &args.model, dev, args.cache, tokens.len())?,
        ),
        AnyBackend::Cuda(b) => eval_on(
            &args,
            &tokens,
            load(b, &args.model, dev, args.cache, tokens.len())?,
        ),
    }
}

fn eval_on<B: Backend>(args: &EvalArgs, tokens: &[u32], mut loaded: Loaded<B>) -> Result<()> {
    if loaded.model.is_demo {
        eprintln!("{DEMO_LABEL}");
    }
    let n_vocab = loaded.generator.stage().config().n_vocab;
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
        bail!("token id {bad} is outside the vocabulary of {n_vocab} tokens");
    }
    let logits = loaded.generator.eval_logits(tokens)?;
    let mut stdout = std::io::stdout().lock();
    for (i, row) in logits.chunks(n_vocab).enumerate() {
        let (best, value) =
            row.iter()
                .enumerate()
                .fold((0usize, f32::NEG_INFINITY), |acc, (j, &v)| {
                    if v > acc.1 { (j, v) } else { acc }
                });
        writeln!(stdout, "{i}\t{}\t{best}\t{value:.6}", tokens[i])?;
    }
    if let Some(path) = &args.logits_out {
        let mut bytes = Vec::with_capacity(logits.len() * 4);
        for v in &logits {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))?;
        eprintln!(
            "wrote {} x {} logits to {}",
            tokens.len(),
            n_vocab,
            path.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_tokens;

    #[test]
    fn token_lists_parse_and_garbage_is_refused() {
        assert_eq!(parse_tokens("1, 2 3,").unwrap(), vec![1, 2, 3]);
        assert!(parse_tokens("1,-2").is_err());
        assert!(parse_tokens("x").is_err());
    }
}
