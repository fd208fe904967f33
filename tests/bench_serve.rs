//! `tether bench --serve` and `--url` end to end: the real binary starts a real
//! `tether serve` (or drives one the test started) and its JSON figures must add up to
//! the workload that was asked for.

mod support;

use std::process::Command;
use support::{Serve, TETHER, TinyModel};

/// Runs `tether bench ARGS --json`; its exit success, JSON rows and stderr.
fn bench(args: &[&str]) -> (bool, Vec<serde_json::Value>, String) {
    let out = Command::new(TETHER)
        .arg("bench")
        .args(args)
        .arg("--json")
        .env_remove("TETHER_API_KEY")
        .output()
        .expect("run tether bench");
    let rows = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("each row is JSON"))
        .collect();
    (
        out.status.success(),
        rows,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn u(v: &serde_json::Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} in {v}"))
}

fn f(v: &serde_json::Value, path: &[&str]) -> f64 {
    path.iter()
        .fold(v, |v, k| &v[*k])
        .as_f64()
        .unwrap_or_else(|| panic!("{path:?} in {v}"))
}

#[test]
fn serve_bench_counts_every_request_and_token() {
    let model = TinyModel::new();
    let (ok, rows, err) = bench(&[
        "--serve",
        "--model",
        model.arg(),
        "--device",
        "cpu",
        "--threads",
        "1",
        "--clients",
        "3",
        "--requests-per-client",
        "2",
        "-p",
        "40",
        "--shared-prefix",
        "32",
        "-n",
        "5",
    ]);
    assert!(ok, "bench failed: {err}");
    assert_eq!(rows.len(), 1, "{rows:?}");
    let r = &rows[0];
    assert_eq!((u(r, "requests"), u(r, "errors")), (6, 0), "{r}");
    assert_eq!(u(r, "prompt_tokens"), 6 * 40, "{r}");
    assert_eq!(
        u(r, "completion_tokens"),
        6 * 5,
        "ignore_eos: every token is generated"
    );
    assert_eq!(r["prefix_cache"], true);
    let (p50, p99) = (f(r, &["ttft_ms", "p50"]), f(r, &["ttft_ms", "p99"]));
    assert!(0.0 < p50 && p50 <= p99, "{r}");
    assert!(f(r, &["itl_ms", "p50"]) > 0.0, "{r}");
    let rate = f(r, &["tokens_per_second"]);
    let wall = f(r, &["wall_seconds"]);
    assert!(
        (rate * wall - 30.0).abs() < 1e-6,
        "t/s is tokens over wall: {r}"
    );
    let rounds = r["rounds"].as_array().expect("rounds");
    assert_eq!(rounds.len(), 2);
    assert!(rounds.iter().all(|x| u(x, "requests") == 3), "{r}");
}

#[test]
fn chat_turns_grow_the_history_with_and_without_the_prefix_cache() {
    let model = TinyModel::new();
    let (ok, rows, err) = bench(&[
        "--serve",
        "--model",
        model.arg(),
        "--device",
        "cpu",
        "--threads",
        "1",
        "--clients",
        "2",
        "--requests-per-client",
        "1",
        "--turns",
        "3",
        "-p",
        "6",
        "-n",
        "4",
        "--ctx",
        "512",
        "--compare-prefix-cache",
    ]);
    assert!(ok, "bench failed: {err}");
    assert_eq!(rows.len(), 3, "two runs and the ratio: {rows:?}");
    assert_eq!(rows[0]["prefix_cache"], true);
    assert_eq!(rows[1]["prefix_cache"], false);
    for run in &rows[..2] {
        assert_eq!((u(run, "requests"), u(run, "errors")), (6, 0), "{run}");
        let prompts: Vec<f64> = run["rounds"]
            .as_array()
            .expect("rounds")
            .iter()
            .map(|t| f(t, &["mean_prompt_tokens"]))
            .collect();
        assert_eq!(prompts.len(), 3);
        assert!(
            prompts[0] < prompts[1] && prompts[1] < prompts[2],
            "history grows: {prompts:?}"
        );
    }
    let ratio = f(
        &rows[2],
        &["compare_prefix_cache", "tokens_per_second_ratio"],
    );
    let want = f(&rows[0], &["tokens_per_second"]) / f(&rows[1], &["tokens_per_second"]);
    assert!((ratio - want).abs() < 1e-9, "{rows:?}");
}

#[test]
fn url_mode_drives_a_running_server_and_refuses_server_flags() {
    let model = TinyModel::new();
    let serve = Serve::start(&[
        "--model",
        model.arg(),
        "--device",
        "cpu",
        "--threads",
        "1",
        "--ctx",
        "128",
    ]);
    let url = format!("http://{}", serve.addr);
    let (ok, rows, err) = bench(&["--url", &url, "--clients", "2", "-p", "8", "-n", "3"]);
    assert!(ok, "bench failed: {err}");
    assert_eq!(
        (u(&rows[0], "requests"), u(&rows[0], "errors")),
        (8, 0),
        "{rows:?}"
    );
    assert_eq!(rows[0]["prefix_cache"], serde_json::Value::Null);
    let (ok, _, err) = bench(&["--url", &url, "--no-prefix-cache"]);
    assert!(!ok && err.contains("--no-prefix-cache"), "{err}");
    // A prompt longer than the server's context: every request fails, and the command says so.
    let (ok, rows, err) = bench(&["--url", &url, "-p", "400", "-n", "3"]);
    assert!(
        !ok && err.contains("warm-up") && err.contains("400"),
        "{err} {rows:?}"
    );
    let (ok, _, err) = bench(&["--turns", "2"]);
    assert!(
        !ok && err.contains("--turns") && err.contains("--serve"),
        "{err}"
    );
}
