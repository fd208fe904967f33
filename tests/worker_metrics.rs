//! A real worker's observability: its Prometheus endpoint follows a session through load,
//! forward, kill and close; the bytes a committed block holds are exactly what the planner
//! (`tether plan`'s `plan_stage`) says; gRPC health turns NOT_SERVING on drain.

mod support;

use support::{
    TinyModel, Worker, attach_options, committed_session, metrics_addr, runtime, sample, scrape,
};
use tether_client::{AdminClient, ClientOptions, Health, WorkerClient, check_health};
use tether_protocol::{EndReason, ForwardInput, ForwardOutput, Rows, TokenPos};

fn value(text: &str, series: &str) -> f64 {
    sample(text, series).unwrap_or_else(|| panic!("no series {series} in:\n{text}"))
}

/// What the planner says the block of `full_load(model, ctx)` holds, computed here from
/// the file, independently of the worker.
fn planned_total(model: &std::path::Path, ctx: usize) -> u64 {
    let file = tether_gguf::GgufFile::open(model).expect("open model");
    let cfg = tether_model::ModelConfig::from_gguf(&file).expect("model config");
    let spec = tether_model::StageSpec {
        first_layer: 0,
        last_layer: cfg.n_layer,
        has_embed: true,
        has_head: true,
        ctx_per_seq: ctx,
        n_seq: 1,
        cached_seqs: 0,
        ubatch: 8,
        cache_k: tether_gguf::GgmlType::F16,
        cache_v: tether_gguf::GgmlType::F16,
    };
    let slots =
        tether_model::required_tensors(&cfg, &spec, file.tensors()).expect("required tensors");
    tether_model::plan_stage(&cfg, &spec, &slots).total_bytes
}

#[test]
fn metrics_follow_a_session_and_health_follows_drain_and_undrain() {
    let model = TinyModel::new();
    let worker = Worker::start(&["--metrics-listen", "127.0.0.1:0"]);
    let metrics = metrics_addr(&worker);
    let before = scrape(&metrics);
    assert_eq!(value(&before, "tether_sessions"), 0.0);
    assert_eq!(value(&before, "tether_forward_seconds_count"), 0.0);
    assert_eq!(
        value(&before, "tether_txn_total{op=\"prepare\",result=\"ok\"}"),
        0.0
    );
    assert!(value(&before, "tether_device_bytes{kind=\"total\"}") > 0.0);
    assert!(value(&before, "tether_process_resident_bytes{when=\"baseline\"}") > 0.0);

    runtime().block_on(async {
        let options = ClientOptions::default();
        assert_eq!(
            check_health(&worker.addr, "", &options)
                .await
                .expect("health"),
            Health::Serving
        );
        let client = WorkerClient::connect(&worker.addr, &options)
            .await
            .expect("connect");
        let mut admin = AdminClient::connect(&worker.addr, None, &options)
            .await
            .expect("admin");
        let ctx = 32;
        let (session, reserved) =
            committed_session(&client, attach_options("metrics-e2e"), &model.path, ctx).await;
        let planned = planned_total(&model.path, ctx);
        assert_eq!(
            reserved, planned,
            "a committed block holds exactly what the planner says"
        );
        println!("the committed block holds {planned} bytes, as planned");
        let held = admin.sessions().await.expect("sessions")[0].bytes;
        assert_eq!(held, planned);
        let tokens = [TokenPos { seq: 0, pos: 0 }, TokenPos { seq: 0, pos: 1 }];
        let out = client
            .forward(
                session.id(),
                &tokens,
                &ForwardInput::TokenIds(vec![1, 2]),
                &[1],
                Rows::Logits,
            )
            .await
            .expect("forward");
        assert!(matches!(out, ForwardOutput::Logits(_)));

        let live = scrape(&metrics);
        let session_series = format!(
            "tether_session_bytes{{session=\"{}\",client=\"metrics-e2e\"}}",
            session.id()
        );
        assert_eq!(value(&live, &session_series), planned as f64);
        assert_eq!(value(&live, "tether_sessions"), 1.0);
        assert_eq!(
            value(&live, "tether_txn_total{op=\"prepare\",result=\"ok\"}"),
            1.0
        );
        assert_eq!(
            value(&live, "tether_txn_total{op=\"commit\",result=\"ok\"}"),
            1.0
        );
        assert_eq!(value(&live, "tether_forward_seconds_count"), 1.0);
        assert!(value(&live, "tether_forward_seconds_sum") > 0.0);

        // A commit of a transaction the worker never saw is refused and counted so.
        assert!(
            client
                .commit(session.id(), tether_protocol::TxnId::new_random())
                .await
                .is_err()
        );
        let victim = client
            .attach(attach_options("victim"))
            .await
            .expect("attach");
        admin.kill(victim.id()).await.expect("kill");

        let end = session.close().await;
        assert_eq!((end.reason, end.bytes_freed), (EndReason::Closed, planned));
        let after = scrape(&metrics);
        assert_eq!(sample(&after, &session_series), None, "{after}");
        assert_eq!(value(&after, "tether_sessions"), 0.0);
        assert_eq!(
            value(&after, "tether_sessions_ended_total{reason=\"closed\"}"),
            1.0
        );
        assert_eq!(
            value(&after, "tether_sessions_ended_total{reason=\"killed\"}"),
            1.0
        );
        assert_eq!(value(&after, "tether_reaped_total"), 0.0);
        assert_eq!(
            value(&after, "tether_txn_total{op=\"commit\",result=\"refused\"}"),
            1.0
        );
        let status = admin.status().await.expect("status");
        assert_eq!(status.session_bytes, 0);
        println!(
            "after close: RSS {} bytes, baseline {} bytes, unaccounted {} bytes",
            status.process_rss_bytes, status.baseline_rss_bytes, status.unaccounted_bytes
        );
        // What remains is the worker's own growth since start (runtime, connections,
        // allocator arenas): a few MiB, bounded.
        assert!(
            status.unaccounted_bytes < 32 << 20,
            "unaccounted {} bytes after every session ended",
            status.unaccounted_bytes
        );
        assert!(value(&after, "tether_unaccounted_bytes") < (32u64 << 20) as f64);

        admin.drain().await.expect("drain");
        assert_eq!(
            check_health(&worker.addr, "", &options)
                .await
                .expect("health"),
            Health::NotServing
        );
        assert_eq!(
            check_health(&worker.addr, "tether.v1.Worker", &options)
                .await
                .expect("health"),
            Health::NotServing
        );
        assert_eq!(value(&scrape(&metrics), "tether_draining"), 1.0);

        assert!(admin.undrain().await.expect("undrain"), "it was draining");
        assert_eq!(
            check_health(&worker.addr, "", &options)
                .await
                .expect("health"),
            Health::Serving
        );
        assert_eq!(value(&scrape(&metrics), "tether_draining"), 0.0);
        assert!(
            !admin.undrain().await.expect("undrain"),
            "it drains no more"
        );
    });
}

#[test]
fn metrics_are_off_unless_asked_for() {
    let worker = Worker::start(&[]);
    let log = worker.log();
    assert!(!log.contains("metrics on"), "{log}");
}
