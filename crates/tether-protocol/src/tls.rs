//! TLS on worker links: the worker's certificate and key, the CA a client checks the worker
//! against, and for mutual TLS the client's certificate and the CA the worker checks it
//! against. Everything is PEM, checked when it is read, so a wrong or mismatched file is
//! named at startup instead of failing every handshake later.

use rustls_pki_types::pem::{self, PemObject};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// How long a TLS handshake may take: a peer that opens a socket and never speaks must not
/// hold a task or a connection slot.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why TLS settings cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The file could not be read.
    #[error("cannot read {file}: {error}")]
    Read {
        /// The file.
        file: String,
        /// What the system said.
        error: std::io::Error,
    },
    /// No certificate where one was expected.
    #[error(
        "{source_name} holds no PEM certificate (a `-----BEGIN CERTIFICATE-----` block): give the certificate file, not a key"
    )]
    NoCertificate {
        /// The file (or other origin) of the PEM text.
        source_name: String,
    },
    /// No private key where one was expected.
    #[error(
        "{source_name} holds no unencrypted PEM private key (PKCS#8, SEC1 or PKCS#1): give the key file, not a certificate"
    )]
    NoKey {
        /// The file (or other origin) of the PEM text.
        source_name: String,
    },
    /// The PEM text is damaged.
    #[error("{source_name} is not valid PEM: {detail}")]
    BadPem {
        /// The file (or other origin) of the PEM text.
        source_name: String,
        /// What the parser said.
        detail: String,
    },
    /// The name to check in the worker's certificate is neither a DNS name nor an address.
    #[error("{name:?} is not a DNS name or IP address to check in the worker's certificate")]
    BadServerName {
        /// The name given.
        name: String,
    },
    /// rustls refused the combination (e.g. a key that does not belong to the certificate).
    #[error("TLS cannot use {what}: {detail}")]
    Refused {
        /// The files involved.
        what: String,
        /// What rustls said.
        detail: String,
    },
}

/// PEM text and where it came from, so errors can name the file.
#[derive(Clone)]
pub struct Pem {
    source_name: String,
    bytes: Vec<u8>,
}

impl Pem {
    /// Reads a PEM file.
    pub fn read(path: &Path) -> Result<Self, TlsError> {
        let file = path.display().to_string();
        match std::fs::read(path) {
            Ok(bytes) => Ok(Self {
                source_name: file,
                bytes,
            }),
            Err(error) => Err(TlsError::Read { file, error }),
        }
    }

    /// PEM text from elsewhere; `source_name` names it in errors.
    pub fn from_bytes(source_name: impl Into<String>, bytes: impl Into<Vec<u8>>) -> Self {
        Self {
            source_name: source_name.into(),
            bytes: bytes.into(),
        }
    }

    /// Where the text came from.
    pub fn source_name(&self) -> &str {
        &self.source_name
    }

    /// Checks that the text holds at least one certificate and nothing damaged.
    fn check_certificates(&self) -> Result<(), TlsError> {
        let mut count = 0;
        for cert in CertificateDer::pem_slice_iter(&self.bytes) {
            cert.map_err(|e| self.bad_pem(e))?;
            count += 1;
        }
        if count == 0 {
            return Err(TlsError::NoCertificate {
                source_name: self.source_name.clone(),
            });
        }
        Ok(())
    }

    /// Checks that the text holds a private key.
    fn check_key(&self) -> Result<(), TlsError> {
        match PrivateKeyDer::from_pem_slice(&self.bytes) {
            Ok(_) => Ok(()),
            Err(pem::Error::NoItemsFound) => Err(TlsError::NoKey {
                source_name: self.source_name.clone(),
            }),
            Err(e) => Err(self.bad_pem(e)),
        }
    }

    fn bad_pem(&self, e: pem::Error) -> TlsError {
        TlsError::BadPem {
            source_name: self.source_name.clone(),
            detail: e.to_string(),
        }
    }

    fn certificate(&self) -> Certificate {
        Certificate::from_pem(&self.bytes)
    }
}

impl fmt::Debug for Pem {
    // A key's text must never reach a log.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Pem({})", self.source_name)
    }
}

/// A certificate (chain) and its private key.
#[derive(Clone, Debug)]
pub struct CertifiedKey {
    cert: Pem,
    key: Pem,
}

impl CertifiedKey {
    /// Pairs a certificate with its key, checking that each is what it should be.
    pub fn new(cert: Pem, key: Pem) -> Result<Self, TlsError> {
        cert.check_certificates()?;
        key.check_key()?;
        Ok(Self { cert, key })
    }

