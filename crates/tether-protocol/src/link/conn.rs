//! A link's socket: TCP, or a Unix socket in the abstract namespace when coordinator and
//! worker share a host (a Unix socket skips the TCP/IP stack: a 16 KiB hidden state costs
//! one copy instead of a loopback segment's processing on each end).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::time::Duration;

/// The abstract Unix socket name of the data links on TCP port `port` (Linux; per network
/// namespace, as loopback is).
pub fn unix_name(port: u16) -> UnixAddr {
    // A name of 17 bytes or so never exceeds the 107 the address holds.
    UnixAddr::from_abstract_name(format!("tether-data-{port}").as_bytes())
        .unwrap_or_else(|_| unreachable!("a short abstract socket name"))
}

/// One end of a link.
#[derive(Debug)]
pub enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Conn {
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_read_timeout(t),
            Self::Unix(s) => s.set_read_timeout(t),
        }
    }

    pub fn try_clone(&self) -> io::Result<Self> {
        Ok(match self {
            Self::Tcp(s) => Self::Tcp(s.try_clone()?),
            Self::Unix(s) => Self::Unix(s.try_clone()?),
        })
    }

    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.shutdown(how),
            Self::Unix(s) => s.shutdown(how),
        }
    }

    /// Looks at the next byte without taking it; honours the socket's mode and timeout.
    pub fn peek(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.peek(buf),
            Self::Unix(s) => {
                // SAFETY: the descriptor is the live socket `s` borrows; `buf` outlives
                // the call and is `buf.len()` bytes long.
                let n = unsafe {
                    libc::recv(
                        s.as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        libc::MSG_PEEK,
                    )
                };
                usize::try_from(n).map_err(|_| io::Error::last_os_error())
            }
        }
    }

    /// The process id at the other end of a Unix socket, as the kernel recorded it when
    /// the connection was made (SO_PEERCRED).
    /// One `recv` that never blocks (`WouldBlock` when nothing is there); with `peek` the
    /// bytes stay queued. Spinning waits use it, so the socket's mode never changes.
    pub fn recv_now(&self, buf: &mut [u8], peek: bool) -> io::Result<usize> {
        let fd = match self {
            Self::Tcp(s) => s.as_raw_fd(),
            Self::Unix(s) => s.as_raw_fd(),
        };
        let flags = libc::MSG_DONTWAIT | if peek { libc::MSG_PEEK } else { 0 };
        // SAFETY: `buf` is valid for `buf.len()` bytes of writes for the call's duration.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), flags) };
        usize::try_from(n).map_err(|_| io::Error::last_os_error())
    }

    /// One `send` that never blocks (`WouldBlock` when the socket's buffer is full).
    pub fn send_now(&self, buf: &[u8]) -> io::Result<usize> {
        let fd = match self {
            Self::Tcp(s) => s.as_raw_fd(),
            Self::Unix(s) => s.as_raw_fd(),
        };
        let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
        // SAFETY: `buf` is valid for `buf.len()` bytes of reads for the call's duration.
        let n = unsafe { libc::send(fd, buf.as_ptr().cast(), buf.len(), flags) };
        usize::try_from(n).map_err(|_| io::Error::last_os_error())
    }

    pub fn peer_pid(&self) -> io::Result<u32> {
        let Self::Unix(s) = self else {
            return Err(io::Error::other("a TCP socket has no peer process"));
        };
        let mut cred = libc::ucred {
            pid: 0,
            uid: 0,
            gid: 0,
        };
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: the descriptor is the live socket `s` borrows; `cred` and `len` are
        // valid for writes of the sizes given and outlive the call.
        let r = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                (&mut cred as *mut libc::ucred).cast(),
                &mut len,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        u32::try_from(cred.pid).map_err(|_| io::Error::other("no peer process id"))
    }

    /// Whether this is the same-host kind.
    pub fn is_unix(&self) -> bool {
        matches!(self, Self::Unix(_))
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.read(buf),
            Self::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write(buf),
            Self::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.flush(),
            Self::Unix(s) => s.flush(),
        }
    }
}
