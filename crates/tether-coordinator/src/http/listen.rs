//! Accepting API connections under limits: a cap on open connections, a deadline for each
//! request head (which also closes idle keep-alive connections), and the TLS handshake
//! deadline for HTTPS.
//!
//! `axum::serve` gives hyper no timer, so hyper's header timeout never fires there and a
//! client that opens sockets and never speaks holds them until the process runs out of
//! descriptors. This loop owns the sockets instead: the cap is taken at TCP accept, before
//! any handshake, so a flood costs at most `max_connections` descriptors and tasks.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;

/// How many connections the API holds open and how long it waits for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    /// Connections open at once (TLS handshakes included); more are answered 503 (plain
    /// HTTP) or closed (HTTPS) straight away.
    pub max_connections: usize,
    /// Time a connection has to send a complete request head, counted from its opening
    /// and again from the end of each response: it closes idle keep-alive connections
    /// and clients that trickle headers.
    pub header_timeout: Duration,
    /// Time a client has to finish its TLS handshake.
    pub handshake_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            header_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

/// What a connection over the cap gets before it is closed: an answer the client can act
/// on instead of a reset.
const OVER_CAP: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
retry-after: 1\r\nconnection: close\r\ncontent-length: 92\r\n\r\n\
{\"error\":{\"message\":\"too many open connections\",\"type\":\"server_error\",\"code\":\"overloaded\"}}\n";

/// How long answering a connection over the cap may take: the socket is ours until then.
const OVER_CAP_WRITE: Duration = Duration::from_millis(200);

/// Connections over the cap being answered at once; beyond it they are closed unanswered,
/// so that a flood holds at most this many sockets more than the cap.
const OVER_CAP_ANSWERS: usize = 64;

/// Serves `router` on `listener` (over TLS when `tls` is given) until `shutdown`
/// completes, then stops accepting, closes idle connections and lets open requests finish.
pub async fn serve_with_limits(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    router: Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let answers = Arc::new(Semaphore::new(OVER_CAP_ANSWERS));
    // Returns a flood's buffers to the OS once it has drained.
    let flood = Arc::new(tether_protocol::heap::FloodWatch::default());
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        // An HTTP/2 peer that stops answering pings is gone: free its slot.
        .keep_alive_interval(limits.header_timeout)
        .keep_alive_timeout(limits.header_timeout);
    let builder = Arc::new(builder);
    let service = TowerToHyperService::new(router);
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of descriptors and the like: wait instead of spinning.
                    tracing::warn!("accepting an API connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = tcp.set_nodelay(true);
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::debug!(%peer, "refusing a connection: {} open", limits.max_connections);
            if let (Ok(answer), true) = (Arc::clone(&answers).try_acquire_owned(), tls.is_none()) {
                tokio::spawn(async move {
                    refuse(tcp).await;
                    drop(answer);
                });
            }
            continue;
        };
        let (builder, service, tls) = (Arc::clone(&builder), service.clone(), tls.clone());
        let watcher = graceful.watcher();
        let open = flood.open();
        tokio::spawn(async move {
            let _slot: OwnedSemaphorePermit = slot;
            let _open = open;
            match tls {
                None => {
                    let io = TokioIo::new(FirstByteDeadline::new(tcp, limits.header_timeout));
                    let conn = builder.serve_connection_with_upgrades(io, service);
                    let _ = watcher.watch(conn.into_owned()).await;
                }
                Some(tls) => {
                    let stream =
                        match tokio::time::timeout(limits.handshake_timeout, tls.accept(tcp)).await
                        {
                            Ok(Ok(stream)) => stream,
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, "TLS handshake failed: {e}");
                                return;
                            }
                            Err(_) => {
                                tracing::debug!(%peer, "TLS handshake timed out");
                                return;
                            }
                        };
                    let io = TokioIo::new(FirstByteDeadline::new(stream, limits.header_timeout));
                    let conn = builder.serve_connection_with_upgrades(io, service);
                    let _ = watcher.watch(conn.into_owned()).await;
                }
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Answers a plain-HTTP connection over the cap with a 503 (a TLS client cannot read one
/// before its handshake, so it is just closed). What the client sent meanwhile is read and
/// dropped before closing: closing on unread bytes resets the connection, and the client
/// would see the reset instead of the answer.
async fn refuse(mut tcp: TcpStream) {
    let _ = tokio::time::timeout(OVER_CAP_WRITE, async {
        tcp.write_all(OVER_CAP).await?;
        tcp.shutdown().await?;
        let mut sink = [0u8; 4096];
        while tcp.read(&mut sink).await? > 0 {}
        std::io::Result::Ok(())
    })
    .await;
}

/// A connection whose first byte must arrive by a deadline. The server reads the first
/// bytes to tell HTTP/1 from HTTP/2 before hyper's own header timeout starts, so without
/// this a client that connects and says nothing would be held for ever.
struct FirstByteDeadline<T> {
    io: T,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<T> FirstByteDeadline<T> {
    fn new(io: T, within: Duration) -> Self {
        Self {
            io,
            deadline: Some(Box::pin(tokio::time::sleep(within))),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for FirstByteDeadline<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if self.deadline.is_none() {
            return polled;
        }
        match polled {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                self.deadline = None;
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match self.deadline.as_mut().map(|d| d.as_mut().poll(cx)) {
                Some(Poll::Ready(())) => Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no request arrived before the header timeout",
                ))),
                _ => Poll::Pending,
            },
            other => other,
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for FirstByteDeadline<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::OVER_CAP;

    #[test]
    fn the_over_cap_answer_states_its_length() {
        let text = std::str::from_utf8(OVER_CAP).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(len, body.len());
        assert!(serde_json::from_str::<serde_json::Value>(body).is_ok());
    }
}
