//! Loading layers into a real worker process: admission refuses what does not fit and
//! stages nothing, an undecided Prepare is aborted by timeout, and 200 load/forward/close
//! cycles give every byte back without the process growing; clients gone mid-Prepare leave
//! neither staged bytes behind a reported end nor resident memory; arg-max and top-k replies,
//! for a few tokens and for a decode batch of many sequences, are the samplers' choices
//! from the logits of the same batch.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use support::{TinyModel, Worker, attach_options, committed_session, full_load, rss_kb, runtime};
use tether_client::{AdminClient, ClientOptions, ErrorKind, WorkerClient};
use tether_protocol::{EndReason, ForwardInput, ForwardOutput, Rows, TokenPos};

#[test]
fn prepare_over_max_memory_is_refused_and_stages_nothing() {
    let model = TinyModel::new();
    let worker = Worker::start(&["--max-memory", "4K"]);
    runtime().block_on(async {
        let client = WorkerClient::connect(&worker.addr, &ClientOptions::default())
            .await
            .expect("connect");
        let session = client
            .attach(attach_options("too-big"))
            .await
            .expect("attach");
        let (load, source, _) = full_load(&model.path, 64);
        let err = client
            .prepare(session.id(), load, source)
            .await
            .unwrap_err();
        println!("refusal: {err}");
        assert_eq!(err.kind(), ErrorKind::ResourceExhausted, "{err}");
        assert!(
            err.to_string().contains("asked") && err.to_string().contains("4096 bytes free"),
            "{err}"
        );
        let mut admin = AdminClient::connect(&worker.addr, None, &ClientOptions::default())
            .await
            .expect("admin");
        let status = admin.status().await.expect("status");
        assert_eq!(
            (status.sessions, status.session_bytes),
            (1, 0),
            "the session lives on with nothing staged"
        );
        assert_eq!(
            admin.sessions().await.expect("sessions")[0].prepared_txns,
            0
        );
    });
}

/// Bytes a worker reserves for the whole tiny model with `ctx` cells.
async fn reserved_for(addr: &str, model: &std::path::Path, ctx: usize) -> u64 {
    let client = WorkerClient::connect(addr, &ClientOptions::default())
        .await
        .expect("connect");
    let session = client
        .attach(attach_options("measure"))
        .await
        .expect("attach");
    let (load, source, _) = full_load(model, ctx);
    let bytes = client
        .prepare(session.id(), load, source)
        .await
        .expect("prepare");
    session.close().await;
    bytes
}

#[test]
fn prepare_over_the_session_limit_is_refused_while_a_smaller_one_loads() {
    let model = TinyModel::new();
    let (small, big) = runtime().block_on(async {
        let probe = Worker::start(&[]);
        let small = reserved_for(&probe.addr, &model.path, 1).await;
        (small, reserved_for(&probe.addr, &model.path, 64).await)
    });
    assert!(big > small, "a longer context needs more bytes");
    let limit = small.to_string();
    let worker = Worker::start(&["--max-session-memory", &limit]);
    runtime().block_on(async {
        let client = WorkerClient::connect(&worker.addr, &ClientOptions::default())
            .await
            .expect("connect");
        let session = client.attach(attach_options("big")).await.expect("attach");
        let (load, source, _) = full_load(&model.path, 64);
        let err = client
            .prepare(session.id(), load, source)
            .await
            .unwrap_err();
        println!("refusal: {err}");
        assert_eq!(err.kind(), ErrorKind::ResourceExhausted, "{err}");
        assert!(err.to_string().contains("--max-session-memory"), "{err}");
        let mut admin = AdminClient::connect(&worker.addr, None, &ClientOptions::default())
            .await
            .expect("admin");
        let status = admin.status().await.expect("status");
        assert_eq!((status.sessions, status.session_bytes), (1, 0));
        // The limit is per session, not for the worker: two sessions each hold all of it.
        let mut kept = Vec::new();
        for name in ["small-1", "small-2"] {
            let session = client.attach(attach_options(name)).await.expect("attach");
            let (load, source, _) = full_load(&model.path, 1);
            let txn = load.txn;
            match client.prepare(session.id(), load, source).await {
                Ok(bytes) => assert_eq!(bytes, small),
                Err(e) => panic!("a load at the limit was refused: {e}"),
            }
            client.commit(session.id(), txn).await.expect("commit");
            kept.push(session);
        }
        let status = admin.status().await.expect("status");
        assert_eq!(status.session_bytes, 2 * small);
    });
}

