//! Data links against a real `tether worker` process and a real model: a link's forward
//! passes equal gRPC's, bad requests are refused without closing the link or touching the
//! cache, a link needs the worker's token and a live session, dies with its session, and
//! keeps nothing alive: the worker frees the session and exits on SIGTERM as without one.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};
use support::{TinyModel, Worker, attach_options, committed_session, runtime, sessions_and_bytes};
use tether_client::{ClientOptions, ErrorKind, WorkerClient};
use tether_client::{DataLink, LinkTarget};
use tether_protocol::{
    BearerToken, EndReason, ForwardCall, ForwardInput, ForwardOutput, Rows, SessionId, SharedArea,
    TokenPos,
};

fn call(ids: Vec<u32>, rows: &[u32], want: Rows) -> ForwardCall {
    ForwardCall {
        tokens: (0..ids.len() as u32)
            .map(|pos| TokenPos { seq: 0, pos })
            .collect(),
        input: ForwardInput::TokenIds(ids),
        logits_rows: rows.to_vec(),
        rows: want,
        targets: Vec::new(),
    }
}

/// `c` over gRPC, the reference a link's answer must equal.
async fn by_grpc(client: &WorkerClient, session: SessionId, c: &ForwardCall) -> ForwardOutput {
    client
        .forward(session, &c.tokens, &c.input, &c.logits_rows, c.rows)
        .await
        .expect("grpc forward")
}

