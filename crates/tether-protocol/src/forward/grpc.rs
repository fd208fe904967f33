//! The Forward RPC's messages: a [`ForwardCall`] and its output to and from their
//! `tether.v1` wire form, for the worker's service and the client alike.

use super::{ForwardCall, ForwardInput, ForwardOutput, Rows, TokenPos, check_reply};
use crate::error::WorkerError;
use crate::grpc::{f32s_from_le, f32s_to_le};
use crate::ids::SessionId;
use tether_proto::v1 as pb;

/// The request for a [`ForwardCall`] on `session`, from borrowed parts so a batch of
/// hidden states is copied once, into the message.
pub fn request_to_proto(
    session: SessionId,
    tokens: &[TokenPos],
    input: &ForwardInput,
    logits_rows: &[u32],
    rows: Rows,
) -> pb::ForwardRequest {
    let (hidden, token_ids) = match input {
        ForwardInput::Hidden(h) => (f32s_to_le(h), Vec::new()),
        ForwardInput::TokenIds(ids) => (Vec::new(), ids.clone()),
    };
    pb::ForwardRequest {
        session_id: session.to_string(),
        tokens: tokens
            .iter()
            .map(|t| pb::BatchToken {
                seq: t.seq,
                pos: t.pos,
            })
            .collect(),
        hidden,
        token_ids,
        logits_rows: logits_rows.to_vec(),
        argmax: rows == Rows::ArgMax,
        top_k: match rows {
            Rows::Top(k) => k,
            _ => 0,
        },
    }
}

/// The session and call a request names; `InvalidArgument` for a malformed one.
pub fn request_from_proto(
    req: pb::ForwardRequest,
) -> Result<(SessionId, ForwardCall), WorkerError> {
    let session = SessionId::parse(&req.session_id)?;
    let input = match (req.hidden.is_empty(), req.token_ids.is_empty()) {
        (false, true) => ForwardInput::Hidden(f32s_from_le(&req.hidden, "forward hidden states")?),
        (true, false) => ForwardInput::TokenIds(req.token_ids),
        _ => {
            return Err(WorkerError::InvalidArgument(
                "forward: send exactly one of hidden states and token ids".into(),
            ));
        }
    };
    let rows = match (req.argmax, req.top_k) {
        (false, 0) => Rows::Logits,
        (true, 0) => Rows::ArgMax,
        (false, k) => Rows::Top(k),
        (true, _) => {
            return Err(WorkerError::InvalidArgument(
                "forward: ask for one of argmax and top_k, not both".into(),
            ));
        }
    };
    let call = ForwardCall {
        tokens: req
            .tokens
            .iter()
            .map(|t| TokenPos {
                seq: t.seq,
                pos: t.pos,
            })
            .collect(),
        input,
        logits_rows: req.logits_rows,
        rows,
    };
    Ok((session, call))
}

/// The reply carrying `output`.
pub fn output_to_proto(output: ForwardOutput) -> pb::ForwardReply {
    match output {
        ForwardOutput::Hidden(h) => pb::ForwardReply {
            hidden: f32s_to_le(&h),
            ..Default::default()
        },
        ForwardOutput::Logits(l) => pb::ForwardReply {
            logits: f32s_to_le(&l),
            ..Default::default()
        },
        ForwardOutput::ArgMax(ids) => pb::ForwardReply {
            argmax: ids,
            ..Default::default()
        },
        ForwardOutput::Top { counts, candidates } => pb::ForwardReply {
            top_ids: candidates.iter().map(|c| c.0).collect(),
            top_logits: candidates.iter().map(|c| c.1).collect(),
            top_counts: counts,
            ..Default::default()
        },
    }
}

/// The output a reply carries for a call that asked `rows` for `logits_rows` rows, checked
/// to be what was asked ([`check_reply`]); `Internal` when it is not, which is a worker bug.
pub fn output_from_proto(
    reply: pb::ForwardReply,
    logits_rows: usize,
    rows: Rows,
) -> Result<ForwardOutput, WorkerError> {
    let out = if logits_rows == 0 {
        ForwardOutput::Hidden(f32s_from_le(&reply.hidden, "forward reply")?)
    } else if let Rows::Top(_) = rows {
        if reply.top_ids.len() != reply.top_logits.len() {
            return Err(WorkerError::Internal(format!(
                "the worker returned {} candidate ids and {} logits",
                reply.top_ids.len(),
                reply.top_logits.len()
            )));
        }
        ForwardOutput::Top {
            counts: reply.top_counts,
            candidates: reply.top_ids.into_iter().zip(reply.top_logits).collect(),
        }
    } else if rows == Rows::ArgMax {
        ForwardOutput::ArgMax(reply.argmax)
    } else {
        ForwardOutput::Logits(f32s_from_le(&reply.logits, "forward reply")?)
    };
    check_reply(logits_rows, rows, out)
}
