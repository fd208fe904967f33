//! Valid (and a few deliberately wrong) inputs for each target, the starting points of the
//! committed corpus: GGUF files from our writer, encoded requests as a coordinator sends
//! them. `cargo test -p tether-fuzz --test fuzz_corpus -- --ignored write_corpus` writes
//! them under `fuzz/corpus/`.

use crate::Target;
use crate::model::{TinyModel, frame, head_only_spec, serving_spec};
use crate::rig::{PREPARED_TXN, SESSION_PLACEHOLDER};
use prost::Message;
use std::path::Path;
use tether_gguf::{GgmlType, GgufWriter, MetaArray, MetaValue};
use tether_proto::PROTOCOL_VERSION;
use tether_proto::v1 as pb;

/// A named seed.
pub type Seed = (&'static str, Vec<u8>);

/// The seeds of `target`; `model` is the rig's tiny model.
pub fn seeds(target: Target, model: &TinyModel) -> Result<Vec<Seed>, String> {
    Ok(match target {
        Target::Gguf => gguf_seeds(model)?,
        Target::Hello => vec![
            ("current", hello(PROTOCOL_VERSION)),
            ("next_major", hello(PROTOCOL_VERSION + 1)),
        ],
        Target::Attach => attach_seeds(),
        Target::Prepare => prepare_seeds(model),
        Target::Commit | Target::Abort => vec![
            ("prepared_txn", decision(SESSION_PLACEHOLDER, PREPARED_TXN)),
            (
                "other_txn",
                decision(SESSION_PLACEHOLDER, "6f7a7a00-0000-4000-8000-0000000000ff"),
            ),
            ("not_uuids", decision("session?", "txn?")),
        ],
        Target::Forward => forward_seeds(model),
        Target::KvClear => vec![
            ("seq0", kv_clear(0)),
            ("seq1", kv_clear(1)),
            ("no_such_seq", kv_clear(7)),
        ],
        Target::KvTruncate => vec![
            ("seq0_keep4", kv_truncate(0, 4)),
            ("seq1_keep0", kv_truncate(1, 0)),
            ("beyond_ctx", kv_truncate(0, 1000)),
        ],
        Target::Admin => vec![
            ("kill_fresh", kill(SESSION_PLACEHOLDER)),
            ("kill_unknown", kill("6f7a7a00-0000-4000-8000-0000000000aa")),
        ],
        Target::DataLink => data_link_seeds(model),
    })
}

/// Request bodies as a coordinator's link sends them (the serving session is implied by
/// the link), and a hello.
fn data_link_seeds(model: &TinyModel) -> Vec<Seed> {
    use tether_protocol::{ForwardCall, ForwardInput, Rows, TokenPos};
    let tokens = |n: u32| {
        (0..n)
            .map(|pos| TokenPos { seq: 0, pos })
            .collect::<Vec<_>>()
    };
    let call = |n, input, logits_rows: Vec<u32>, rows| {
        tether_protocol::link::request_body(&ForwardCall {
            tokens: tokens(n),
            input,
            logits_rows,
            rows,
            targets: Vec::new(),
        })
    };
    let hidden = (0..2 * model.config.n_embd)
        .map(|i| (i % 13) as f32 * 0.1 - 0.6)
        .collect();
    let id = tether_protocol::SessionId(uuid::Uuid::from_u128(
        0x6f7a7a00_0000_4000_8000_0000000000bb,
    ));
    vec![
        (
            "ids_to_argmax",
            call(
                3,
                ForwardInput::TokenIds(vec![1, 2, 3]),
                vec![2],
                Rows::ArgMax,
            ),
        ),
        (
            "hidden_to_hidden",
            call(2, ForwardInput::Hidden(hidden), vec![], Rows::Logits),
        ),
        (
            "ids_to_top5",
            call(
                2,
                ForwardInput::TokenIds(vec![4, 5]),
                vec![0, 1],
                Rows::Top(5),
            ),
        ),
        ("hello", tether_protocol::link::hello_body(id, b"token")),
    ]
}

/// Writes every target's seeds to `dir/<target>/<seed>`. Other files there (inputs that
/// found bugs, added by hand) stay.
pub fn write_corpus(dir: &Path, model: &TinyModel) -> Result<usize, String> {
    let mut written = 0;
    for target in Target::ALL {
        let sub = dir.join(target.name());
        std::fs::create_dir_all(&sub).map_err(|e| format!("{}: {e}", sub.display()))?;
        for (name, bytes) in seeds(target, model)? {
            let path = sub.join(name);
            std::fs::write(&path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
            written += 1;
        }
    }
    Ok(written)
}

fn gguf_seeds(model: &TinyModel) -> Result<Vec<Seed>, String> {
    let finish = |w: GgufWriter, name: &str| {
        let mut out = Vec::new();
        w.write_to(&mut out, name).map_err(|e| e.to_string())?;
        Ok::<_, String>(out)
    };

    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", MetaValue::String("llama".into()));
    w.add_metadata("k.u8", MetaValue::U8(7));
    w.add_metadata("k.i8", MetaValue::I8(-7));
    w.add_metadata("k.u16", MetaValue::U16(700));
    w.add_metadata("k.i16", MetaValue::I16(-700));
    w.add_metadata("k.u32", MetaValue::U32(70_000));
    w.add_metadata("k.i32", MetaValue::I32(-70_000));
    w.add_metadata("k.f32", MetaValue::F32(0.5));
    w.add_metadata("k.bool", MetaValue::Bool(true));
    w.add_metadata("k.u64", MetaValue::U64(1 << 40));
    w.add_metadata("k.i64", MetaValue::I64(-(1 << 40)));
    w.add_metadata("k.f64", MetaValue::F64(-2.25));
    w.add_metadata(
        "k.strings",
        MetaValue::Array(MetaArray::strings(["<s>", "</s>", "▁a", "bc"])),
    );
    w.add_metadata(
        "k.nested",
        // The empty array's element type is u8, as the seeds were first written.
        MetaValue::Array(MetaArray::Array(vec![
            MetaArray::U32(vec![1, 2]),
            MetaArray::U8(vec![]),
        ])),
    );
    let add = |w: &mut GgufWriter, name: &str, ty: GgmlType, dims: &[u64]| {
        let elems: u64 = dims.iter().product();
        let bytes = ty.bytes_for(elems).unwrap_or(0) as usize;
        let data = (0..bytes).map(|i| (i * 37 % 251) as u8).collect();
        w.add_tensor(name, ty, dims, data)
            .map_err(|e| e.to_string())
    };
    add(&mut w, "t.f32", GgmlType::F32, &[4, 2])?;
    add(&mut w, "t.f16", GgmlType::F16, &[8])?;
    add(&mut w, "t.q4_0", GgmlType::Q4_0, &[32, 2])?;
    add(&mut w, "t.q8_0", GgmlType::Q8_0, &[32])?;
    add(&mut w, "t.q4_k", GgmlType::Q4K, &[256])?;
    add(&mut w, "t.q6_k", GgmlType::Q6K, &[256])?;
    let kinds = finish(w, "kinds")?;

    let mut w = GgufWriter::new();
    w.set_alignment(64).map_err(|e| e.to_string())?;
    w.add_metadata("general.name", MetaValue::String("aligned".into()));
    add(&mut w, "a", GgmlType::BF16, &[16])?;
    add(&mut w, "b", GgmlType::Q5_1, &[32])?;
    let aligned = finish(w, "aligned")?;

    let empty = finish(GgufWriter::new(), "empty")?;
    Ok(vec![
        ("metadata_kinds_and_tensor_types", kinds),
        ("alignment_64", aligned),
        ("empty", empty),
        // A real model's header without its data: hyper-parameters and a tokenizer.
        ("tiny_llama_header", model.header().to_vec()),
    ])
}

fn hello(version: u32) -> Vec<u8> {
    pb::HelloRequest {
        protocol_version: version,
        client_version: "tether 0.1.0".into(),
    }
    .encode_to_vec()
}

fn attach_seeds() -> Vec<Seed> {
    let request = |kind| frame(&pb::AttachRequest { kind: Some(kind) });
    let open = |heartbeat_interval_ms, ttl_ms| {
        request(pb::attach_request::Kind::Open(pb::Open {
            protocol_version: PROTOCOL_VERSION,
            client_name: "fuzz-client".into(),
            heartbeat_interval_ms,
            ttl_ms,
        }))
    };
    let beat = |seq| request(pb::attach_request::Kind::Heartbeat(pb::Heartbeat { seq }));
    let close = request(pb::attach_request::Kind::Close(pb::Close {}));
    vec![
        (
            "open_beat_close",
            [open(50, 500), beat(1), beat(2), close.clone()].concat(),
        ),
        ("open_then_end", open(0, 0)),
        ("heartbeat_first", [beat(1), close.clone()].concat()),
        ("open_open", [open(20, 100), open(20, 100)].concat()),
    ]
}

fn prepare_seeds(model: &TinyModel) -> Vec<Seed> {
    let request = |kind| frame(&pb::PrepareRequest { kind: Some(kind) });
    let end = request(pb::prepare_request::Kind::End(pb::PrepareEnd {}));
    let head = head_only_spec();
    let begin = |spec| {
        request(pb::prepare_request::Kind::Begin(model.begin(
            SESSION_PLACEHOLDER,
            PREPARED_TXN,
            spec,
        )))
    };
    // A block too large for the rig's memory limit: refused by the ledger.
    let too_big = pb::StageSpec {
        ctx_per_seq: 1 << 20,
        n_seq: 64,
        cached_seqs: 0,
        ..serving_spec()
    };
    // Before the header-only reader, the worker allocated the file length named here (1 TiB)
    // to check the header; this failed the allocation check.
    let mut huge_file = model.begin(SESSION_PLACEHOLDER, PREPARED_TXN, head);
    huge_file.gguf_file_bytes = 1 << 40;
    let huge_file = request(pb::prepare_request::Kind::Begin(huge_file));
    vec![
        ("huge_file_bytes", [huge_file, end.clone()].concat()),
        (
            "head_complete",
            model.prepare_frames(SESSION_PLACEHOLDER, PREPARED_TXN, head),
        ),
        ("head_without_chunks", [begin(head), end.clone()].concat()),
        ("whole_model_begin_only", begin(serving_spec())),
        ("too_big_for_memory", [begin(too_big), end].concat()),
    ]
}

fn decision(session: &str, txn: &str) -> Vec<u8> {
    pb::Decision {
        session_id: session.into(),
        txn_id: txn.into(),
    }
    .encode_to_vec()
}

fn forward_seeds(model: &TinyModel) -> Vec<Seed> {
    let n_embd = model.config.n_embd;
    let tokens = |n: u32| {
        (0..n)
            .map(|i| pb::BatchToken {
                seq: i % 2,
                pos: i / 2,
            })
            .collect::<Vec<_>>()
    };
    let hidden: Vec<u8> = (0..3 * n_embd)
        .flat_map(|i| ((i % 17) as f32 * 0.1 - 0.8).to_le_bytes())
        .collect();
    let request = |tokens, hidden, token_ids, logits_rows| {
        pb::ForwardRequest {
            session_id: SESSION_PLACEHOLDER.into(),
            tokens,
            hidden,
            token_ids,
            logits_rows,
            argmax: false,
            top_k: 0,
            logprobs: false,
            logprobs_k: 0,
            targets: vec![],
            embeddings: false,
        }
        .encode_to_vec()
    };
    vec![
        (
            "hidden_in_hidden_out",
            request(tokens(3), hidden, vec![], vec![]),
        ),
        (
            "ids_to_logits",
            request(tokens(4), vec![], vec![1, 2, 3, 300], vec![2, 3]),
        ),
        (
            "ids_to_hidden",
            request(tokens(2), vec![], vec![5, 6], vec![]),
        ),
        // Repeated logits rows, one byte each on the wire and n_vocab floats each of
        // output: before the worker bounded them, this failed the allocation check.
        (
            "repeated_logits_rows",
            request(tokens(2), vec![], vec![5, 6], vec![1; 60_000]),
        ),
    ]
}

fn kv_clear(seq: u32) -> Vec<u8> {
    pb::KvClearRequest {
        session_id: SESSION_PLACEHOLDER.into(),
        seq,
    }
    .encode_to_vec()
}

fn kv_truncate(seq: u32, length: u32) -> Vec<u8> {
    pb::KvTruncateRequest {
        session_id: SESSION_PLACEHOLDER.into(),
        seq,
        length,
    }
    .encode_to_vec()
}

fn kill(session: &str) -> Vec<u8> {
    pb::KillSessionRequest {
        session_id: session.into(),
    }
    .encode_to_vec()
}
