//! Conversions between the wire types of `tether.v1` and the worker's own types.

use crate::block::BlockSpec;
use crate::error::WorkerError;
use crate::file_identity::FileIdentity;
use crate::prepare_timings::PrepareTimings;
use crate::session::EndReason;
use crate::status::{CounterValues, MemorySource, SessionSummary, WorkerStatus};
use tether_gguf::GgmlType;
use tether_proto::PROTOCOL_VERSION;
use tether_proto::v1 as pb;
use tonic::{Code, Status};

/// Metadata key (sent as a trailer) marking a Prepare refused because the worker would not
/// read the model from its own file; the client then streams the bytes.
pub const REFUSED_KEY: &str = "tether-refused";
/// The value of [`REFUSED_KEY`] for a refused local read.
pub const REFUSED_LOCAL_FILE: &str = "local-file";

/// The gRPC code for a domain error (data links send it too).
pub fn code_of(e: &WorkerError) -> Code {
    match e {
        WorkerError::NotFound(_) => Code::NotFound,
        WorkerError::InvalidArgument(_) => Code::InvalidArgument,
        WorkerError::FailedPrecondition(_) | WorkerError::LocalFile(_) => Code::FailedPrecondition,
        WorkerError::ResourceExhausted { .. } | WorkerError::OverLimit(_) => {
            Code::ResourceExhausted
        }
        WorkerError::Unavailable(_) => Code::Unavailable,
        WorkerError::Aborted(_) => Code::Aborted,
        WorkerError::Internal(_) => Code::Internal,
    }
}

/// The gRPC status for a domain error.
pub fn to_status(e: WorkerError) -> Status {
    let local_file = matches!(e, WorkerError::LocalFile(_));
    let mut status = Status::new(code_of(&e), e.to_string());
    if local_file {
        status.metadata_mut().insert(
            REFUSED_KEY,
            tonic::metadata::MetadataValue::from_static(REFUSED_LOCAL_FILE),
        );
    }
    status
}

/// The wire form of a file identity.
pub fn identity_to_proto(id: &FileIdentity) -> pb::FileIdentity {
    pb::FileIdentity {
        boot_id: id.boot_id.clone(),
        device: id.device,
        inode: id.inode,
        bytes: id.bytes,
        modified_ns: id.modified_ns,
    }
}

/// A file identity from the wire; any values are accepted, as they are only compared.
pub fn identity_from_proto(id: pb::FileIdentity) -> FileIdentity {
    FileIdentity {
        boot_id: id.boot_id,
        device: id.device,
        inode: id.inode,
        bytes: id.bytes,
        modified_ns: id.modified_ns,
    }
}

/// The wire form of a Prepare's timings.
pub fn timings_to_proto(t: &PrepareTimings) -> pb::PrepareTimings {
    let us = |d: std::time::Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    pb::PrepareTimings {
        plan_us: us(t.plan),
        allocate_us: us(t.allocate),
        read_us: us(t.read),
        checksum_us: us(t.checksum),
        upload_us: us(t.upload),
        finish_us: us(t.finish),
        tensor_bytes: t.tensor_bytes,
    }
}

/// A Prepare's timings from the wire (any values are accepted: they are only shown).
pub fn timings_from_proto(t: &pb::PrepareTimings) -> PrepareTimings {
    let us = std::time::Duration::from_micros;
    PrepareTimings {
        plan: us(t.plan_us),
        allocate: us(t.allocate_us),
        read: us(t.read_us),
        checksum: us(t.checksum_us),
        upload: us(t.upload_us),
        finish: us(t.finish_us),
        tensor_bytes: t.tensor_bytes,
    }
}

/// Refuses a peer speaking another protocol major version.
pub fn check_version(peer: u32) -> Result<(), WorkerError> {
    if peer == PROTOCOL_VERSION {
        return Ok(());
    }
    Err(WorkerError::FailedPrecondition(format!(
        "the peer speaks tether protocol v{peer}, this worker speaks v{PROTOCOL_VERSION}; run matching tether versions"
    )))
}

