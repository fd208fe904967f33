//! The coordinator's end of a data link: one socket to one worker's session, one blocking
//! request at a time. Forward calls go here instead of gRPC because each gRPC call crosses
//! several threads on both ends (about 0.3 ms a call on a server CPU), where a link's
//! request and reply are one write and one read each.

use tether_protocol::link::conn::{Conn, unix_name};
use tether_protocol::link::frame::{self, Refusal};
use tether_protocol::link::wire::{FRAME_WITHIN, FrameError, WaitEnd, read_frame, wait_for_frame};

use crate::ClientError;
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tether_protocol::forward::check_reply;
use tether_protocol::{BearerToken, ForwardCall, ForwardOutput, SessionId, WorkerError};

/// A data link to one session on one worker.
pub struct DataLink {
    worker: String,
    stream: Mutex<Conn>,
    // A second handle on the socket, so that `shut` can wake a call blocked on the first.
    control: Conn,
    shut: AtomicBool,
    // Set when the socket failed: the link cannot tell whether the call ran, so that call
    // fails, and later calls go over gRPC.
    broken: AtomicBool,
    spin: Duration,
    max_frame_bytes: usize,
}

impl std::fmt::Debug for DataLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataLink")
            .field("worker", &self.worker)
            .field("spin", &self.spin)
            .finish()
    }
}

/// Where a data link goes.
#[derive(Clone, Debug)]
pub struct LinkTarget {
    /// The worker's gRPC address, for messages.
    pub worker: String,
    /// Its data port.
    pub at: SocketAddr,
    /// Its process id, as its Hello said (0: unknown). A same-host socket is used only when
    /// the process at its other end is this one: any local user can bind an abstract name.
    pub pid: u32,
    /// Largest request frame it takes.
    pub max_frame_bytes: usize,
    /// How long connecting and the hello may take.
    pub connect_timeout: Duration,
}

impl DataLink {
    /// Opens a link to `session` on `to`; when `to.at` is a loopback address, through the
    /// worker's same-host Unix socket first. Blocking.
    pub fn open(
        to: &LinkTarget,
        session: SessionId,
        token: Option<&BearerToken>,
    ) -> Result<Self, ClientError> {
        if to.at.ip().is_loopback()
            && to.pid != 0
            && let Ok(unix) = UnixStream::connect_addr(&unix_name(to.at.port()))
        {
            let conn = Conn::Unix(unix);
            match conn.peer_pid() {
                Ok(pid) if pid == to.pid => {
                    // Another worker of this process (embedded workers) may hold the
                    // name: its refusal of our session sends us to TCP.
                    match Self::hello(&to.worker, conn, session, token, to.connect_timeout) {
                        Ok((conn, spin)) => return Self::new(to, conn, spin),
                        Err(e) => tracing::debug!(
                            worker = %to.worker,
                            "same-host data link refused, trying TCP: {e}"
                        ),
                    }
                }
                other => tracing::debug!(
                    worker = %to.worker,
                    "the same-host socket belongs to {other:?}, not the worker's process {}; using TCP",
                    to.pid
                ),
            }
        }
        Self::open_tcp(to, session, token)
    }

    /// As [`DataLink::open`], always over TCP.
    pub fn open_tcp(
        to: &LinkTarget,
        session: SessionId,
        token: Option<&BearerToken>,
    ) -> Result<Self, ClientError> {
        let worker = to.worker.as_str();
        let stream = TcpStream::connect_timeout(&to.at, to.connect_timeout).map_err(|e| {
            ClientError::Connect {
                addr: to.at.to_string(),
                detail: format!("data link of worker {worker}: {e}"),
            }
        })?;
        stream
            .set_nodelay(true)
            .map_err(|e| ClientError::protocol("data link", worker, e.to_string()))?;
        let (conn, spin) = Self::hello(
            worker,
            Conn::Tcp(stream),
            session,
            token,
            to.connect_timeout,
        )?;
        Self::new(to, conn, spin)
    }