#[test]
fn prepare_without_commit_is_aborted_by_timeout_and_freed() {
    let model = TinyModel::new();
    let worker = Worker::start(&["--prepare-timeout", "500ms"]);
    runtime().block_on(async {
        let client = WorkerClient::connect(&worker.addr, &ClientOptions::default())
            .await
            .expect("connect");
        let session = client
            .attach(attach_options("undecided"))
            .await
            .expect("attach");
        let (load, source, _) = full_load(&model.path, 64);
        let txn = load.txn;
        let reserved = client
            .prepare(session.id(), load, source)
            .await
            .expect("prepare");
        let prepared_at = Instant::now();
        let mut admin = AdminClient::connect(&worker.addr, None, &ClientOptions::default())
            .await
            .expect("admin");
        assert_eq!(
            admin.status().await.expect("status").session_bytes,
            reserved
        );
        loop {
            let status = admin.status().await.expect("status");
            if status.session_bytes == 0 {
                assert_eq!(status.counters.txn_timed_out, 1);
                break;
            }
            assert!(
                prepared_at.elapsed() < Duration::from_millis(1500),
                "not aborted in time"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        println!(
            "undecided prepare of {reserved} bytes freed {:?} after its vote",
            prepared_at.elapsed()
        );
        let err = client.commit(session.id(), txn).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
        assert_eq!(session.close().await.reason, EndReason::Closed);
    });
}

#[test]
fn two_hundred_load_forward_close_cycles_return_every_byte() {
    let model = TinyModel::new();
    let worker = Worker::start(&[]);
    let pid = worker.pid();
    runtime().block_on(async {
        let client = WorkerClient::connect(&worker.addr, &ClientOptions::default()).await.expect("connect");
        let mut admin = AdminClient::connect(&worker.addr, None, &ClientOptions::default()).await.expect("admin");
        let mut rss_after_warmup = 0;
        let started = Instant::now();
        for cycle in 0..200 {
            let (session, reserved) = committed_session(&client, attach_options("cycle"), &model.path, 32).await;
            let tokens = [TokenPos { seq: 0, pos: 0 }, TokenPos { seq: 0, pos: 1 }];
            let out = client
                .forward(session.id(), &tokens, &ForwardInput::TokenIds(vec![1, 2]), &[1], Rows::Logits)
                .await
                .expect("forward");
            let ForwardOutput::Logits(logits) = out else { panic!("asked for logits") };
            assert!(!logits.is_empty() && logits.iter().all(|v| v.is_finite()));
            let end = session.close().await;
            assert_eq!((end.reason, end.bytes_freed), (EndReason::Closed, reserved), "cycle {cycle}");
            let status = admin.status().await.expect("status");
            assert_eq!((status.sessions, status.session_bytes), (0, 0), "cycle {cycle}");
            if cycle == 9 {
                rss_after_warmup = rss_kb(pid);
            }
        }
        let rss_last = rss_kb(pid);
        println!(
            "200 cycles in {:?}: worker RSS after 10 cycles {rss_after_warmup} kB, after 200 {rss_last} kB",
            started.elapsed()
        );
        assert!(rss_last <= rss_after_warmup + 8 * 1024, "RSS grew from {rss_after_warmup} kB to {rss_last} kB");
        assert_eq!(admin.status().await.expect("status").counters.closed, 200);
    });
}

#[test]
fn argmax_and_top_k_replies_carry_what_the_samplers_take_from_each_logits_row() {
    // A real worker process: the arg-max it returns for each row is what greedy sampling
    // picks from the logits it returns for the same batch, and its top candidates are the
    // head of the sampler's candidate list; arg-max with no logits rows and top_k outside
    // 1..=MAX_TOP_K are refused.
    let model = TinyModel::new();
    let worker = Worker::start(&[]);
    runtime().block_on(async {
        let client = WorkerClient::connect(&worker.addr, &ClientOptions::default())
            .await
            .expect("connect");
        let (session, _) =
            committed_session(&client, attach_options("argmax"), &model.path, 32).await;
        let tokens = [
            TokenPos { seq: 0, pos: 0 },
            TokenPos { seq: 0, pos: 1 },
            TokenPos { seq: 0, pos: 2 },
        ];
        let ids = ForwardInput::TokenIds(vec![1, 2, 3]);
        replies_follow_the_logits(&client, session.id(), &tokens, &ids, &[0, 2]).await;
        let err = client
            .forward(session.id(), &tokens, &ids, &[], Rows::ArgMax)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
        assert!(err.to_string().contains("argmax"), "{err}");
        for bad in [0, tether_protocol::MAX_TOP_K + 1] {
            let err = client
                .forward(session.id(), &tokens, &ids, &[0], Rows::Top(bad))
                .await
                .unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidArgument, "top_k {bad}: {err}");
        }
        let end = session.close().await;
        assert_eq!(end.reason, EndReason::Closed);
    });
}

#[test]
fn a_decode_batch_of_many_sequences_gets_the_argmax_and_top_k_of_its_logits() {
    // Twelve sequences decoding at once: more tokens than a replayed step holds, so the
    // worker's device path for large decode steps answers; what it returns for arg-max and
    // top-k rows must be what the samplers take from the logits of the same batch.
    let model = TinyModel::new();
    let worker = Worker::start(&[]);
    runtime().block_on(async {
        let client = WorkerClient::connect(&worker.addr, &ClientOptions::default())
            .await
            .expect("connect");
        let session = client
            .attach(attach_options("batch"))
            .await
            .expect("attach");
        let (mut load, source, _) = full_load(&model.path, 8);
        let txn = load.txn;
        load.spec.n_seq = 12;
        load.spec.ubatch = 16;
        client
            .prepare(session.id(), load, source)
            .await
            .expect("prepare");
        client.commit(session.id(), txn).await.expect("commit");
        let tokens: Vec<TokenPos> = (0..12).map(|seq| TokenPos { seq, pos: 0 }).collect();
        let ids = ForwardInput::TokenIds((0..12).map(|i| 3 + 7 * i).collect());
        let rows: Vec<u32> = (0..12).collect();
        replies_follow_the_logits(&client, session.id(), &tokens, &ids, &rows).await;
        assert_eq!(session.close().await.reason, EndReason::Closed);
    });
}

/// Runs `tokens` three times on a committed session (the same batch writes the same
/// cells with the same values), asking for the logits of `rows`, then their arg-max, then
/// their top 5 candidates; the last two must be what the samplers take from the logits.
async fn replies_follow_the_logits(
    client: &WorkerClient,
    session: tether_protocol::SessionId,
    tokens: &[TokenPos],
    ids: &ForwardInput,
    rows: &[u32],
) {
    let out = client
        .forward(session, tokens, ids, rows, Rows::Logits)
        .await
        .expect("logits");
    let ForwardOutput::Logits(logits) = out else {
        panic!("asked for logits")
    };
    let vocab = logits.len() / rows.len();
    let greedy: Vec<u32> = logits
        .chunks(vocab)
        .map(tether_model::sampling::greedy)
        .collect();
    let out = client
        .forward(session, tokens, ids, rows, Rows::ArgMax)
        .await
        .expect("argmax");
    assert_eq!(out, ForwardOutput::ArgMax(greedy));
    // The top candidates of each row, as the sampler orders them.
    let (mut counts, mut candidates, mut row) = (Vec::new(), Vec::new(), Vec::new());
    for l in logits.chunks(vocab) {
        tether_model::sampling::top_candidates(l, 5, &mut row);
        counts.push(row.len() as u32);
        candidates.extend_from_slice(&row);
    }
    assert!(counts.iter().all(|&c| c == 5), "{counts:?}");
    let out = client
        .forward(session, tokens, ids, rows, Rows::Top(5))
        .await
        .expect("top 5");
    assert_eq!(out, ForwardOutput::Top { counts, candidates });
}

/// A tensor source that stops the upload at the first chunk of one tensor until released.
/// The client reads each tensor once for its digest, then once per chunk: the second read of
/// `stall_on` is its first chunk.
struct StallingSource {
    inner: std::sync::Arc<dyn tether_client::TensorSource>,
    stall_on: String,
    reads: AtomicUsize,
    stalled: Arc<AtomicUsize>,
    release: Arc<AtomicBool>,
}

impl tether_client::TensorSource for StallingSource {
    fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        if name == self.stall_on && self.reads.fetch_add(1, Ordering::SeqCst) == 1 {
            self.stalled.fetch_add(1, Ordering::SeqCst);
            let since = Instant::now();
            // Bounded: a test that fails elsewhere must not hang here.
            while !self.release.load(Ordering::SeqCst) && since.elapsed() < Duration::from_secs(60)
            {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        self.inner.tensor_bytes(name)
    }

    fn crc32(&self, name: &str) -> Option<u32> {
        self.inner.crc32(name)
    }
}

#[test]
fn clients_gone_mid_prepare_leave_no_staged_bytes_behind_a_reported_end() {
    const CLIENTS: usize = 16;
    let model = TinyModel::new();
    let worker = Worker::start(&[]);
    let pid = worker.pid();
    let stalled = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(AtomicBool::new(false));
    runtime().block_on(async {
        let client = WorkerClient::connect(&worker.addr, &ClientOptions::default()).await.expect("connect");
        let mut admin = AdminClient::connect(&worker.addr, None, &ClientOptions::default()).await.expect("admin");
        // One whole load first, so one-time allocations (thread pools, caches) are in the
        // baseline.
        let (warm, _) = committed_session(&client, attach_options("warm-up"), &model.path, 64).await;
        warm.close().await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let baseline_kb = rss_kb(pid);

        let mut sessions = Vec::new();
        let mut uploads = Vec::new();
        let mut staged_bytes = 0;
        for i in 0..CLIENTS {
            let session = client.attach(attach_options(&format!("gone-{i}"))).await.expect("attach");
            let (load, source, _) = full_load(&model.path, 64);
            let last = load.tensors.last().expect("tensors").clone();
            staged_bytes += load.tensors.iter().filter(|t| **t != last).map(|t| source.tensor_bytes(t).map_or(0, <[u8]>::len)).sum::<usize>();
            let source = Arc::new(StallingSource {
                inner: source,
                stall_on: last,
                reads: AtomicUsize::new(0),
                stalled: Arc::clone(&stalled),
                release: Arc::clone(&release),
            });
            let (addr, id) = (worker.addr.clone(), session.id());
            // Its own thread and runtime: the stalled source blocks them, as a client
            // process stuck reading its file would be.
            uploads.push(std::thread::spawn(move || {
                runtime().block_on(async {
                    let client = WorkerClient::connect(&addr, &ClientOptions::default()).await.expect("connect");
                    client.prepare(id, load, source).await
                })
            }));
            sessions.push(session);
        }
        let since = Instant::now();
        while stalled.load(Ordering::SeqCst) < CLIENTS {
            assert!(since.elapsed() < Duration::from_secs(30), "the uploads did not all reach their stall");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // The chunks before the stall have arrived once the worker's RSS holds them.
        let since = Instant::now();
        while (rss_kb(pid).saturating_sub(baseline_kb) as usize) < staged_bytes / 1024 / 2 {
            assert!(since.elapsed() < Duration::from_secs(10), "staged chunks never showed in the worker's RSS (baseline {baseline_kb} kB, now {} kB, {staged_bytes} bytes sent)", rss_kb(pid));
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let status = admin.status().await.expect("status");
        assert_eq!(status.sessions as usize, CLIENTS);
        assert!(status.session_bytes > 0);
        let staged_kb = rss_kb(pid);

        // Every client goes away mid-upload at once.
        drop(sessions);
        let dropped = Instant::now();
        let mut polls = 0;
        loop {
            let status = admin.status().await.expect("status");
            polls += 1;
            assert!(
                status.sessions > 0 || status.session_bytes == 0,
                "status reports 0 sessions while {} staged bytes are held ({:?} after the drop)",
                status.session_bytes,
                dropped.elapsed()
            );
            if (status.sessions, status.session_bytes) == (0, 0) {
                break;
            }
            assert!(dropped.elapsed() < Duration::from_secs(5), "sessions did not end: {status:?}");
        }
        let ended_after = dropped.elapsed();
        const BOUND_KB: u64 = 16 * 1024;
        let rss_back = loop {
            let now_kb = rss_kb(pid);
            if now_kb <= baseline_kb + BOUND_KB {
                break dropped.elapsed();
            }
            assert!(
                dropped.elapsed() < Duration::from_secs(2),
                "worker RSS {now_kb} kB is still over its baseline {baseline_kb} kB + {BOUND_KB} kB 2 s after the clients went away (staged: {staged_kb} kB)"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        println!(
            "{CLIENTS} clients gone mid-prepare: RSS baseline {baseline_kb} kB, staged {staged_kb} kB; sessions ended {ended_after:?} after ({polls} status polls), RSS back within {BOUND_KB} kB after {rss_back:?}"
        );
        release.store(true, Ordering::SeqCst);
        for upload in uploads {
            let result = upload.join().expect("upload thread");
            assert!(result.is_err(), "a Prepare of an ended session must fail");
        }
        let status = admin.status().await.expect("status");
        assert_eq!((status.sessions, status.session_bytes), (0, 0));
        assert_eq!(status.counters.disconnected as usize, CLIENTS);
    });
}
