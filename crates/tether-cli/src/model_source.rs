//! Where a command's model comes from: a local file, the Hugging Face hub, or the built-in
//! synthetic demo model.

use anyhow::{Context, Result, bail};
use clap::Args;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use tether_gguf::GgmlType;
use tether_model::synth::{SynthShape, synthesize};

/// Seed of the built-in demo model, fixed so every machine gets the same file.
const DEMO_SEED: u64 = 0x7e7e;

/// The model a command runs: `--model`, `--hf`, or the demo model when neither is given.
#[derive(Args, Debug, Clone, Default)]
pub struct ModelArgs {
    /// Path of a GGUF model file.
    #[arg(long, short = 'm', conflicts_with = "hf")]
    pub model: Option<PathBuf>,
    /// Download OWNER/REPO/FILE.gguf from the Hugging Face hub into the cache directory.
    #[arg(long)]
    pub hf: Option<String>,
}

/// A resolved model file, and whether it is the synthetic demo model.
pub struct ResolvedModel {
    /// Local path of the GGUF file.
    pub path: PathBuf,
    /// True when no model was given and the synthetic demo model is used.
    pub is_demo: bool,
}

impl ModelArgs {
    /// Finds or fetches the model file.
    pub fn resolve(&self) -> Result<ResolvedModel> {
        if let Some(path) = &self.model {
            if !path.is_file() {
                bail!(
                    "model file {} does not exist or is not a file",
                    path.display()
                );
            }
            return Ok(ResolvedModel {
                path: path.clone(),
                is_demo: false,
            });
        }
        if let Some(spec) = &self.hf {
            return Ok(ResolvedModel {
                path: download_hf(spec)?,
                is_demo: false,
            });
        }
        Ok(ResolvedModel {
            path: demo_model()?,
            is_demo: true,
        })
    }
}

/// The cache directory ([`tether_compute::cache_root`]: `$TETHER_CACHE`, else
/// `$XDG_CACHE_HOME/tether`, else `~/.cache/tether`), else one under the temporary
/// directory; created when missing.
pub fn cache_dir() -> Result<PathBuf> {
    let dir =
        tether_compute::cache_root().unwrap_or_else(|| std::env::temp_dir().join("tether-cache"));
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("creating cache directory {}", dir.display()))?;
    Ok(dir)
}

/// Synthesizes the demo model once into the cache and returns its path.
fn demo_model() -> Result<PathBuf> {
    let path = cache_dir()?.join(format!("demo-tiny-q8_0-{DEMO_SEED:x}.gguf"));
    if !path.is_file() {
        let partial = path.with_extension("gguf.partial");
        synthesize(&partial, SynthShape::Tiny, GgmlType::Q8_0, DEMO_SEED)
            .with_context(|| format!("synthesizing the demo model at {}", partial.display()))?;
        std::fs::rename(&partial, &path)
            .with_context(|| format!("moving the demo model into place at {}", path.display()))?;
    }
    Ok(path)
}

/// Downloads `OWNER/REPO/FILE.gguf` (or `OWNER/REPO/SUBDIR/FILE.gguf`) from the hub,
/// resuming nothing: a partial file is replaced on the next try.
fn download_hf(spec: &str) -> Result<PathBuf> {
    let parts: Vec<&str> = spec.splitn(3, '/').collect();
    let [owner, repo, file] = parts[..] else {
        bail!("--hf expects OWNER/REPO/FILE.gguf, got {spec:?}");
    };
    if owner.is_empty() || repo.is_empty() || !file.ends_with(".gguf") || file.contains("..") {
        bail!("--hf expects OWNER/REPO/FILE.gguf, got {spec:?}");
    }
    let dest_dir = cache_dir()?.join("hf").join(owner).join(repo);
    let dest = dest_dir.join(file);
    if dest.is_file() {
        return Ok(dest);
    }
    if let Some(parent) = dest.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let endpoint =
        std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".to_string());
    let url = format!("{endpoint}/{owner}/{repo}/resolve/main/{file}");
    fetch_to_file(&url, &dest).with_context(|| {
        format!("downloading {url} (check the network, the name, and HF_TOKEN for gated repos)")
    })?;
    Ok(dest)
}

fn fetch_to_file(url: &str, dest: &Path) -> Result<()> {
    let mut request = ureq::get(url);
    if let Ok(token) = std::env::var("HF_TOKEN") {
        request = request.header("Authorization", &format!("Bearer {token}"));
    }
    let response = request.call()?;
    let total: Option<u64> = response
        .headers()
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let bar = match total {
        Some(n) => indicatif::ProgressBar::new(n),
        None => indicatif::ProgressBar::new_spinner(),
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let partial = dest.with_extension("gguf.partial");
    let mut out = std::fs::File::create(&partial)
        .with_context(|| format!("creating {}", partial.display()))?;
    let mut body = response.into_body().into_reader();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = body.read(&mut buf)?;
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n])?;
        bar.inc(n as u64);
    }
    out.sync_all()?;
    bar.finish();
    std::fs::rename(&partial, dest)?;
    Ok(())
}
