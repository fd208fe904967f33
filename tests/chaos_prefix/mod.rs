//! Prefix-cache soak: `tether serve` over two real worker processes while client threads
//! send interleaved requests whose prompts share prefixes ending on, just before and just
//! after block boundaries (streamed, whole, and streams the client drops after the first
//! token). Throughout and after, every worker's session bytes must equal what
//! `tether plan` planned for it (prefix reuse allocates nothing), a probe prompt sent again
//! and again must generate the same greedy text, and the cache must have been hit. Then
//! SIGKILL of serve must leave every worker at 0 sessions and 0 bytes within a second.
//! `TETHER_PREFIX_SOAK_SECONDS` sets how long the clients run (default
//! [`DEFAULT_SOAK_SECONDS`]).

use super::*;
use support::{http, http_deadline, sample, sessions_and_bytes};

/// How long the clients run when `TETHER_PREFIX_SOAK_SECONDS` is unset.
const DEFAULT_SOAK_SECONDS: u64 = 20;
/// Client threads.
const CLIENTS: u64 = 4;
/// Prefix lengths around the cache's 32-token blocks.
const PREFIX_LENGTHS: [usize; 9] = [1, 31, 32, 33, 63, 64, 65, 96, 97];
/// Sequences the server runs at once: fewer than the clients, so slots are taken over.
const PARALLEL: &str = "3";
/// Cells per sequence.
const CTX: &str = "192";
/// How long a request may take on busy CI cores.
const REQUEST_DEADLINE: Duration = Duration::from_secs(60);

/// Token `i` of shared prefix family `family` (ids 1..300 exist in the tiny vocabulary).
fn family_token(family: usize, i: usize) -> u32 {
    1 + ((family * 7919 + i * 104_729) % 299) as u32
}

/// A probe's greedy completion, whole.
fn probe_text(addr: &str, prompt: &[u32]) -> Result<String, String> {
    let body = support::completion_body(prompt, 4, false);
    let (status, text) = http_deadline(
        addr,
        "POST",
        "/v1/completions",
        Some(&body),
        REQUEST_DEADLINE,
    )?;
    if status != 200 {
        return Err(format!("probe: HTTP {status}: {text}"));
    }
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))?;
    v["choices"][0]["text"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| format!("probe reply without text: {text}"))
}

/// One client's loop until `stop`: requests of every kind over the prefix families, and
/// the probe every few requests. Returns how many requests it sent.
fn client(
    addr: &str,
    seed: u64,
    probe: &[u32],
    expected: &str,
    stop: &AtomicBool,
) -> Result<u64, String> {
    let mut rng = Rng(seed | 1);
    let mut sent = 0;
    while !stop.load(Ordering::SeqCst) {
        sent += 1;
        if sent % 5 == 0 {
            let got = probe_text(addr, probe)?;
            if got != expected {
                return Err(format!("the probe generated {got:?}, first {expected:?}"));
            }
            continue;
        }
        let family = rng.below(3) as usize;
        let shared = PREFIX_LENGTHS[rng.below(PREFIX_LENGTHS.len() as u64) as usize];
        let own = rng.below(9) as usize;
        let prompt: Vec<u32> = (0..shared)
            .map(|i| family_token(family, i))
            .chain((0..own).map(|_| 1 + rng.below(299) as u32))
            .collect();
        let max_tokens = 1 + rng.below(6) as usize;
        match rng.below(3) {
            0 => {
                let body = support::completion_body(&prompt, max_tokens, false);
                let (status, text) = http_deadline(
                    addr,
                    "POST",
                    "/v1/completions",
                    Some(&body),
                    REQUEST_DEADLINE,
                )?;
                if status != 200 {
                    return Err(format!("HTTP {status}: {text}"));
                }
            }
            kind => {
                let body = support::completion_body(&prompt, max_tokens, true);
                let tcp = support::http_send(addr, "POST", "/v1/completions", Some(&body));
                tcp.set_read_timeout(Some(REQUEST_DEADLINE))
                    .map_err(|e| e.to_string())?;
                let mut reader = BufReader::new(tcp);
                let mut line = String::new();
                // kind 1 reads to the end; kind 2 leaves after the first token, which
                // cancels the request mid-generation.
                loop {
                    line.clear();
                    match reader.read_line(&mut line) {
                        Ok(0) => return Err("a stream ended without [DONE]".into()),
                        Ok(_) if line.contains("[DONE]") => break,
                        Ok(_) if kind == 2 && line.contains("\"text\"") => break,
                        Ok(_) if line.contains("\"error\"") => {
                            return Err(format!("stream error: {line}"));
                        }
                        Ok(_) => {}
                        Err(e) => return Err(format!("stream stalled: {e}")),
                    }
                }
            }
        }
    }
    Ok(sent)
}

