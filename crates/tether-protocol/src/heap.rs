//! Giving freed host memory back to the operating system.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

/// Returns the free pages of every malloc arena to the OS. A session's host buffers (cpu
/// weights, KV, scratch) are large and freed together, and so are the buffers of a flood of
/// connections; without this, glibc keeps them in per-thread arenas and the process's RSS
/// stays at its high-water mark after they have gone, which reads as a leak to operators
/// watching it.
pub fn return_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Keeps glibc's malloc to one arena, unless `MALLOC_ARENA_MAX` asks for another count; call
/// it first thing in a long-running process, before it starts threads. With an arena per
/// thread (glibc's default, up to 8 per core) the buffers of a flood of connections, freed on
/// other threads than the ones that took them, stayed pinned in the arenas after every trim:
/// a debug worker on 2 busy cores kept 0.5-10 MiB of a 33 MiB flood of 2,000 gRPC
/// connections 10 s after they closed (with 2 arenas as well), and 0.3 MiB with one. Small
/// allocations come from each thread's cache without taking the arena's lock, and the
/// services allocate little per token, so one arena costs them no measurable speed.
pub fn one_malloc_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: mallopt only sets an allocator parameter; it has no preconditions.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    }
}

/// Connections open at once from which their closing is worth a trim.
const FLOOD: usize = 256;

/// How long a drain must stand still before the trimming that follows it stops: the last
/// connections of a flood close over some milliseconds after the first trim.
const SETTLE: Duration = Duration::from_millis(150);

/// When the last trim of a drain runs after the one that found it still: a connection's
/// tasks (an HTTP/2 connection's streams and buffers) may outlive its count by that long
/// on a busy machine, and what they free after the last trim stays in the arena.
const LATE: Duration = Duration::from_secs(1);

/// Counts a server's open connections and returns the heap to the OS once a flood of them
/// (at least [`FLOOD`] open at once) has drained to a quarter of its peak, and again as the
/// rest closes: each connection's buffers are small, so the allocator keeps them all after
/// they are freed.
#[derive(Debug, Default)]
pub struct FloodWatch {
    open: AtomicUsize,
    peak: AtomicUsize,
    trimming: AtomicBool,
}

/// One open connection of a [`FloodWatch`]; dropping it counts the connection closed.
#[derive(Debug)]
pub struct OpenConnection(Arc<FloodWatch>);

impl FloodWatch {
    /// Counts a connection open until the returned value is dropped.
    pub fn open(self: &Arc<Self>) -> OpenConnection {
        let open = self.open.fetch_add(1, Ordering::AcqRel) + 1;
        self.peak.fetch_max(open, Ordering::AcqRel);
        OpenConnection(Arc::clone(self))
    }

    /// Connections open now.
    pub fn open_now(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Whether a connection closing, leaving `open`, ends a flood; if so the next flood is
    /// counted from `open`.
    fn drained(&self, open: usize) -> bool {
        let peak = self.peak.load(Ordering::Acquire);
        peak >= FLOOD
            && open <= peak / 4
            && self
                .peak
                .compare_exchange(peak, open, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        let open = self.0.open.fetch_sub(1, Ordering::AcqRel) - 1;
        if self.0.drained(open) && !self.0.trimming.swap(true, Ordering::AcqRel) {
            let watch = Arc::clone(&self.0);
            // Off the caller's (async) thread: a trim walks every arena.
            let spawned = std::thread::Builder::new()
                .name("tether-trim".into())
                .spawn(move || trim_while_draining(&watch));
            if spawned.is_err() {
                self.0.trimming.store(false, Ordering::Release);
            }
        }
    }
}

/// Trims after each [`SETTLE`] until one passes in which no connection closed, so that the
/// buffers of the flood's last connections go back too, not only those of the first three
/// quarters, and those freed just after a connection is counted closed; then once more
/// [`LATE`] after, for what their tasks free later still.
fn trim_while_draining(watch: &FloodWatch) {
    let mut last = usize::MAX;
    loop {
        std::thread::sleep(SETTLE);
        let open = watch.open_now();
        return_freed_heap();
        if open == last {
            break;
        }
        last = open;
    }
    std::thread::sleep(LATE);
    return_freed_heap();
    watch.trimming.store(false, Ordering::Release);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_is_over_once_a_quarter_of_its_peak_is_left() {
        let watch = Arc::new(FloodWatch::default());
        let mut open: Vec<OpenConnection> = (0..FLOOD).map(|_| watch.open()).collect();
        assert_eq!(watch.open_now(), FLOOD);
        open.truncate(FLOOD / 4 + 1);
        assert_eq!(watch.peak.load(Ordering::Acquire), FLOOD, "not drained yet");
        open.pop();
        assert_eq!(
            watch.peak.load(Ordering::Acquire),
            FLOOD / 4,
            "drained: the next flood counts from here"
        );
        drop(open);
        assert_eq!(watch.open_now(), 0);
        // Fewer than a flood: no trim, the peak just follows.
        let few: Vec<OpenConnection> = (0..10).map(|_| watch.open()).collect();
        drop(few);
        assert_eq!(watch.peak.load(Ordering::Acquire), FLOOD / 4);
    }
}
