//! Seeded chaos test: `tether serve` over two real `tether worker` processes, each behind
//! an in-test TCP fault proxy, while the test injects faults at random moments: link
//! delay, blackhole or reset; SIGKILL of serve (then a restart); SIGSTOP+SIGCONT of serve;
//! SIGKILL of a worker (then a restart on the same port). After every step it checks that
//! no worker died unless killed, that the workers free every session within the lease
//! when no coordinator holds them, that a running serve answers again within
//! [`RECOVERY`], that it then holds exactly one session per worker (no leak), and that no
//! HTTP request hangs past its deadline. A hostile-clients phase follows the faults
//! (`chaos_hostile`): idle and trickling connections, huge and oversized bodies, garbage
//! and dropped streams, while `/health` must answer within a second and the model must
//! stay loaded; `TETHER_CHAOS_HOSTILE` sets its number of bursts.
//!
//! Replay a failure with `TETHER_CHAOS_SEED=<printed seed>`. `TETHER_CHAOS_ITERATIONS`
//! sets the number of steps (default [`DEFAULT_ITERATIONS`], well under a minute); soak
//! mode is the same test with a large count, e.g.
//! `TETHER_CHAOS_ITERATIONS=500 cargo test -p tether-cli --test chaos -- --nocapture`, or
//! for a duration: `TETHER_CHAOS_SECONDS=1800` runs steps until 30 minutes have passed
//! (then the count is only an upper bound).
//!
//! A second test (`chaos_prefix`) soaks the prefix cache: interleaved requests sharing
//! prefixes around block boundaries while worker bytes must stay at the plan, then SIGKILL
//! of serve must free every worker within a second.

mod chaos_cluster;
mod chaos_hostile;
mod chaos_prefix;
mod chaos_stream;
mod support;

use chaos_cluster::Cluster;
use chaos_stream::Stream;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use support::proxy::{Mode, Proxy};
use support::{Serve, TinyModel, Worker, http_deadline, process_alive, send_signal};

/// Steps run when `TETHER_CHAOS_ITERATIONS` is unset.
const DEFAULT_ITERATIONS: u64 = 8;
/// The `--lease-ttl` given to serve.
const LEASE_TTL: Duration = Duration::from_secs(1);
/// Slack over the lease for a worker to notice and for the test to poll (tetherctl is a
/// process per poll, on busy cores).
const RELEASE_SLACK: Duration = Duration::from_secs(3);
/// How long a running serve may take to answer /health and a completion after a fault.
const RECOVERY: Duration = Duration::from_secs(15);
/// A streamed response that delivers nothing for this long counts as a hang.
const STREAM_STALL: Duration = Duration::from_secs(12);

/// Bursts of hostile clients after the fault phase when `TETHER_CHAOS_HOSTILE` is unset.
const DEFAULT_HOSTILE_BURSTS: u64 = 2;

/// xorshift64*: small, seedable, good enough to pick faults.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    Delay(usize),
    Blackhole(usize),
    Reset(usize),
    KillServe,
    StopServe,
    KillWorker(usize),
}

