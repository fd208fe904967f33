//! `tetherctl --coordinator URL model load|unload|reload` against real `tether serve` and
//! worker processes: the model changes without a restart, the worker holds only the
//! served model's session afterwards, and an unloaded coordinator refuses requests.

mod support;

use std::process::{Command, Output};
use std::time::Duration;
use support::{Serve, TETHERCTL, TinyModel, Worker, completion_body, http, http_json};

fn tetherctl(url: &str, args: &[&str]) -> Output {
    Command::new(TETHERCTL)
        .args(["--coordinator", url])
        .args(args)
        .env_remove("TETHER_API_KEY")
        .output()
        .expect("run tetherctl")
}

fn tetherctl_json(url: &str, args: &[&str]) -> serde_json::Value {
    let out = tetherctl(url, &[&["--json"][..], args].concat());
    assert!(
        out.status.success(),
        "tetherctl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("tetherctl prints JSON")
}

fn complete(addr: &str) -> (u16, String) {
    let body = completion_body(&[1, 2, 3], 4, false);
    http(addr, "POST", "/v1/completions", Some(&body))
}

#[test]
fn tetherctl_loads_unloads_and_reloads_the_model_of_a_running_serve() {
    let (first, second) = (TinyModel::new(), TinyModel::new());
    let worker = Worker::start(&[]);
    let serve = Serve::start(&["--model", first.arg(), "--worker", &worker.addr]);
    let url = format!("http://{}", serve.addr);

    let loaded = tetherctl_json(&url, &["model", "load", second.arg(), "--id", "second"]);
    assert_eq!(loaded["model"], "second", "{loaded}");
    assert_eq!(loaded["previous"], "tiny", "{loaded}");
    assert_eq!(
        http_json(&serve.addr, "/v1/models")["data"][0]["id"],
        "second"
    );
    assert_eq!(complete(&serve.addr).0, 200);
    // The first model's session was closed: one session, the second model's.
    worker
        .wait_status(Duration::from_secs(5), |s| s["sessions"] == 1)
        .expect("only the new model's session is left");

    let view = tetherctl(&url, &["model"]);
    assert!(view.status.success());
    assert!(String::from_utf8_lossy(&view.stdout).contains("model second"));

    let unloaded = tetherctl_json(&url, &["model", "unload"]);
    assert_eq!(unloaded["model"], serde_json::Value::Null, "{unloaded}");
    let status = worker.status();
    assert_eq!(status["sessions"], 0, "{status}");
    assert_eq!(status["session_bytes"], 0, "{status}");
    let (code, body) = complete(&serve.addr);
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("no model is loaded"), "{body}");
    let again = tetherctl(&url, &["model", "unload"]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("nothing to unload"));

    let reloaded = tetherctl_json(&url, &["model", "reload"]);
    assert_eq!(reloaded["model"], "second", "{reloaded}");
    assert_eq!(complete(&serve.addr).0, 200);
}
