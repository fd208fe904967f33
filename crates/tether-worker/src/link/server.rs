//! The worker's end of data links: a listener thread, and one thread per link that runs
//! its requests on the session's block, in order, beside a thread that reads the next
//! request meanwhile (and one that writes large replies: `overlap`).
//!
//! A link owns nothing: each request looks its session up in the registry and holds the
//! block only while it runs, exactly as a gRPC Forward does. A link whose session has ended
//! (closed, reaped, killed, shut down) answers NOT_FOUND once and closes; an idle one
//! notices within [`tether_protocol::link::wire::POLL`] and closes.

use super::overlap::{Replies, Request, Requests};
use crate::registry::SessionRegistry;
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tether_protocol::BearerToken;
use tether_protocol::SessionId;
use tether_protocol::WorkerError;
use tether_protocol::link::conn::{Conn, unix_name};
use tether_protocol::link::frame;
use tether_protocol::link::wire::{FrameError, read_frame_by};
use tether_protocol::{ForwardCall, ForwardOutput};
use tonic::Code;

/// Most links open at once; a connection beyond it is closed unanswered.
const MAX_LINKS: usize = 1024;
/// How long a new connection has to send its whole hello, by default.
pub const DEFAULT_HELLO_WITHIN: Duration = Duration::from_secs(5);
/// Most connections waiting for their hello at once, by default.
pub const DEFAULT_MAX_UNAUTHENTICATED: usize = 64;

/// How data links are served.
#[derive(Clone, Debug)]
pub struct DataOptions {
    /// The token a hello must carry (the worker's `--token`); `None` for open workers.
    pub token: Option<BearerToken>,
    /// Largest request frame, in bytes (the gRPC message limit).
    pub max_frame_bytes: usize,
    /// How long a link's thread spins for its next request before it blocks; zero for
    /// workers whose compute shares the CPU with it.
    pub spin: Duration,
    /// How long a new connection has to send its whole hello (one deadline, however the
    /// bytes trickle in).
    pub hello_within: Duration,
    /// Most connections waiting for their hello at once; a new one beyond it closes the
    /// one that has waited longest, so slow or silent peers cannot keep a coordinator,
    /// whose hello comes in its first write, from linking.
    pub max_unauthenticated: usize,
}

/// A listening data-link endpoint; dropping it stops the listener, and each link's thread
/// ends within [`tether_protocol::link::wire::POLL`].
pub struct DataPlane {
    port: u16,
    wake: SocketAddr,
    unix: bool,
    stop: Arc<AtomicBool>,
    accepts: Vec<JoinHandle<()>>,
}

