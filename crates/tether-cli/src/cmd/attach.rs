//! `tether attach`: a debugging client that opens a session on a worker, loads a layer block
//! through Prepare/Commit, prints the session id and holds the session until it is stopped.

use crate::ctl::units::parse_duration;
use anyhow::{Context, bail};
use clap::Args;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tether_client::{AttachOptions, DEFAULT_CHUNK_BYTES, LoadRequest, TensorSource, WorkerClient};
use tether_gguf::{GgmlType, GgufFile};
use tether_model::{ModelConfig, StageSpec};
use tether_protocol::{BlockSpec, Lease, TxnId};

/// Arguments of `tether attach`.
#[derive(Args, Debug)]
pub struct AttachArgs {
    /// The worker's address (host:port).
    #[arg(long)]
    pub worker: String,
    #[command(flatten)]
    pub worker_link: crate::cmd::worker_link::WorkerLinkArgs,
    /// The GGUF model whose layers to load.
    #[arg(long)]
    pub model: PathBuf,
    /// Layers to load: `A..B` (B excluded) or `A..=B`; all by default. The first layer's block
    /// also takes the embedding table, the last layer's the output head.
    #[arg(long)]
    pub layers: Option<String>,
    /// Keep the stream open but never heartbeat: a zombie for trying the reaper.
    #[arg(long)]
    pub no_heartbeat: bool,
    /// Attach without loading anything.
    #[arg(long)]
    pub no_load: bool,
    /// Heartbeat interval asked for.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub heartbeat: Duration,
    /// Lease TTL asked for.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub ttl: Duration,
    /// KV cells per sequence to reserve.
    #[arg(long, default_value_t = 256)]
    pub ctx: usize,
    /// Sequences to reserve.
    #[arg(long, default_value_t = 1)]
    pub n_seq: usize,
    /// Most tokens per forward pass.
    #[arg(long, default_value_t = 32)]
    pub ubatch: usize,
}

/// Opens the session and holds it until SIGINT/SIGTERM (then closes it) or until the worker
/// ends it.
pub fn run(args: AttachArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(attach(args))
}

/// Parses `A..B` (B excluded) or `A..=B` into an inclusive range.
pub fn parse_layers(text: &str, n_layers: usize) -> anyhow::Result<(usize, usize)> {
    let (a, b, inclusive) = if let Some((a, b)) = text.split_once("..=") {
        (a, b, true)
    } else if let Some((a, b)) = text.split_once("..") {
        (a, b, false)
    } else {
        bail!("--layers {text:?}: write A..B (B excluded) or A..=B");
    };
    let first: usize = if a.is_empty() {
        0
    } else {
        a.parse().with_context(|| format!("--layers {text:?}"))?
    };
    let last = match (b.is_empty(), inclusive) {
        (true, _) => n_layers.saturating_sub(1),
        (false, true) => b.parse().with_context(|| format!("--layers {text:?}"))?,
        (false, false) => b
            .parse::<usize>()
            .with_context(|| format!("--layers {text:?}"))?
            .checked_sub(1)
            .with_context(|| format!("--layers {text:?} is empty"))?,
    };
    if first > last || last >= n_layers {
        bail!("--layers {text:?}: the model has layers 0..{n_layers}");
    }
    Ok((first, last))
}

struct GgufSource(GgufFile);

impl TensorSource for GgufSource {
    fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        self.0.tensor(name).map(|t| self.0.tensor_data(t))
    }
}

fn read_header(path: &Path, bytes: u64) -> anyhow::Result<Vec<u8>> {
    let mut header = Vec::new();
    std::fs::File::open(path)
        .with_context(|| format!("opening {}", path.display()))?
        .take(bytes)
        .read_to_end(&mut header)
        .with_context(|| format!("reading the header of {}", path.display()))?;
    Ok(header)
}

