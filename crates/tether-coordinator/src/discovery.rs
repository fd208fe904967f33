//! Workers found through DNS (`--worker-dns`): a name such as a Kubernetes headless Service,
//! which resolves to one address per ready worker, is resolved again every refresh period.
//! When the set of addresses changes, the new worker list is published on a watch channel;
//! the scheduler then unloads and loads again over it.
//!
//! Every resolved address is kept, IPv4 and IPv6 alike: one that does not answer is skipped
//! when the model is loaded again (as any unreachable worker is), so a name such as
//! `localhost`, which may also resolve to `::1`, works when the worker listens on one of them.

use std::net::SocketAddr;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// A DNS name whose addresses are workers, resolved again every `refresh`.
#[derive(Clone, Debug)]
pub struct WorkerDns {
    /// `host:port`; every address the host resolves to is a worker on that port.
    pub name: String,
    /// How often the name is resolved again.
    pub refresh: Duration,
}

/// The worker list in layer order: the fixed workers first, then the resolved addresses,
/// sorted and without repeats so that the order (and so the placement) does not depend on
/// the order the resolver answered in.
pub(crate) fn worker_list(fixed: &[String], resolved: &[SocketAddr]) -> Vec<String> {
    let mut found = resolved.to_vec();
    found.sort_unstable();
    found.dedup();
    fixed
        .iter()
        .cloned()
        .chain(found.iter().map(SocketAddr::to_string))
        .collect()
}

/// Resolves `dns` once. `None` (with a warning logged) when resolution fails or finds no
/// address, so that a blink of DNS never unloads a working model.
pub(crate) async fn resolve(dns: &WorkerDns) -> Option<Vec<SocketAddr>> {
    match tokio::net::lookup_host(&dns.name).await {
        Ok(addrs) => {
            let addrs: Vec<SocketAddr> = addrs.collect();
            if addrs.is_empty() {
                tracing::warn!(name = %dns.name, "--worker-dns resolved to no address; keeping the current workers");
                return None;
            }
            Some(addrs)
        }
        Err(e) => {
            tracing::warn!(name = %dns.name, "resolving --worker-dns failed: {e}; keeping the current workers");
            None
        }
    }
}

/// Resolves `dns` every refresh period until `stop`, and publishes the worker list on
/// `workers` whenever it differs from the one there.
pub(crate) async fn watch_dns(
    dns: WorkerDns,
    fixed: Vec<String>,
    workers: watch::Sender<Vec<String>>,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(dns.refresh) => {}
        }
        let Some(resolved) = resolve(&dns).await else {
            continue;
        };
        let list = worker_list(&fixed, &resolved);
        workers.send_if_modified(|current| {
            if *current == list {
                return false;
            }
            tracing::info!(
                "--worker-dns {} now resolves to: {}",
                dns.name,
                list.join(", ")
            );
            *current = list;
            true
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("a socket address literal")
    }

    #[test]
    fn fixed_workers_come_first_then_resolved_ones_sorted_without_repeats() {
        let fixed = vec!["gpu-box:50061".to_string()];
        let resolved = [
            addr("10.0.0.10:50061"),
            addr("[::1]:50061"),
            addr("10.0.0.9:50061"),
            addr("10.0.0.10:50061"),
        ];
        assert_eq!(
            worker_list(&fixed, &resolved),
            [
                "gpu-box:50061",
                "10.0.0.9:50061",
                "10.0.0.10:50061",
                "[::1]:50061"
            ]
        );
    }

    #[test]
    fn the_list_does_not_depend_on_the_resolver_order() {
        let a = [addr("10.0.0.2:1"), addr("10.0.0.1:1")];
        let b = [addr("10.0.0.1:1"), addr("10.0.0.2:1")];
        assert_eq!(worker_list(&[], &a), worker_list(&[], &b));
        assert_ne!(
            worker_list(&[], &a),
            worker_list(&[], &[addr("10.0.0.1:1")]),
            "a worker gone is a change"
        );
    }

    #[tokio::test]
    async fn a_changed_address_set_is_published_and_a_failed_lookup_is_not() {
        let (tx, mut rx) = watch::channel(vec!["10.0.0.1:50061".to_string()]);
        let stop = CancellationToken::new();
        let dns = WorkerDns {
            name: "localhost:50061".to_string(),
            refresh: Duration::from_millis(10),
        };
        let task = tokio::spawn(watch_dns(dns, Vec::new(), tx, stop.clone()));
        tokio::time::timeout(Duration::from_secs(10), rx.changed())
            .await
            .expect("the new list within 10 s")
            .expect("the watcher is running");
        assert!(
            rx.borrow_and_update()
                .iter()
                .any(|w| w == "127.0.0.1:50061"),
            "localhost resolved to {:?}",
            *rx.borrow()
        );
        stop.cancel();
        task.await.expect("the watcher ends on stop");

        let missing = WorkerDns {
            name: "no-such-host.invalid:50061".to_string(),
            refresh: Duration::from_millis(10),
        };
        assert_eq!(resolve(&missing).await, None);
    }
}
