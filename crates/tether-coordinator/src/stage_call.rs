//! One forward pass on one worker: over its data link when it has one, else over gRPC;
//! whole ([`forward`]) or sent now and taken later ([`send`], [`Pending::output`]).

use crate::load::LoadedStage;
use std::sync::Arc;
use tether_client::{ClientError, DataLink, SentForward};
use tether_protocol::{ForwardCall, ForwardOutput};
use tokio::runtime::{Handle, RuntimeFlavor};

/// Runs `call` through `st`'s block. `alone`: no other pass of this step runs meanwhile
/// (a single decode step), so nothing overlaps with it on this task.
pub(crate) async fn forward(
    st: &LoadedStage,
    call: ForwardCall,
    alone: bool,
) -> Result<ForwardOutput, ClientError> {
    let Some(link) = st.link.as_ref().filter(|l| l.usable()) else {
        let c = &call;
        return st
            .client
            .forward_scored(
                st.session,
                &c.tokens,
                &c.input,
                &c.logits_rows,
                c.rows,
                &c.targets,
            )
            .await;
    };
    if alone && link.spins() && Handle::current().runtime_flavor() == RuntimeFlavor::MultiThread {
        // A GPU worker answers within a step of a few ms, and this task has nothing else to
        // do until it does: waiting here, spinning, saves two thread hand-offs a call
        // (~0.1 ms each on a server CPU). But the tasks this one woke last step (the
        // streams of the tokens it sampled) wait on this thread (tokio's LIFO slot is not
        // stolen) until it yields: without this yield a stream's events all arrived when
        // its request ended. They run while the worker computes.
        let sent = link.forward_send(&call)?;
        tokio::task::yield_now().await;
        return link.forward_reply(sent);
    }
    let link = Arc::clone(link);
    blocking(addr(st), move || link.forward(&call)).await
}

/// A forward pass sent to a worker, its output still to come.
pub(crate) enum Pending {
    /// Sent over the data link: the worker runs its link's calls in order, so the next
    /// call may be sent before this reply is taken.
    Link {
        link: Arc<DataLink>,
        sent: SentForward,
        addr: String,
    },
    /// Run over gRPC to its end: gRPC calls in flight at once may run in any order.
    Done(Result<ForwardOutput, ClientError>),
}

/// Sends a pass as [`forward`] runs it, without waiting for its output when it goes over
/// a data link. Outputs must be taken in the order the passes were sent.
pub(crate) async fn send(st: &LoadedStage, call: ForwardCall) -> Result<Pending, ClientError> {
    let Some(link) = st.link.as_ref().filter(|l| l.usable()) else {
        return Ok(Pending::Done(forward(st, call, false).await));
    };
    let link = Arc::clone(link);
    let sending = Arc::clone(&link);
    // A request of megabytes blocks its writer until the worker reads it, which it does
    // once the pass before it is done.
    let sent = blocking(addr(st), move || sending.forward_send(&call)).await?;
    Ok(Pending::Link {
        link,
        sent,
        addr: addr(st),
    })
}

impl Pending {
    /// The pass's output, once the worker has sent it.
    pub(crate) async fn output(self) -> Result<ForwardOutput, ClientError> {
        match self {
            Pending::Done(out) => out,
            Pending::Link { link, sent, addr } => {
                blocking(addr, move || link.forward_reply(sent)).await
            }
        }
    }
}

fn addr(st: &LoadedStage) -> String {
    st.client.addr().to_string()
}

/// Runs `work` on tokio's blocking pool; `addr` names the worker if the task fails.
async fn blocking<T: Send + 'static>(
    addr: String,
    work: impl FnOnce() -> Result<T, ClientError> + Send + 'static,
) -> Result<T, ClientError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ClientError::Connect {
            addr,
            detail: format!("the data link's call failed: {e}"),
        })?
}
