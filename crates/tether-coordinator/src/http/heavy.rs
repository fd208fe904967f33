//! CPU-heavy request work (parsing large JSON bodies, rendering chat templates, tokenizing
//! long prompts) runs on tokio's blocking pool, never on the async runtime that also
//! carries the workers' heartbeats and the scheduler, and at most `max_heavy_requests` of
//! them at once: one more is refused with 429 at once instead of queueing without bound.

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

    /// Runs `work` on the blocking pool when a slot is free, else fails with 429 at once.
    pub(super) async fn run<T: Send + 'static>(
        &self,
        state: Arc<AppState>,
        work: impl FnOnce(&AppState) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let permit = Arc::clone(&self.permits)
            .try_acquire_owned()
            .map_err(|_| self.busy())?;
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            work(&state)
        })
        .await
        .map_err(|e| ApiError::internal(format!("preparing the request failed: {e}")))?
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

/// The default cap: one per core, since each keeps a core busy.
pub fn default_max_heavy_requests() -> usize {
    std::thread::available_parallelism()
        .map(usize::from)
        .unwrap_or(1)
}
