//! What lets a link's worker start its next pass as soon as it has answered the last: the
//! next request is read and decoded by a reader thread while the pass before it runs, and
//! large replies are encoded and written by a writer thread while the next pass runs. A
//! prompt chunk's hidden states are megabytes, whose trip through the socket takes
//! milliseconds that the GPU would otherwise idle through, on every pass of a pipeline.

use std::io;
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, sync_channel};
use std::time::{Duration, Instant};
use tether_protocol::link::conn::Conn;
use tether_protocol::link::frame;
use tether_protocol::link::wire::{
    FRAME_WITHIN, FrameError, WaitEnd, read_frame, wait_for_frame, write_frame,
};
use tether_protocol::{ForwardCall, ForwardOutput, WorkerError};

use super::DataOptions;

/// Replies of this size and up are written behind, by the writer thread; smaller ones (a
/// decode step's) at once: a hand-off would cost more than it saves.
const WRITE_BEHIND_BYTES: usize = 256 << 10;

/// How a request was read.
pub(super) struct Read {
    pub bytes: usize,
    /// From its first byte to its decoded call.
    pub took: Duration,
    /// When it was ready.
    pub done: Instant,
}

/// What the reader hands the link's thread.
pub(super) enum Request {
    /// A request, decoded (or why it could not be).
    Call {
        // Boxed: a call is a few hundred bytes beside the other variants' few.
        call: Box<Result<ForwardCall, WorkerError>>,
        read: Read,
    },
    /// A frame over the size limit: the link answers it and closes.
    TooLong(usize),
    /// The peer closed, the socket failed, or the link was told to give up.
    End,
}

/// The requests of one link, read one ahead by a thread of their own.
pub(super) struct Requests {
    next: Receiver<Request>,
    spin: Duration,
    // A handle that closes the socket when the link's thread ends, so that the reader,
    // blocked on it, ends too.
    socket: Conn,
}

impl Requests {
    /// Starts the reader on a handle of `stream`; it stops at the first `Request::End` or
    /// `TooLong` it reads, or when `give_up` says so while it waits.
    pub(super) fn start(
        stream: &Conn,
        options: DataOptions,
        give_up: impl FnMut() -> bool + Send + 'static,
    ) -> io::Result<Self> {
        let (sender, next) = sync_channel(1);
        let conn = stream.try_clone()?;
        let socket = stream.try_clone()?;
        let spin = options.spin;
        std::thread::Builder::new()
            .name("tether-data-read".into())
            .spawn(move || read_requests(conn, options, give_up, sender))?;
        Ok(Self { next, spin, socket })
    }

    /// The next request; spins for it as long as the link's spin, then blocks.
    pub(super) fn next(&self) -> Request {
        let started = Instant::now();
        while started.elapsed() < self.spin {
            match self.next.try_recv() {
                Ok(r) => return r,
                Err(TryRecvError::Empty) => std::hint::spin_loop(),
                Err(TryRecvError::Disconnected) => return Request::End,
            }
        }
        self.next.recv().unwrap_or(Request::End)
    }
}

impl Drop for Requests {
    fn drop(&mut self) {
        let _ = self.socket.shutdown(std::net::Shutdown::Read);
    }
}

fn read_requests(
    mut conn: Conn,
    options: DataOptions,
    mut give_up: impl FnMut() -> bool,
    sender: SyncSender<Request>,
) {
    loop {
        let request = match wait_for_frame(&conn, options.spin, &mut give_up) {
            Ok(()) => {
                let began = Instant::now();
                match read_frame(
                    &mut conn,
                    options.max_frame_bytes,
                    FRAME_WITHIN,
                    options.spin,
                ) {
                    Ok(body) => {
                        let call = frame::decode_forward(&body);
                        let done = Instant::now();
                        let read = Read {
                            bytes: body.len(),
                            took: done - began,
                            done,
                        };
                        Request::Call {
                            call: Box::new(call),
                            read,
                        }
                    }
                    Err(FrameError::TooLong(n)) => Request::TooLong(n),
                    Err(FrameError::Io(_)) => Request::End,
                }
            }
            Err(WaitEnd::Io(e)) => {
                tracing::debug!(error = %e, "data link failed");
                Request::End
            }
            Err(WaitEnd::Closed | WaitEnd::GaveUp) => Request::End,
        };
        let last = !matches!(request, Request::Call { .. });
        if sender.send(request).is_err() || last {
            return;
        }
    }
}

