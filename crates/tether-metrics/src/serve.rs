//! The worker's metrics port: axum answering `GET /metrics`, one response per connection
//! (all a scraper needs), every connection bounded in size and time so a slow or hostile
//! peer holds nothing for long.

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::task::TaskTracker;

/// Largest request head read (hyper's smallest buffer); a scrape's is a few hundred bytes.
const MAX_REQUEST_BYTES: usize = 8 << 10;
/// How long a peer may take to send its request and read the answer.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

/// A router answering `GET /metrics` with what `render` returns at each scrape; other
/// paths get 404 and other methods 405.
pub fn router<F>(render: F) -> Router
where
    F: Fn() -> String + Clone + Send + Sync + 'static,
{
    Router::new()
        .route(
            "/metrics",
            get(move |headers: HeaderMap| {
                let text = render();
                async move { crate::response(&headers, text) }
            }),
        )
        .fallback(|| async { (StatusCode::NOT_FOUND, "try GET /metrics\n") })
}

/// Serves `router` on `listener` until `shutdown` resolves, then waits for the answers in
/// flight (each bounded by the connection timeout).
pub async fn serve(listener: TcpListener, router: Router, shutdown: impl Future<Output = ()>) {
    let mut builder = auto::Builder::new(TokioExecutor::new()).http1_only();
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(CONNECTION_TIMEOUT)
        .max_buf_size(MAX_REQUEST_BYTES)
        .keep_alive(false);
    let builder = Arc::new(builder);
    let service = TowerToHyperService::new(router);
    let connections = TaskTracker::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((tcp, peer)) => {
                    let (builder, service) = (Arc::clone(&builder), service.clone());
                    connections.spawn(async move {
                        let conn = builder.serve_connection(TokioIo::new(tcp), service);
                        let answered = tokio::time::timeout(CONNECTION_TIMEOUT, conn).await;
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
