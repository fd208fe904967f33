//! `--worker-token`: the secret a coordinator sends to workers started with `--token`,
//! shared by `run`, `serve`, `attach` and `plan`.

use anyhow::Context;
use clap::Args;
use tether_worker::BearerToken;
use tether_worker::client::ClientOptions;

/// The worker token flag.
#[derive(Args, Debug, Clone, Default)]
pub struct WorkerTokenArgs {
    /// Token the --worker processes require (their --token), sent on every call to them.
    #[arg(long, env = "TETHER_WORKER_TOKEN", hide_env_values = true)]
    pub worker_token: Option<String>,
}

impl WorkerTokenArgs {
    /// The token, checked; `None` when not given (or given empty).
    pub fn token(&self) -> anyhow::Result<Option<BearerToken>> {
        BearerToken::parse(self.worker_token.as_deref()).context("--worker-token")
    }

    /// Worker connection settings carrying the token.
    pub fn client_options(&self) -> anyhow::Result<ClientOptions> {
        Ok(ClientOptions {
            token: self.token()?,
            ..ClientOptions::default()
        })
    }
}