    /// Reads both from PEM files.
    pub fn read(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        Self::new(Pem::read(cert)?, Pem::read(key)?)
    }

    fn identity(&self) -> Identity {
        Identity::from_pem(&self.cert.bytes, &self.key.bytes)
    }

    /// The chain and key, parsed.
    fn der(&self) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
        let chain = CertificateDer::pem_slice_iter(&self.cert.bytes)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.cert.bad_pem(e))?;
        let key =
            PrivateKeyDer::from_pem_slice(&self.key.bytes).map_err(|e| self.key.bad_pem(e))?;
        Ok((chain, key))
    }

    fn describe(&self) -> String {
        format!(
            "certificate {} with key {}",
            self.cert.source_name, self.key.source_name
        )
    }
}

/// How a worker serves TLS: its identity and, for mutual TLS, the CA that must have signed
/// every client's certificate.
#[derive(Clone, Debug)]
pub struct ServerTls {
    identity: CertifiedKey,
    client_ca: Option<Pem>,
}

impl ServerTls {
    /// Checks the files and builds the rustls configuration once, so a key that does not
    /// belong to its certificate is refused here and not at the first handshake.
    pub fn new(identity: CertifiedKey, client_ca: Option<Pem>) -> Result<Self, TlsError> {
        if let Some(ca) = &client_ca {
            ca.check_certificates()?;
        }
        let tls = Self {
            identity,
            client_ca,
        };
        tonic::transport::Server::builder()
            .tls_config(tls.tonic_config())
            .map_err(|e| TlsError::Refused {
                what: tls.describe(),
                detail: crate::error::error_chain(&e),
            })?;
        Ok(tls)
    }

    /// Whether clients must present a certificate signed by the client CA.
    pub fn requires_client_certificate(&self) -> bool {
        self.client_ca.is_some()
    }

    pub fn tonic_config(&self) -> ServerTlsConfig {
        let config = ServerTlsConfig::new()
            .identity(self.identity.identity())
            .timeout(HANDSHAKE_TIMEOUT);
        match &self.client_ca {
            Some(ca) => config.client_ca_root(ca.certificate()),
            None => config,
        }
    }

    /// The same settings as a rustls configuration, for listeners outside tonic (the
    /// coordinator's HTTPS API), offering HTTP/2 and HTTP/1.1.
    pub fn rustls_config(&self) -> Result<tokio_rustls::rustls::ServerConfig, TlsError> {
        use tokio_rustls::rustls;
        let refused = |e: &dyn std::fmt::Display| TlsError::Refused {
            what: self.describe(),
            detail: e.to_string(),
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| refused(&e))?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in CertificateDer::pem_slice_iter(&ca.bytes) {
                    roots
                        .add(cert.map_err(|e| ca.bad_pem(e))?)
                        .map_err(|e| refused(&e))?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .map_err(|e| refused(&e))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let (certs, key) = self.identity.der()?;
        let mut config = builder
            .with_single_cert(certs, key)
            .map_err(|e| refused(&e))?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(config)
    }

    fn describe(&self) -> String {
        match &self.client_ca {
            Some(ca) => format!(
                "{} and client CA {}",
                self.identity.describe(),
                ca.source_name
            ),
            None => self.identity.describe(),
        }
    }
}

/// How a client speaks TLS to a worker: the CA that signed the worker's certificate, the
/// client's own certificate when the worker requires one, and the name to check in the
/// worker's certificate when it is not the host of the address.
#[derive(Clone, Debug)]
pub struct ClientTls {
    ca: Pem,
    identity: Option<CertifiedKey>,
    server_name: Option<String>,
}

impl ClientTls {
    /// Checks the files and the name, and builds the rustls configuration once so a
    /// mismatched key is refused here.
    pub fn new(
        ca: Pem,
        identity: Option<CertifiedKey>,
        server_name: Option<String>,
    ) -> Result<Self, TlsError> {
        ca.check_certificates()?;
        if let Some(name) = &server_name
            && ServerName::try_from(name.as_str()).is_err()
        {
            return Err(TlsError::BadServerName { name: name.clone() });
        }
        let tls = Self {
            ca,
            identity,
            server_name,
        };
        Endpoint::from_static("https://localhost")
            .tls_config(tls.tonic_config())
            .map_err(|e| TlsError::Refused {
                what: tls.describe(),
                detail: crate::error::error_chain(&e),
            })?;
        Ok(tls)
    }