impl Fault {
    fn kind(self) -> &'static str {
        match self {
            Fault::Delay(_) => "link delay",
            Fault::Blackhole(_) => "link blackhole",
            Fault::Reset(_) => "link reset",
            Fault::KillServe => "SIGKILL serve",
            Fault::StopServe => "SIGSTOP/SIGCONT serve",
            Fault::KillWorker(_) => "SIGKILL worker",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Moment {
    Idle,
    Streaming,
    Loading,
}

#[derive(Default)]
struct Stats {
    faults: BTreeMap<&'static str, u64>,
    worst_release: Duration,
    worst_recovery: Duration,
    worker_crashes: u64,
    leaks: u64,
    hangs: u64,
    startup_failures: u64,
    port_reused: u64,
    port_moved: u64,
    failures: Vec<String>,
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn pick(rng: &mut Rng) -> (Fault, Moment) {
    let link = rng.below(2) as usize;
    let fault = match rng.below(6) {
        0 => Fault::Delay(link),
        1 => Fault::Blackhole(link),
        2 => Fault::Reset(link),
        3 => Fault::KillServe,
        4 => Fault::StopServe,
        _ => Fault::KillWorker(link),
    };
    let moment = match rng.below(3) {
        0 => Moment::Idle,
        1 => Moment::Streaming,
        _ => Moment::Loading,
    };
    (fault, moment)
}

/// Holds a fault for `held` while watching workers `cut` (cut off from any coordinator
/// that loaded before the fault): if they held sessions, the lease must free them, and
/// does so within [`LEASE_TTL`] + [`RELEASE_SLACK`].
fn hold_and_watch(
    c: &Cluster,
    cut: &[usize],
    held: Duration,
    stats: &mut Stats,
) -> Result<(), String> {
    let start = Instant::now();
    // Only a loaded coordinator holds sessions to reap; one still loading may not.
    let loaded = c.serve.as_ref().is_some_and(|s| !s.addr.is_empty())
        && cut
            .iter()
            .all(|&i| support::sessions_and_bytes(&c.workers[i].status()).0 > 0);
    let mut freed = None;
    if loaded {
        let mut all = Duration::ZERO;
        freed = cut
            .iter()
            .map(|&i| {
                c.workers[i].wait_status(held.saturating_sub(start.elapsed()), |s| {
                    support::sessions_and_bytes(s) == (0, 0)
                })
            })
            .try_fold((), |(), d| {
                all = start.elapsed();
                d.map(|_| ())
            })
            .map(|()| all);
    }
    std::thread::sleep(held.saturating_sub(start.elapsed()));
    match freed {
        Some(d) => {
            println!("  lease freed the cut-off sessions after {d:?} (held {held:?})");
            stats.worst_release = stats.worst_release.max(d);
        }
        None if loaded && held >= LEASE_TTL + RELEASE_SLACK => {
            stats.leaks += 1;
            return Err(format!(
                "cut off for {held:?}, the lease did not free: {}",
                c.worker_states()
            ));
        }
        None => {}
    }
    Ok(())
}

/// /health 200 and a short completion 200 within [`RECOVERY`]; hangs are failures.
fn recover(addr: &str, stats: &mut Stats) -> Result<Duration, String> {
    let start = Instant::now();
    let body = r#"{"prompt":[1,2,3],"max_tokens":4,"temperature":0.0}"#;
    let mut last = String::new();
    while start.elapsed() < RECOVERY {
        let health = http_deadline(addr, "GET", "/health", None, Duration::from_secs(5));
        let done = match health {
            Ok((200, _)) => http_deadline(
                addr,
                "POST",
                "/v1/completions",
                Some(body),
                Duration::from_secs(10),
            ),
            other => other,
        };
        match done {
            Ok((200, _)) => return Ok(start.elapsed()),
            Ok((code, text)) => last = format!("{code} {text}"),
            Err(e) if e.contains("hung") => {
                stats.hangs += 1;
                return Err(e);
            }
            Err(e) => last = e,
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(format!(
        "serve did not recover within {RECOVERY:?}; last: {last}"
    ))
}

/// Runs one fault with the given moment; Err describes a broken invariant.
fn step(
    c: &mut Cluster,
    rng: &mut Rng,
    fault: Fault,
    moment: Moment,
    stats: &mut Stats,
) -> Result<(), String> {
    let mut killed_worker = None;
    let mut stream = None;
    match moment {
        Moment::Idle => {}
        Moment::Streaming => {
            let addr = c.serve.as_ref().map(|s| s.addr.clone()).unwrap_or_default();
            stream = Some(Stream::start(&addr)?);
        }
        Moment::Loading => {
            c.stop_serve(libc::SIGTERM);
            let freed = c
                .wait_workers(Duration::from_millis(500) + RELEASE_SLACK, |n, b| {
                    (n, b) == (0, 0)
                })
                .ok_or_else(|| format!("SIGTERM left sessions: {}", c.worker_states()))?;
            stats.worst_release = stats.worst_release.max(freed);
            c.spawn_serve();
            std::thread::sleep(rng.millis(0, 300));
        }
    }
    *stats.faults.entry(fault.kind()).or_default() += 1;
    let mut serve_gone = false;
    match fault {
        Fault::Delay(i) => {
            c.proxies[i].set_mode(Mode::Delay(rng.below(150) + 10));
            std::thread::sleep(rng.millis(300, 2000));
            c.proxies[i].set_mode(Mode::Pass);
        }
        Fault::Blackhole(i) => {
            c.proxies[i].set_mode(Mode::Blackhole);
            let held = rng.millis(300, 4500);
            hold_and_watch(c, &[i], held, stats)?;
            c.proxies[i].set_mode(Mode::Pass);
        }
        Fault::Reset(i) => {
            c.proxies[i].reset_all();
        }
        Fault::KillServe => {
            c.stop_serve(libc::SIGKILL);
            serve_gone = true;
        }
        Fault::StopServe => {
            if let Some(s) = &c.serve {
                let pid = s.child.id();
                send_signal(pid, libc::SIGSTOP);
                let held = rng.millis(200, 4500);
                let watched = hold_and_watch(c, &[0, 1], held, stats);
                send_signal(pid, libc::SIGCONT);
                watched?;
            }
        }
        Fault::KillWorker(i) => {
            let old = c.workers[i].addr.clone();
            send_signal(c.workers[i].pid(), libc::SIGKILL);
            let _ = support::wait_exit(&mut c.workers[i].child, Duration::from_secs(5));
            killed_worker = Some(i);
            let fresh = match Worker::try_start_at(&old, &[]) {
                Ok(w) => {
                    stats.port_reused += 1;
                    w
                }
                Err(e) => {
                    println!("  worker port {old} not reusable, moving the proxy target: {e}");
                    stats.port_moved += 1;
                    let w = Worker::start(&[]);
                    c.proxies[i].set_target(&w.addr);
                    w
                }
            };
            c.workers[i] = fresh;
        }
    }
    if let Some(s) = stream.take() {
        let ended = s.finish(Duration::from_secs(3));
        println!("  stream: {ended:?}");
        if let Err(e) = ended {
            stats.hangs += 1;
            return Err(e);
        }
    }
    for (i, w) in c.workers.iter().enumerate() {
        if Some(i) != killed_worker && !process_alive(w.pid()) {
            stats.worker_crashes += 1;
            return Err(format!("worker {} died; log:\n{}", w.addr, w.log()));
        }
    }
    if serve_gone {
        let freed = c
            .wait_workers(LEASE_TTL + RELEASE_SLACK, |n, b| (n, b) == (0, 0))
            .ok_or_else(|| {
                stats.leaks += 1;
                format!("no coordinator, but sessions stay: {}", c.worker_states())
            })?;
        println!("  released {freed:?} after serve died");
        stats.worst_release = stats.worst_release.max(freed);
        c.spawn_serve();
    }
    if c.serve.as_ref().is_some_and(|s| s.addr.is_empty())
        && let Err(e) = c.await_listening(RECOVERY)
    {
        // A load that fails under a fault ends serve, which is allowed; its sessions
        // must still go.
        let tail: Vec<&str> = e.lines().rev().take(4).collect();
        println!("  serve did not come up: {}", tail.join(" | "));
        stats.startup_failures += 1;
        c.stop_serve(libc::SIGKILL);
        let freed = c
            .wait_workers(LEASE_TTL + RELEASE_SLACK, |n, b| (n, b) == (0, 0))
            .ok_or_else(|| {
                stats.leaks += 1;
                format!("failed load left sessions: {}; {e}", c.worker_states())
            })?;
        stats.worst_release = stats.worst_release.max(freed);
        c.spawn_serve();
        c.await_listening(RECOVERY)?;
    }
    let addr = c.serve.as_ref().map(|s| s.addr.clone()).unwrap_or_default();
    if let Some(serve) = c.serve.as_mut()
        && let Ok(Some(status)) = serve.child.try_wait()
    {
        return Err(format!(
            "serve exited by itself: {status:?}; log:\n{}",
            serve.log()
        ));
    }
    let recovered = recover(&addr, stats).map_err(|e| {
        format!(
            "{e}; serve log:\n{}",
            c.serve.as_ref().map(Serve::log).unwrap_or_default()
        )
    })?;
    stats.worst_recovery = stats.worst_recovery.max(recovered);
    // Old sessions (dropped links, dead coordinators) must be reaped: one each remains.
    c.wait_workers(LEASE_TTL + RELEASE_SLACK, |n, b| n == 1 && b > 0)
        .ok_or_else(|| {
            stats.leaks += 1;
            format!("serving, but workers hold {}", c.worker_states())
        })?;
    println!("  recovered in {recovered:?}");
    Ok(())
}

/// The hostile-clients phase: `bursts` bursts of every kind of hostile client against the
/// serving cluster. `/health` answers within a second throughout, and afterwards the model
/// is still loaded once (no reap, no reload), each worker holds one session, and a
/// completion succeeds.
fn hostile_phase(c: &mut Cluster, rng: &mut Rng, bursts: u64) -> Result<(), String> {
    let serve = c.serve.as_ref().ok_or("no serve to attack")?;
    let addr = serve.addr.clone();
    let log_before = serve.log().len();
    for b in 0..bursts {
        let seed = rng.next();
        let done = chaos_hostile::burst(&addr, seed)?;
        println!(
            "hostile burst {b} (seed {seed}): {} health probes, slowest {:?}",
            done.probes, done.slowest
        );
    }
    recover(&addr, &mut Stats::default())?;
    let log = c.serve.as_ref().map(Serve::log).unwrap_or_default();
    let during = log.get(log_before..).unwrap_or_default();
    if during.contains(" loaded:") || during.contains("reaped") {
        return Err(format!("the model was reloaded or reaped:\n{during}"));
    }
    c.wait_workers(LEASE_TTL + RELEASE_SLACK, |n, b| n == 1 && b > 0)
        .ok_or_else(|| format!("after the hostile clients: {}", c.worker_states()))?;
    Ok(())
}

#[test]
fn seeded_chaos_keeps_workers_up_and_frees_every_session() {
    let seed = env_u64("TETHER_CHAOS_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let duration = env_u64("TETHER_CHAOS_SECONDS").map(Duration::from_secs);
    let iterations = env_u64("TETHER_CHAOS_ITERATIONS").unwrap_or(if duration.is_some() {
        u64::MAX
    } else {
        DEFAULT_ITERATIONS
    });
    println!(
        "TETHER_CHAOS_SEED={seed} TETHER_CHAOS_ITERATIONS={iterations} TETHER_CHAOS_SECONDS={}",
        duration.map_or(0, |d| d.as_secs())
    );
    // Seeded through splitmix64, so that nearby seeds give unrelated runs.
    let mut rng = Rng(tether_compute::rng::SplitMix64::seed_of(seed, 0) | 1);
    let workers = [Worker::start(&[]), Worker::start(&[])];
    let proxies = [
        Proxy::start(&workers[0].addr),
        Proxy::start(&workers[1].addr),
    ];
    let mut c = Cluster {
        model: TinyModel::new(),
        workers,
        proxies,
        serve: None,
    };
    c.spawn_serve();
    let mut stats = Stats::default();
    let started = Instant::now();
    if let Err(e) = c.await_listening(Duration::from_secs(30)) {
        panic!("{e}");
    }
    let mut steps = 0;
    for i in 0..iterations {
        if duration.is_some_and(|d| started.elapsed() >= d) {
            break;
        }
        steps = i + 1;
        let (fault, moment) = pick(&mut rng);
        println!(
            "step {i}: {fault:?} while {moment:?} (t={:?})",
            started.elapsed()
        );
        if let Err(e) = step(&mut c, &mut rng, fault, moment, &mut stats) {
            stats
                .failures
                .push(format!("step {i} {fault:?}/{moment:?}: {e}"));
            break;
        }
    }
    let bursts = env_u64("TETHER_CHAOS_HOSTILE").unwrap_or(DEFAULT_HOSTILE_BURSTS);
    if stats.failures.is_empty()
        && let Err(e) = hostile_phase(&mut c, &mut rng, bursts)
    {
        stats.failures.push(format!("hostile clients: {e}"));
    }
    if stats.failures.is_empty() {
        c.stop_serve(libc::SIGTERM);
        match c.wait_workers(Duration::from_millis(500) + RELEASE_SLACK, |n, b| {
            (n, b) == (0, 0)
        }) {
            Some(d) => stats.worst_release = stats.worst_release.max(d),
            None => {
                stats.leaks += 1;
                stats
                    .failures
                    .push(format!("SIGTERM at the end left {}", c.worker_states()));
            }
        }
    }
    println!(
        "chaos summary: seed {seed}, iterations {steps}, {:?} total\n  faults {:?}\n  worst release {:?}, worst recovery {:?}\n  worker crashes {}, leaks {}, hangs {}, serve startup failures {}, worker port reused {} / moved {}",
        started.elapsed(),
        stats.faults,
        stats.worst_release,
        stats.worst_recovery,
        stats.worker_crashes,
        stats.leaks,
        stats.hangs,
        stats.startup_failures,
        stats.port_reused,
        stats.port_moved,
    );
    assert!(
        stats.failures.is_empty(),
        "seed {seed}: {}",
        stats.failures.join("\n")
    );
    assert_eq!((stats.worker_crashes, stats.leaks, stats.hangs), (0, 0, 0));
}

/// The proxy itself, against an echo server: passes bytes, delays them, holds them while
/// blackholed (and delivers them after), and resets connections with RST.
#[test]
fn the_fault_proxy_passes_delays_holds_and_resets() {
    use std::io::Read;
    let echo = std::net::TcpListener::bind("127.0.0.1:0").expect("bind echo");
    let target = echo.local_addr().expect("echo address").to_string();
    std::thread::spawn(move || {
        for mut s in echo.incoming().map_while(Result::ok) {
            std::thread::spawn(move || {
                let mut buf = [0u8; 1024];
                while let Ok(n @ 1..) = s.read(&mut buf) {
                    if s.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    let proxy = Proxy::start(&target);
    let mut conn = std::net::TcpStream::connect(&proxy.addr).expect("connect to the proxy");
    conn.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut roundtrip = |msg: &[u8]| -> (Vec<u8>, Duration) {
        let start = Instant::now();
        conn.write_all(msg).expect("write");
        let mut got = vec![0u8; msg.len()];
        let ok = conn.read_exact(&mut got).is_ok();
        (if ok { got } else { Vec::new() }, start.elapsed())
    };
    assert_eq!(roundtrip(b"pass").0, b"pass");
    proxy.set_mode(Mode::Delay(100));
    let (got, took) = roundtrip(b"slow");
    assert_eq!(got, b"slow");
    assert!(
        took >= Duration::from_millis(200),
        "two hops of 100 ms: {took:?}"
    );
    proxy.set_mode(Mode::Blackhole);
    let release = Instant::now();
    let held = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(400));
            proxy.set_mode(Mode::Pass);
        });
        roundtrip(b"held")
    });
    assert_eq!(
        held.0, b"held",
        "held bytes are delivered once the partition heals"
    );
    assert!(
        release.elapsed() >= Duration::from_millis(350),
        "{:?}",
        held.1
    );
    assert_eq!(proxy.open_connections(), 1);
    assert_eq!(proxy.reset_all(), 1);
    let mut buf = [0u8; 4];
    let after = conn.read(&mut buf);
    assert!(
        matches!(&after, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "reset, not a clean close: {after:?}"
    );
    let mut again = std::net::TcpStream::connect(&proxy.addr).expect("new connections work");
    again
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    again.write_all(b"next").expect("write");
    let mut got = [0u8; 4];
    again.read_exact(&mut got).expect("echo after reset");
    assert_eq!(&got, b"next");
}
