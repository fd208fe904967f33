//! `tether run`: generate text from a prompt in this process.

use crate::cmd::local::{DEMO_LABEL, DeviceArgs, load};
use crate::model_source::ModelArgs;
use anyhow::{Result, bail};
use clap::Args;
use std::io::Write;
use std::time::Instant;
use tether_model::tokenizer::Tokenizer;
use tether_model::{Sampler, SamplingParams, StopReason};

/// Arguments of `tether run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// The prompt.
    #[arg(long, short = 'p', default_value = "Once upon a time")]
    pub prompt: String,
    /// Most tokens to generate.
    #[arg(long = "n-predict", short = 'n', default_value_t = 64)]
    pub n_predict: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Do not add the BOS token even when the model asks for it.
    #[arg(long)]
    pub no_bos: bool,
    /// Print the generated token ids on stderr after the text.
    #[arg(long)]
    pub print_ids: bool,
}

/// Sampling flags, named as llama.cpp names them.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Top-k (0 keeps all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Top-p (1.0 keeps all).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Min-p (0 keeps all).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Repetition penalty (1.0 is off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Tokens the repetition penalty looks back over.
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Random seed.
    #[arg(long, short = 's', default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    /// The sampler parameters, after checking the ranges.
    pub fn params(&self) -> Result<SamplingParams> {
        if !self.temp.is_finite() || !(0.0..=1.0).contains(&self.top_p) {
            bail!("--temp must be finite and --top-p within 0..=1");
        }
        if !(0.0..=1.0).contains(&self.min_p)
            || self.repeat_penalty.is_nan()
            || self.repeat_penalty <= 0.0
        {
            bail!("--min-p must be within 0..=1 and --repeat-penalty above 0");
        }
        Ok(SamplingParams {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed: self.seed,
        })
    }
}

/// Streams the generated text to stdout; timings go to stderr.
pub fn run(args: RunArgs) -> Result<()> {
    let params = args.sampling.params()?;
    let started = Instant::now();
    let mut loaded = load(&args.model, &args.device, 1)?;
    if loaded.model.is_demo {
        eprintln!("{DEMO_LABEL}");
    }
    let tokenizer = Tokenizer::from_gguf(&loaded.file)?;
    let load_s = started.elapsed().as_secs_f64();
    let add_bos = !args.no_bos && tokenizer.add_bos_default();
    let prompt = tokenizer.encode(&args.prompt, add_bos, false);
    if prompt.is_empty() {
        bail!("the prompt has no tokens; give a non-empty --prompt");
    }
    if prompt.len() >= loaded.ctx {
        bail!(
            "the prompt has {} tokens, the context {}: raise --ctx",
            prompt.len(),
            loaded.ctx
        );
    }
    let eog: Vec<u32> = (0..tokenizer.vocab_size() as u32)
        .filter(|&t| tokenizer.is_eog(t))
        .collect();
    let mut out = std::io::stdout().lock();
    out.write_all(args.prompt.as_bytes())?;
    out.flush()?;
    let mut sampler = Sampler::new(params);
    let gen_start = Instant::now();
    let mut first_token: Option<f64> = None;
    let mut write_err = None;
    let (tokens, reason) =
        loaded
            .generator
            .generate(&prompt, args.n_predict, &mut sampler, &eog, |tok| {
                first_token.get_or_insert_with(|| gen_start.elapsed().as_secs_f64());
                let piece = tokenizer.token_to_piece(tok);
                match out.write_all(&piece).and_then(|_| out.flush()) {
                    Ok(()) => true,
                    Err(e) => {
                        write_err = Some(e);
                        false
                    }
                }
            })?;
    if let Some(e) = write_err {
        return Err(e.into());
    }
    writeln!(out)?;
    let total = gen_start.elapsed().as_secs_f64();
    let prefill = first_token.unwrap_or(total);
    let decode_n = tokens.len().saturating_sub(1);
    let why = match reason {
        StopReason::EndOfGeneration => "end of generation",
        StopReason::Limit => "n-predict reached",
        StopReason::ContextFull => "context full",
        StopReason::Callback => "stopped",
    };
    eprintln!(
        "load {load_s:.2} s | prompt {} tokens in {:.3} s ({:.1} t/s) | generated {} tokens, {:.1} t/s | {why}",
        prompt.len(),
        prefill,
        prompt.len() as f64 / prefill.max(1e-9),
        tokens.len(),
        decode_n as f64 / (total - prefill).max(1e-9),
    );
    if args.print_ids {
        let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
        eprintln!("ids: {}", ids.join(" "));
    }
    Ok(())
}
