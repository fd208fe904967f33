//! CPU-heavy request work (parsing large JSON bodies, rendering chat templates, tokenizing
//! long prompts) runs on threads of its own at a lower scheduling priority, never on the
//! async runtime that also carries the workers' heartbeats, the scheduler and `/health`,
//! and at most `max_heavy_requests` of them at once: one more is refused with 429 at once
//! instead of queueing without bound.
//!
//! The priority matters as much as the thread: with more heavy requests than cores, the
//! kernel shares the cores evenly among runnable threads, and the runtime's threads would
//! wait behind every one of them at each wake-up (a `/health` probe needs several). At a
//! lower priority the heavy threads take what the runtime leaves.

use std::sync::Arc;

use tokio::sync::Semaphore;

use super::AppState;
use super::error::ApiError;

/// Bodies from this size up count as heavy: tokenizing 16 KiB takes a few milliseconds,
/// which the async runtime can afford; megabytes it cannot.
pub(super) const HEAVY_BODY_BYTES: usize = 16 << 10;

/// The cap on heavy request work running at once.
#[derive(Clone, Debug)]
pub(super) struct HeavyWork {
    permits: Arc<Semaphore>,
    limit: usize,
}

impl HeavyWork {
    /// Allows `limit` (at least 1) heavy requests at once.
    pub(super) fn new(limit: usize) -> Self {
        let limit = limit.max(1);
        Self {
            permits: Arc::new(Semaphore::new(limit)),
            limit,
        }
    }

    /// Runs `work` on a thread of its own at a lower priority when a slot is free, else
    /// fails with 429 at once. A thread per request, not a pool: its start costs tens of
    /// microseconds against the milliseconds of work that make a request heavy, and tokio's
    /// blocking pool would hand a thread lowered for good to its other users.
    pub(super) async fn run<T: Send + 'static>(
        &self,
        state: Arc<AppState>,
        work: impl FnOnce(&AppState) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        self.run_lowered(move || work(&state)).await
    }

    async fn run_lowered<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let permit = Arc::clone(&self.permits)
            .try_acquire_owned()
            .map_err(|_| self.busy())?;
        let (done, result) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("tether-heavy".into())
            .spawn(move || {
                // The permit goes back before the result (and, on a panic, before the
                // sender's drop wakes the caller): a client that sends its next request on
                // the answer must find the slot free.
                let done = done;
                let permit = permit;
                lower_this_threads_priority();
                let result = work();
                drop(permit);
                // The receiver is gone only when the client hung up: nobody wants the result.
                let _ = done.send(result);
            })
            .map_err(|e| ApiError::internal(format!("starting a thread to prepare it: {e}")))?;
        result
            .await
            .map_err(|_| ApiError::internal("preparing the request failed (its thread panicked)"))?
    }

    fn busy(&self) -> ApiError {
        ApiError {
            code: Some("server_busy"),
            kind: "rate_limit_error",
            status: axum::http::StatusCode::TOO_MANY_REQUESTS,
            ..ApiError::invalid(format!(
                "{} large or templated requests are already being prepared \
                 (--max-heavy-requests); retry shortly",
                self.limit
            ))
        }
    }
}

/// How far below the process's priority heavy threads run, in nice steps: nice 10 weighs
/// a tenth of nice 0 in Linux's scheduler.
const HEAVY_NICE_STEPS: libc::c_int = 10;

/// Moves the calling thread `HEAVY_NICE_STEPS` toward the lowest priority. Linux keeps a
/// nice value per thread; where that fails (or elsewhere) the work runs at the process's
/// priority, which only costs latency under overload.
fn lower_this_threads_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: gettid, getpriority and setpriority touch only the calling thread's
    // scheduling attributes; errno is read right after the call that sets it.
    unsafe {
        let tid = libc::gettid() as libc::id_t;
        *libc::__errno_location() = 0;
        let now = libc::getpriority(libc::PRIO_PROCESS, tid);
        if now == -1 && *libc::__errno_location() != 0 {
            return;
        }
        let lower = (now + HEAVY_NICE_STEPS).min(19);
        let _ = libc::setpriority(libc::PRIO_PROCESS, tid, lower);
    }
}

/// The default cap: one per core, since each keeps a core busy.
pub fn default_max_heavy_requests() -> usize {
    std::thread::available_parallelism()
        .map(usize::from)
        .unwrap_or(1)
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    fn this_threads_nice() -> libc::c_int {
        // SAFETY: reads the calling thread's own nice value.
        unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
    }

    #[tokio::test]
    async fn heavy_work_runs_below_the_runtimes_priority_and_a_panic_is_an_error() {
        let heavy = HeavyWork::new(1);
        let runtime = this_threads_nice();
        let worked = heavy.run_lowered(|| Ok(this_threads_nice())).await;
        let expected = (runtime + HEAVY_NICE_STEPS).min(19);
        assert_eq!(worked.expect("heavy work"), expected);
        assert_eq!(
            this_threads_nice(),
            runtime,
            "the runtime's thread was lowered"
        );

        let panicked = heavy
            .run_lowered(|| -> Result<(), ApiError> { panic!("boom") })
            .await;
        let error = panicked.expect_err("a panic is an error");
        assert_eq!(error.status, axum::http::StatusCode::INTERNAL_SERVER_ERROR);
        // The panicking thread gave its permit back.
        assert_eq!(
            heavy.run_lowered(|| Ok(1)).await.expect("after the panic"),
            1
        );
    }

    #[tokio::test]
    async fn one_more_than_the_cap_is_refused_at_once() {
        let heavy = HeavyWork::new(1);
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let busy = heavy.clone();
        let first = tokio::spawn(async move {
            busy.run_lowered(move || {
                let _ = wait.recv();
                Ok(())
            })
            .await
        });
        while heavy.permits.available_permits() > 0 {
            tokio::task::yield_now().await;
        }
        let refused = heavy
            .run_lowered(|| Ok(()))
            .await
            .expect_err("over the cap");
        assert_eq!(refused.status, axum::http::StatusCode::TOO_MANY_REQUESTS);
        release.send(()).expect("release the first");
        first.await.expect("join").expect("the first ran");
    }
}
