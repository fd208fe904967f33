//! SIGTERM with sessions attached: every session ends with reason `shutdown`, the worker
//! exits 0 within its grace period.

mod support;

use std::time::{Duration, Instant};
use support::{Attached, Worker, send_signal, sessions_and_bytes};

#[test]
fn sigterm_ends_every_session_and_exits_zero_within_grace() {
    let mut worker = Worker::start(&["--shutdown-grace", "2s"]);
    let a = Attached::start(&worker.addr, &["--model", "unused.gguf", "--no-load"]);
    let b = Attached::start(&worker.addr, &["--model", "unused.gguf", "--no-load"]);
    assert_eq!(sessions_and_bytes(&worker.status()).0, 2);
    let sent = Instant::now();
    send_signal(worker.pid(), libc::SIGTERM);
    let deadline = sent + Duration::from_secs(3);
    let status = loop {
        if let Some(status) = worker.child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "worker still running 3 s after SIGTERM; log:\n{}",
            worker.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    println!(
        "worker exited {:?} after {:?}",
        status.code(),
        sent.elapsed()
    );
    assert_eq!(status.code(), Some(0), "log:\n{}", worker.log());
    std::thread::sleep(Duration::from_millis(100));
    let log = worker.log();
    assert_eq!(log.matches("reason=shutdown").count(), 2, "log:\n{log}");
    for client in [&a, &b] {
        assert!(log.contains(&client.session));
    }
}
