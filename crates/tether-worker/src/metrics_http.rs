//! The metrics endpoint: a minimal HTTP/1.1 server answering `GET /metrics` with the
//! registry's Prometheus text. Each connection gets one response and is closed, which is
//! all a scraper needs; requests are read with a size and time bound, so a slow or hostile
//! peer holds nothing for long.

use crate::registry::SessionRegistry;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::task::TaskTracker;

/// Largest request head read; a scrape's is a few hundred bytes.
const MAX_REQUEST_BYTES: usize = 8 << 10;
/// How long a peer may take to send its request and read the answer.
const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// Content type of the Prometheus text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Serves `GET /metrics` on `listener` until `shutdown` resolves, then waits for the
/// answers in flight.
pub async fn serve_metrics(
    listener: TcpListener,
    registry: Arc<SessionRegistry>,
    shutdown: impl Future<Output = ()>,
) {
    let connections = TaskTracker::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let registry = Arc::clone(&registry);
                    connections.spawn(async move {
                        let answered = tokio::time::timeout(IO_TIMEOUT, answer(stream, &registry)).await;
                        if !matches!(answered, Ok(Ok(()))) {
                            tracing::debug!(%peer, "metrics request dropped: slow, malformed or closed");
                        }
                    });
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!("metrics endpoint cannot accept a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
    connections.close();
    connections.wait().await;
}

/// Reads one request head and writes one response.
async fn answer(mut stream: TcpStream, registry: &SessionRegistry) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() > MAX_REQUEST_BYTES {
            return respond(&mut stream, "431 Request Header Fields Too Large", "").await;
        }
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let request_line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = request_line.split(|&b| b == b' ');
    let (method, target) = (parts.next().unwrap_or_default(), parts.next());
    let path = target.map(|t| t.split(|&b| b == b'?').next().unwrap_or_default());
    match (method, path) {
        (b"GET", Some(b"/metrics")) => {
            respond(&mut stream, "200 OK", &registry.prometheus_text()).await
        }
        (b"GET", _) => respond(&mut stream, "404 Not Found", "try GET /metrics\n").await,
        _ => respond(&mut stream, "405 Method Not Allowed", "only GET /metrics\n").await,
    }
}

async fn respond(stream: &mut TcpStream, status: &str, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {CONTENT_TYPE}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::RegistryConfig;
    use crate::testing::FakeFactory;
    use tether_protocol::Lease;
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
        // One byte past the limit, all of which the server reads, so closing sends no reset.
        let huge = vec![b'a'; MAX_REQUEST_BYTES + 1];
        let refused = request(addr, &huge).await;
        assert!(refused.starts_with("HTTP/1.1 431"), "{refused}");

        stop.cancel();
        server.await.unwrap();
    }
}
