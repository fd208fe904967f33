//! `tetherctl --coordinator URL`: the coordinator's view of its workers, over its HTTP admin
//! endpoints (`/v1/admin/*`).

use super::Command;
use super::units::human_bytes;
use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::Value;
use std::path::PathBuf;
use std::time::Duration;
use ureq::tls::{Certificate, ClientCert, PrivateKey, RootCerts, TlsConfig};

/// How tetherctl checks a coordinator that serves HTTPS (`serve --tls-cert`).
#[derive(Args, Debug, Clone, Default)]
pub struct CoordinatorTlsArgs {
    /// CA (PEM) that signed the coordinator's certificate, for an `https://` URL.
    #[arg(long, env = "TETHER_COORDINATOR_CA", value_name = "PEM")]
    pub coordinator_ca: Option<PathBuf>,
    /// Client certificate (PEM) for a coordinator that requires one (its --tls-ca); needs
    /// --coordinator-key.
    #[arg(long, env = "TETHER_COORDINATOR_CERT", value_name = "PEM")]
    pub coordinator_cert: Option<PathBuf>,
    /// Private key (PEM) of --coordinator-cert.
    #[arg(long, env = "TETHER_COORDINATOR_KEY", value_name = "PEM")]
    pub coordinator_key: Option<PathBuf>,
}

impl CoordinatorTlsArgs {
    /// The TLS settings of the HTTP client, with every file read and checked.
    fn config(&self) -> Result<TlsConfig> {
        let read = |path: &PathBuf, flag: &str| {
            std::fs::read(path).with_context(|| format!("{flag}: reading {}", path.display()))
        };
        let mut config = TlsConfig::builder();
        if let Some(path) = &self.coordinator_ca {
            let text = read(path, "--coordinator-ca")?;
            let ca = Certificate::from_pem(&text).with_context(|| {
                format!(
                    "--coordinator-ca: {} is not a PEM certificate",
                    path.display()
                )
            })?;
            config = config.root_certs(RootCerts::new_with_certs(&[ca]));
        }
        match (&self.coordinator_cert, &self.coordinator_key) {
            (None, None) => {}
            (Some(cert), Some(key)) => {
                let chain = Certificate::from_pem(&read(cert, "--coordinator-cert")?)
                    .with_context(|| {
                        format!(
                            "--coordinator-cert: {} is not a PEM certificate",
                            cert.display()
                        )
                    })?;
                let key =
                    PrivateKey::from_pem(&read(key, "--coordinator-key")?).with_context(|| {
                        format!(
                            "--coordinator-key: {} is not a PEM private key",
                            key.display()
                        )
                    })?;
                config = config.client_cert(Some(ClientCert::new_with_certs(&[chain], key)));
            }
            _ => bail!("--coordinator-cert and --coordinator-key go together"),
        }
        Ok(config.build())
    }
}

/// Runs one command against a coordinator; a view again every `watch` until interrupted.
pub fn run(
    url: &str,
    api_key: Option<&str>,
    tls: &CoordinatorTlsArgs,
    command: &Command,
    json: bool,
    watch: Option<Duration>,
) -> Result<()> {
    let path = match command {
        Command::Workers | Command::Status => "workers",
        Command::Sessions => "sessions",
        Command::Model { change: None } => "model",
        Command::Model { change: Some(_) } if watch.is_some() => {
            bail!("--watch refreshes a view; a model change runs once")
        }
        Command::Model { change: Some(_) } => "",
        Command::Kill { .. } | Command::Drain | Command::Undrain => {
            bail!(
                "kill, drain and undrain act on one worker: give --worker ADDR instead of --coordinator"
            )
        }
    };
    let base = if url.contains("://") {
        url.trim_end_matches('/').to_string()
    } else {
        format!("http://{}", url.trim_end_matches('/'))
    };
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .tls_config(tls.config()?)
        .http_status_as_error(false)
        .build()
        .into();
    if let Command::Model {
        change: Some(change),
    } = command
    {
        return super::model_change::run(&agent, &base, api_key, change, json);
    }
    loop {
        let value = fetch(&agent, &format!("{base}/v1/admin/{path}"), api_key)?;
        if json {
            println!("{}", serde_json::to_string_pretty(&value)?);
        } else {
            match path {
                "workers" => print_workers(&value),
                "sessions" => print_sessions(&value),
                _ => print_model(&value),
            }
        }
        let Some(every) = watch else {
            return Ok(());
        };
        std::thread::sleep(every);
        if !json {
            println!();
        }
    }
}

fn fetch(agent: &ureq::Agent, url: &str, api_key: Option<&str>) -> Result<Value> {
    let mut request = agent.get(url);
    if let Some(key) = api_key {
        request = request.header("Authorization", &format!("Bearer {key}"));
    }
    let response = request
        .call()
        .with_context(|| format!("asking the coordinator at {url}"))?;
    reply_json(url, response)
}

/// The JSON body of a 2xx reply; the API's error message otherwise.
pub(super) fn reply_json(
    url: &str,
    mut response: ureq::http::Response<ureq::Body>,
) -> Result<Value> {
    let status = response.status();
    let text = response
        .body_mut()
        .read_to_string()
        .with_context(|| format!("reading the reply of {url}"))?;
    if !status.is_success() {
        let message = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
            .unwrap_or(text);
        bail!("{url} answered {status}: {message}");
    }
    serde_json::from_str(&text).with_context(|| format!("{url} did not answer JSON"))
}

