//! `tether tokenize`: text to token ids with a model's tokenizer.

use crate::model_source::ModelArgs;
use anyhow::{Context, Result, bail};
use clap::Args;
use std::path::PathBuf;
use tether_gguf::GgufFile;
use tether_model::tokenizer::Tokenizer;

/// `tether tokenize`.
#[derive(Args, Debug)]
pub struct TokenizeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text to tokenize.
    #[arg(long, conflicts_with = "text_file")]
    pub text: Option<String>,
    /// A file whose whole content is tokenized.
    #[arg(long)]
    pub text_file: Option<PathBuf>,
    /// Do not add the BOS token even when the model asks for it.
    #[arg(long)]
    pub no_bos: bool,
    /// Treat control-token strings in the text (e.g. `<|eot_id|>`) as those tokens.
    #[arg(long)]
    pub parse_special: bool,
}

/// Prints the ids of the text, separated by spaces.
pub fn run(args: TokenizeArgs) -> Result<()> {
    let text = match (&args.text, &args.text_file) {
        (Some(text), _) => text.clone(),
        (None, Some(path)) => {
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
        }
        (None, None) => bail!("give --text or --text-file"),
    };
    let model = args.model.resolve()?;
    let file =
        GgufFile::open(&model.path).with_context(|| format!("reading {}", model.path.display()))?;
    let tokenizer = Tokenizer::from_gguf(&file)
        .with_context(|| format!("loading the tokenizer of {}", model.path.display()))?;
    let add_bos = !args.no_bos && tokenizer.add_bos_default();
    let ids = tokenizer.encode(&text, add_bos, args.parse_special);
    let line: Vec<String> = ids.iter().map(u32::to_string).collect();
    println!("{}", line.join(" "));
    Ok(())
}
