//! `tether bench --serve` (or `--url URL`): the HTTP serving path under N concurrent
//! streaming clients, measured like the kernels: aggregate generated tokens/s, time to
//! first token and inter-token latency (p50/p99), errors; a multi-turn chat mode whose
//! every turn resends the growing history; and a run with and without the prefix cache.

mod client;
mod prompts;
mod report;
mod server;
mod workload;

use crate::cmd::bench::BenchArgs;
use anyhow::{Context, Result, bail};
use clap::Args;
use client::Endpoint;
use prompts::PromptShape;
use report::Summary;
use serde_json::json;
use server::SpawnedServe;
use std::time::Duration;
use workload::{Workload, measure};

/// Requests each client sends when `--requests-per-client` is not given.
const DEFAULT_REQUESTS_PER_CLIENT: usize = 4;
/// Token ids a prompt takes against `--url`, whose vocabulary the bench does not know:
/// every vocabulary has these.
const URL_ID_LIMIT: u32 = 256;
/// How long a started server may take to load its model.
const SERVE_START_TIMEOUT: Duration = Duration::from_secs(900);

/// The flags of `bench --serve` and `bench --url`.
#[derive(Args, Debug, Clone, Default)]
pub struct ServeBenchArgs {
    /// Instead, measure the HTTP path: start `tether serve` with embedded workers (this
    /// command's --model/--hf, --device, --threads, --ctx, --ubatch and cache types;
    /// --parallel N sequences, default --clients) and drive it with --clients streaming
    /// clients.
    #[arg(long, conflicts_with = "pipeline")]
    pub serve: bool,
    /// Like --serve, against a server already running at URL (`http://host:port`).
    #[arg(long, value_name = "URL", conflicts_with_all = ["pipeline", "serve"])]
    pub url: Option<String>,
    /// Concurrent streaming clients (default 1).
    #[arg(long)]
    pub clients: Option<usize>,
    /// Requests (with --turns: conversations) each client sends one after another
    /// (default 4).
    #[arg(long)]
    pub requests_per_client: Option<usize>,
    /// The first N of the -p prompt tokens (or words) are the same in every request, the
    /// rest random; with --turns, a system message of N words every conversation shares.
    /// Without it every prompt differs, so the prefix cache skips nothing.
    #[arg(long, value_name = "N")]
    pub shared_prefix: Option<usize>,
    /// Send -p random words as text instead of -p random token ids.
    #[arg(long)]
    pub prompt_words: bool,
    /// Multi-turn chat: each conversation has T turns over /v1/chat/completions, each
    /// resending the whole history plus a new user message of -p words.
    #[arg(long, value_name = "T")]
    pub turns: Option<usize>,
    /// With --serve: start the server with --no-prefix-cache.
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// With --serve: measure with the prefix cache, then again with a server started with
    /// --no-prefix-cache, and print the ratio.
    #[arg(long, conflicts_with = "no_prefix_cache")]
    pub compare_prefix_cache: bool,
    /// With --serve: start the server with --cached-prefixes N (with the prefix cache on).
    #[arg(long, value_name = "N")]
    pub cached_prefixes: Option<usize>,
    /// With --url: the API key to send (`Authorization: Bearer KEY`).
    #[arg(long, requires = "url")]
    pub api_key: Option<String>,
    /// Every request asks for output valid under the JSON schema in FILE
    /// (`response_format: json_schema`), to measure constrained decoding against the same
    /// run without it. A schema that cannot end early (a string with a large `minLength`)
    /// keeps every request generating -n tokens.
    #[arg(long, value_name = "FILE")]
    pub json_schema: Option<std::path::PathBuf>,
}

impl ServeBenchArgs {
    /// Whether `bench` measures the serving path.
    pub fn chosen(&self) -> bool {
        self.serve || self.url.is_some()
    }

    /// The first flag given that only the serving path takes.
    fn stray_flag(&self) -> Option<&'static str> {
        [
            (self.clients.is_some(), "--clients"),
            (self.requests_per_client.is_some(), "--requests-per-client"),
            (self.shared_prefix.is_some(), "--shared-prefix"),
            (self.prompt_words, "--prompt-words"),
            (self.turns.is_some(), "--turns"),
            (self.no_prefix_cache, "--no-prefix-cache"),
            (self.compare_prefix_cache, "--compare-prefix-cache"),
            (self.cached_prefixes.is_some(), "--cached-prefixes"),
            (self.json_schema.is_some(), "--json-schema"),
        ]
        .into_iter()
        .find_map(|(given, name)| given.then_some(name))
    }
}

/// Refuses the serving path's flags on the other benches.
pub fn refuse_stray_flags(args: &ServeBenchArgs) -> Result<()> {
    match args.stray_flag() {
        Some(flag) => bail!("{flag} measures the serving path: add --serve (or --url URL)"),
        None => Ok(()),
    }
}