async fn attach(args: AttachArgs) -> anyhow::Result<()> {
    let client = WorkerClient::connect(&args.worker, &args.worker_link.client_options()?).await?;
    let name = format!("tether-attach@{}:{}", hostname(), std::process::id());
    let options = AttachOptions {
        client_name: name,
        lease: Lease {
            heartbeat_interval: args.heartbeat,
            ttl: args.ttl,
        },
        heartbeat: !args.no_heartbeat,
    };
    let mut session = client.attach(options).await?;
    println!("session {}", session.id());
    if !args.no_load {
        let file = GgufFile::open(&args.model)
            .with_context(|| format!("reading {}", args.model.display()))?;
        let cfg = ModelConfig::from_gguf(&file)
            .with_context(|| format!("reading {}", args.model.display()))?;
        let n_layers = cfg.n_layer;
        let (first, last) = match &args.layers {
            Some(text) => parse_layers(text, n_layers)?,
            None if n_layers > 0 => (0, n_layers - 1),
            None => bail!("{} has no layers", args.model.display()),
        };
        let spec = BlockSpec {
            first_layer: first,
            last_layer: last + 1,
            has_embed: first == 0,
            has_head: last + 1 == n_layers,
            ctx_per_seq: args.ctx,
            n_seq: args.n_seq,
            cached_seqs: 0,
            ubatch: args.ubatch,
            cache_k: GgmlType::F16,
            cache_v: GgmlType::F16,
        };
        let model_spec = StageSpec {
            first_layer: spec.first_layer,
            last_layer: spec.last_layer,
            has_embed: spec.has_embed,
            has_head: spec.has_head,
            ctx_per_seq: spec.ctx_per_seq,
            n_seq: spec.n_seq,
            cached_seqs: spec.cached_seqs,
            ubatch: spec.ubatch,
            cache_k: spec.cache_k,
            cache_v: spec.cache_v,
        };
        // Which tensors a block needs is the model's decision; the worker checks the same list.
        let tensors = tether_model::required_tensors(&cfg, &model_spec, file.tensors())?
            .into_iter()
            .map(|slot| slot.name)
            .collect();
        let file_bytes = std::fs::metadata(&args.model)
            .with_context(|| format!("reading the size of {}", args.model.display()))?
            .len();
        let txn = TxnId::new_random();
        let load = LoadRequest {
            txn,
            gguf_header: read_header(&args.model, file.data_offset())?,
            gguf_file_bytes: file_bytes,
            spec,
            tensors,
            decision_timeout: None,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            local_path: None,
            same_file: None,
        };
        let reserved = client
            .prepare(session.id(), load, Arc::new(GgufSource(file)))
            .await?;
        client.commit(session.id(), txn).await?;
        println!("loaded layers {first}..={last}: {reserved} bytes");
    }
    println!("holding the session; Ctrl-C or SIGTERM closes it");
    tokio::select! {
        end = session.ended() => {
            println!("session ended by the worker: {} ({} bytes freed)", end.reason, end.bytes_freed);
            bail!("the worker ended the session ({})", end.reason);
        }
        () = stop_signal() => {
            let end = session.close().await;
            println!("session closed: {} ({} bytes freed)", end.reason, end.bytes_freed);
        }
    }
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
async fn stop_signal() {
    #[cfg(unix)]
    if let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    {
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        return;
    }
    let _ = tokio::signal::ctrl_c().await;
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into())
}

#[cfg(test)]
mod tests {
    use super::parse_layers;

    #[test]
    fn layer_ranges_parse_both_forms() {
        assert_eq!(parse_layers("0..4", 8).unwrap(), (0, 3));
        assert_eq!(parse_layers("2..=5", 8).unwrap(), (2, 5));
        assert_eq!(parse_layers("3..", 8).unwrap(), (3, 7));
        assert!(parse_layers("5..2", 8).is_err());
        assert!(parse_layers("0..9", 8).is_err());
        assert!(parse_layers("x", 8).is_err());
    }
}