/// A writer thread's input, and its answers: how each write went.
type Writer = (
    SyncSender<Result<ForwardOutput, WorkerError>>,
    Receiver<io::Result<()>>,
);

/// The replies of one link, written in order: large ones behind, by a writer thread
/// started with the first of them; any write waits for the one before it.
pub(super) struct Replies {
    writer: Option<Writer>,
    // A reply handed to the writer and not yet known to be written.
    behind: bool,
    // How long a write spins for room in the socket's buffer ([`write_frame`]).
    spin: Duration,
}

impl Replies {
    pub(super) fn new(spin: Duration) -> Self {
        Self {
            writer: None,
            behind: false,
            spin,
        }
    }

    /// Writes the reply of `result` on `stream` after every reply before it.
    pub(super) fn write(
        &mut self,
        stream: &mut Conn,
        result: Result<ForwardOutput, WorkerError>,
    ) -> io::Result<()> {
        self.flush()?;
        if output_bytes(&result) < WRITE_BEHIND_BYTES {
            return write_frame(stream, &frame::encode_output(&result), self.spin);
        }
        if self.writer.is_none() {
            self.writer = Some(start_writer(stream.try_clone()?, self.spin)?);
        }
        let Some((to_write, _)) = &self.writer else {
            return Err(gone_writer());
        };
        to_write.send(result).map_err(|_| gone_writer())?;
        self.behind = true;
        Ok(())
    }

    /// Waits until every reply handed to the writer is written.
    pub(super) fn flush(&mut self) -> io::Result<()> {
        if !std::mem::take(&mut self.behind) {
            return Ok(());
        }
        match &self.writer {
            Some((_, written)) => written.recv().map_err(|_| gone_writer())?,
            None => Ok(()),
        }
    }
}

/// About how many bytes the reply of `result` takes.
fn output_bytes(result: &Result<ForwardOutput, WorkerError>) -> usize {
    match result {
        Ok(ForwardOutput::Hidden(v) | ForwardOutput::Logits(v) | ForwardOutput::Embeddings(v)) => {
            v.len() * 4
        }
        _ => 0,
    }
}

/// A thread that encodes and writes the replies it is sent on `stream`, answering each
/// with how it went.
fn start_writer(mut stream: Conn, spin: Duration) -> io::Result<Writer> {
    let (to_write, replies) = sync_channel::<Result<ForwardOutput, WorkerError>>(1);
    let (report, written) = sync_channel(1);
    std::thread::Builder::new()
        .name("tether-data-write".into())
        .spawn(move || {
            for result in replies {
                let written = write_frame(&mut stream, &frame::encode_output(&result), spin);
                let failed = written.is_err();
                if report.send(written).is_err() || failed {
                    return;
                }
            }
        })?;
    Ok((to_write, written))
}

fn gone_writer() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "the link's writer thread ended")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read as _;
    use std::os::unix::net::UnixStream;

    #[test]
    fn replies_large_and_small_arrive_whole_and_in_order() {
        let (ours, theirs) = UnixStream::pair().expect("socket pair");
        let mut stream = Conn::Unix(ours);
        // Large ones go behind, small ones at once after waiting for them: mixed, they
        // must still arrive one after another, in order, each whole.
        let floats = WRITE_BEHIND_BYTES / 4;
        let sizes = [floats * 8, 4, floats, floats * 3, 1, floats - 1];
        let results: Vec<Result<ForwardOutput, WorkerError>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                Ok(ForwardOutput::Hidden(
                    (0..n).map(|j| (i * 1000 + j) as f32).collect(),
                ))
            })
            .chain([Err(WorkerError::InvalidArgument("a refusal".into()))])
            .collect();
        let expected: Vec<u8> = results.iter().flat_map(frame::encode_output).collect();
        let reader = std::thread::spawn(move || {
            let mut theirs = theirs;
            let mut got = Vec::new();
            theirs.read_to_end(&mut got).map(|_| got)
        });
        let mut out = Replies::new(Duration::from_millis(1));
        for result in results {
            out.write(&mut stream, result).expect("write");
        }
        assert!(out.writer.is_some(), "the large replies went behind");
        // Every handle on our end closed, so the reader sees the end.
        drop(out);
        drop(stream);
        let got = reader.join().expect("reader").expect("read");
        assert_eq!(got.len(), expected.len());
        assert!(got == expected, "bytes out of order");
    }
}
