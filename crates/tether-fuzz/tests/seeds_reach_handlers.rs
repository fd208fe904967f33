//! The valid seeds get past decoding and validation into the worker's real work, so the
//! mutations built on them explore the handlers and not only their first checks. Fails
//! when a wire or model change leaves the committed corpus stale; regenerate it then.

use prost::Message;
use tether_fuzz::Target;
use tether_fuzz::rig::{Rig, prepare_stream, substitute};
use tether_fuzz::seeds::seeds;
use tether_proto::v1 as pb;
use tether_proto::v1::worker_server::Worker;
use tonic::Request;

/// The tests share one worker and check its session count: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn seed(target: Target, name: &str) -> Vec<u8> {
    let rig = Rig::get();
    let all = seeds(target, &rig.model).unwrap();
    let (_, bytes) = all.into_iter().find(|(n, _)| *n == name).unwrap();
    let committed = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target.name())
        .join(name);
    assert_eq!(
        std::fs::read(&committed).ok().as_deref(),
        Some(bytes.as_slice()),
        "{} differs from its seed; regenerate the corpus",
        committed.display()
    );
    bytes
}

#[test]
fn valid_forward_seeds_are_served() {
    let _serial = serial();
    let rig = Rig::get();
    for name in ["hidden_in_hidden_out", "ids_to_logits", "ids_to_hidden"] {
        let mut req = pb::ForwardRequest::decode(seed(Target::Forward, name).as_slice()).unwrap();
        substitute(&mut req.session_id, rig.serving());
        let reply = rig
            .run("forward", rig.worker().forward(Request::new(req)))
            .unwrap();
        let reply = reply.unwrap_or_else(|s| panic!("{name}: {s}")).into_inner();
        assert!(
            !reply.hidden.is_empty() || !reply.logits.is_empty(),
            "{name}"
        );
    }
    let mut req =
        pb::ForwardRequest::decode(seed(Target::Forward, "repeated_logits_rows").as_slice())
            .unwrap();
    substitute(&mut req.session_id, rig.serving());
    let refused = rig
        .run("forward", rig.worker().forward(Request::new(req)))
        .unwrap()
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused}");
}

#[test]
fn valid_data_link_seeds_are_served() {
    use tether_protocol::ForwardOutput;
    let _serial = serial();
    let rig = Rig::get();
    let serve = |name| {
        tether_worker::link::serve_request(
            &rig.registry,
            rig.serving(),
            &seed(Target::DataLink, name),
        )
        .unwrap()
        .unwrap_or_else(|refused| panic!("seed {name} refused: {refused}"))
    };
    assert!(matches!(serve("ids_to_argmax"), ForwardOutput::ArgMax(ids) if ids.len() == 1));
    let n_embd = rig.model.config.n_embd;
    assert!(matches!(serve("hidden_to_hidden"), ForwardOutput::Hidden(h) if h.len() == 2 * n_embd));
    assert!(matches!(serve("ids_to_top5"), ForwardOutput::Top { counts, .. } if counts == [5, 5]));
    let hello = tether_protocol::link::hello_session(&seed(Target::DataLink, "hello"));
    assert!(hello.is_ok(), "{hello:?}");
}

#[test]
fn the_complete_prepare_seed_loads_and_commits() {
    let _serial = serial();
    let rig = Rig::get();
    let session = rig.fresh_session().unwrap();
    let frames = seed(Target::Prepare, "head_complete");
    let reply = rig
        .run(
            "prepare",
            rig.worker()
                .prepare(Request::new(prepare_stream(&frames, session))),
        )
        .unwrap()
        .unwrap()
        .into_inner();
    assert!(reply.reserved_bytes > 0);
    let bytes = |id: String| {
        rig.registry
            .sessions()
            .into_iter()
            .find(|s| s.session_id == id)
            .map(|s| s.bytes)
    };
    assert_eq!(bytes(session.to_string()), Some(reply.reserved_bytes));
    rig.end(session);
    assert_eq!(bytes(session.to_string()), None);
}

#[test]
fn the_prepared_decision_seed_commits() {
    let _serial = serial();
    let rig = Rig::get();
    let session = rig.fresh_session().unwrap();
    rig.prepare_txn(session).unwrap();
    let mut req = pb::Decision::decode(seed(Target::Commit, "prepared_txn").as_slice()).unwrap();
    substitute(&mut req.session_id, session);
    let reply = rig
        .run("commit", rig.worker().commit(Request::new(req)))
        .unwrap()
        .unwrap()
        .into_inner();
    assert_eq!(reply.state, pb::TxnState::Committed as i32);
    rig.end(session);
}

#[test]
fn every_target_runs_its_corpus_cleanly() {
    let _serial = serial();
    for target in Target::ALL {
        let rig = Rig::get();
        for (name, bytes) in seeds(target, &rig.model).unwrap() {
            target
                .run(&bytes)
                .unwrap_or_else(|f| panic!("{} seed {name}: {f}", target.name()));
        }
    }
}
