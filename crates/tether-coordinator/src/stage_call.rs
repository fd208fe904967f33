//! One forward pass on one worker: over its data link when it has one, else over gRPC.

use crate::load::LoadedStage;
use std::sync::Arc;
use tether_client::ClientError;
use tether_protocol::{ForwardCall, ForwardInput, ForwardOutput, Rows, TokenPos};
use tokio::runtime::{Handle, RuntimeFlavor};

/// Runs `input` through `st`'s block (`targets`: the token ids whose logits
/// [`Rows::LogProbs`] rows return). `alone`: no other pass of this step runs meanwhile
/// (a single decode step), so nothing overlaps with it on this task.
pub(crate) async fn forward(
    st: &LoadedStage,
    tokens: &[TokenPos],
    input: ForwardInput,
    logits_rows: &[u32],
    rows: Rows,
    targets: &[u32],
    alone: bool,
) -> Result<ForwardOutput, ClientError> {
    let Some(link) = st.link.as_ref().filter(|l| l.usable()) else {
        return st
            .client
            .forward_scored(st.session, tokens, &input, logits_rows, rows, targets)
            .await;
    };
    let call = ForwardCall {
        tokens: tokens.to_vec(),
        input,
        logits_rows: logits_rows.to_vec(),
        rows,
        targets: targets.to_vec(),
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
    tokio::task::spawn_blocking(move || link.forward(&call))
        .await
        .map_err(|e| ClientError::Connect {
            addr: st.client.addr().to_string(),
            detail: format!("the data link's call failed: {e}"),
        })?
}
