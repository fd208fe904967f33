//! One worker's Prepare within a load: from its own copy of the model when it has one
//! (the very file the coordinator mapped, or with CRC-32s), else by streaming the bytes.

use super::BytesVia;
use crate::progress::LoadProgress;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};
use tether_client::{ClientError, ErrorKind, LoadRequest, Prepared, TensorSource, WorkerClient};
use tether_protocol::{FileIdentity, SessionId, TxnId};

/// One worker's vote in Prepare: the transaction it prepared (a fallback to streaming
/// prepares under a fresh id), and what it prepared and the way the tensors came, or why
/// it refused.
pub(super) struct Vote {
    pub(super) txn: TxnId,
    pub(super) result: Result<(Prepared, BytesVia), ClientError>,
    /// Time spent on Prepares from the worker's own copy that it refused.
    pub(super) refused_local: Option<Duration>,
}

/// What one worker's Prepare needs.
pub(super) struct PrepareJob<'a> {
    pub(super) client: &'a WorkerClient,
    pub(super) session: SessionId,
    pub(super) request: LoadRequest,
    pub(super) source: Arc<dyn TensorSource>,
    pub(super) sent: Arc<AtomicU64>,
    pub(super) total: u64,
    pub(super) path_on_workers: Option<&'a str>,
    /// The identity of the coordinator's copy, for workers on this machine.
    pub(super) same_file: Option<&'a FileIdentity>,
    pub(super) progress: Option<&'a LoadProgress>,
}

/// Prepares one worker: from its own copy of the model when a path is given and it agrees
/// (as the very file this coordinator mapped, without checksums, when the worker is on
/// this machine and the path names that file here; else with CRC-32s), else (or after it refused, with a warning) by
/// streaming the bytes.
pub(super) async fn prepare_worker(job: PrepareJob<'_>) -> Vote {
    let PrepareJob {
        client,
        session,
        mut request,
        source,
        sent,
        total,
        path_on_workers,
        same_file,
        progress,
    } = job;
    let addr = client.addr();
    let mut refused_local: Option<Duration> = None;
    let local_tries: Vec<(&str, Option<FileIdentity>)> =
        path_on_workers.map_or(Vec::new(), |path| {
            let same_host = same_file
                .filter(|id| on_this_host(addr) && names_this_file(path, id))
                .cloned();
            // Asked once: a worker on this machine that will not read the very file the path
            // names here (outside its --model-dir, none given) would not read it with CRC-32s.
            vec![(path, same_host)]
        });
    for (path, same_file) in local_tries {
        let checked = if same_file.is_some() {
            "the very file this coordinator mapped"
        } else {
            "its CRC-32s checked"
        };
        let local = LoadRequest {
            local_path: Some(path.to_string()),
            same_file,
            ..request.clone()
        };
        let trying = Instant::now();
        match client
            .prepare_timed(session, local, Arc::clone(&source), Arc::default())
            .await
        {
            Ok(prepared) => {
                if let Some(p) = progress {
                    p.mark_read_by_worker(addr);
                }
                tracing::info!(worker = %addr, path, bytes = total, "worker {addr} read its tensors from its own copy of the model ({checked})");
                return Vote {
                    txn: request.txn,
                    result: Ok((prepared, BytesVia::WorkerFile)),
                    refused_local,
                };
            }
            Err(e) if e.kind() == ErrorKind::LocalFileRefused => {
                tracing::warn!(worker = %addr, path, "worker {addr} did not read the model from its own copy ({checked}): {e}");
                *refused_local.get_or_insert_default() += trying.elapsed();
            }
            Err(e) => {
                return Vote {
                    txn: request.txn,
                    result: Err(e),
                    refused_local,
                };
            }
        }
        // The refused transaction is aborted on the worker; ids are used once.
        request.txn = TxnId::new_random();
    }
    let txn = request.txn;
    let result = client
        .prepare_timed(session, request, source, sent)
        .await
        .map(|prepared| {
            tracing::info!(worker = %addr, bytes = total, "streamed the tensors of worker {addr}'s block from the coordinator");
            (prepared, BytesVia::Stream)
        });
    Vote {
        txn,
        result,
        refused_local,
    }
}

/// Whether `addr` (host:port) names this machine by a loopback address: only there can
/// the worker's file be the one this coordinator mapped. A worker elsewhere would refuse
/// the identity anyway (another boot id); asking costs it a round trip and a warning.
fn on_this_host(addr: &str) -> bool {
    let host = addr
        .rsplit_once(':')
        .map_or(addr, |(host, _)| host)
        .trim_start_matches('[')
        .trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Whether `path`, read on this machine, is the file `id` names: only an absolute path can
/// be (a relative one is resolved in the worker's `--model-dir`, unknown here). A copy
/// elsewhere on the disk is not, and is sent CRC-32s without a refused try first.
fn names_this_file(path: &str, id: &FileIdentity) -> bool {
    std::path::Path::new(path).is_absolute()
        && std::fs::File::open(path)
            .ok()
            .and_then(|f| FileIdentity::of(&f))
            .is_some_and(|found| id.differs(&found).is_none())
}

#[cfg(test)]
mod tests {
    use super::{names_this_file, on_this_host};
    use tether_protocol::FileIdentity;

    #[test]
    fn only_an_absolute_path_to_the_same_file_names_it() {
        let dir = std::env::temp_dir().join(format!("tether-names-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a.gguf"), dir.join("b.gguf"));
        std::fs::write(&a, b"model").unwrap();
        std::fs::write(&b, b"model").unwrap();
        if let Some(id) = FileIdentity::of(&std::fs::File::open(&a).unwrap()) {
            assert!(names_this_file(a.to_str().unwrap(), &id));
            assert!(!names_this_file(b.to_str().unwrap(), &id));
            assert!(!names_this_file("a.gguf", &id));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn only_loopback_addresses_are_this_host() {
        assert!(on_this_host("127.0.0.1:50051"));
        assert!(on_this_host("[::1]:50051"));
        assert!(on_this_host("localhost:1"));
        assert!(!on_this_host("10.0.0.7:50051"));
        assert!(!on_this_host("gpu-node-2:50051"));
    }
}
