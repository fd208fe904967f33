//! A client's session over a real worker: a runtime for its calls, its lease, and a Prepare
//! of a whole model.

use std::time::Duration;

/// Tensor bytes straight from a GGUF file.
pub struct GgufSource(pub tether_gguf::GgufFile);

impl tether_client::TensorSource for GgufSource {
    fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        self.0.tensor(name).map(|t| self.0.tensor_data(t))
    }
}

/// A single-threaded runtime for a test's client calls.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Attach options for client `name`: heartbeats every 200 ms, a 5 s lease.
pub fn attach_options(name: &str) -> tether_client::AttachOptions {
    tether_client::AttachOptions {
        client_name: name.into(),
        lease: tether_protocol::Lease {
            heartbeat_interval: Duration::from_millis(200),
            ttl: Duration::from_secs(5),
        },
        heartbeat: true,
    }
}

/// A session attached with `options`, serving every layer of `model` for `ctx` cells
/// (`full_load`), committed; returns it and the bytes it reserved.
pub async fn committed_session(
    client: &tether_client::WorkerClient,
    options: tether_client::AttachOptions,
    model: &std::path::Path,
    ctx: usize,
) -> (tether_client::Session, u64) {
    let session = client.attach(options).await.expect("attach");
    let (load, source, _) = full_load(model, ctx);
    let txn = load.txn;
    let reserved = client
        .prepare(session.id(), load, source)
        .await
        .expect("prepare");
    client.commit(session.id(), txn).await.expect("commit");
    (session, reserved)
}

/// A Prepare of every layer of `model` (with embedding and head), and its tensor source.
pub fn full_load(
    model: &std::path::Path,
    ctx: usize,
) -> (
    tether_client::LoadRequest,
    std::sync::Arc<dyn tether_client::TensorSource>,
    usize,
) {
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
    let tensors = tether_model::required_tensors(&cfg, &spec, file.tensors())
        .expect("required tensors")
        .into_iter()
        .map(|s| s.name)
        .collect();
    let bytes = std::fs::read(model).expect("read model");
    let request = tether_client::LoadRequest {
        txn: tether_protocol::TxnId::new_random(),
        gguf_header: bytes[..file.data_offset() as usize].to_vec(),
        gguf_file_bytes: bytes.len() as u64,
        spec: tether_protocol::BlockSpec {
            first_layer: spec.first_layer,
            last_layer: spec.last_layer,
            has_embed: true,
            has_head: true,
            ctx_per_seq: ctx,
            n_seq: 1,
            cached_seqs: 0,
            ubatch: 8,
            cache_k: tether_gguf::GgmlType::F16,
            cache_v: tether_gguf::GgmlType::F16,
        },
        tensors,
        decision_timeout: None,
        chunk_bytes: 64 << 10,
        local_path: None,
        same_file: None,
    };
    (request, std::sync::Arc::new(GgufSource(file)), cfg.n_embd)
}
