//! The runs of a request's choices read as one stream: each event tagged with its choice,
//! in the order the choices produce them. Dropping it drops every run, which cancels every
//! choice still generating.

use futures::StreamExt;
use futures::stream::{BoxStream, SelectAll};

use super::error::ApiError;
use super::run::{Run, RunEvent};

/// An event of choice `.0`.
pub(super) type Tagged = (usize, Result<RunEvent, ApiError>);

/// The events of every choice of one request.
pub(super) struct Choices {
    streams: SelectAll<BoxStream<'static, Tagged>>,
    count: usize,
}

impl Choices {
    /// The events of `runs`, choice `i` being `runs[i]`.
    pub fn new(runs: Vec<Run>) -> Self {
        let count = runs.len();
        let streams = futures::stream::select_all(runs.into_iter().enumerate().map(|(i, run)| {
            futures::stream::unfold(run, move |mut run| async move {
                let event = run.next().await?;
                Some(((i, event), run))
            })
            .boxed()
        }));
        Self { streams, count }
    }

    /// How many choices there are.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The next event of any choice; `None` once every choice has ended or failed.
    pub async fn next(&mut self) -> Option<Tagged> {
        self.streams.next().await
    }
}
