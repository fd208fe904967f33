//! `--model-path-on-workers`: where the workers keep their own copy of the model, shared by
//! `run` and `serve`.

use clap::Args;

/// The flag.
#[derive(Args, Debug, Clone, Default)]
pub struct PathOnWorkersArgs {
    /// The model's path as the workers see it (absolute, or relative to their --model-dir).
    /// Each worker then reads its layers from its own copy, once the copy's size, header and
    /// every tensor's CRC-32 match this model; a worker that refuses (no --model-dir, outside
    /// it, missing, or different) is warned about and gets the bytes streamed as without
    /// this flag.
    #[arg(long, value_name = "PATH")]
    pub model_path_on_workers: Option<String>,
}

impl PathOnWorkersArgs {
    /// Refuses the flag without remote workers: embedded workers have no `--model-dir`.
    pub fn check_remote(&self, remote_workers: bool) -> anyhow::Result<()> {
        if self.path().is_some() && !remote_workers {
            anyhow::bail!(
                "--model-path-on-workers needs remote workers (--worker or --worker-dns) started with --model-dir; embedded workers always receive the model from this process"
            );
        }
        Ok(())
    }

    /// The path, when given and not empty.
    pub fn path(&self) -> Option<String> {
        self.model_path_on_workers.clone().filter(|p| !p.is_empty())
    }
}