/// Each worker's planned session bytes, from `tether plan --json` over the running
/// workers with serve's settings.
fn planned_bytes(model: &str, workers: &[Worker; 2]) -> Vec<u64> {
    let out = std::process::Command::new(support::TETHER)
        .args([
            "plan",
            "--model",
            model,
            "--worker",
            workers[0].addr.as_str(),
            "--worker",
            workers[1].addr.as_str(),
        ])
        .args([
            "--split",
            "1,1",
            "--ctx",
            CTX,
            "--parallel",
            PARALLEL,
            "--ubatch",
            "64",
            "--json",
        ])
        .output()
        .expect("run tether plan");
    assert!(
        out.status.success(),
        "tether plan: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).expect("plan JSON");
    plan["workers"]
        .as_array()
        .expect("plan workers")
        .iter()
        .map(|w| w["total_bytes"].as_u64().expect("total_bytes"))
        .collect()
}

#[test]
fn prefix_cache_soak_holds_the_plan_and_sigkill_frees_every_session() {
    let seconds = env_u64("TETHER_PREFIX_SOAK_SECONDS").unwrap_or(DEFAULT_SOAK_SECONDS);
    let model = TinyModel::new();
    let workers = [Worker::start(&[]), Worker::start(&[])];
    let mut serve = Serve::start(&[
        "--model",
        model.arg(),
        "--worker",
        workers[0].addr.as_str(),
        "--worker",
        workers[1].addr.as_str(),
        "--split",
        "1,1",
        "--ctx",
        CTX,
        "--parallel",
        PARALLEL,
        "--ubatch",
        "64",
        "--lease-ttl",
        "1s",
        "--threads",
        "1",
    ]);
    let plan = planned_bytes(model.arg(), &workers);
    let held = |w: &Worker| sessions_and_bytes(&w.status());
    let states = || workers.iter().map(held).collect::<Vec<_>>();
    let want: Vec<(u64, u64)> = plan.iter().map(|&b| (1, b)).collect();
    assert_eq!(
        states(),
        want,
        "after the load: (sessions, bytes) per worker vs the plan"
    );
    let addr = serve.addr.clone();
    let probe: Vec<u32> = (0..70).map(|i| family_token(1, i)).collect();
    let expected = probe_text(&addr, &probe).expect("first probe");
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    let (sent, drift) = std::thread::scope(|s| {
        let clients: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let (addr, probe, expected, stop) = (&addr, &probe, &expected, &stop);
                s.spawn(move || client(addr, 0x5eed + c * 7_777, probe, expected, stop))
            })
            .collect();
        let mut drift = Vec::new();
        while started.elapsed() < Duration::from_secs(seconds)
            && !clients.iter().any(|c| c.is_finished())
        {
            let now = states();
            if now != want {
                drift.push(format!("t={:?}: {now:?}", started.elapsed()));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        stop.store(true, Ordering::SeqCst);
        let sent: Vec<_> = clients
            .into_iter()
            .map(|c| c.join().unwrap_or_else(|_| Err("client panicked".into())))
            .collect();
        (sent, drift)
    });
    let total: u64 = sent.iter().map(|r| r.as_ref().map_or(0, |n| *n)).sum();
    println!("prefix soak: {total} requests in {:?}", started.elapsed());
    for r in &sent {
        assert!(
            r.is_ok(),
            "a client failed: {r:?}\nserve log:\n{}",
            serve.log()
        );
    }
    assert!(
        drift.is_empty(),
        "worker bytes left the plan {want:?}:\n{}",
        drift.join("\n")
    );
    assert_eq!(
        states(),
        want,
        "after the soak: (sessions, bytes) per worker vs the plan"
    );
    let (status, metrics) = http(&addr, "GET", "/metrics", None);
    assert_eq!(status, 200);
    let hits = sample(&metrics, "tether_engine_prefix_cache_hit_tokens_total").unwrap_or(0.0);
    assert!(
        hits > 0.0,
        "the soak never hit the prefix cache:\n{metrics}"
    );
    send_signal(serve.child.id(), libc::SIGKILL);
    let killed = Instant::now();
    let _ = serve.wait_exit(Duration::from_secs(5));
    // Freed within a second: the poll that saw every worker empty began within it.
    loop {
        let asked = killed.elapsed();
        let now = states();
        if now.iter().all(|&s| s == (0, 0)) {
            println!("prefix soak: every worker empty {asked:?} after SIGKILL of serve");
            break;
        }
        assert!(
            asked < Duration::from_secs(1),
            "1 s after SIGKILL of serve the workers hold {now:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
