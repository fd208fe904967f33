//! Reading frames from real sockets (a Unix pair and a TCP loopback pair) whose writer
//! sends them in pieces, stops, or closes mid-frame.

use super::conn::Conn;
use super::wire::{FrameError, WaitEnd, read_frame, wait_for_frame};
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::thread;
use std::time::{Duration, Instant};

const SPIN: Duration = Duration::from_millis(10);
const WITHIN: Duration = Duration::from_secs(5);

fn unix_pair() -> (Conn, Conn) {
    let (a, b) = UnixStream::pair().expect("a Unix socket pair");
    (Conn::Unix(a), Conn::Unix(b))
}

fn tcp_pair() -> (Conn, Conn) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback listener");
    let addr = listener.local_addr().expect("its address");
    let a = TcpStream::connect(addr).expect("a connection");
    let (b, _) = listener.accept().expect("the accepted end");
    a.set_nodelay(true).expect("nodelay");
    (Conn::Tcp(a), Conn::Tcp(b))
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

/// A 16 KiB body, as a hidden state of a 4096-wide model is.
fn hidden_body() -> Vec<u8> {
    (0..16 * 1024u32).map(|i| (i * 31 % 251) as u8).collect()
}

/// Sends `bytes` in two writes `gap` apart, from another thread.
fn send_in_two(
    mut to: Conn,
    bytes: Vec<u8>,
    split: usize,
    gap: Duration,
) -> thread::JoinHandle<Conn> {
    thread::spawn(move || {
        to.write_all(&bytes[..split]).expect("the first piece");
        thread::sleep(gap);
        to.write_all(&bytes[split..]).expect("the second piece");
        to
    })
}

#[test]
fn a_frame_in_pieces_is_read_whole_while_spinning_and_after() {
    let body = hidden_body();
    // 200 us: the rest arrives while the reader spins; 30 ms: after it gave up spinning
    // and blocked. The first split is inside the length prefix.
    for (pair, name) in [
        (unix_pair as fn() -> (Conn, Conn), "unix"),
        (tcp_pair, "tcp"),
    ] {
        for (split, gap) in [
            (2, Duration::from_micros(200)),
            (4 + 5000, Duration::from_micros(200)),
            (4 + 5000, Duration::from_millis(30)),
        ] {
            let (mut reader, writer) = pair();
            let sender = send_in_two(writer, frame(&body), split, gap);
            wait_for_frame(&reader, SPIN, || false).expect("a frame begins");
            let got = read_frame(&mut reader, 1 << 20, WITHIN, SPIN)
                .unwrap_or_else(|e| panic!("{name}, split {split}, gap {gap:?}: {e:?}"));
            assert_eq!(got, body, "{name}, split {split}, gap {gap:?}");
            sender.join().expect("the writer");
        }
    }
}

#[test]
fn a_writer_that_stops_mid_frame_times_out_and_one_that_closes_is_an_error() {
    for (pair, name) in [
        (unix_pair as fn() -> (Conn, Conn), "unix"),
        (tcp_pair, "tcp"),
    ] {
        let (mut reader, mut writer) = pair();
        writer
            .write_all(&frame(&hidden_body())[..100])
            .expect("a piece");
        let started = Instant::now();
        let within = Duration::from_millis(150);
        match read_frame(&mut reader, 1 << 20, within, SPIN) {
            Err(FrameError::Io(_)) => {}
            other => panic!("{name}: a stalled frame gave {other:?}"),
        }
        assert!(
            started.elapsed() >= within,
            "{name}: gave up before the timeout"
        );

        let (mut reader, mut writer) = pair();
        writer
            .write_all(&frame(&hidden_body())[..100])
            .expect("a piece");
        drop(writer);
        match read_frame(&mut reader, 1 << 20, WITHIN, SPIN) {
            Err(FrameError::Io(e)) => {
                assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{name}: {e}")
            }
            other => panic!("{name}: a frame cut short gave {other:?}"),
        }
    }
}

#[test]
fn an_oversized_frame_is_refused_before_its_body_and_a_closed_peer_ends_the_wait() {
    let (mut reader, mut writer) = unix_pair();
    writer.write_all(&frame(&hidden_body())).expect("a frame");
    match read_frame(&mut reader, 1024, WITHIN, SPIN) {
        Err(FrameError::TooLong(n)) => assert_eq!(n, 16 * 1024),
        other => panic!("an oversized frame gave {other:?}"),
    }
    let (reader, writer) = unix_pair();
    drop(writer);
    assert!(matches!(
        wait_for_frame(&reader, SPIN, || false),
        Err(WaitEnd::Closed)
    ));
    // Nothing comes and nothing closes: the wait ends when asked to.
    let (reader, _writer) = unix_pair();
    let mut asked = 0;
    let ended = wait_for_frame(&reader, Duration::from_millis(1), || {
        asked += 1;
        asked > 1
    });
    assert!(matches!(ended, Err(WaitEnd::GaveUp)), "{ended:?}");
}