    /// Says hello on `conn`; the worker's spin when it welcomes the link.
    fn hello(
        worker: &str,
        mut conn: Conn,
        session: SessionId,
        token: Option<&BearerToken>,
        within: Duration,
    ) -> Result<(Conn, Duration), ClientError> {
        let op = "data link";
        let io = |e: std::io::Error| ClientError::protocol(op, worker, e.to_string());
        let token = token.map(|t| t.expose().as_bytes()).unwrap_or_default();
        conn.write_all(&frame::encode_hello(session, token))
            .map_err(io)?;
        let body =
            read_frame(&mut conn, 64 * 1024, within, Duration::ZERO).map_err(|e| match e {
                FrameError::TooLong(n) => {
                    ClientError::protocol(op, worker, format!("a {n}-byte welcome"))
                }
                FrameError::Io(e) => io(e),
            })?;
        match frame::decode_welcome(&body) {
            Ok(Ok(spin)) => Ok((conn, spin)),
            Ok(Err(refusal)) => Err(refused(op, worker, refusal)),
            Err(e) => Err(ClientError::domain(op, worker, e)),
        }
    }

    fn new(to: &LinkTarget, conn: Conn, spin: Duration) -> Result<Self, ClientError> {
        let control = conn
            .try_clone()
            .map_err(|e| ClientError::protocol("data link", &to.worker, e.to_string()))?;
        Ok(Self {
            worker: to.worker.clone(),
            stream: Mutex::new(conn),
            control,
            shut: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            spin,
            max_frame_bytes: to.max_frame_bytes,
        })
    }

    /// Whether the link goes through the worker's same-host Unix socket.
    pub fn same_host(&self) -> bool {
        self.control.is_unix()
    }

    /// Whether the worker's end spins for requests (a GPU worker): then a reply is worth
    /// waiting for on the calling thread.
    pub fn spins(&self) -> bool {
        !self.spin.is_zero()
    }

    /// Whether calls may still go over the link: not closed, and its socket has not failed.
    pub fn usable(&self) -> bool {
        !self.shut.load(Ordering::SeqCst) && !self.broken.load(Ordering::SeqCst)
    }

    /// Closes the link; a call blocked on it returns an error at once.
    pub fn shut(&self) {
        self.shut.store(true, Ordering::SeqCst);
        let _ = self.control.shutdown(std::net::Shutdown::Both);
    }

    /// Runs `call` on the session's block. Blocking: the reply is awaited on this thread.
    pub fn forward(&self, call: &ForwardCall) -> Result<ForwardOutput, ClientError> {
        let op = "forward";
        let worker = self.worker.as_str();
        let io = |e: std::io::Error| {
            self.broken.store(true, Ordering::SeqCst);
            ClientError::Connect {
                addr: worker.to_string(),
                detail: format!("data link: {e}"),
            }
        };
        let request = frame::encode_forward(call);
        if request.len() - 4 > self.max_frame_bytes {
            return Err(ClientError::domain(
                op,
                worker,
                WorkerError::InvalidArgument(format!(
                    "a {}-byte request is over the worker's {}-byte limit",
                    request.len() - 4,
                    self.max_frame_bytes
                )),
            ));
        }
        let mut stream = match self.stream.lock() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        };
        if self.shut.load(Ordering::SeqCst) {
            return Err(ClientError::protocol(
                op,
                worker,
                "the data link was closed",
            ));
        }
        stream.write_all(&request).map_err(io)?;
        wait_for_frame(&stream, self.spin, || self.shut.load(Ordering::SeqCst)).map_err(
            |e| match e {
                WaitEnd::Closed => io(std::io::ErrorKind::UnexpectedEof.into()),
                WaitEnd::GaveUp => ClientError::protocol(op, worker, "the data link was closed"),
                WaitEnd::Io(e) => io(e),
            },
        )?;
        // Replies are bounded by what was asked, far below this.
        let body = read_frame(&mut stream, usize::MAX >> 1, FRAME_WITHIN, self.spin).map_err(
            |e| match e {
                FrameError::TooLong(n) => {
                    self.broken.store(true, Ordering::SeqCst);
                    ClientError::protocol(op, worker, format!("a {n}-byte reply"))
                }
                FrameError::Io(e) => io(e),
            },
        )?;
        drop(stream);
        let out = match frame::decode_output(&body) {
            Ok(Ok(out)) => out,
            Ok(Err(refusal)) => return Err(refused(op, worker, refusal)),
            Err(e) => return Err(ClientError::domain(op, worker, e)),
        };
        check_reply(call.logits_rows.len(), call.rows, out)
            .map_err(|e| ClientError::domain(op, worker, e))
    }
}

fn refused(op: &'static str, worker: &str, r: Refusal) -> ClientError {
    ClientError::rpc(op, worker, &r.into_status())
}
