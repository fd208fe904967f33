//! Workers started with `--tls-cert/--tls-key` serve only TLS, and with `--tls-ca` only to
//! clients whose certificate that CA signed. Clients that do not trust the worker's CA,
//! speak plaintext, or present no or a foreign certificate are refused with an error that
//! names TLS, and the worker opens nothing for them; trusted clients load and serve, with
//! the token on top, and `tether run` / `tether serve` / `tetherctl` work end to end.
//! All against real `tether worker` processes, with the test PKI of tests/data/tls.

mod support;

use std::process::{Command, Output};
use std::time::Duration;
use support::{Serve, TETHER, TETHERCTL, TinyModel, Worker, http, http_json, sessions_and_bytes};
use tether_client::{AttachOptions, ClientError, ClientOptions, ErrorKind, WorkerClient};
use tether_protocol::tls::{CertifiedKey, ClientTls, Pem};
use tether_protocol::{BearerToken, Lease};

const TOKEN: &str = "worker-tls-test-3b8e1d";

/// A file of the test PKI (scripts/make_test_certs.sh).
fn pki(name: &str) -> String {
    format!("{}/../../tests/data/tls/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn pem(name: &str) -> Pem {
    Pem::read(std::path::Path::new(&pki(name))).expect("test PKI file")
}

/// `tether worker` flags of a TLS worker; with `mutual`, clients need a certificate.
fn tls_worker_args(mutual: bool) -> Vec<String> {
    let mut args = vec![
        "--tls-cert".to_string(),
        pki("worker.pem"),
        "--tls-key".to_string(),
        pki("worker.key"),
    ];
    if mutual {
        args.extend(["--tls-ca".to_string(), pki("ca.pem")]);
    }
    args
}

fn start_worker(args: &[String]) -> Worker {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Worker::start(&args)
}

/// Client TLS settings: trusting `ca`, presenting `client` (`NAME.pem`/`NAME.key`) if given.
fn client_tls(ca: &str, client: Option<&str>, name: Option<&str>) -> ClientTls {
    let identity = client.map(|c| {
        CertifiedKey::new(pem(&format!("{c}.pem")), pem(&format!("{c}.key"))).expect("client pair")
    });
    ClientTls::new(pem(ca), identity, name.map(str::to_string)).expect("client TLS")
}

fn options(tls: Option<ClientTls>, token: Option<&str>) -> ClientOptions {
    ClientOptions {
        tls,
        token: BearerToken::parse(token).expect("token"),
        ..ClientOptions::default()
    }
}

/// `--worker-tls-*` flags trusting ca.pem, with the test client certificate.
fn client_flags() -> Vec<String> {
    vec![
        "--worker-tls-ca".to_string(),
        pki("ca.pem"),
        "--worker-tls-cert".to_string(),
        pki("client.pem"),
        "--worker-tls-key".to_string(),
        pki("client.key"),
    ]
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// `tetherctl --worker ADDR --json ARGS` with `flags`, the token in TETHER_WORKER_TOKEN
/// when given, and no TLS settings from the environment.
fn tetherctl(addr: &str, flags: &[String], token: Option<&str>, args: &[&str]) -> Output {
    let mut cmd = Command::new(TETHERCTL);
    cmd.args(["--worker", addr, "--json"])
        .args(flags)
        .args(args)
        .env_remove("TETHER_ADMIN_TOKEN")
        .env_remove("TETHER_WORKER_TOKEN");
    for var in ["CA", "CERT", "KEY", "NAME"] {
        cmd.env_remove(format!("TETHER_WORKER_TLS_{var}"));
    }
    if let Some(t) = token {
        cmd.env("TETHER_WORKER_TOKEN", t);
    }
    cmd.output().expect("run tetherctl")
}

/// The worker's status through the admin API over (mutual) TLS.
fn status(addr: &str, token: Option<&str>) -> serde_json::Value {
    let out = tetherctl(addr, &client_flags(), token, &["status"]);
    assert!(
        out.status.success(),
        "tetherctl status over TLS: {}",
        text(&out)
    );
    serde_json::from_slice(&out.stdout).expect("tetherctl prints JSON")
}

fn assert_nothing_opened(addr: &str, token: Option<&str>) {
    let s = status(addr, token);
    assert_eq!(sessions_and_bytes(&s), (0, 0), "{s}");
    assert_eq!(s["counters"]["opened"], 0, "{s}");
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Waits a moment for `needle` in the worker's log (its output is read by other threads).
fn wait_for_log(worker: &Worker, needle: &str) {
    let start = std::time::Instant::now();
    while !worker.log().contains(needle) {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "no {needle:?} in the worker's log:\n{}",
            worker.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn lease() -> Lease {
    Lease {
        heartbeat_interval: Duration::from_millis(200),
        ttl: Duration::from_secs(5),
    }
}

/// Connects and opens a session; returns the failure of either step.
async fn open_session(addr: &str, options: &ClientOptions) -> Result<(), ClientError> {
    let client = WorkerClient::connect(addr, options).await?;
    let session = client
        .attach(AttachOptions {
            client_name: "worker-tls".into(),
            lease: lease(),
            heartbeat: true,
        })
        .await?;
    session.close().await;
    Ok(())
}

/// A refused connection: an Unavailable connect error that says TLS.
fn assert_refused_for_tls(result: Result<(), ClientError>, what: &str) -> String {
    let err = result
        .err()
        .unwrap_or_else(|| panic!("{what} was admitted"));
    let message = err.to_string();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{what}: {message}");
    assert!(
        matches!(err, ClientError::Connect { .. }),
        "{what}: {message}"
    );
    assert!(message.contains("TLS"), "{what}: {message}");
    eprintln!("{what}: {message}");
    message
}

#[test]
fn a_tls_worker_serves_clients_that_trust_its_ca() {
    let worker = start_worker(&tls_worker_args(false));
    wait_for_log(&worker, "transport=\"TLS\"");
    let rt = runtime();
    rt.block_on(async {
        let tls = options(Some(client_tls("ca.pem", None, None)), None);
        let client = WorkerClient::connect(&worker.addr, &tls)
            .await
            .expect("a client trusting ca.pem connects");
        assert!(client.info().free_bytes > 0, "{:?}", client.info());
        let session = client
            .attach(AttachOptions {
                client_name: "worker-tls".into(),
                lease: lease(),
                heartbeat: true,
            })
            .await
            .expect("attach over TLS");
        let held = status(&worker.addr, None);
        assert_eq!(held["sessions"], 1, "{held}");
        session.close().await;
        // The certificate holds 127.0.0.1 and localhost: another name it holds works, one
        // it does not hold is refused.
        let by_name = options(Some(client_tls("ca.pem", None, Some("localhost"))), None);
        WorkerClient::connect(&worker.addr, &by_name)
            .await
            .expect("--worker-tls-name localhost");
        let wrong = options(
            Some(client_tls("ca.pem", None, Some("worker.elsewhere"))),
            None,
        );
        let message = assert_refused_for_tls(
            open_session(&worker.addr, &wrong).await,
            "a client checking another name",
        );
        assert!(message.contains("--worker-tls-name"), "{message}");
    });
    let s = status(&worker.addr, None);
    assert_eq!(sessions_and_bytes(&s), (0, 0), "{s}");
    assert_eq!(s["counters"]["opened"], 1, "{s}");
}

#[test]
fn plaintext_clients_of_a_tls_worker_are_refused_and_told_about_tls() {
    let worker = start_worker(&tls_worker_args(false));
    let message = assert_refused_for_tls(
        runtime().block_on(open_session(&worker.addr, &options(None, None))),
        "a plaintext client",
    );
    assert!(message.contains("--worker-tls-ca"), "{message}");
    let plain = tetherctl(&worker.addr, &[], None, &["status"]);
    assert!(!plain.status.success(), "{}", text(&plain));
    assert!(text(&plain).contains("--worker-tls-ca"), "{}", text(&plain));
    assert_nothing_opened(&worker.addr, None);
}

#[test]
fn a_client_trusting_another_ca_refuses_the_worker() {
    let worker = start_worker(&tls_worker_args(false));
    let rogue = options(Some(client_tls("rogue-ca.pem", None, None)), None);
    let message = assert_refused_for_tls(
        runtime().block_on(open_session(&worker.addr, &rogue)),
        "a client trusting rogue-ca.pem",
    );
    assert!(
        message.contains("UnknownIssuer") && message.contains("--worker-tls-ca"),
        "{message}"
    );
    assert_nothing_opened(&worker.addr, None);
}

#[test]
fn a_mutual_tls_worker_refuses_clients_without_a_certificate_of_its_ca() {
    let worker = start_worker(&tls_worker_args(true));
    wait_for_log(&worker, "transport=\"mutual TLS\"");
    let rt = runtime();
    let bare = options(Some(client_tls("ca.pem", None, None)), None);
    let message = assert_refused_for_tls(
        rt.block_on(open_session(&worker.addr, &bare)),
        "a client without a certificate",
    );
    assert!(message.contains("--worker-tls-cert"), "{message}");
    let rogue = options(Some(client_tls("ca.pem", Some("rogue-client"), None)), None);
    let message = assert_refused_for_tls(
        rt.block_on(open_session(&worker.addr, &rogue)),
        "a client whose certificate rogue-ca signed",
    );
    assert!(message.contains("--tls-ca"), "{message}");
    // tetherctl without a client certificate is refused as well.
    let flags = vec!["--worker-tls-ca".to_string(), pki("ca.pem")];
    let refused = tetherctl(&worker.addr, &flags, None, &["status"]);
    assert!(!refused.status.success(), "{}", text(&refused));
    assert!(text(&refused).contains("TLS"), "{}", text(&refused));
    assert_nothing_opened(&worker.addr, None);
    let trusted = options(Some(client_tls("ca.pem", Some("client"), None)), None);
    rt.block_on(open_session(&worker.addr, &trusted))
        .expect("the client certificate of ca.pem is admitted");
    let s = status(&worker.addr, None);
    assert_eq!(s["counters"]["opened"], 1, "{s}");
}

#[test]
fn mutual_tls_and_the_token_together_admit_only_clients_with_both() {
    let mut args = tls_worker_args(true);
    args.extend(["--token".to_string(), TOKEN.to_string()]);
    let worker = start_worker(&args);
    let rt = runtime();
    let cert_only = options(Some(client_tls("ca.pem", Some("client"), None)), None);
    let err = rt
        .block_on(open_session(&worker.addr, &cert_only))
        .expect_err("a certificate without the token is refused");
    assert_eq!(err.kind(), ErrorKind::Unauthenticated, "{err}");
    assert_nothing_opened(&worker.addr, Some(TOKEN));
    let both = options(
        Some(client_tls("ca.pem", Some("client"), None)),
        Some(TOKEN),
    );
    rt.block_on(open_session(&worker.addr, &both))
        .expect("certificate and token");
    let s = status(&worker.addr, Some(TOKEN));
    assert_eq!(sessions_and_bytes(&s), (0, 0), "{s}");
    assert_eq!(s["counters"]["opened"], 1, "{s}");
}

#[test]
fn tether_run_and_serve_work_through_a_mutual_tls_worker() {
    let model = TinyModel::new();
    let mut args = tls_worker_args(true);
    args.extend(["--token".to_string(), TOKEN.to_string()]);
    let worker = start_worker(&args);
    let ran = Command::new(TETHER)
        .args(["run", "--model", model.arg(), "--worker", &worker.addr])
        .args(["-n", "4", "--ctx", "32", "--temp", "0", "-p", "hello"])
        .args(client_flags())
        .args(["--worker-token", TOKEN])
        .env_remove("TETHER_WORKER_TOKEN")
        .output()
        .expect("run tether run");
    assert!(ran.status.success(), "{}", text(&ran));
    assert!(
        String::from_utf8_lossy(&ran.stdout).starts_with("hello"),
        "{}",
        text(&ran)
    );
    let without_tls = Command::new(TETHER)
        .args(["run", "--model", model.arg(), "--worker", &worker.addr])
        .args(["-n", "1", "--ctx", "32", "-p", "hello"])
        .args(["--worker-token", TOKEN])
        .env_remove("TETHER_WORKER_TOKEN")
        .output()
        .expect("run tether run");
    assert!(!without_tls.status.success(), "{}", text(&without_tls));
    assert!(
        text(&without_tls).contains("--worker-tls-ca"),
        "{}",
        text(&without_tls)
    );

    let mut serve_args = vec![
        "--model".to_string(),
        model.arg().to_string(),
        "--worker".to_string(),
        worker.addr.clone(),
        "--worker-token".to_string(),
        TOKEN.to_string(),
        "--ctx".to_string(),
        "32".to_string(),
        "--parallel".to_string(),
        "1".to_string(),
    ];
    serve_args.extend(client_flags());
    let serve_args: Vec<&str> = serve_args.iter().map(String::as_str).collect();
    let serve = Serve::start(&serve_args);
    let body = r#"{"prompt": [1, 2], "max_tokens": 3, "temperature": 0}"#;
    let (code, reply) = http(&serve.addr, "POST", "/v1/completions", Some(body));
    assert_eq!(code, 200, "{reply}");
    // The coordinator's admin view reaches the worker's admin service over mutual TLS too.
    let workers = http_json(&serve.addr, "/v1/admin/workers");
    let workers = workers.as_array().expect("worker list");
    assert_eq!(workers.len(), 1, "{workers:?}");
    assert_eq!(workers[0]["status"]["sessions"], 1, "{workers:?}");
    let s = status(&worker.addr, Some(TOKEN));
    assert_eq!(s["sessions"], 1, "{s}");
    assert_eq!(
        s["counters"]["opened"], 2,
        "the run and the serve opened one session each: {s}"
    );
}

#[test]
fn a_worker_with_bad_tls_files_does_not_start_and_names_them() {
    let half = Worker::try_start_at("127.0.0.1:0", &["--tls-cert", &pki("worker.pem")])
        .err()
        .expect("--tls-cert without --tls-key must not start");
    assert!(half.contains("needs --tls-key"), "{half}");
    let swapped = Worker::try_start_at(
        "127.0.0.1:0",
        &[
            "--tls-cert",
            &pki("worker.key"),
            "--tls-key",
            &pki("worker.pem"),
        ],
    )
    .err()
    .expect("swapped files must not start");
    assert!(
        swapped.contains("worker.key") && swapped.contains("no PEM certificate"),
        "{swapped}"
    );
}
