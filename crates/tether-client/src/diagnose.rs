//! Turning transport failures into advice: a TLS handshake that fails says only what rustls
//! saw ("UnknownIssuer", "received fatal alert: CertificateRequired"), and a plaintext
//! client at a TLS worker sees just a closed connection, so each gets the flag to look at.

use crate::{ClientError, ClientOptions};
use tether_protocol::error::append_causes;

/// What a connection was set up with, kept by clients to explain later failures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Link {
    tls: bool,
    client_certificate: bool,
}

impl Link {
    pub(crate) fn of(options: &ClientOptions) -> Self {
        Self {
            tls: options.tls.is_some(),
            client_certificate: options
                .tls
                .as_ref()
                .is_some_and(|t| t.presents_certificate()),
        }
    }

    /// `detail` (an error chain) with what to check: the TLS setting, when the failure
    /// looks like TLS, else the address and the worker.
    pub(crate) fn explain(self, detail: &str) -> String {
        match self.hint(detail) {
            Some(hint) => format!("{detail} ({hint})"),
            None => format!("{detail}; check the address and that the worker runs"),
        }
    }

    fn hint(self, detail: &str) -> Option<&'static str> {
        let has = |needle: &str| detail.contains(needle);
        let lower = detail.to_lowercase();
        let unreachable = ["refused", "timed out", "dns error", "lookup", "unreachable"];
        if unreachable.iter().any(|u| lower.contains(u)) {
            return None;
        }
        if !self.tls {
            return Some(
                "if the worker serves TLS (its --tls-cert), pass --worker-tls-ca and, when it requires client certificates, --worker-tls-cert and --worker-tls-key",
            );
        }
        Some(if has("UnknownIssuer") {
            "TLS: the worker's certificate is not signed by the CA given with --worker-tls-ca"
        } else if has("not valid for name") {
            "TLS: the worker's certificate does not hold the host of its address; connect by a name it holds or pass --worker-tls-name"
        } else if has("CertificateRequired") || has("peer sent no certificates") {
            "TLS: the worker requires a client certificate (its --tls-ca); pass --worker-tls-cert and --worker-tls-key"
        } else if has("corrupt message") || has("HTTP/2 was not negotiated") {
            "TLS: the worker does not speak TLS; start it with --tls-cert and --tls-key, or drop the --worker-tls-* flags"
        } else if self.client_certificate {
            // With TLS 1.3 the worker checks the client certificate after the client has
            // finished its side, so a refusal often arrives as a closed connection.
            "TLS: the worker refused the handshake or closed the connection; check that --worker-tls-cert is signed by the CA of the worker's --tls-ca"
        } else {
            "TLS: the worker refused the handshake or closed the connection; if it requires client certificates (its --tls-ca), pass --worker-tls-cert and --worker-tls-key"
        })
    }

    /// The error of a call that failed: a failure of the connection under it (it carries a
    /// transport error as its source) reads as a connect error with advice, since with TLS
    /// 1.3 a refused client certificate only shows on the first call.
    pub(crate) fn call_failed(
        self,
        op: &'static str,
        addr: &str,
        s: &tonic::Status,
    ) -> ClientError {
        use tonic::Code;
        let transport = std::error::Error::source(s).is_some()
            && matches!(
                s.code(),
                Code::Unavailable | Code::Unknown | Code::Internal | Code::Cancelled
            );
        if !transport {
            return ClientError::rpc(op, addr, s);
        }
        let detail = append_causes(
            format!("{op}: {}", s.message()),
            std::error::Error::source(s),
        );
        ClientError::Connect {
            addr: addr.to_string(),
            detail: self.explain(&detail),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PLAIN: Link = Link {
        tls: false,
        client_certificate: false,
    };
    const TLS: Link = Link {
        tls: true,
        client_certificate: false,
    };
    const MUTUAL_TLS: Link = Link {
        tls: true,
        client_certificate: true,
    };

    #[test]
    fn tls_failures_name_the_flag_to_check() {
        let unknown = TLS.explain("invalid peer certificate: UnknownIssuer");
        assert!(unknown.contains("--worker-tls-ca"), "{unknown}");
        let required = TLS.explain("received fatal alert: CertificateRequired");
        assert!(required.contains("--worker-tls-cert"), "{required}");
        let name = TLS.explain("certificate not valid for name \"10.0.0.7\"");
        assert!(name.contains("--worker-tls-name"), "{name}");
        let closed = MUTUAL_TLS.explain("hello: operation was canceled: connection closed");
        assert!(closed.contains("signed by the CA"), "{closed}");
        let refused = TLS.explain("tcp connect error: Connection refused (os error 111)");
        assert!(!refused.contains("TLS"), "{refused}");
    }

    #[test]
    fn plaintext_clients_hear_of_tls_but_not_when_nothing_listens() {
        let closed = PLAIN.explain("h2 protocol error: connection closed");
        assert!(closed.contains("--worker-tls-ca"), "{closed}");
        let refused = PLAIN.explain("tcp connect error: Connection refused (os error 111)");
        assert!(!refused.contains("TLS"), "{refused}");
        assert!(refused.contains("check the address"), "{refused}");
    }
}