    /// Whether a client certificate is presented (for workers that require one).
    pub fn presents_certificate(&self) -> bool {
        self.identity.is_some()
    }

    pub fn tonic_config(&self) -> ClientTlsConfig {
        let mut config = ClientTlsConfig::new()
            .ca_certificate(self.ca.certificate())
            .timeout(HANDSHAKE_TIMEOUT);
        if let Some(identity) = &self.identity {
            config = config.identity(identity.identity());
        }
        if let Some(name) = &self.server_name {
            config = config.domain_name(name.clone());
        }
        config
    }

    fn describe(&self) -> String {
        match &self.identity {
            Some(identity) => format!("CA {} and {}", self.ca.source_name, identity.describe()),
            None => format!("CA {}", self.ca.source_name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The test-only PKI that scripts/make_test_certs.sh wrote.
    const CERT: &str = include_str!("../../../tests/data/tls/worker.pem");
    const KEY: &str = include_str!("../../../tests/data/tls/worker.key");
    const OTHER_KEY: &str = include_str!("../../../tests/data/tls/client.key");
    const CA: &str = include_str!("../../../tests/data/tls/ca.pem");

    fn pem(name: &str, text: &str) -> Pem {
        Pem::from_bytes(name, text)
    }

    #[test]
    fn a_matching_certificate_and_key_make_a_server_config() {
        let identity =
            CertifiedKey::new(pem("worker.pem", CERT), pem("worker.key", KEY)).expect("valid pair");
        let tls = ServerTls::new(identity, Some(pem("ca.pem", CA))).expect("server tls");
        assert!(tls.requires_client_certificate());
    }

    #[test]
    fn swapped_files_are_named() {
        let err = CertifiedKey::new(pem("worker.key", KEY), pem("worker.pem", CERT))
            .expect_err("a key is no certificate");
        assert!(
            matches!(&err, TlsError::NoCertificate { source_name } if source_name == "worker.key"),
            "{err}"
        );
        let err = CertifiedKey::new(pem("worker.pem", CERT), pem("other.pem", CERT))
            .expect_err("a certificate is no key");
        assert!(err.to_string().contains("other.pem"), "{err}");
        assert!(err.to_string().contains("private key"), "{err}");
    }

    #[test]
    fn damaged_and_empty_pem_is_refused() {
        let damaged = CERT.replacen("MII", "M!I", 1);
        let err = CertifiedKey::new(pem("damaged.pem", &damaged), pem("worker.key", KEY))
            .expect_err("damaged base64");
        assert!(err.to_string().contains("damaged.pem"), "{err}");
        let err = ClientTls::new(pem("empty.pem", ""), None, None).expect_err("no CA");
        assert!(
            matches!(&err, TlsError::NoCertificate { source_name } if source_name == "empty.pem"),
            "{err}"
        );
    }

    #[test]
    fn a_key_of_another_certificate_is_refused_at_once() {
        let identity = CertifiedKey::new(pem("worker.pem", CERT), pem("client.key", OTHER_KEY))
            .expect("each file alone is fine");
        let err = ServerTls::new(identity.clone(), None).expect_err("mismatched pair");
        assert!(
            matches!(&err, TlsError::Refused { what, .. } if what.contains("client.key")),
            "{err}"
        );
        let err = ClientTls::new(pem("ca.pem", CA), Some(identity), None)
            .expect_err("mismatched client pair");
        assert!(err.to_string().contains("client.key"), "{err}");
    }

    #[test]
    fn server_names_are_checked() {
        let err = ClientTls::new(pem("ca.pem", CA), None, Some("not a name!".into()))
            .expect_err("bad name");
        assert!(matches!(err, TlsError::BadServerName { .. }), "{err}");
        let tls = ClientTls::new(pem("ca.pem", CA), None, Some("worker-0.tether".into()))
            .expect("a DNS name");
        assert!(!tls.presents_certificate());
    }

    #[test]
    fn unreadable_files_are_named() {
        let err = Pem::read(Path::new("/nonexistent/tether-tls.pem")).expect_err("missing");
        assert!(
            err.to_string().contains("/nonexistent/tether-tls.pem"),
            "{err}"
        );
    }

    #[test]
    fn debug_output_holds_no_key_text() {
        let identity =
            CertifiedKey::new(pem("worker.pem", CERT), pem("worker.key", KEY)).expect("valid pair");
        let shown = format!("{identity:?}");
        assert!(shown.contains("worker.key"), "{shown}");
        assert!(!shown.contains("PRIVATE KEY"), "{shown}");
    }
}