fn bytes(v: &Value, key: &str) -> String {
    human_bytes(v.get(key).and_then(Value::as_u64).unwrap_or(0))
}

fn print_workers(value: &Value) {
    println!(
        "{:<28}  {:<10}  {:>8}  {:>12}  {:>12}  {:>12}  {:>12}",
        "WORKER", "DEVICE", "SESSIONS", "SESSION MEM", "FREE", "UNACCOUNTED", "STATE"
    );
    for w in value.as_array().into_iter().flatten() {
        let addr = w.get("worker").and_then(Value::as_str).unwrap_or("?");
        match w.get("status") {
            Some(s) => println!(
                "{:<28}  {:<10}  {:>8}  {:>12}  {:>12}  {:>12}  {:>12}",
                addr,
                s.get("device").and_then(Value::as_str).unwrap_or("?"),
                s.get("sessions").and_then(Value::as_u64).unwrap_or(0),
                bytes(s, "session_bytes"),
                bytes(s, "device_free_bytes"),
                bytes(s, "unaccounted_bytes"),
                if s.get("draining").and_then(Value::as_bool) == Some(true) {
                    "draining"
                } else {
                    "up"
                }
            ),
            None => println!(
                "{addr:<28}  unreachable: {}",
                w.get("error").and_then(Value::as_str).unwrap_or("?")
            ),
        }
    }
}

fn print_sessions(value: &Value) {
    for w in value.as_array().into_iter().flatten() {
        let addr = w.get("worker").and_then(Value::as_str).unwrap_or("?");
        match w.get("sessions").and_then(Value::as_array) {
            Some(list) if list.is_empty() => println!("{addr}: no live sessions"),
            Some(list) => {
                println!("{addr}:");
                for s in list {
                    println!(
                        "  {}  {:<24}  {:>12}  layers {}",
                        s.get("session_id").and_then(Value::as_str).unwrap_or("?"),
                        s.get("client_name").and_then(Value::as_str).unwrap_or("?"),
                        bytes(s, "bytes"),
                        s.get("layers").and_then(Value::as_str).unwrap_or("-"),
                    );
                }
            }
            None => println!(
                "{addr}: unreachable: {}",
                w.get("error").and_then(Value::as_str).unwrap_or("?")
            ),
        }
    }
}

fn print_model(v: &Value) {
    if v.get("loaded").and_then(Value::as_bool) == Some(false) {
        println!(
            "no model loaded: {}",
            v.get("unavailable_reason")
                .and_then(Value::as_str)
                .unwrap_or("?")
        );
    }
    if let Some(change) = v.get("model_change").filter(|c| !c.is_null()) {
        println!(
            "changing: {} {} ({} of {})",
            change.get("phase").and_then(Value::as_str).unwrap_or("?"),
            change.get("model").and_then(Value::as_str).unwrap_or("?"),
            bytes(change, "bytes_loaded"),
            bytes(change, "bytes_total"),
        );
    }
    let serving = v.get("serving").and_then(Value::as_bool) == Some(true);
    println!(
        "model {}  ctx {}  {}  queued {}  running {}",
        v.get("id").and_then(Value::as_str).unwrap_or("?"),
        v.get("ctx_per_seq").and_then(Value::as_u64).unwrap_or(0),
        if serving {
            "serving".to_string()
        } else {
            format!(
                "NOT serving: {}",
                v.get("unavailable_reason")
                    .and_then(Value::as_str)
                    .unwrap_or("?")
            )
        },
        v.get("queued").and_then(Value::as_u64).unwrap_or(0),
        v.get("running").and_then(Value::as_u64).unwrap_or(0),
    );
    println!("  {}", prefix_line(v));
    for a in v
        .get("placement")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let layer = |k: &str| a.get(k).and_then(Value::as_u64).unwrap_or(0);
        let mut parts = format!("layers {}..{}", layer("first_layer"), layer("last_layer"));
        if a.get("has_embed").and_then(Value::as_bool) == Some(true) {
            parts.push_str(" +embed");
        }
        if a.get("has_head").and_then(Value::as_bool) == Some(true) {
            parts.push_str(" +head");
        }
        println!(
            "  {:<28}  {:<24}  weights {}  kv {}  scratch {}  total {}",
            a.get("worker").and_then(Value::as_str).unwrap_or("?"),
            parts,
            bytes(a, "weights_bytes"),
            bytes(a, "kv_bytes"),
            bytes(a, "scratch_bytes"),
            bytes(a, "total_bytes"),
        );
    }
}

/// The prefix cache's state and hit rate: reused prompt tokens over all prompt tokens.
fn prefix_line(v: &Value) -> String {
    if v.get("prefix_cache").and_then(Value::as_bool) != Some(true) {
        return "prefix cache off".to_string();
    }
    let count = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
    let (hit, processed) = (count("prefix_hit_tokens"), count("prompt_tokens"));
    let all = hit + processed;
    let rate = if all == 0 {
        0.0
    } else {
        100.0 * hit as f64 / all as f64
    };
    format!("prefix cache on: {hit} of {all} prompt tokens reused ({rate:.1}%)")
}