impl DataPlane {
    /// Listens on `ip:port` (port 0 picks a free one) for links to `registry`'s sessions,
    /// and on the abstract Unix socket named after the port for clients on this host
    /// (skipped when another process holds that name).
    pub fn start(
        ip: IpAddr,
        port: u16,
        registry: Arc<SessionRegistry>,
        options: DataOptions,
    ) -> io::Result<Self> {
        let listener = TcpListener::bind((ip, port))?;
        let port = listener.local_addr()?.port();
        let wake_ip = match ip {
            IpAddr::V4(v4) if v4.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(v6) if v6.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            other => other,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let live = Arc::new(AtomicUsize::new(0));
        let acceptor = Acceptor {
            registry,
            options,
            stop: Arc::clone(&stop),
            live,
            greeting: Arc::new(Greeting::default()),
        };
        let mut accepts = Vec::new();
        let tcp = acceptor.clone();
        accepts.push(
            std::thread::Builder::new()
                .name("tether-data-accept".into())
                .spawn(move || tcp.run(|| listener.accept().map(|(s, _)| Conn::Tcp(s))))?,
        );
        let unix = match UnixListener::bind_addr(&unix_name(port)) {
            Ok(listener) => {
                let unix = acceptor.clone();
                accepts.push(
                    std::thread::Builder::new()
                        .name("tether-data-accept-unix".into())
                        .spawn(move || {
                            unix.run(|| listener.accept().map(|(s, _)| Conn::Unix(s)))
                        })?,
                );
                true
            }
            Err(e) => {
                tracing::info!(error = %e, "no same-host data links (abstract socket tether-data-{port})");
                false
            }
        };
        Ok(Self {
            port,
            wake: SocketAddr::new(wake_ip, port),
            unix,
            stop,
            accepts,
        })
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for DataPlane {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept calls so that their threads see the stop.
        let _ = TcpStream::connect_timeout(&self.wake, Duration::from_secs(1));
        if self.unix {
            let _ = UnixStream::connect_addr(&unix_name(self.port));
        }
        for accept in self.accepts.drain(..) {
            let _ = accept.join();
        }
    }
}

/// One request as a link's thread serves it: the reply frame to `body` (a request frame's
/// body) on `session`, and whether the session is gone.
pub(crate) fn answer(
    registry: &SessionRegistry,
    session: SessionId,
    body: &[u8],
) -> (Vec<u8>, bool) {
    let (result, gone) = run(registry, session, frame::decode_forward(body));
    (frame::encode_output(&result), gone)
}

/// Runs a decoded request on `session`: its output, and whether the session is gone.
fn run(
    registry: &SessionRegistry,
    session: SessionId,
    call: Result<ForwardCall, WorkerError>,
) -> (Result<ForwardOutput, WorkerError>, bool) {
    let result = call.and_then(|call| registry.forward_here(session, call));
    let gone = matches!(result, Err(WorkerError::NotFound(_)));
    (result, gone)
}

/// The connections still waiting for their hello, oldest first, each with a handle that
/// can close it.
#[derive(Default)]
struct Greeting {
    next_id: AtomicU64,
    waiting: Mutex<VecDeque<(u64, Conn)>>,
}

impl Greeting {
    /// Registers `conn`; when `max` already wait, closes the one that waited longest (its
    /// thread sees its reads fail and ends). `None` when `conn` cannot be registered.
    fn admit(&self, conn: &Conn, max: usize) -> Option<u64> {
        let handle = conn.try_clone().ok()?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        while waiting.len() >= max.max(1) {
            if let Some((_, oldest)) = waiting.pop_front() {
                tracing::debug!("closed a data-link connection still without a hello");
                let _ = oldest.shutdown(std::net::Shutdown::Both);
            }
        }
        waiting.push_back((id, handle));
        Some(id)
    }

    /// Forgets `id`: its hello came, or it ended.
    fn done(&self, id: u64) {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = waiting.iter().position(|(i, _)| *i == id) {
            waiting.remove(at);
        }
    }
}

/// What an accept thread needs to start links.
#[derive(Clone)]
struct Acceptor {
    registry: Arc<SessionRegistry>,
    options: DataOptions,
    stop: Arc<AtomicBool>,
    live: Arc<AtomicUsize>,
    greeting: Arc<Greeting>,
}

impl Acceptor {
    fn run(self, mut accept: impl FnMut() -> io::Result<Conn>) {
        loop {
            let conn = accept();
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            let stream = match conn {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "data link accept failed");
                    // Out of descriptors, say: let links end before trying again.
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
            };
            if self.live.fetch_add(1, Ordering::SeqCst) >= MAX_LINKS {
                self.live.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!("{MAX_LINKS} data links are open; refused another");
                continue;
            }
            let Some(greeting_id) = self
                .greeting
                .admit(&stream, self.options.max_unauthenticated)
            else {
                self.live.fetch_sub(1, Ordering::SeqCst);
                continue;
            };
            let link = Link {
                registry: Arc::clone(&self.registry),
                options: self.options.clone(),
                stop: Arc::clone(&self.stop),
                live: Arc::clone(&self.live),
                greeting: Arc::clone(&self.greeting),
                greeting_id,
            };
            let spawned = std::thread::Builder::new()
                .name("tether-data-link".into())
                .spawn(move || link.serve(stream));
            if let Err(e) = spawned {
                // The link, dropped with the closure, gave its slots back.
                tracing::warn!(error = %e, "could not start a data link thread");
            }
        }
    }
}

/// One link's thread.
struct Link {
    registry: Arc<SessionRegistry>,
    options: DataOptions,
    stop: Arc<AtomicBool>,
    live: Arc<AtomicUsize>,
    greeting: Arc<Greeting>,
    greeting_id: u64,
}

impl Drop for Link {
    fn drop(&mut self) {
        self.greeting.done(self.greeting_id);
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Link {
    fn serve(self, mut stream: Conn) {
        if let Conn::Tcp(s) = &stream {
            let _ = s.set_nodelay(true);
        }
        let session = self.welcome(&mut stream);
        self.greeting.done(self.greeting_id);
        let Some(session) = session else {
            return;
        };
        tracing::debug!(session = %session, "data link open");
        let give_up = {
            let (stop, registry) = (Arc::clone(&self.stop), Arc::clone(&self.registry));
            move || stop.load(Ordering::SeqCst) || !registry.holds(session)
        };
        let requests = match Requests::start(&stream, self.options.clone(), give_up) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(session = %session, error = %e, "could not start a data link's reader");
                return;
            }
        };
        let mut replies = Replies::new(self.options.spin);
        loop {
            let (call, read) = match requests.next() {
                Request::Call { call, read } => (*call, read),
                Request::TooLong(n) => {
                    let e = WorkerError::InvalidArgument(format!(
                        "data link: a {n}-byte request is over the worker's {}-byte limit (--max-message-bytes)",
                        self.options.max_frame_bytes
                    ));
                    if replies.flush().is_ok() {
                        refuse_and_close(stream, &frame::encode_output(&Err(e)));
                    }
                    return;
                }
                Request::End => return,
            };
            let taken_at = Instant::now();
            let (result, gone) = run(&self.registry, session, call);
            let answered_at = Instant::now();
            if replies.write(&mut stream, result).is_err() || gone {
                return;
            }
            // Where a pipelined pass's time goes on this side (TETHER_LOG=tether_worker::link=trace).
            tracing::trace!(
                request_bytes = read.bytes,
                read_us = read.took.as_micros() as u64,
                waited_us = (taken_at - read.done).as_micros() as u64,
                answer_us = (answered_at - taken_at).as_micros() as u64,
                write_us = answered_at.elapsed().as_micros() as u64,
                "data link forward"
            );
        }
    }

