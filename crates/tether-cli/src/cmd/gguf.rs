//! `tether gguf inspect|synth`.

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use std::path::PathBuf;
use std::time::Instant;
use tether_gguf::GgufFile;
use tether_model::synth::{SynthShape, SynthType, synthesize};

/// GGUF file tools.
#[derive(Subcommand, Debug)]
pub enum GgufCommand {
    /// Print a GGUF file's metadata and tensor table.
    Inspect(InspectArgs),
    /// Write a model file with random weights of a real model's shape.
    Synth(SynthArgs),
}

/// `tether gguf inspect`.
#[derive(Args, Debug)]
pub struct InspectArgs {
    /// The GGUF file.
    pub file: PathBuf,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `tether gguf synth`.
#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Output path.
    pub out: PathBuf,
    /// Model shape: tiny, tiny-qwen2, tiny-qwen3, llama3-1b, llama3-8b, llama3-70b, llama2-7b,
    /// qwen2-0.5b, qwen2.5-14b, qwen3-8b.
    #[arg(long, default_value = "tiny")]
    pub shape: String,
    /// Weight type of every matrix: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k,
    /// q4_k, q5_k, q6_k, iq4_nl, iq4_xs; or a per-tensor mix as llama.cpp's quantizer makes
    /// it: q3_k_m, q4_k_m, q5_k_m, q2_k_mix (llama.cpp's Q2_K file), iq4_xs_mix (its IQ4_XS).
    #[arg(long = "type", default_value = "q4_0")]
    pub ty: String,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// Runs a `tether gguf` subcommand.
pub fn run(command: GgufCommand) -> Result<()> {
    match command {
        GgufCommand::Inspect(args) => {
            let file = GgufFile::open(&args.file)
                .with_context(|| format!("reading {}", args.file.display()))?;
            if args.json {
                let value = tether_gguf::inspect::describe_json(&file);
                println!("{}", serde_json::to_string_pretty(&value)?);
            } else {
                print!("{}", tether_gguf::inspect::describe(&file));
            }
            Ok(())
        }
        GgufCommand::Synth(args) => {
            let Some(shape) = SynthShape::from_name(&args.shape) else {
                bail!(
                    "unknown shape {:?}; choose one of {}",
                    args.shape,
                    SynthShape::ALL
                        .iter()
                        .map(|s| s.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            };
            let Some(ty) = SynthType::from_name(&args.ty) else {
                bail!(
                    "unknown weight type {:?}; see `tether gguf synth --help` for the types and mixes",
                    args.ty
                );
            };
            let start = Instant::now();
            synthesize(&args.out, shape, ty, args.seed)
                .with_context(|| format!("writing {}", args.out.display()))?;
            let bytes = std::fs::metadata(&args.out).map(|m| m.len()).unwrap_or(0);
            println!(
                "wrote {} ({} {}, seed {}, random weights): {:.2} GB in {:.1} s",
                args.out.display(),
                args.shape,
                ty,
                args.seed,
                bytes as f64 / 1e9,
                start.elapsed().as_secs_f64()
            );
            Ok(())
        }
    }
}
