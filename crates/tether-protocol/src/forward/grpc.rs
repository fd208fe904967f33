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
    targets: &[u32],
) -> pb::ForwardRequest {
    let (hidden, token_ids) = match input {
        ForwardInput::Hidden(h) => (f32s_to_le(h), Vec::new()),
        ForwardInput::TokenIds(ids) => (Vec::new(), ids.clone()),
        // Refused before it gets here (`WorkerClient::forward_scored`); sent, neither field
        // set, the worker would refuse it.
        ForwardInput::Lent(_) => (Vec::new(), Vec::new()),
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
        logprobs: matches!(rows, Rows::LogProbs(_)),
        logprobs_k: match rows {
            Rows::LogProbs(k) => k,
            _ => 0,
        },
        targets: targets.to_vec(),
        embeddings: rows == Rows::Embeddings,
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
    let rows = match (req.argmax, req.top_k, req.logprobs, req.embeddings) {
        (false, 0, false, false) => Rows::Logits,
        (true, 0, false, false) => Rows::ArgMax,
        (false, k, false, false) => Rows::Top(k),
        (false, 0, true, false) => Rows::LogProbs(req.logprobs_k),
        (false, 0, false, true) => Rows::Embeddings,
        _ => {
            return Err(WorkerError::InvalidArgument(
                "forward: ask for one of argmax, top_k, logprobs and embeddings, not several"
                    .into(),
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
        targets: req.targets,
    };
    Ok((session, call))
}

/// The reply carrying `output`.
pub fn output_to_proto(output: ForwardOutput) -> pb::ForwardReply {
    match output {
        ForwardOutput::Hidden(h) | ForwardOutput::Embeddings(h) => pb::ForwardReply {
            hidden: f32s_to_le(&h),
            ..Default::default()
        },
        // A gRPC request cannot ask for a hand-off, so no reply carries one; an empty
        // reply fails the client's check of its kind.
        ForwardOutput::Lent(_) => pb::ForwardReply::default(),
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
        ForwardOutput::Scored {
            counts,
            candidates,
            scores,
        } => pb::ForwardReply {
            top_ids: candidates.iter().map(|c| c.0).collect(),
            top_logits: candidates.iter().map(|c| c.1).collect(),
            top_counts: counts,
            logsumexp: scores.iter().map(|s| s.0).collect(),
            target_logits: scores.iter().map(|s| s.1).collect(),
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
    } else if let Rows::Top(_) | Rows::LogProbs(_) = rows {
        let uneven = |what: &str, a: usize, b: usize| {
            Err(WorkerError::Internal(format!(
                "the worker returned {a} {what} and {b} logits"
            )))
        };
        if reply.top_ids.len() != reply.top_logits.len() {
            return uneven("candidate ids", reply.top_ids.len(), reply.top_logits.len());
        }
        if reply.logsumexp.len() != reply.target_logits.len() {
            return uneven(
                "log-sum-exps",
                reply.logsumexp.len(),
                reply.target_logits.len(),
            );
        }
        let counts = reply.top_counts;
        let candidates = reply.top_ids.into_iter().zip(reply.top_logits).collect();
        match rows {
            Rows::Top(_) => ForwardOutput::Top { counts, candidates },
            _ => ForwardOutput::Scored {
                counts,
                candidates,
                scores: reply
                    .logsumexp
                    .into_iter()
                    .zip(reply.target_logits)
                    .collect(),
            },
        }
    } else if rows == Rows::Embeddings {
        ForwardOutput::Embeddings(f32s_from_le(&reply.hidden, "forward reply")?)
    } else if rows == Rows::ArgMax {
        ForwardOutput::ArgMax(reply.argmax)
    } else {
        ForwardOutput::Logits(f32s_from_le(&reply.logits, "forward reply")?)
    };
    check_reply(logits_rows, rows, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_probability_calls_and_replies_survive_the_round_trip() {
        let session = SessionId::new_random();
        let tokens = [TokenPos { seq: 1, pos: 4 }, TokenPos { seq: 1, pos: 5 }];
        let input = ForwardInput::TokenIds(vec![3, 9]);
        let req = request_to_proto(
            session,
            &tokens,
            &input,
            &[0, 1],
            Rows::LogProbs(5),
            &[9, 2],
        );
        let (got_session, call) = request_from_proto(req).unwrap();
        assert_eq!(got_session, session);
        assert_eq!(call.rows, Rows::LogProbs(5));
        assert_eq!(call.targets, [9, 2]);
        let mut both = request_to_proto(session, &tokens, &input, &[0], Rows::Top(3), &[]);
        both.logprobs = true;
        assert!(
            request_from_proto(both).is_err(),
            "top_k and logprobs at once"
        );
        let out = ForwardOutput::Scored {
            counts: vec![2, 1],
            candidates: vec![(7, 1.5), (3, 1.0), (2, 0.0)],
            scores: vec![(2.5, 1.0), (0.75, -3.0)],
        };
        let back = output_from_proto(output_to_proto(out.clone()), 2, Rows::LogProbs(2));
        assert_eq!(back.unwrap(), out);
        let mut short = output_to_proto(out);
        short.target_logits.pop();
        assert!(output_from_proto(short, 2, Rows::LogProbs(2)).is_err());
    }

    #[test]
    fn embedding_calls_and_replies_survive_the_round_trip() {
        let session = SessionId::new_random();
        let tokens = [TokenPos { seq: 0, pos: 0 }, TokenPos { seq: 0, pos: 1 }];
        let input = ForwardInput::TokenIds(vec![3, 9]);
        let req = request_to_proto(session, &tokens, &input, &[0, 1], Rows::Embeddings, &[]);
        let (_, call) = request_from_proto(req.clone()).unwrap();
        assert_eq!(call.rows, Rows::Embeddings);
        let mut both = req;
        both.argmax = true;
        assert!(request_from_proto(both).is_err(), "argmax and embeddings");
        let out = ForwardOutput::Embeddings(vec![0.5, -1.0, 2.0, 0.25]);
        let back = output_from_proto(output_to_proto(out.clone()), 2, Rows::Embeddings);
        assert_eq!(back.unwrap(), out);
        // Three values cannot be two rows of one width.
        let odd = output_to_proto(ForwardOutput::Embeddings(vec![1.0, 2.0, 3.0]));
        assert!(output_from_proto(odd, 2, Rows::Embeddings).is_err());
    }
}
