//! The metrics endpoint: `GET /metrics` answered with the registry's Prometheus text on a
//! port of its own, by the server the coordinator's exposition shares.

use crate::registry::SessionRegistry;
use std::sync::Arc;
use tokio::net::TcpListener;

/// Serves `GET /metrics` on `listener` until `shutdown` resolves, then waits for the
/// answers in flight.
pub async fn serve_metrics(
    listener: TcpListener,
    registry: Arc<SessionRegistry>,
    shutdown: impl Future<Output = ()>,
) {
    let router = tether_metrics::router(move || registry.prometheus_text());
    tether_metrics::serve(listener, router, shutdown).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::RegistryConfig;
    use crate::testing::FakeFactory;
    use std::time::Duration;
    use tether_protocol::Lease;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio_util::sync::CancellationToken;

    async fn request(addr: std::net::SocketAddr, raw: &[u8]) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(raw).await.unwrap();
        let mut out = String::new();
        stream.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn answers_get_metrics_and_refuses_everything_else() {
        let registry = Arc::new(SessionRegistry::new(
            Arc::new(FakeFactory { free: 1 << 20 }),
            1 << 20,
            RegistryConfig::default(),
        ));
        let _ticket = registry.open(
            "scraped",
            Lease {
                heartbeat_interval: Duration::from_millis(100),
                ttl: Duration::from_secs(5),
            },
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let server = tokio::spawn(serve_metrics(
            listener,
            Arc::clone(&registry),
            stop.clone().cancelled_owned(),
        ));

        let ok = request(addr, b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        let (head, body) = ok.split_once("\r\n\r\n").unwrap();
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        assert!(body.contains("\ntether_sessions 1\n"), "{body}");
        assert!(body.contains("client=\"scraped\""), "{body}");

        let missing = request(addr, b"GET / HTTP/1.1\r\n\r\n").await;
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        let post = request(addr, b"POST /metrics HTTP/1.1\r\n\r\n").await;
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
        // An unfinished head as large as the read buffer (8 KiB): the server reads all of
        // it before refusing, so closing sends no reset.
        let huge = vec![b'a'; 8 << 10];
        let refused = request(addr, &huge).await;
        assert!(refused.starts_with("HTTP/1.1 431"), "{refused}");

        stop.cancel();
        server.await.unwrap();
    }
}
