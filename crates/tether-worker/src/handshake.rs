//! Limits on the worker's gRPC connections before any call: a connection must send the
//! first bytes of its handshake (the 24-byte HTTP/2 preface, or as many TLS bytes) within a
//! deadline, and at most so many connections are open at once. Without them, peers that
//! connect and say nothing hold descriptors until the worker cannot accept its own
//! coordinator or `tetherctl`.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tether_protocol::heap::{FloodWatch, OpenConnection};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// Bytes a connection must send by the deadline: the HTTP/2 client preface.
const HANDSHAKE_BYTES: usize = 24;

/// One accepted connection: its reads fail with `TimedOut` when its first
/// [`HANDSHAKE_BYTES`] bytes have not come by the deadline, and it holds one of the
/// server's connection slots until dropped.
pub struct Guarded {
    stream: TcpStream,
    deadline: Option<Pin<Box<Sleep>>>,
    seen: usize,
    _slot: OwnedSemaphorePermit,
    _open: OpenConnection,
}

/// Admits connections while fewer than `max` are open.
#[derive(Clone)]
pub struct ConnectionLimits {
    slots: Arc<Semaphore>,
    handshake_within: Duration,
    /// Returns a flood's buffers to the OS once it has drained.
    flood: Arc<FloodWatch>,
}

impl ConnectionLimits {
    /// At most `max` connections at once, each with `handshake_within` to begin.
    pub fn new(max: usize, handshake_within: Duration) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(max.max(1))),
            handshake_within,
            flood: Arc::default(),
        }
    }

    /// `stream` with its deadline and slot; `None` (and the stream closed) when every
    /// slot is taken.
    pub fn admit(&self, stream: TcpStream) -> Option<Guarded> {
        let Ok(slot) = Arc::clone(&self.slots).try_acquire_owned() else {
            tracing::warn!(
                peer = ?stream.peer_addr().ok(),
                "every gRPC connection slot is taken (--max-connections); closed a new connection"
            );
            return None;
        };
        Some(Guarded {
            stream,
            deadline: Some(Box::pin(tokio::time::sleep(self.handshake_within))),
            seen: 0,
            _slot: slot,
            _open: self.flood.open(),
        })
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Some(deadline) = &mut this.deadline
            && deadline.as_mut().poll(cx).is_ready()
        {
            tracing::debug!("closed a gRPC connection that did not begin its handshake in time");
            return Poll::Ready(Err(io::ErrorKind::TimedOut.into()));
        }
        let before = buf.filled().len();
        let read = Pin::new(&mut this.stream).poll_read(cx, buf);
        if this.deadline.is_some() {
            this.seen += buf.filled().len() - before;
            if this.seen >= HANDSHAKE_BYTES {
                this.deadline = None;
            }
        }
        read
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

impl Connected for Guarded {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}