/// The wire form of an end reason.
pub fn reason_to_proto(r: EndReason) -> pb::EndReason {
    match r {
        EndReason::Closed => pb::EndReason::Closed,
        EndReason::Disconnected => pb::EndReason::Disconnected,
        EndReason::Reaped => pb::EndReason::Reaped,
        EndReason::Killed => pb::EndReason::Killed,
        EndReason::Shutdown => pb::EndReason::Shutdown,
    }
}

/// The domain form of an end reason; `None` for an unspecified or unknown value.
pub fn reason_from_proto(r: i32) -> Option<EndReason> {
    match pb::EndReason::try_from(r).ok()? {
        pb::EndReason::Closed => Some(EndReason::Closed),
        pb::EndReason::Disconnected => Some(EndReason::Disconnected),
        pb::EndReason::Reaped => Some(EndReason::Reaped),
        pb::EndReason::Killed => Some(EndReason::Killed),
        pb::EndReason::Shutdown => Some(EndReason::Shutdown),
        pb::EndReason::Unspecified => None,
    }
}

/// A block spec from the wire, checked for shape.
pub fn spec_from_proto(spec: Option<pb::StageSpec>) -> Result<BlockSpec, WorkerError> {
    let s = spec
        .ok_or_else(|| WorkerError::InvalidArgument("prepare: the stage spec is missing".into()))?;
    if s.first_layer > s.last_layer {
        return Err(WorkerError::InvalidArgument(format!(
            "prepare: first layer {} is after the end layer {}",
            s.first_layer, s.last_layer
        )));
    }
    if s.ctx_per_seq == 0 || s.n_seq == 0 || s.ubatch == 0 {
        return Err(WorkerError::InvalidArgument(format!(
            "prepare: ctx_per_seq ({}), n_seq ({}) and ubatch ({}) must all be positive",
            s.ctx_per_seq, s.n_seq, s.ubatch
        )));
    }
    let cache_k = cache_type_from_proto(s.cache_type_k, "K")?;
    let cache_v = cache_type_from_proto(s.cache_type_v, "V")?;
    Ok(BlockSpec {
        first_layer: s.first_layer as usize,
        last_layer: s.last_layer as usize,
        has_embed: s.has_embed,
        has_head: s.has_head,
        ctx_per_seq: s.ctx_per_seq as usize,
        n_seq: s.n_seq as usize,
        cached_seqs: s.cached_seqs as usize,
        ubatch: s.ubatch as usize,
        cache_k,
        cache_v,
    })
}

/// The cache type a wire value names; unset means f16, as peers before the field sent.
fn cache_type_from_proto(raw: i32, which: &str) -> Result<GgmlType, WorkerError> {
    match pb::KvCacheType::try_from(raw) {
        Ok(pb::KvCacheType::Unspecified | pb::KvCacheType::F16) => Ok(GgmlType::F16),
        Ok(pb::KvCacheType::Q80) => Ok(GgmlType::Q8_0),
        Ok(pb::KvCacheType::Q40) => Ok(GgmlType::Q4_0),
        Err(_) => Err(WorkerError::InvalidArgument(format!(
            "prepare: unknown {which} cache type {raw}: this worker knows f16, q8_0 and q4_0; upgrade it"
        ))),
    }
}

/// The wire value of a cache type; types no cache uses go as unset (f16), which
/// `tether_model` would refuse anyway.
fn cache_type_to_proto(ty: GgmlType) -> pb::KvCacheType {
    match ty {
        GgmlType::Q8_0 => pb::KvCacheType::Q80,
        GgmlType::Q4_0 => pb::KvCacheType::Q40,
        GgmlType::F16 => pb::KvCacheType::F16,
        _ => pb::KvCacheType::Unspecified,
    }
}

