//! TLS flags: `--tls-cert/--tls-key/--tls-ca` of `tether worker` (gRPC) and `tether serve`
//! (the HTTP API), and
//! `--worker-tls-ca/--worker-tls-cert/--worker-tls-key/--worker-tls-name` of everything
//! that connects to workers (`run`, `serve`, `attach`, `plan`, `tetherctl`).

use anyhow::{Context, Result, bail};
use clap::Args;
use std::path::{Path, PathBuf};
use tether_protocol::tls::{CertifiedKey, ClientTls, Pem, ServerTls};

/// How `tether worker` (gRPC) or `tether serve` (HTTPS) serves TLS.
#[derive(Args, Debug, Clone, Default)]
pub struct ServeTlsArgs {
    /// Serve TLS only, with this certificate (PEM, leaf first, then any intermediates);
    /// needs --tls-key. Clients of a worker then pass --worker-tls-ca; `serve` answers
    /// HTTPS only.
    #[arg(long, env = "TETHER_TLS_CERT", value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM, unencrypted) of --tls-cert.
    #[arg(long, env = "TETHER_TLS_KEY", value_name = "PEM")]
    pub tls_key: Option<PathBuf>,
    /// Mutual TLS: refuse every client that does not present a certificate signed by this
    /// CA (PEM). Needs --tls-cert and --tls-key.
    #[arg(long, env = "TETHER_TLS_CA", value_name = "PEM")]
    pub tls_ca: Option<PathBuf>,
}

impl ServeTlsArgs {
    /// The TLS settings, with every file read and checked; `None` serves plaintext.
    pub fn server_tls(&self) -> Result<Option<ServerTls>> {
        let (cert, key, ca) = (
            given(&self.tls_cert),
            given(&self.tls_key),
            given(&self.tls_ca),
        );
        let identity = match (cert, key) {
            (None, None) if ca.is_some() => bail!(
                "--tls-ca (require client certificates) needs --tls-cert and --tls-key: TLS must be served to check clients' certificates"
            ),
            (None, None) => return Ok(None),
            (Some(_), None) => bail!("--tls-cert needs --tls-key (the certificate's private key)"),
            (None, Some(_)) => bail!("--tls-key needs --tls-cert (the certificate it belongs to)"),
            (Some(cert), Some(key)) => {
                CertifiedKey::read(cert, key).context("--tls-cert/--tls-key")?
            }
        };
        let client_ca = ca.map(Pem::read).transpose().context("--tls-ca")?;
        ServerTls::new(identity, client_ca)
            .context("the TLS settings")
            .map(Some)
    }
}

/// How clients reach workers that serve TLS.
#[derive(Args, Debug, Clone, Default)]
pub struct WorkerTlsArgs {
    /// Speak TLS to the workers and check their certificates against this CA (PEM); for
    /// workers started with --tls-cert.
    #[arg(long, env = "TETHER_WORKER_TLS_CA", value_name = "PEM")]
    pub worker_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for workers that require one (their --tls-ca); needs
    /// --worker-tls-key and --worker-tls-ca.
    #[arg(long, env = "TETHER_WORKER_TLS_CERT", value_name = "PEM")]
    pub worker_tls_cert: Option<PathBuf>,
    /// Private key (PEM, unencrypted) of --worker-tls-cert.
    #[arg(long, env = "TETHER_WORKER_TLS_KEY", value_name = "PEM")]
    pub worker_tls_key: Option<PathBuf>,
    /// Name to check in the workers' certificates instead of the host of each address
    /// (e.g. when connecting by IP to a certificate that holds only a DNS name).
    #[arg(long, env = "TETHER_WORKER_TLS_NAME", value_name = "NAME")]
    pub worker_tls_name: Option<String>,
}

impl WorkerTlsArgs {
    /// The TLS settings, with every file read and checked; `None` speaks plaintext.
    pub fn client_tls(&self) -> Result<Option<ClientTls>> {
        let cert = given(&self.worker_tls_cert);
        let key = given(&self.worker_tls_key);
        let name = self.worker_tls_name.clone().filter(|n| !n.is_empty());
        let Some(ca) = given(&self.worker_tls_ca) else {
            if cert.is_some() || key.is_some() || name.is_some() {
                bail!(
                    "--worker-tls-cert, --worker-tls-key and --worker-tls-name need --worker-tls-ca (the CA that signed the workers' certificates)"
                );
            }
            return Ok(None);
        };
        let identity = match (cert, key) {
            (None, None) => None,
            (Some(_), None) => bail!("--worker-tls-cert needs --worker-tls-key"),
            (None, Some(_)) => bail!("--worker-tls-key needs --worker-tls-cert"),
            (Some(cert), Some(key)) => {
                Some(CertifiedKey::read(cert, key).context("--worker-tls-cert/--worker-tls-key")?)
            }
        };
        let ca = Pem::read(ca).context("--worker-tls-ca")?;
        ClientTls::new(ca, identity, name)
            .context("the TLS settings for workers")
            .map(Some)
    }

