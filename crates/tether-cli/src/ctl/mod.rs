//! `tetherctl`: the operator's view of one worker. Parsing and printing only; the calls
//! are `tether_client::AdminClient`'s.

mod coordinator;
mod model_change;
pub mod units;

use crate::cmd::tls_args::WorkerTlsArgs;
use anyhow::Context;
use clap::{Parser, Subcommand};
use tether_client::{AdminClient, ClientOptions};
use tether_protocol::SessionId;
use tether_protocol::{SessionSummary, WorkerStatus};
use units::human_bytes;

/// Inspect and manage a tether worker.
#[derive(Parser, Debug)]
#[command(
    name = "tetherctl",
    version,
    about = "Inspect and manage a tether worker"
)]
pub struct Cli {
    /// The worker's gRPC address (host:port).
    #[arg(long, env = "TETHER_WORKER", required_unless_present = "coordinator")]
    pub worker: Option<String>,
    /// A coordinator's HTTP address (`http://host:8080`): `workers`, `sessions` and `model`
    /// show its view of every worker.
    #[arg(long, env = "TETHER_COORDINATOR", conflicts_with = "worker")]
    pub coordinator: Option<String>,
    /// The coordinator's API key, when it requires one.
    #[arg(long, env = "TETHER_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    #[command(flatten)]
    pub coordinator_tls: coordinator::CoordinatorTlsArgs,
    /// Admin token, when the worker requires one; default: TETHER_WORKER_TOKEN (a worker
    /// started with --token but no --admin-token takes its --token on admin calls).
    #[arg(long, env = "TETHER_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    #[command(flatten)]
    pub tls: WorkerTlsArgs,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
    /// Show `status`, `sessions`, `workers` or `model` again every SECS seconds until
    /// interrupted (Ctrl-C).
    #[arg(long, global = true, value_name = "SECS", value_parser = watch_interval)]
    pub watch: Option<std::time::Duration>,
    #[command(subcommand)]
    pub command: Command,
}

/// What to do.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Device memory, session bytes and counters.
    Status,
    /// Live sessions.
    Sessions,
    /// End a session now and free its memory.
    Kill {
        /// The session id (UUID).
        session: String,
    },
    /// Refuse new sessions; current ones carry on until they end.
    Drain,
    /// Take new sessions again after a drain.
    Undrain,
    /// (--coordinator) Every worker's status.
    Workers,
    /// (--coordinator) The model's placement over the workers and whether it serves;
    /// `load`, `reload` and `unload` change it without a restart.
    Model {
        #[command(subcommand)]
        change: Option<ModelChange>,
    },
}

/// A change of the coordinator's model.
#[derive(Subcommand, Debug, Clone)]
pub enum ModelChange {
    /// Load a GGUF file (a path the coordinator can read) beside the served model and
    /// switch to it once it is committed on every worker.
    Load {
        /// The model file.
        path: String,
        /// Its id in the API (default: the file name without extension).
        #[arg(long)]
        id: Option<String>,
        /// When it does not fit beside the served model, unload that one first (requests
        /// are refused until the new one serves).
        #[arg(long)]
        unload_first: bool,
    },
    /// Load the served model's file again, beside the running copy.
    Reload {
        /// When a second copy does not fit, unload the first one first (a short outage).
        #[arg(long)]
        unload_first: bool,
    },
    /// Unload the model: requests are refused until a load.
    Unload,
}

/// `--watch`: seconds between refreshes, at least 0.1.
fn watch_interval(text: &str) -> Result<std::time::Duration, String> {
    let secs: f64 = text
        .parse()
        .map_err(|_| format!("--watch takes seconds (like 2 or 0.5), not {text:?}"))?;
    if !secs.is_finite() || secs < 0.1 {
        return Err(format!("--watch must be at least 0.1 seconds, not {secs}"));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

/// Runs one tetherctl command.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    if let Some(url) = &cli.coordinator {
        return coordinator::run(
            url,
            cli.api_key.as_deref(),
            &cli.coordinator_tls,
            &cli.command,
            cli.json,
            cli.watch,
        );
    }
    let watched = matches!(cli.command, Command::Status | Command::Sessions);
    if cli.watch.is_some() && !watched {
        anyhow::bail!(
            "--watch refreshes `status` and `sessions` of a worker, not {:?}",
            cli.command
        );
    }
    let Some(worker) = cli.worker.clone() else {
        anyhow::bail!("give --worker ADDR or --coordinator URL");
    };
    let token = cli
        .admin_token
        .clone()
        .filter(|t| !t.is_empty())
        .or_else(|| std::env::var("TETHER_WORKER_TOKEN").ok())
        .filter(|t| !t.is_empty());
    let options = ClientOptions {
        tls: cli.tls.client_tls()?,
        ..ClientOptions::default()
    };
    let mut admin = AdminClient::connect(&worker, token, &options).await?;
    loop {
        worker_command(&mut admin, &worker, &cli.command, cli.json).await?;
        let Some(every) = cli.watch else {
            return Ok(());
        };
        tokio::time::sleep(every).await;
        if !cli.json {
            println!();
        }
    }
}

