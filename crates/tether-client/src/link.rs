//! The coordinator's end of a data link: one socket to one worker's session. Forward calls
//! go here instead of gRPC because each gRPC call crosses several threads on both ends
//! (about 0.3 ms a call on a server CPU), where a link's request and reply are one write and
//! one read each.
//!
//! The worker answers a link's requests one by one, in order, so a caller may send the next
//! request before the last reply is read (a pipeline's stage keeps its worker busy that
//! way): writes and reads take separate locks, replies are numbered in sending order, and
//! they must be taken in that order.

use tether_protocol::link::conn::{Conn, unix_name};
use tether_protocol::link::frame::{self, Refusal};
use tether_protocol::link::wire::{
    FRAME_WITHIN, FrameError, WaitEnd, read_frame, wait_for_frame, write_frame,
};

use crate::ClientError;
use std::collections::BTreeSet;
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tether_protocol::forward::check_reply;
use tether_protocol::{BearerToken, ForwardCall, ForwardOutput, SessionId, WorkerError};

/// A data link to one session on one worker.
pub struct DataLink {
    worker: String,
    // The socket's writing end, with the number of requests written.
    writer: Mutex<(Conn, u64)>,
    // Its reading end, with the number of replies read.
    reader: Mutex<(Conn, u64)>,
    // A third handle on the socket, so that `shut` can wake a call blocked on the others.
    control: Conn,
    shut: AtomicBool,
    // Set when the socket failed: the link cannot tell whether the call ran, so that call
    // fails, and later calls go over gRPC.
    broken: AtomicBool,
    spin: Duration,
    max_frame_bytes: usize,
    // The numbers of sent calls whose callers gave up: their replies are read and dropped.
    abandoned: Arc<Mutex<BTreeSet<u64>>>,
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
        let clone = |c: &Conn| {
            c.try_clone()
                .map_err(|e| ClientError::protocol("data link", &to.worker, e.to_string()))
        };
        let (control, reader) = (clone(&conn)?, clone(&conn)?);
        Ok(Self {
            worker: to.worker.clone(),
            writer: Mutex::new((conn, 0)),
            reader: Mutex::new((reader, 0)),
            control,
            shut: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            spin,
            max_frame_bytes: to.max_frame_bytes,
            abandoned: Arc::default(),
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
        let sent = self.forward_send(call)?;
        self.forward_reply(sent)
    }

    /// Sends `call` and returns without waiting, so that the caller can do other work while
    /// the worker computes, or send the next call; [`DataLink::forward_reply`] takes the
    /// reply. Replies must be taken in the order their calls were sent; one whose
    /// [`SentForward`] was dropped untaken (its caller gave up) is read and dropped.
    pub fn forward_send(&self, call: &ForwardCall) -> Result<SentForward, ClientError> {
        let op = "forward";
        let request = frame::encode_forward(call);
        if request.len() - 4 > self.max_frame_bytes {
            return Err(ClientError::domain(
                op,
                &self.worker,
                WorkerError::InvalidArgument(format!(
                    "a {}-byte request is over the worker's {}-byte limit",
                    request.len() - 4,
                    self.max_frame_bytes
                )),
            ));
        }
        let mut writer = lock(&self.writer);
        self.still_open()?;
        // Replies nobody will take are read first, when no caller is reading: a worker
        // blocked writing an unread reply reads no request, and a large request written to
        // it would then never finish.
        if let Ok(mut reader) = self.reader.try_lock() {
            let (conn, read) = &mut *reader;
            while *read < writer.1 && self.take_abandoned(*read) {
                self.read_body(conn)?;
                *read += 1;
            }
        }
        write_frame(&mut writer.0, &request, self.spin).map_err(|e| self.io(e))?;
        let seq = writer.1;
        writer.1 += 1;
        Ok(SentForward {
            seq,
            logits_rows: call.logits_rows.len(),
            rows: call.rows,
            abandoned: Some(Arc::clone(&self.abandoned)),
        })
    }

    /// Waits for the reply of the call `sent` by [`DataLink::forward_send`]. Blocking.
    pub fn forward_reply(&self, mut sent: SentForward) -> Result<ForwardOutput, ClientError> {
        let (op, worker) = ("forward", self.worker.as_str());
        let mut reader = lock(&self.reader);
        self.still_open()?;
        let (conn, read) = &mut *reader;
        while *read < sent.seq {
            if !self.take_abandoned(*read) {
                return Err(ClientError::protocol(
                    op,
                    worker,
                    format!(
                        "the reply of call {} was asked for before that of call {}, sent earlier",
                        sent.seq, *read
                    ),
                ));
            }
            self.read_body(conn)?;
            *read += 1;
        }
        // Taken from here on, whatever happens next: a failed read breaks the link anyway.
        // (Refused above, `sent` is dropped as abandoned and its reply skipped.)
        sent.abandoned = None;
        if *read > sent.seq {
            return Err(ClientError::protocol(
                op,
                worker,
                format!("the reply of call {} was already read", sent.seq),
            ));
        }
        let body = self.read_body(conn)?;
        *read += 1;
        let out = match frame::decode_output(&body) {
            Ok(Ok(out)) => out,
            Ok(Err(refusal)) => return Err(refused(op, worker, refusal)),
            Err(e) => return Err(ClientError::domain(op, worker, e)),
        };
        check_reply(sent.logits_rows, sent.rows, out)
            .map_err(|e| ClientError::domain(op, worker, e))
    }

    /// Whether call `seq` was abandoned; forgets it.
    fn take_abandoned(&self, seq: u64) -> bool {
        lock(&self.abandoned).remove(&seq)
    }

    /// Fails once the link is closed.
    fn still_open(&self) -> Result<(), ClientError> {
        if self.shut.load(Ordering::SeqCst) {
            return Err(ClientError::protocol(
                "forward",
                &self.worker,
                "the data link was closed",
            ));
        }
        Ok(())
    }

    /// The error of a failed socket, which breaks the link: whether the call ran is unknown.
    fn io(&self, e: std::io::Error) -> ClientError {
        self.broken.store(true, Ordering::SeqCst);
        ClientError::Connect {
            addr: self.worker.clone(),
            detail: format!("data link: {e}"),
        }
    }

    /// Waits for the next reply frame and reads its body.
    fn read_body(&self, stream: &mut Conn) -> Result<Vec<u8>, ClientError> {
        let op = "forward";
        wait_for_frame(stream, self.spin, || self.shut.load(Ordering::SeqCst)).map_err(
            |e| match e {
                WaitEnd::Closed => self.io(std::io::ErrorKind::UnexpectedEof.into()),
                WaitEnd::GaveUp => {
                    ClientError::protocol(op, &self.worker, "the data link was closed")
                }
                WaitEnd::Io(e) => self.io(e),
            },
        )?;
        // Replies are bounded by what was asked, far below this.
        read_frame(stream, usize::MAX >> 1, FRAME_WITHIN, self.spin).map_err(|e| match e {
            FrameError::TooLong(n) => {
                self.broken.store(true, Ordering::SeqCst);
                ClientError::protocol(op, &self.worker, format!("a {n}-byte reply"))
            }
            FrameError::Io(e) => self.io(e),
        })
    }
}

/// A forward call sent by [`DataLink::forward_send`] whose reply is still to be read: its
/// place in the link's order and what checking its reply needs. Dropped untaken, its reply
/// is read and dropped.
#[derive(Debug)]
#[must_use = "the reply must be taken with forward_reply"]
pub struct SentForward {
    seq: u64,
    logits_rows: usize,
    rows: tether_protocol::Rows,
    abandoned: Option<Arc<Mutex<BTreeSet<u64>>>>,
}

impl Drop for SentForward {
    fn drop(&mut self) {
        if let Some(abandoned) = self.abandoned.take() {
            lock(&abandoned).insert(self.seq);
        }
    }
}

/// A lock whose holder panicked is still good: what it guards is counters and a socket.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn refused(op: &'static str, worker: &str, r: Refusal) -> ClientError {
    ClientError::rpc(op, worker, &r.into_status())
}