    /// Whether any of the flags is given.
    pub fn any_given(&self) -> bool {
        given(&self.worker_tls_ca).is_some()
            || given(&self.worker_tls_cert).is_some()
            || given(&self.worker_tls_key).is_some()
    }
}

/// A path flag, with an empty value (an exported but empty variable) taken as not given.
fn given(path: &Option<PathBuf>) -> Option<&Path> {
    path.as_deref().filter(|p| !p.as_os_str().is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct WorkerCli {
        #[command(flatten)]
        tls: ServeTlsArgs,
    }

    #[derive(Parser)]
    struct ClientCli {
        #[command(flatten)]
        tls: WorkerTlsArgs,
    }

    fn pki(name: &str) -> String {
        format!("{}/../../tests/data/tls/{name}", env!("CARGO_MANIFEST_DIR"))
    }

    fn worker(args: &[&str]) -> Result<Option<ServerTls>> {
        let cli = WorkerCli::try_parse_from(std::iter::once("tether").chain(args.iter().copied()))
            .context("parsing")?;
        cli.tls.server_tls()
    }

    fn client(args: &[&str]) -> Result<Option<ClientTls>> {
        let cli = ClientCli::try_parse_from(std::iter::once("tether").chain(args.iter().copied()))
            .context("parsing")?;
        cli.tls.client_tls()
    }

    fn message(result: Result<impl std::fmt::Debug>) -> String {
        match result {
            Ok(v) => panic!("expected an error, got {v:?}"),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn a_worker_serves_plaintext_tls_or_mutual_tls() {
        assert!(worker(&[]).expect("no flags").is_none());
        let (cert, key, ca) = (pki("worker.pem"), pki("worker.key"), pki("ca.pem"));
        let tls = worker(&["--tls-cert", &cert, "--tls-key", &key])
            .expect("cert and key")
            .expect("TLS");
        assert!(!tls.requires_client_certificate());
        let mtls = worker(&["--tls-cert", &cert, "--tls-key", &key, "--tls-ca", &ca])
            .expect("mutual TLS")
            .expect("TLS");
        assert!(mtls.requires_client_certificate());
    }

    #[test]
    fn half_given_worker_flags_say_what_is_missing() {
        let cert = pki("worker.pem");
        let key = pki("worker.key");
        let ca = pki("ca.pem");
        assert!(message(worker(&["--tls-cert", &cert])).contains("needs --tls-key"));
        assert!(message(worker(&["--tls-key", &key])).contains("needs --tls-cert"));
        assert!(message(worker(&["--tls-ca", &ca])).contains("needs --tls-cert and --tls-key"));
    }

    #[test]
    fn wrong_worker_files_are_named() {
        let cert = pki("worker.pem");
        let key = pki("worker.key");
        let swapped = message(worker(&["--tls-cert", &key, "--tls-key", &cert]));
        assert!(
            swapped.contains("worker.key") && swapped.contains("no PEM certificate"),
            "{swapped}"
        );
        let missing = message(worker(&[
            "--tls-cert",
            "/nonexistent/w.pem",
            "--tls-key",
            &key,
        ]));
        assert!(missing.contains("/nonexistent/w.pem"), "{missing}");
        let mismatched = pki("client.key");
        let refused = message(worker(&["--tls-cert", &cert, "--tls-key", &mismatched]));
        assert!(refused.contains("client.key"), "{refused}");
        let bad_ca = message(worker(&[
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--tls-ca",
            &key,
        ]));
        assert!(
            bad_ca.contains("--tls-ca") || bad_ca.contains("worker.key"),
            "{bad_ca}"
        );
    }

    #[test]
    fn client_flags_need_the_ca_and_whole_pairs() {
        assert!(client(&[]).expect("no flags").is_none());
        let (ca, cert, key) = (pki("ca.pem"), pki("client.pem"), pki("client.key"));
        let plain_tls = client(&["--worker-tls-ca", &ca])
            .expect("CA only")
            .expect("TLS");
        assert!(!plain_tls.presents_certificate());
        let mutual = client(&[
            "--worker-tls-ca",
            &ca,
            "--worker-tls-cert",
            &cert,
            "--worker-tls-key",
            &key,
        ])
        .expect("client certificate")
        .expect("TLS");
        assert!(mutual.presents_certificate());
        let without_ca = message(client(&[
            "--worker-tls-cert",
            &cert,
            "--worker-tls-key",
            &key,
        ]));
        assert!(without_ca.contains("need --worker-tls-ca"), "{without_ca}");
        let half = message(client(&[
            "--worker-tls-ca",
            &ca,
            "--worker-tls-cert",
            &cert,
        ]));
        assert!(half.contains("needs --worker-tls-key"), "{half}");
        let name = message(client(&["--worker-tls-name", "worker-0"]));
        assert!(name.contains("need --worker-tls-ca"), "{name}");
        let bad_name = message(client(&[
            "--worker-tls-ca",
            &ca,
            "--worker-tls-name",
            "a b",
        ]));
        assert!(bad_name.contains("\"a b\""), "{bad_name}");
    }
}