async fn worker_command(
    admin: &mut AdminClient,
    worker: &str,
    command: &Command,
    json: bool,
) -> anyhow::Result<()> {
    match command {
        Command::Status => {
            let status = admin.status().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                print_status(worker, &status);
            }
        }
        Command::Sessions => {
            let sessions = admin.sessions().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&sessions)?);
            } else {
                print_sessions(&sessions);
            }
        }
        Command::Kill { session } => {
            let id = SessionId::parse(session).context("tetherctl kill")?;
            let bytes_freed = admin.kill(id).await?;
            if json {
                println!(
                    "{}",
                    serde_json::json!({ "session_id": session, "bytes_freed": bytes_freed })
                );
            } else {
                println!(
                    "killed session {session}: {} freed",
                    human_bytes(bytes_freed)
                );
            }
        }
        Command::Workers | Command::Model { .. } => {
            anyhow::bail!("`workers` and `model` read a coordinator: give --coordinator URL")
        }
        Command::Drain => {
            let sessions = admin.drain().await?;
            if json {
                println!(
                    "{}",
                    serde_json::json!({ "draining": true, "sessions": sessions })
                );
            } else {
                println!("draining: new sessions are refused; {sessions} live session(s) carry on");
            }
        }
        Command::Undrain => {
            let was_draining = admin.undrain().await?;
            if json {
                println!(
                    "{}",
                    serde_json::json!({ "draining": false, "was_draining": was_draining })
                );
            } else if was_draining {
                println!("undrained: new sessions are taken again");
            } else {
                println!("the worker was not draining; it takes new sessions");
            }
        }
    }
    Ok(())
}

fn print_status(addr: &str, s: &WorkerStatus) {
    let used = s.device_total_bytes.saturating_sub(s.device_free_bytes);
    println!(
        "worker     {addr} ({}, up {} s){}",
        s.worker_version,
        s.uptime_s,
        if s.draining { ", draining" } else { "" }
    );
    println!("device     {}", s.device);
    println!(
        "memory     total {}  free {}  used {}  baseline {}",
        human_bytes(s.device_total_bytes),
        human_bytes(s.device_free_bytes),
        human_bytes(used),
        human_bytes(s.baseline_used_bytes)
    );
    println!(
        "sessions   {} live, {} held (limit {}), {} unaccounted",
        s.sessions,
        human_bytes(s.session_bytes),
        human_bytes(s.max_memory_bytes),
        human_bytes(s.unaccounted_bytes)
    );
    let c = &s.counters;
    println!(
        "counters   opened {}  closed {}  disconnected {}  reaped {}  killed {}  shutdown {}  txn timed out {}",
        c.opened, c.closed, c.disconnected, c.reaped, c.killed, c.shutdown, c.txn_timed_out
    );
    println!("process    rss {}", human_bytes(s.process_rss_bytes));
    if s.process_device_bytes > 0 {
        println!(
            "           device {} (at start {})",
            human_bytes(s.process_device_bytes),
            human_bytes(s.baseline_process_device_bytes)
        );
    }
    println!("           unaccounted counts {}", s.memory_source.as_str());
}

fn print_sessions(sessions: &[SessionSummary]) {
    if sessions.is_empty() {
        println!("no live sessions");
        return;
    }
    println!(
        "{:<36}  {:<24}  {:>12}  {:<10}  {:>13}  {:>9}  {:>9}  {:>8}",
        "SESSION", "CLIENT", "BYTES", "LAYERS", "KV BLOCKS", "AGE", "HEARTBEAT", "PREPARED"
    );
    for s in sessions {
        let client: String = s.client_name.chars().take(24).collect();
        // Held / in the pool.
        let blocks = if s.kv_blocks == 0 {
            "-".to_string()
        } else {
            format!("{}/{}", s.kv_blocks - s.kv_blocks_free, s.kv_blocks)
        };
        println!(
            "{:<36}  {:<24}  {:>12}  {:<10}  {:>13}  {:>8}s  {:>7}ms  {:>8}",
            s.session_id,
            client,
            human_bytes(s.bytes),
            if s.layers.is_empty() { "-" } else { &s.layers },
            blocks,
            s.age_ms / 1000,
            s.last_heartbeat_ms_ago,
            s.prepared_txns
        );
    }
}
