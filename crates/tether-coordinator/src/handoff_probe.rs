//! After a load, which pairs of neighbouring workers can hand hidden states over GPU to
//! GPU ([`crate::handoff`]): the first must lend its slots and the next open them.

use std::sync::Arc;

use tether_model::plan::HANDOFF_SLOTS;
use tether_protocol::{ForwardCall, ForwardInput, ForwardOutput, Rows};

use crate::handoff::Handoff;
use crate::load::LoadedStage;
use crate::stage_call;

/// Asks each pair of neighbouring workers whether the first can lend its slots and the
/// next open them (both on GPUs of one host, over data links), and sets
/// [`LoadedStage::handoff`] where they can. A refusal is no error: those stages pass
/// hidden states through the host as before.
pub(crate) async fn probe(stages: &mut [LoadedStage]) {
    for i in 1..stages.len() {
        let (before, after) = stages.split_at_mut(i);
        let (from, to) = (&mut before[i - 1], &after[0]);
        let linked = |st: &LoadedStage| st.link.as_ref().is_some_and(|l| l.usable());
        if !linked(from) || !linked(to) {
            continue;
        }
        match try_pair(from, to).await {
            Ok(()) => {
                tracing::info!(
                    from = %from.client.addr(),
                    to = %to.client.addr(),
                    "hidden states go device to device between these workers"
                );
                from.handoff = Some(Arc::new(Handoff::new(HANDOFF_SLOTS)));
            }
            Err(why) => tracing::info!(
                from = %from.client.addr(),
                to = %to.client.addr(),
                %why,
                "hidden states go through the host between these workers"
            ),
        }
    }
}

async fn try_pair(from: &LoadedStage, to: &LoadedStage) -> Result<(), String> {
    let call = |input, rows| ForwardCall {
        tokens: Vec::new(),
        input,
        logits_rows: Vec::new(),
        rows,
        targets: Vec::new(),
    };
    let lent = stage_call::forward(
        from,
        call(ForwardInput::Hidden(Vec::new()), Rows::HandOff(0)),
        false,
    )
    .await
    .map_err(|e| e.to_string())?;
    let ForwardOutput::Lent(area) = lent else {
        return Err("the first worker lent no slot".into());
    };
    stage_call::forward(to, call(ForwardInput::Lent(area), Rows::Logits), false)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}
