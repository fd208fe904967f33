//! An in-test TCP fault proxy: forwards 127.0.0.1:PORT to a target and, switched at run
//! time, delays chunks, holds every byte (a partition that keeps the connections open),
//! or resets all current connections.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

/// What the proxy does with the bytes it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Forward at once.
    Pass,
    /// Sleep this many milliseconds before forwarding each chunk.
    Delay(u64),
    /// Keep the connections open but forward nothing, either way, until the mode changes.
    Blackhole,
}

/// How often blocked pumps look at the mode and the stop flags.
const TICK: Duration = Duration::from_millis(10);

/// One proxied connection; its sockets close when both pumps let go of it.
struct Conn {
    client: TcpStream,
    server: TcpStream,
    closed: AtomicBool,
}

struct Shared {
    mode: Mutex<Mode>,
    target: Mutex<String>,
    conns: Mutex<Vec<Weak<Conn>>>,
    stop: AtomicBool,
}

impl Shared {
    fn mode(&self) -> Mode {
        self.mode.lock().map(|m| *m).unwrap_or(Mode::Pass)
    }
}

/// The proxy; stops accepting and resets its connections when dropped.
pub struct Proxy {
    /// `127.0.0.1:PORT` to connect to instead of the target.
    pub addr: String,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl Proxy {
    /// Listens on a free port of 127.0.0.1 and forwards to `target`.
    pub fn start(target: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        listener
            .set_nonblocking(true)
            .expect("non-blocking listener");
        let addr = listener.local_addr().expect("proxy address").to_string();
        let shared = Arc::new(Shared {
            mode: Mutex::new(Mode::Pass),
            target: Mutex::new(target.to_string()),
            conns: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
        });
        let acceptor = {
            let shared = Arc::clone(&shared);
            std::thread::spawn(move || accept_loop(listener, shared))
        };
        Proxy {
            addr,
            shared,
            acceptor: Some(acceptor),
        }
    }

    /// Switches the mode; connections in flight follow it from their next chunk.
    pub fn set_mode(&self, mode: Mode) {
        if let Ok(mut m) = self.shared.mode.lock() {
            *m = mode;
        }
    }

    /// The current mode.
    pub fn mode(&self) -> Mode {
        self.shared.mode()
    }

    /// Forwards new connections to `target` from now on.
    pub fn set_target(&self, target: &str) {
        if let Ok(mut t) = self.shared.target.lock() {
            *t = target.to_string();
        }
    }

    /// Closes every current connection abruptly (RST, SO_LINGER 0) on both sides; new
    /// connections are accepted as before. Returns how many were reset.
    pub fn reset_all(&self) -> usize {
        reset_all(&self.shared)
    }

    /// Connections open now.
    pub fn open_connections(&self) -> usize {
        self.shared.conns.lock().map_or(0, |mut c| {
            c.retain(|w| w.strong_count() > 0);
            c.len()
        })
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        reset_all(&self.shared);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
    }
}

fn reset_all(shared: &Shared) -> usize {
    let conns: Vec<Arc<Conn>> = shared
        .conns
        .lock()
        .map(|mut c| c.drain(..).filter_map(|w| w.upgrade()).collect())
        .unwrap_or_default();
    for c in &conns {
        c.closed.store(true, Ordering::SeqCst);
        for s in [&c.client, &c.server] {
            linger_zero(s);
            // Wakes a pump blocked in read; the RST goes out when the last fd closes.
            let _ = s.shutdown(Shutdown::Read);
        }
    }
    conns.len()
}

/// SO_LINGER 0 makes the final close send RST instead of FIN.
fn linger_zero(s: &TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt on an open socket with a correctly sized `linger` value.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        let client = match listener.accept() {
            Ok((c, _)) => c,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(TICK);
                continue;
            }
            Err(_) => continue,
        };
        let target = shared.target.lock().map(|t| t.clone()).unwrap_or_default();
        let server = target
            .parse()
            .ok()
            .and_then(|a| TcpStream::connect_timeout(&a, Duration::from_secs(1)).ok());
        let Some(server) = server else {
            // The target is down: the client sees its connection refused, as it would.
            linger_zero(&client);
            continue;
        };
        let _ = client.set_nonblocking(false);
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        for s in [&client, &server] {
            let _ = s.set_read_timeout(Some(TICK * 5));
        }
        let conn = Arc::new(Conn {
            client,
            server,
            closed: AtomicBool::new(false),
        });
        if let Ok(mut c) = shared.conns.lock() {
            c.retain(|w| w.strong_count() > 0);
            c.push(Arc::downgrade(&conn));
        }
        for upstream in [true, false] {
            let conn = Arc::clone(&conn);
            let shared = Arc::clone(&shared);
            std::thread::spawn(move || pump(&conn, &shared, upstream));
        }
    }
}

/// Copies one direction (client → server when `upstream`) until EOF, error or reset.
fn pump(conn: &Conn, shared: &Shared, upstream: bool) {
    let (mut from, mut to) = if upstream {
        (&conn.client, &conn.server)
    } else {
        (&conn.server, &conn.client)
    };
    let live = || !conn.closed.load(Ordering::SeqCst) && !shared.stop.load(Ordering::SeqCst);
    let mut buf = vec![0u8; 64 << 10];
    while live() {
        if shared.mode() == Mode::Blackhole {
            std::thread::sleep(TICK);
            continue;
        }
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(_) => break,
        };
        // Bytes read just as a partition starts are held, not delivered.
        loop {
            match shared.mode() {
                Mode::Blackhole if live() => std::thread::sleep(TICK),
                Mode::Delay(ms) => {
                    std::thread::sleep(Duration::from_millis(ms));
                    break;
                }
                _ => break,
            }
        }
        if !live() || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    if conn.closed.load(Ordering::SeqCst) {
        return;
    }
    // A clean end of one side is passed on as a FIN; an error ends both.
    let _ = to.shutdown(Shutdown::Write);
}