    /// Reads the hello and answers it; the session, when the link may serve it.
    fn welcome(&self, stream: &mut Conn) -> Option<SessionId> {
        let deadline = Instant::now() + self.options.hello_within;
        let body = match read_frame_by(stream, 64 + 4096, deadline) {
            Ok(body) => body,
            Err(FrameError::TooLong(_)) => {
                // An HTTP request, say: its first four bytes read as a huge length.
                let refusal = frame::encode_welcome(Err((
                    Code::InvalidArgument,
                    "this port serves tether data links, which open with a hello; not a tether data link".into(),
                )));
                refuse_and_close(stream.try_clone().ok()?, &refusal);
                return None;
            }
            Err(FrameError::Io(_)) => return None,
        };
        let verdict = frame::decode_hello(&body)
            .map_err(|e| (Code::InvalidArgument, e.to_string()))
            .and_then(|hello| {
                let token_ok = self.options.token.as_ref().is_none_or(|t| {
                    std::str::from_utf8(&hello.token).is_ok_and(|given| t.matches(given))
                });
                if !token_ok {
                    return Err((
                        Code::Unauthenticated,
                        "data link: the worker's token is missing or wrong".to_string(),
                    ));
                }
                if !self.registry.holds(hello.session) {
                    return Err((
                        Code::NotFound,
                        format!("data link: no session {}", hello.session),
                    ));
                }
                Ok(hello.session)
            });
        match verdict {
            Ok(session) => {
                stream
                    .write_all(&frame::encode_welcome(Ok(self.options.spin)))
                    .ok()?;
                Some(session)
            }
            Err((status, message)) => {
                tracing::info!("refused a data link: {message}");
                let refusal = frame::encode_welcome(Err((status, message)));
                refuse_and_close(stream.try_clone().ok()?, &refusal);
                None
            }
        }
    }
}

/// Sends a last reply and closes. What the peer sent beyond what was read is drained
/// first (a little of it, briefly): closing with unread bytes resets the connection, and
/// the peer could lose the reply that says why.
fn refuse_and_close(mut stream: Conn, reply: &[u8]) {
    if stream.write_all(reply).is_err() {
        return;
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    let mut sink = [0u8; 16 << 10];
    let mut drained = 0usize;
    while drained < (8 << 20) {
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}
