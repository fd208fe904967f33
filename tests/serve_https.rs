//! `tether serve --tls-cert/--tls-key` answers HTTPS only, and with `--tls-ca` only to
//! clients whose certificate that CA signed; `tetherctl --coordinator https://…` reads it
//! with `--coordinator-ca` (and a client certificate when required). A real serve process
//! with embedded workers and the test PKI of tests/data/tls.

mod support;

use std::process::Command;
use std::time::Duration;
use support::{Serve, TETHERCTL, TinyModel};
use ureq::tls::{Certificate, ClientCert, PrivateKey, RootCerts, TlsConfig};

fn pki(name: &str) -> String {
    format!("{}/../../tests/data/tls/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn read(name: &str) -> Vec<u8> {
    std::fs::read(pki(name)).expect("test PKI file")
}

/// Starts serve over HTTPS; returns it and its `127.0.0.1:PORT`.
fn https_serve(model: &TinyModel, mutual: bool) -> (Serve, String) {
    let (cert, key, ca) = (pki("worker.pem"), pki("worker.key"), pki("ca.pem"));
    let mut args = vec![
        "--model",
        model.arg(),
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
    ];
    if mutual {
        args.extend(["--tls-ca", &ca]);
    }
    let serve = Serve::spawn(&args);
    let line = "tether serve listening on https://";
    assert!(
        serve.log_contains(line, Duration::from_secs(60)),
        "serve did not start over HTTPS; log:\n{}",
        serve.log()
    );
    let log = serve.log();
    let addr = log
        .split(line)
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("listening address")
        .to_string();
    (serve, addr)
}

/// An HTTP client trusting `ca` (or the public roots), presenting `client` if given.
fn agent(ca: Option<&str>, client: Option<&str>) -> ureq::Agent {
    let mut tls = TlsConfig::builder();
    if let Some(ca) = ca {
        let ca = Certificate::from_pem(&read(ca)).expect("CA");
        tls = tls.root_certs(RootCerts::new_with_certs(&[ca]));
    }
    if let Some(c) = client {
        let chain = Certificate::from_pem(&read(&format!("{c}.pem"))).expect("cert");
        let key = PrivateKey::from_pem(&read(&format!("{c}.key"))).expect("key");
        tls = tls.client_cert(Some(ClientCert::new_with_certs(&[chain], key)));
    }
    ureq::Agent::config_builder()
        .tls_config(tls.build())
        .timeout_global(Some(Duration::from_secs(20)))
        .build()
        .into()
}

fn health(agent: &ureq::Agent, url: &str) -> Result<u16, String> {
    agent
        .get(&format!("{url}/health"))
        .call()
        .map(|r| r.status().as_u16())
        .map_err(|e| e.to_string())
}

fn tetherctl_model(url: &str, flags: &[&str]) -> std::process::Output {
    Command::new(TETHERCTL)
        .args(["--coordinator", url])
        .args(flags)
        .args(["--json", "model"])
        .env_remove("TETHER_COORDINATOR_CA")
        .env_remove("TETHER_COORDINATOR_CERT")
        .env_remove("TETHER_COORDINATOR_KEY")
        .output()
        .expect("run tetherctl")
}

#[test]
fn serve_answers_https_to_clients_that_trust_its_ca_and_nothing_else() {
    let model = TinyModel::new();
    let (_serve, addr) = https_serve(&model, false);
    let url = format!("https://{addr}");
    assert_eq!(health(&agent(Some("ca.pem"), None), &url), Ok(200));
    let reply = agent(Some("ca.pem"), None)
        .post(&format!("{url}/v1/completions"))
        .header("Content-Type", "application/json")
        .send(r#"{"prompt": [1, 5, 6], "max_tokens": 3, "temperature": 0}"#)
        .map(|mut r| r.body_mut().read_to_string().unwrap_or_default());
    assert!(
        reply
            .as_ref()
            .is_ok_and(|body| body.contains("\"choices\"")),
        "{reply:?}"
    );

    let untrusted = health(&agent(Some("rogue-ca.pem"), None), &url);
    assert!(untrusted.is_err(), "a client trusting another CA connected");
    let plaintext = health(&agent(None, None), &format!("http://{addr}"));
    assert!(plaintext.is_err(), "plain HTTP was answered: {plaintext:?}");

    let out = tetherctl_model(&url, &["--coordinator-ca", &pki("ca.pem")]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("ctx_per_seq"));
    let out = tetherctl_model(&url, &["--coordinator-ca", &pki("rogue-ca.pem")]);
    assert!(!out.status.success(), "tetherctl trusted the wrong CA");
}

#[test]
fn with_tls_ca_serve_admits_only_clients_with_a_certificate_of_that_ca() {
    let model = TinyModel::new();
    let (_serve, addr) = https_serve(&model, true);
    let url = format!("https://{addr}");
    assert!(
        health(&agent(Some("ca.pem"), None), &url).is_err(),
        "no certificate"
    );
    assert!(
        health(&agent(Some("ca.pem"), Some("rogue-client")), &url).is_err(),
        "a certificate of another CA"
    );
    assert_eq!(
        health(&agent(Some("ca.pem"), Some("client")), &url),
        Ok(200)
    );
    let flags = [
        "--coordinator-ca",
        &pki("ca.pem"),
        "--coordinator-cert",
        &pki("client.pem"),
        "--coordinator-key",
        &pki("client.key"),
    ];
    let out = tetherctl_model(&url, &flags);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = tetherctl_model(&url, &flags[..2]);
    assert!(
        !out.status.success(),
        "tetherctl got in without a certificate"
    );
}