/// Runs the serving bench `args` asks for and prints its figures.
pub fn run(args: &BenchArgs) -> Result<()> {
    let s = &args.serve;
    let clients = s.clients.unwrap_or(1);
    let requests = s.requests_per_client.unwrap_or(DEFAULT_REQUESTS_PER_CLIENT);
    if clients == 0 || requests == 0 {
        bail!("--clients and --requests-per-client must be at least 1");
    }
    if args.n_gen == 0 {
        bail!("--serve measures generation: give -n above 0");
    }
    if s.turns == Some(0) {
        bail!("--turns must be at least 1");
    }
    let shared = s.shared_prefix.unwrap_or(0);
    let words_asked = s.prompt_words || s.turns.is_some();
    if s.turns.is_none() && shared > args.n_prompt {
        bail!(
            "--shared-prefix {shared} is longer than the prompt (-p {})",
            args.n_prompt
        );
    }
    if s.turns.is_none() && args.n_prompt == 0 {
        bail!("--serve needs a prompt: give -p above 0");
    }
    // A run's prompts differ from every earlier run's, so a server that stays up (--url)
    // has no cached prefix of them.
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    let mut workload = Workload {
        clients,
        requests,
        turns: s.turns,
        shape: PromptShape {
            len: args.n_prompt,
            shared,
            words: words_asked,
            id_limit: URL_ID_LIMIT,
        },
        n_gen: args.n_gen,
        seed,
        response_format: s.json_schema.as_deref().map(response_format).transpose()?,
    };
    if let Some(url) = &s.url {
        refuse_server_flags(args)?;
        let endpoint = Endpoint::new(url, s.api_key.clone());
        let summary = measure(&endpoint, &workload)?;
        report(args, &workload, endpoint.base(), None, &summary);
        return finish(&[&summary]);
    }
    workload.shape.id_limit = model_vocab(args)?;
    let parallel = match args.parallel.as_deref() {
        None => clients,
        Some([n]) if *n > 0 => *n,
        Some(_) => bail!("with --serve, --parallel takes one count of sequences, e.g. 64"),
    };
    let with_cache = !s.no_prefix_cache;
    let first = spawned_run(args, &workload, parallel, with_cache)?;
    if !s.compare_prefix_cache {
        return finish(&[&first]);
    }
    let second = spawned_run(args, &workload, parallel, false)?;
    let ratio = first.tokens_per_second / second.tokens_per_second.max(1e-9);
    let ttft = first.ttft_ms.p50 / second.ttft_ms.p50.max(1e-9);
    if args.json {
        let row = json!({"compare_prefix_cache": {
            "tokens_per_second_ratio": ratio, "ttft_p50_ratio": ttft,
        }});
        println!("{row}");
    } else {
        println!(
            "\nprefix cache on vs off: gen t/s x{ratio:.2}, TTFT p50 x{ttft:.3} ({:.1} vs {:.1} ms)",
            first.ttft_ms.p50, second.ttft_ms.p50
        );
    }
    finish(&[&first, &second])
}

