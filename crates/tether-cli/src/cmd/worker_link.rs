//! How `run`, `serve`, `attach` and `plan` reach workers: `--worker-token`, the secret of
//! workers started with `--token`, and the `--worker-tls-*` flags for workers that serve
//! TLS.

use crate::cmd::tls_args::WorkerTlsArgs;
use anyhow::Context;
use clap::Args;
use tether_client::ClientOptions;
use tether_protocol::BearerToken;
use tether_worker::embedded::LocalWorkers;

/// The flags of a connection to workers.
#[derive(Args, Debug, Clone, Default)]
pub struct WorkerLinkArgs {
    /// Token the --worker processes require (their --token), sent on every call to them.
    #[arg(long, env = "TETHER_WORKER_TOKEN", hide_env_values = true)]
    pub worker_token: Option<String>,
    /// Send forward passes over gRPC even to workers that serve data links (the faster
    /// framed socket beside gRPC, used by default).
    #[arg(long)]
    pub grpc_forward: bool,
    #[command(flatten)]
    pub tls: WorkerTlsArgs,
}

impl WorkerLinkArgs {
    /// The token, checked; `None` when not given (or given empty).
    pub fn token(&self) -> anyhow::Result<Option<BearerToken>> {
        BearerToken::parse(self.worker_token.as_deref()).context("--worker-token")
    }

    /// Worker connection settings carrying the token and the TLS settings.
    pub fn client_options(&self) -> anyhow::Result<ClientOptions> {
        Ok(ClientOptions {
            token: self.token()?,
            tls: self.tls.client_tls()?,
            ..ClientOptions::default()
        })
    }

    /// The settings for `local`, the workers embedded in this process, which listen on
    /// loopback in plaintext and require the token they generated: the TLS flags and
    /// --worker-token are meant for --worker processes.
    pub fn embedded_options(&self, local: &LocalWorkers) -> ClientOptions {
        if self.tls.any_given() {
            tracing::warn!(
                "the --worker-tls-* settings apply to --worker processes; the embedded workers are reached in plaintext on loopback"
            );
        }
        if self.worker_token.as_deref().is_some_and(|t| !t.is_empty()) {
            tracing::warn!(
                "--worker-token applies to --worker processes; the embedded workers take a secret generated at start"
            );
        }
        ClientOptions::with_token(local.token().clone())
    }
}