fn data_addr(client: &WorkerClient) -> SocketAddr {
    let port = client.info().data_port;
    assert_ne!(port, 0, "the worker advertises a data port in Hello");
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// The worker's data links as its Hello describes them.
fn target(client: &WorkerClient) -> LinkTarget {
    LinkTarget {
        worker: client.addr().to_string(),
        at: data_addr(client),
        pid: client.info().pid,
        max_frame_bytes: 1 << 20,
        connect_timeout: Duration::from_secs(5),
    }
}

fn open(client: &WorkerClient, session: SessionId, token: Option<&str>) -> DataLink {
    let token = BearerToken::parse(token).expect("token");
    DataLink::open(&target(client), session, token.as_ref()).expect("open the data link")
}

#[test]
fn a_links_forward_passes_equal_grpcs_and_bad_requests_leave_it_open() {
    let model = TinyModel::new();
    let worker = Worker::start(&[]);
    runtime().block_on(async {
        let client = WorkerClient::connect(&worker.addr, &ClientOptions::default())
            .await
            .expect("connect");
        let (session, _) =
            committed_session(&client, attach_options("link"), &model.path, 32).await;
        let link = client
            .open_data_link(session.id())
            .await
            .expect("open")
            .expect("a plaintext worker serves links");
        assert!(!link.spins(), "a cpu worker's link does not spin");
        assert!(
            link.same_host(),
            "a loopback worker is reached through its Unix socket"
        );
        let tcp =
            DataLink::open_tcp(&target(&client), session.id(), None).expect("a link over TCP");
        assert!(!tcp.same_host());
        for (rows, want) in [
            (vec![], Rows::Logits),
            (vec![0, 2], Rows::Logits),
            (vec![1, 2], Rows::ArgMax),
            (vec![2], Rows::Top(7)),
        ] {
            let c = call(vec![1, 2, 3], &rows, want);
            // Each pass writes the same cells with the same values, so order is free.
            let by_link = link.forward(&c).expect("link forward");
            assert_eq!(tcp.forward(&c).expect("tcp link forward"), by_link);
            let by_grpc = by_grpc(&client, session.id(), &c).await;
            assert_eq!(by_link, by_grpc, "rows {rows:?} {want:?}");
            if rows.is_empty() {
                assert!(matches!(by_link, ForwardOutput::Hidden(ref h) if !h.is_empty()));
            }
        }
        let reference = link
            .forward(&call(vec![1, 2, 3], &[2], Rows::Logits))
            .expect("logits");
        // Sent and answered in two halves, as a decode step over a GPU worker is: the same
        // answer.
        let c = call(vec![1, 2, 3], &[2], Rows::Logits);
        let sent = link.forward_send(&c).expect("send");
        assert_eq!(link.forward_reply(sent).expect("reply"), reference);
        // Three sent before any reply is read, as a pipeline's stage sends them: each reply
        // is its own call's. Asked for out of order, a reply is refused and skipped.
        let argmax = link
            .forward(&call(vec![1, 2, 3], &[1, 2], Rows::ArgMax))
            .expect("arg-max");
        let first = link.forward_send(&c).expect("send");
        let second = link
            .forward_send(&call(vec![1, 2, 3], &[1, 2], Rows::ArgMax))
            .expect("send ahead");
        let third = link.forward_send(&c).expect("send further ahead");
        let e = link
            .forward_reply(second)
            .expect_err("the second reply before the first");
        assert!(e.to_string().contains("sent earlier"), "{e}");
        assert_eq!(link.forward_reply(first).expect("first"), reference);
        assert_eq!(link.forward_reply(third).expect("third"), reference);
        // A reply whose caller gave up is dropped before the next call's.
        drop(
            link.forward_send(&call(vec![1, 2, 3], &[1, 2], Rows::ArgMax))
                .expect("send"),
        );
        assert_eq!(link.forward(&c).expect("the next call"), reference);
        assert_eq!(
            link.forward(&call(vec![1, 2, 3], &[1, 2], Rows::ArgMax))
                .expect("and the next"),
            argmax
        );
        // A range as a GPU worker would lend it: three tokens of the model's width.
        let three = call(vec![1, 2, 3], &[], Rows::Logits);
        let n_embd = match by_grpc(&client, session.id(), &three).await {
            ForwardOutput::Hidden(h) => h.len() as u64 / 3,
            other => panic!("hidden states expected, got {other:?}"),
        };
        let lent = SharedArea {
            host: [0; 16],
            pid: 1,
            device: 0,
            handle: [0; 64],
            base: 1 << 40,
            key: 7,
            offset: 0,
            len: 3 * 4 * n_embd,
        };
        let bad = [
            call(vec![1, 2, 1 << 30], &[2], Rows::Logits),
            call(vec![1, 2, 3], &[], Rows::ArgMax),
            call(vec![1, 2, 3], &[2], Rows::Top(0)),
            ForwardCall {
                input: ForwardInput::Hidden(vec![0.5; 3]),
                ..call(vec![1, 2, 3], &[2], Rows::Logits)
            },
            call(vec![1; 9], &[], Rows::Logits),
            // A hand-off asked of the block with the head, and one with logits rows.
            call(vec![1, 2, 3], &[], Rows::HandOff(0)),
            call(vec![1, 2, 3], &[2], Rows::HandOff(0)),
            // Lent hidden states of the wrong size for three tokens.
            ForwardCall {
                input: ForwardInput::Lent(SharedArea { len: 12, ..lent }),
                ..call(vec![1, 2, 3], &[2], Rows::Logits)
            },
        ];
        for c in &bad {
            let e = link.forward(c).expect_err("a bad request");
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{c:?}: {e}");
        }
        // A cpu worker borrows no device memory: lent hidden states of the right size, and
        // the probe a pipeline opens with, are refused as a state it cannot serve.
        for c in [
            ForwardCall {
                input: ForwardInput::Lent(lent),
                ..call(vec![1, 2, 3], &[2], Rows::Logits)
            },
            ForwardCall {
                tokens: Vec::new(),
                input: ForwardInput::Lent(SharedArea { len: 0, ..lent }),
                ..call(vec![], &[], Rows::Logits)
            },
        ] {
            let e = link.forward(&c).expect_err("lent input on a cpu worker");
            assert_eq!(e.kind(), ErrorKind::FailedPrecondition, "{c:?}: {e}");
            assert!(e.to_string().contains("borrows no device memory"), "{e}");
            // gRPC carries neither a hand-off nor lent input: refused by name.
            let e = client
                .forward(session.id(), &c.tokens, &c.input, &c.logits_rows, c.rows)
                .await
                .expect_err("lent input over gRPC");
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
            assert!(e.to_string().contains("only on a data link"), "{e}");
        }
        // A fourth token after the three: a cell the bad requests would have written.
        let next = ForwardCall {
            tokens: vec![TokenPos { seq: 0, pos: 3 }],
            input: ForwardInput::TokenIds(vec![4]),
            logits_rows: vec![0],
            rows: Rows::Logits,
            targets: Vec::new(),
        };
        let after = link.forward(&next).expect("the link still serves");
        let again = link
            .forward(&call(vec![1, 2, 3], &[2], Rows::Logits))
            .expect("logits");
        assert_eq!(again, reference, "the refused requests changed no cell");
        assert_eq!(
            link.forward(&next).expect("again"),
            after,
            "the same step on the same cells gives the same logits"
        );
        let end = session.close().await;
        assert_eq!(end.reason, EndReason::Closed);
        let e = link.forward(&next).expect_err("the session is gone");
        assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
        let e = link
            .forward(&next)
            .expect_err("the link closed with its session");
        assert_ne!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    });
    let (sessions, bytes) = sessions_and_bytes(&worker.status());
    assert_eq!((sessions, bytes), (0, 0), "{}", worker.log());
}

#[test]
fn a_link_needs_the_token_and_a_live_session() {
    const TOKEN: &str = "data-link-secret";
    let model = TinyModel::new();
    let worker = Worker::start(&["--token", TOKEN]);
    runtime().block_on(async {
        let options = ClientOptions {
            token: BearerToken::parse(Some(TOKEN)).expect("token"),
            ..ClientOptions::default()
        };
        let client = WorkerClient::connect(&worker.addr, &options)
            .await
            .expect("connect");
        let (session, _) =
            committed_session(&client, attach_options("auth"), &model.path, 16).await;
        for token in [None, Some("wrong")] {
            let token = BearerToken::parse(token).expect("token");
            let e = DataLink::open(&target(&client), session.id(), token.as_ref())
                .expect_err("a link without the token");
            assert_eq!(e.kind(), ErrorKind::Unauthenticated, "{e}");
        }
        let stranger = DataLink::open(
            &target(&client),
            SessionId::new_random(),
            BearerToken::parse(Some(TOKEN)).expect("token").as_ref(),
        )
        .expect_err("a session nobody opened");
        assert_eq!(stranger.kind(), ErrorKind::NotFound, "{stranger}");
        let link = client
            .open_data_link(session.id())
            .await
            .expect("open")
            .expect("link");
        link.forward(&call(vec![1], &[0], Rows::ArgMax))
            .expect("with the token");
        session.close().await;
    });
}

#[test]
fn garbage_on_the_data_port_is_refused_and_the_worker_goes_on() {
    let model = TinyModel::new();
    let worker = Worker::start(&["--max-message-bytes", "256K"]);
    runtime().block_on(async {
        let client = WorkerClient::connect(&worker.addr, &ClientOptions::default())
            .await
            .expect("connect");
        let at = data_addr(&client);
        // An HTTP request where a hello belongs: refused with a reason, then closed.
        let mut raw = TcpStream::connect(at).expect("connect");
        raw.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .expect("write");
        let mut reply = Vec::new();
        raw.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        raw.read_to_end(&mut reply)
            .expect("the worker answers and closes");
        let text = String::from_utf8_lossy(&reply);
        assert!(text.contains("not a tether data link"), "{text:?}");

        // A request frame over the worker's message limit: refused, the link closed.
        let (session, _) = committed_session(&client, attach_options("big"), &model.path, 16).await;
        let link = open(&client, session.id(), None);
        let big = ForwardCall {
            tokens: vec![TokenPos { seq: 0, pos: 0 }],
            input: ForwardInput::Hidden(vec![0.0; 100_000]),
            logits_rows: vec![],
            rows: Rows::Logits,
            targets: Vec::new(),
        };
        let e = link.forward(&big).expect_err("400 KB over a 256 KiB limit");
        assert!(e.to_string().contains("limit"), "{e}");
        assert!(link.usable(), "a refusal is an answer, not a failed socket");
        let e = link
            .forward(&call(vec![5], &[0], Rows::ArgMax))
            .expect_err("closed by the worker");
        assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
        assert!(!link.usable(), "a failed socket sends later calls to gRPC");
        // The worker still serves the session, over gRPC and over a new link.
        let fresh = open(&client, session.id(), None);
        let c = call(vec![5, 6], &[1], Rows::ArgMax);
        assert_eq!(
            fresh.forward(&c).expect("fresh link"),
            by_grpc(&client, session.id(), &c).await
        );
        session.close().await;
    });
}

#[test]
fn links_hold_nothing_a_killed_session_or_a_sigterm_must_wait_for() {
    let model = TinyModel::new();
    let mut worker = Worker::start(&[]);
    let links = runtime().block_on(async {
        let client = WorkerClient::connect(&worker.addr, &ClientOptions::default())
            .await
            .expect("connect");
        let (killed, _) =
            committed_session(&client, attach_options("killed"), &model.path, 16).await;
        let (kept, _) = committed_session(&client, attach_options("kept"), &model.path, 16).await;
        let a = open(&client, killed.id(), None);
        let b = open(&client, kept.id(), None);
        a.forward(&call(vec![1, 2], &[1], Rows::ArgMax)).expect("a");
        b.forward(&call(vec![1, 2], &[1], Rows::ArgMax)).expect("b");
        let out = support::tetherctl_json(&worker.addr, &["kill", &killed.id().to_string()]);
        assert!(out.is_object(), "{out}");
        let e = a
            .forward(&call(vec![3], &[0], Rows::ArgMax))
            .expect_err("killed");
        assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
        b.forward(&call(vec![3], &[0], Rows::ArgMax))
            .expect("the other session serves");
        // Both stay open across the SIGTERM below; the kept session's link is idle in it.
        std::mem::forget(killed);
        (b, kept)
    });
    let started = Instant::now();
    support::send_signal(worker.pid(), 15);
    let status = loop {
        if let Some(s) = worker.child.try_wait().expect("wait") {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the worker did not exit with a link open; log:\n{}",
            worker.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit {status:?}; log:\n{}", worker.log());
    let e = links
        .0
        .forward(&call(vec![4], &[0], Rows::ArgMax))
        .expect_err("the worker is gone");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
}

#[test]
fn a_same_host_socket_of_another_process_is_not_trusted() {
    // Any local user can bind an abstract socket name. Here this test process takes the
    // name before the worker starts: the worker serves links over TCP only, and a client
    // that finds the squatter checks the process at the other end against the worker's
    // Hello and goes over TCP instead of saying hello to it.
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener};
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let name = UnixAddr::from_abstract_name(format!("tether-data-{port}")).expect("name");
    let squatter = UnixListener::bind_addr(&name).expect("squat the name");
    squatter.set_nonblocking(true).expect("non-blocking");
    let model = TinyModel::new();
    let worker = Worker::start(&["--data-port", &port.to_string()]);
    runtime().block_on(async {
        let client = WorkerClient::connect(&worker.addr, &ClientOptions::default())
            .await
            .expect("connect");
        assert_eq!(client.info().data_port, port);
        assert_ne!(client.info().pid, std::process::id());
        let (session, _) = committed_session(&client, attach_options("pid"), &model.path, 16).await;
        let link = client
            .open_data_link(session.id())
            .await
            .expect("open")
            .expect("link");
        assert!(!link.same_host(), "the squatter's socket was used");
        let c = call(vec![2, 3], &[1], Rows::ArgMax);
        assert_eq!(
            link.forward(&c).expect("tcp"),
            by_grpc(&client, session.id(), &c).await
        );
        session.close().await;
    });
    // The squatter was reached (the client looked) but never heard a hello.
    match squatter.accept() {
        Ok((mut conn, _)) => {
            conn.set_nonblocking(true).expect("non-blocking");
            let mut buf = [0u8; 64];
            let heard = conn.read(&mut buf);
            assert!(
                !matches!(heard, Ok(n) if n > 0),
                "the client sent {heard:?} to a stranger"
            );
        }
        Err(e) => panic!("the client never looked at the same-host socket: {e}"),
    }
}

#[test]
fn hellos_dripped_a_byte_at_a_time_are_cut_at_the_deadline_and_a_real_link_still_opens() {
    const TOKEN: &str = "data-link-drip-secret";
    const DRIPPERS: usize = 32;
    let model = TinyModel::new();
    // A 1 s hello deadline and room for 8 connections without a hello, a quarter of the
    // drippers.
    let worker = Worker::start(&[
        "--token",
        TOKEN,
        "--data-hello-timeout",
        "1s",
        "--data-max-unauthenticated",
        "8",
    ]);
    runtime().block_on(async {
        let options = ClientOptions {
            token: BearerToken::parse(Some(TOKEN)).expect("token"),
            ..ClientOptions::default()
        };
        let client = WorkerClient::connect(&worker.addr, &options)
            .await
            .expect("connect");
        let (session, _) =
            committed_session(&client, attach_options("drip"), &model.path, 16).await;
        let at = data_addr(&client);
        let mut drips: Vec<TcpStream> = (0..DRIPPERS)
            .map(|_| TcpStream::connect(at).expect("connect to the data port"))
            .collect();
        // A 100-byte hello announced, then one byte of it every 300 ms: each read on its
        // own is quick, the hello never completes.
        let hello = [100u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let started = Instant::now();
        let mut linked = false;
        for byte in hello {
            for drip in &mut drips {
                let _ = drip.write_all(&[byte]);
            }
            if !linked && started.elapsed() >= Duration::from_millis(500) {
                // The drippers hold every slot for unauthenticated connections now.
                let link = client
                    .open_data_link(session.id())
                    .await
                    .expect("open")
                    .expect("a real coordinator still gets its link");
                link.forward(&call(vec![1], &[0], Rows::ArgMax))
                    .expect("a forward pass on it");
                linked = true;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
        assert!(linked);
        assert!(started.elapsed() >= Duration::from_secs(3));
        // Each dripper was closed: by the total deadline (1 s), or to make room.
        for (i, drip) in drips.iter_mut().enumerate() {
            drip.set_read_timeout(Some(Duration::from_millis(500)))
                .expect("read timeout");
            let mut buf = [0u8; 64];
            let read = loop {
                match drip.read(&mut buf) {
                    Ok(n) if n > 0 => continue,
                    other => break other,
                }
            };
            match read {
                Ok(_) => {}
                Err(e) => assert!(
                    !matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ),
                    "dripper {i} is still open after {:?}",
                    started.elapsed()
                ),
            }
        }
        session.close().await;
    });
}