/// The wire form of a block spec.
pub fn spec_to_proto(s: &BlockSpec) -> pb::StageSpec {
    pb::StageSpec {
        first_layer: s.first_layer as u32,
        last_layer: s.last_layer as u32,
        has_embed: s.has_embed,
        has_head: s.has_head,
        ctx_per_seq: s.ctx_per_seq as u32,
        n_seq: s.n_seq as u32,
        cached_seqs: s.cached_seqs as u32,
        ubatch: s.ubatch as u32,
        cache_type_k: cache_type_to_proto(s.cache_k) as i32,
        cache_type_v: cache_type_to_proto(s.cache_v) as i32,
    }
}

/// f32 values from little-endian bytes.
pub fn f32s_from_le(bytes: &[u8], what: &str) -> Result<Vec<f32>, WorkerError> {
    if !bytes.len().is_multiple_of(4) {
        return Err(WorkerError::InvalidArgument(format!(
            "{what}: {} bytes is not a whole number of f32 values",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Little-endian bytes of f32 values.
pub fn f32s_to_le(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 4);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// The wire form of a worker status.
pub fn status_to_proto(s: &WorkerStatus) -> pb::StatusReply {
    let c = &s.counters;
    pb::StatusReply {
        worker_version: s.worker_version.clone(),
        device: s.device.clone(),
        device_total_bytes: s.device_total_bytes,
        device_free_bytes: s.device_free_bytes,
        baseline_used_bytes: s.baseline_used_bytes,
        max_memory_bytes: s.max_memory_bytes,
        sessions: s.sessions,
        session_bytes: s.session_bytes,
        unaccounted_bytes: s.unaccounted_bytes,
        counters: Some(pb::Counters {
            opened: c.opened,
            closed: c.closed,
            disconnected: c.disconnected,
            reaped: c.reaped,
            killed: c.killed,
            shutdown: c.shutdown,
            txn_timed_out: c.txn_timed_out,
        }),
        draining: s.draining,
        uptime_s: s.uptime_s,
        process_rss_bytes: s.process_rss_bytes,
        baseline_rss_bytes: s.baseline_rss_bytes,
        memory_source: s.memory_source.as_str().to_string(),
        process_device_bytes: s.process_device_bytes,
        baseline_process_device_bytes: s.baseline_process_device_bytes,
    }
}

/// The domain form of a worker status.
pub fn status_from_proto(s: pb::StatusReply) -> WorkerStatus {
    let c = s.counters.unwrap_or_default();
    WorkerStatus {
        worker_version: s.worker_version,
        device: s.device,
        device_total_bytes: s.device_total_bytes,
        device_free_bytes: s.device_free_bytes,
        baseline_used_bytes: s.baseline_used_bytes,
        max_memory_bytes: s.max_memory_bytes,
        sessions: s.sessions,
        session_bytes: s.session_bytes,
        unaccounted_bytes: s.unaccounted_bytes,
        memory_source: MemorySource::parse(&s.memory_source),
        process_device_bytes: s.process_device_bytes,
        baseline_process_device_bytes: s.baseline_process_device_bytes,
        counters: CounterValues {
            opened: c.opened,
            closed: c.closed,
            disconnected: c.disconnected,
            reaped: c.reaped,
            killed: c.killed,
            shutdown: c.shutdown,
            txn_timed_out: c.txn_timed_out,
        },
        draining: s.draining,
        uptime_s: s.uptime_s,
        process_rss_bytes: s.process_rss_bytes,
        baseline_rss_bytes: s.baseline_rss_bytes,
    }
}

/// The wire form of a session summary.
pub fn session_to_proto(s: &SessionSummary) -> pb::SessionInfo {
    pb::SessionInfo {
        session_id: s.session_id.clone(),
        client_name: s.client_name.clone(),
        bytes: s.bytes,
        layers: s.layers.clone(),
        ttl_ms: s.ttl_ms,
        last_heartbeat_ms_ago: s.last_heartbeat_ms_ago,
        age_ms: s.age_ms,
        prepared_txns: s.prepared_txns,
        kv_blocks: s.kv_blocks,
        kv_blocks_free: s.kv_blocks_free,
    }
}

/// The domain form of a session summary.
pub fn session_from_proto(s: pb::SessionInfo) -> SessionSummary {
    SessionSummary {
        session_id: s.session_id,
        client_name: s.client_name,
        bytes: s.bytes,
        layers: s.layers,
        ttl_ms: s.ttl_ms,
        last_heartbeat_ms_ago: s.last_heartbeat_ms_ago,
        age_ms: s.age_ms,
        prepared_txns: s.prepared_txns,
        kv_blocks: s.kv_blocks,
        kv_blocks_free: s.kv_blocks_free,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_bytes_round_trip_and_odd_lengths_fail() {
        let v = [1.5f32, -2.0, f32::MIN_POSITIVE];
        assert_eq!(f32s_from_le(&f32s_to_le(&v), "x").unwrap(), v);
        assert!(f32s_from_le(&[0; 5], "x").is_err());
    }

    #[test]
    fn exhaustion_keeps_asked_and_free_in_the_message() {
        let s = to_status(WorkerError::ResourceExhausted {
            what: "w".into(),
            asked: 5,
            free: 3,
            limit: 3,
            held: 0,
        });
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert!(s.message().contains("asked 5 bytes, 3 bytes free"));
        assert_eq!(
            to_status(WorkerError::NotFound("x".into())).code(),
            Code::NotFound
        );
    }

    #[test]
    fn version_mismatch_names_both_versions() {
        assert!(check_version(PROTOCOL_VERSION).is_ok());
        let msg = check_version(2).unwrap_err().to_string();
        assert!(msg.contains("v2") && msg.contains("v1"), "{msg}");
    }

    #[test]
    fn bad_specs_are_refused() {
        let good = pb::StageSpec {
            first_layer: 0,
            last_layer: 1,
            has_embed: false,
            has_head: false,
            ctx_per_seq: 8,
            n_seq: 1,
            cached_seqs: 0,
            ubatch: 4,
            cache_type_k: 0,
            cache_type_v: 0,
        };
        assert!(spec_from_proto(Some(good)).is_ok());
        assert!(spec_from_proto(None).is_err());
        assert!(
            spec_from_proto(Some(pb::StageSpec {
                first_layer: 2,
                ..good
            }))
            .is_err()
        );
        assert!(spec_from_proto(Some(pb::StageSpec { ubatch: 0, ..good })).is_err());
        let unknown = pb::StageSpec {
            cache_type_v: 99,
            ..good
        };
        let err = spec_from_proto(Some(unknown)).unwrap_err().to_string();
        assert!(err.contains("V cache type 99"), "{err}");
    }

    #[test]
    fn cache_types_round_trip_and_default_to_f16() {
        let old_peer = pb::StageSpec {
            first_layer: 0,
            last_layer: 2,
            has_embed: true,
            has_head: true,
            ctx_per_seq: 8,
            n_seq: 1,
            cached_seqs: 0,
            ubatch: 4,
            cache_type_k: 0,
            cache_type_v: 0,
        };
        let spec = spec_from_proto(Some(old_peer)).unwrap();
        assert_eq!((spec.cache_k, spec.cache_v), (GgmlType::F16, GgmlType::F16));
        for (k, v) in [
            (GgmlType::Q8_0, GgmlType::Q8_0),
            (GgmlType::Q4_0, GgmlType::Q4_0),
            (GgmlType::Q8_0, GgmlType::F16),
            (GgmlType::F16, GgmlType::Q4_0),
        ] {
            let sent = BlockSpec {
                cache_k: k,
                cache_v: v,
                ..spec
            };
            let wire = spec_to_proto(&sent);
            // Through the bytes an old or new peer would read.
            let bytes = prost::Message::encode_to_vec(&wire);
            let read: pb::StageSpec = prost::Message::decode(bytes.as_slice()).unwrap();
            assert_eq!(spec_from_proto(Some(read)).unwrap(), sent);
        }
    }
}
