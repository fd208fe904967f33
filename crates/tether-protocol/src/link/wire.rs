//! Blocking socket reads and writes shared by both ends of a data link: waiting for the
//! next frame (spinning first, where the peer answers within a GPU step), and reading or
//! writing one whole frame.

use super::conn::Conn;
use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

/// How often a blocked wait looks at whether it should give up.
pub const POLL: Duration = Duration::from_millis(50);
/// How long the rest of a request or reply may take once its first byte came.
pub const FRAME_WITHIN: Duration = Duration::from_secs(30);

/// Why no frame was read.
#[derive(Debug)]
pub enum WaitEnd {
    /// The peer closed the connection.
    Closed,
    /// `give_up` said so.
    GaveUp,
    /// The socket failed.
    Io(io::Error),
}

/// Waits until a frame's first byte is there. Spins (non-blocking peeks) for `spin`,
/// because waking a parked thread costs tens of microseconds on a server CPU, a
/// noticeable part of a 2 ms decode step; then blocks, asking `give_up` every [`POLL`].
pub fn wait_for_frame(
    stream: &Conn,
    spin: Duration,
    mut give_up: impl FnMut() -> bool,
) -> Result<(), WaitEnd> {
    let mut probe = [0u8; 1];
    if !spin.is_zero() {
        let started = Instant::now();
        loop {
            match stream.recv_now(&mut probe, true) {
                Ok(0) => return Err(WaitEnd::Closed),
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if started.elapsed() >= spin {
                        break;
                    }
                    std::hint::spin_loop();
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(WaitEnd::Io(e)),
            }
        }
    }
    stream.set_read_timeout(Some(POLL)).map_err(WaitEnd::Io)?;
    loop {
        match stream.peek(&mut probe) {
            Ok(0) => return Err(WaitEnd::Closed),
            Ok(_) => return Ok(()),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                if give_up() {
                    return Err(WaitEnd::GaveUp);
                }
            }
            Err(e) => return Err(WaitEnd::Io(e)),
        }
    }
}

/// Why a frame could not be read.
#[derive(Debug)]
pub enum FrameError {
    /// Longer than the limit; its body was not read, so the link cannot go on.
    TooLong(usize),
    /// The socket failed or closed mid-frame, or `within` passed.
    Io(io::Error),
}

/// Longest a reader spins for the rest of a frame that has begun to arrive.
const MID_FRAME_SPIN: Duration = Duration::from_millis(1);

/// Reads one frame's body, refusing one over `max` bytes. The peer sends each frame with a
/// single write, so `within` only trips on a peer that stopped mid-frame. With a non-zero
/// `spin` the rest of a frame that has begun to arrive is awaited spinning (for at most
/// [`MID_FRAME_SPIN`]): a frame of hidden states arrives in pieces, and a thread put to
/// sleep between them costs more than the whole transfer.
pub fn read_frame(
    stream: &mut Conn,
    max: usize,
    within: Duration,
    spin: Duration,
) -> Result<Vec<u8>, FrameError> {
    let spin = spin.min(MID_FRAME_SPIN);
    let mut len = [0u8; 4];
    fill(stream, &mut len, within, spin).map_err(FrameError::Io)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(FrameError::TooLong(len));
    }
    let mut body = vec![0u8; len];
    fill(stream, &mut body, within, spin).map_err(FrameError::Io)?;
    Ok(body)
}

/// Reads one frame's body, refusing one over `max` bytes, all of it by `deadline`: a peer
/// that sends a byte now and then cannot stretch it, as it could a per-read timeout.
pub fn read_frame_by(
    stream: &mut Conn,
    max: usize,
    deadline: Instant,
) -> Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    fill_by(stream, &mut len, deadline).map_err(FrameError::Io)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(FrameError::TooLong(len));
    }
    let mut body = vec![0u8; len];
    fill_by(stream, &mut body, deadline).map_err(FrameError::Io)?;
    Ok(body)
}

/// Writes a whole frame. With a non-zero `spin`, a write that finds the socket's buffer
/// full spins for room (for at most [`MID_FRAME_SPIN`] without progress) before it
/// blocks: a frame of hidden states is many buffers long, the reader spins for them, and
/// a writer put to sleep each time the buffer fills (~0.1 ms to wake) made 8 MiB take
/// 5-14 ms instead of ~1.
pub fn write_frame(stream: &mut Conn, frame: &[u8], spin: Duration) -> io::Result<()> {
    let mut sent = 0;
    let mut stalled = Instant::now();
    while sent < frame.len() && !spin.is_zero() {
        match stream.send_now(&frame[sent..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                sent += n;
                stalled = Instant::now();
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if stalled.elapsed() >= MID_FRAME_SPIN {
                    break;
                }
                std::hint::spin_loop();
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    stream.write_all(&frame[sent..])
}

/// Fills `buf` with blocking reads, each waiting at most until `deadline`.
fn fill_by(stream: &mut Conn, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Fills `buf`: non-blocking reads while `spin` lasts, then blocking ones that give up after
/// `within`.
fn fill(stream: &mut Conn, buf: &mut [u8], within: Duration, spin: Duration) -> io::Result<()> {
    let started = Instant::now();
    let mut got = 0;
    while got < buf.len() && !spin.is_zero() {
        match stream.recv_now(&mut buf[got..], false) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if started.elapsed() >= spin {
                    break;
                }
                std::hint::spin_loop();
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    if got < buf.len() {
        stream.set_read_timeout(Some(within))?;
        stream.read_exact(&mut buf[got..])?;
    }
    Ok(())
}