/// The `response_format` of `--json-schema FILE`.
fn response_format(path: &std::path::Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the JSON schema {}", path.display()))?;
    let schema: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    if !schema.is_object() {
        bail!("{} must hold a JSON schema object", path.display());
    }
    Ok(json!({"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}))
}

/// Fails when any request failed, after the figures were printed.
fn finish(summaries: &[&Summary]) -> Result<()> {
    for s in summaries {
        if let Some(e) = &s.first_error {
            bail!(
                "{} of {} requests failed; the first: {e}",
                s.errors,
                s.requests
            );
        }
    }
    Ok(())
}

/// Against --url, the flags that shape a started server would be silently ignored.
fn refuse_server_flags(args: &BenchArgs) -> Result<()> {
    let given = [
        (
            args.model.model.is_some() || args.model.hf.is_some(),
            "--model/--hf",
        ),
        (args.device.device != "auto", "--device"),
        (args.device.threads.is_some(), "--threads"),
        (args.device.ctx.is_some(), "--ctx"),
        (args.parallel.is_some(), "--parallel"),
        (args.serve.no_prefix_cache, "--no-prefix-cache"),
        (args.serve.compare_prefix_cache, "--compare-prefix-cache"),
        (args.serve.cached_prefixes.is_some(), "--cached-prefixes"),
    ];
    match given.into_iter().find_map(|(g, name)| g.then_some(name)) {
        Some(flag) => bail!("{flag} shapes a server --serve starts; --url measures one that runs"),
        None => Ok(()),
    }
}

/// Token ids of the model's vocabulary a prompt may take.
fn model_vocab(args: &BenchArgs) -> Result<u32> {
    let resolved = args.model.resolve()?;
    let file = tether_gguf::GgufFile::open(&resolved.path)
        .with_context(|| format!("opening {}", resolved.path.display()))?;
    let config = tether_model::ModelConfig::from_gguf(&file)
        .with_context(|| format!("reading the model of {}", resolved.path.display()))?;
    Ok(u32::try_from(config.n_vocab).unwrap_or(u32::MAX))
}

/// Starts a server, measures it, stops it, prints the figures.
fn spawned_run(
    args: &BenchArgs,
    workload: &Workload,
    parallel: usize,
    prefix_cache: bool,
) -> Result<Summary> {
    let mut flags = vec![
        "--device".to_string(),
        args.device.device.clone(),
        "--parallel".into(),
        parallel.to_string(),
        // Every client waits in the queue rather than getting HTTP 429.
        "--queue".into(),
        workload.clients.to_string(),
        // Chat requests are heavy (templates); past the default cap (one per core) the
        // server answers 429, which would count as errors of the measured path.
        "--max-heavy-requests".into(),
        workload.clients.to_string(),
        "--ubatch".into(),
        args.device.ubatch.to_string(),
        "--cache-type-k".into(),
        args.cache.k().name().into(),
        "--cache-type-v".into(),
        args.cache.v().name().into(),
        "--max-tokens-limit".into(),
        args.n_gen.max(4096).to_string(),
    ];
    if let Some(path) = &args.model.model {
        flags.extend(["--model".into(), path.display().to_string()]);
    }
    if let Some(spec) = &args.model.hf {
        flags.extend(["--hf".into(), spec.clone()]);
    }
    if let Some(t) = args.device.threads {
        flags.extend(["--threads".into(), t.to_string()]);
    }
    // Token-id prompts have a known length: give each sequence just the cells it needs.
    // Words and chats take the server's default context.
    let ctx = match (args.device.ctx, workload.shape.words) {
        (Some(c), _) => Some(c),
        (None, false) => Some(workload.shape.len + workload.n_gen + 16),
        (None, true) => None,
    };
    if let Some(c) = ctx {
        flags.extend(["--ctx".into(), c.to_string()]);
    }
    match (prefix_cache, args.serve.cached_prefixes) {
        (false, _) => flags.push("--no-prefix-cache".into()),
        (true, Some(n)) => flags.extend(["--cached-prefixes".into(), n.to_string()]),
        (true, None) => {}
    }
    let serve = SpawnedServe::start(&flags, SERVE_START_TIMEOUT)?;
    let endpoint = Endpoint::new(&serve.url, None);
    let summary = measure(&endpoint, workload)?;
    drop(serve);
    let label = format!(
        "parallel {parallel}, ctx {}, prefix cache {}",
        ctx.map_or("default".into(), |c| c.to_string()),
        if prefix_cache { "on" } else { "off" }
    );
    report(
        args,
        workload,
        endpoint.base(),
        Some((label, prefix_cache)),
        &summary,
    );
    Ok(summary)
}

/// Prints a run's figures as a table or one JSON object.
fn report(
    args: &BenchArgs,
    w: &Workload,
    url: &str,
    server: Option<(String, bool)>,
    summary: &Summary,
) {
    let mode = if w.turns.is_some() {
        "chat"
    } else {
        "completions"
    };
    if args.json {
        let context = json!({
            "bench": "serve", "url": url, "mode": mode, "clients": w.clients,
            "requests_per_client": w.requests, "turns": w.turns, "n_prompt": w.shape.len,
            "prompt_words": w.shape.words, "shared_prefix": w.shape.shared, "n_gen": w.n_gen,
            "server": server.as_ref().map(|s| s.0.clone()),
            "json_schema": w.response_format.is_some(),
            "prefix_cache": server.as_ref().map(|s| s.1),
        });
        println!("{}", summary.json(context));
        return;
    }
    let unit = if w.shape.words { "words" } else { "token ids" };
    println!(
        "serve bench: {url} ({}) | {mode} | {} clients x {} {} | -p {} {unit} ({} shared) | -n {}",
        server.as_ref().map_or("running server", |s| s.0.as_str()),
        w.clients,
        w.requests,
        match w.turns {
            Some(t) => format!("conversations of {t} turns"),
            None => "requests".into(),
        },
        w.shape.len,
        w.shape.shared,
        w.n_gen
    );
    if w.response_format.is_some() {
        println!("every request constrained by --json-schema");
    }
    let round = if w.turns.is_some() { "turn" } else { "request" };
    summary.print(mode, round);
    println!();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serving_flags_are_refused_on_the_other_benches() {
        let mut args = ServeBenchArgs::default();
        assert!(refuse_stray_flags(&args).is_ok());
        args.turns = Some(3);
        let e = refuse_stray_flags(&args).expect_err("refused");
        assert!(e.to_string().contains("--turns"), "{e}");
    }
}
