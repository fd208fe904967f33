//! The worker targets: bytes from the network decoded as each request type and handed to
//! the real service handler of the rig's worker. Unary inputs are one encoded message;
//! streaming inputs (Attach, Prepare) are gRPC frames, decoded by tonic's own reader.

use crate::Finding;
use crate::rig::{Rig, attach_stream, check_status, prepare_stream, substitute};
use prost::Message;
use tether_proto::v1 as pb;
use tether_proto::v1::admin_server::Admin;
use tether_proto::v1::worker_server::Worker;
use tether_protocol::TxnId;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status};

/// The outcome of one handler call: any status is fine unless it hides a bug.
fn answered<T>(what: &str, result: Result<Response<T>, Status>) -> Result<Option<T>, Finding> {
    match result {
        Ok(reply) => Ok(Some(reply.into_inner())),
        Err(status) => check_status(what, &status).map(|()| None),
    }
}

/// `Hello`.
pub fn hello(data: &[u8]) -> Result<(), Finding> {
    let Ok(req) = pb::HelloRequest::decode(data) else {
        return Ok(());
    };
    let rig = Rig::get();
    let result = rig.run("hello", rig.worker().hello(Request::new(req)))?;
    answered("hello", result).map(drop)
}

/// `Attach`: a stream that opens a session, beats and closes; the session must end with
/// the stream.
pub fn attach(data: &[u8]) -> Result<(), Finding> {
    let rig = Rig::get();
    let before = rig.registry.status().sessions;
    rig.run("attach", async {
        match rig.worker().attach(Request::new(attach_stream(data))).await {
            Ok(events) => {
                let mut events = events.into_inner();
                while let Some(event) = events.next().await {
                    if let Err(status) = event {
                        check_status("attach event", &status)?;
                    }
                }
                Ok(())
            }
            Err(status) => check_status("attach", &status),
        }
    })??;
    let after = rig.registry.status().sessions;
    if after != before {
        return Err(Finding(format!(
            "attach: {after} sessions live after the stream ended, {before} before"
        )));
    }
    Ok(())
}

/// `Prepare` into a fresh session, then `Commit` of whatever it prepared.
pub fn prepare(data: &[u8]) -> Result<(), Finding> {
    let rig = Rig::get();
    let session = rig.fresh_session()?;
    let outcome = rig.run("prepare", async {
        let result = rig
            .worker()
            .prepare(Request::new(prepare_stream(data, session)))
            .await;
        match answered("prepare", result)? {
            Some(reply) => {
                let txn = TxnId::parse(&reply.txn_id)
                    .map_err(|e| Finding(format!("prepare answered a bad txn id: {e}")))?;
                rig.registry
                    .commit(session, txn)
                    .map_err(|e| Finding(format!("commit after a prepare that worked: {e}")))?;
                Ok(())
            }
            None => Ok(()),
        }
    });
    rig.end(session);
    let bytes = rig.registry.status().session_bytes;
    outcome??;
    let serving = serving_bytes(rig);
    if bytes != serving {
        return Err(Finding(format!(
            "prepare: {bytes} session bytes held after the session ended; the serving session holds {serving}"
        )));
    }
    Ok(())
}

fn serving_bytes(rig: &Rig) -> u64 {
    let id = rig.serving().to_string();
    rig.registry
        .sessions()
        .iter()
        .filter(|s| s.session_id == id)
        .map(|s| s.bytes)
        .sum()
}

/// `Commit` or `Abort` against a session holding the prepared [`crate::rig::PREPARED_TXN`].
pub fn decision(data: &[u8], commit: bool) -> Result<(), Finding> {
    let Ok(mut req) = pb::Decision::decode(data) else {
        return Ok(());
    };
    let rig = Rig::get();
    let session = rig.fresh_session()?;
    let outcome = rig.prepare_txn(session).and_then(|()| {
        substitute(&mut req.session_id, session);
        let what = if commit { "commit" } else { "abort" };
        let result = rig.run(what, async {
            if commit {
                rig.worker().commit(Request::new(req)).await
            } else {
                rig.worker().abort(Request::new(req)).await
            }
        })?;
        answered(what, result).map(drop)
    });
    rig.end(session);
    outcome
}

/// `Forward` on the serving session; a reply must have the size the request implies.
pub fn forward(data: &[u8]) -> Result<(), Finding> {
    let Ok(mut req) = pb::ForwardRequest::decode(data) else {
        return Ok(());
    };
    let rig = Rig::get();
    substitute(&mut req.session_id, rig.serving());
    let (tokens, rows) = (req.tokens.len(), req.logits_rows.len());
    // With logits rows, the request's mode says which reply field carries them (the
    // worker refuses a request that asks for two).
    let (argmax, top_k, logprobs, embeddings) =
        (req.argmax, req.top_k, req.logprobs, req.embeddings);
    let result = rig.run("forward", rig.worker().forward(Request::new(req)))?;
    let Some(reply) = answered("forward", result)? else {
        return Ok(());
    };
    let config = &rig.model.config;
    let (what, got, want) = if rows == 0 {
        (
            "hidden bytes",
            reply.hidden.len(),
            tokens * config.n_embd * 4,
        )
    } else if argmax {
        ("arg-max ids", reply.argmax.len(), rows)
    } else if top_k > 0 {
        ("top-k counts", reply.top_counts.len(), rows)
    } else if logprobs {
        ("log-sum-exps", reply.logsumexp.len(), rows)
    } else if embeddings {
        (
            "embedding bytes",
            reply.hidden.len(),
            rows * config.n_embd * 4,
        )
    } else {
        ("logit bytes", reply.logits.len(), rows * config.n_vocab * 4)
    };
    if got != want {
        return Err(Finding(format!(
            "forward of {tokens} tokens, {rows} logits rows answered {got} {what}, expected {want}"
        )));
    }
    Ok(())
}

/// `KvClear` on the serving session.
pub fn kv_clear(data: &[u8]) -> Result<(), Finding> {
    let Ok(mut req) = pb::KvClearRequest::decode(data) else {
        return Ok(());
    };
    let rig = Rig::get();
    substitute(&mut req.session_id, rig.serving());
    let result = rig.run("kv clear", rig.worker().kv_clear(Request::new(req)))?;
    answered("kv clear", result).map(drop)
}

/// `KvTruncate` on the serving session.
pub fn kv_truncate(data: &[u8]) -> Result<(), Finding> {
    let Ok(mut req) = pb::KvTruncateRequest::decode(data) else {
        return Ok(());
    };
    let rig = Rig::get();
    substitute(&mut req.session_id, rig.serving());
    let result = rig.run("kv truncate", rig.worker().kv_truncate(Request::new(req)))?;
    answered("kv truncate", result).map(drop)
}

/// The admin calls that read or end one session: `KillSession` (of a fresh session, so
/// the serving one survives), then `Status` and `ListSessions`. `Drain` is left out: it
/// would stop the rig's worker admitting sessions for every later input.
pub fn admin(data: &[u8]) -> Result<(), Finding> {
    let Ok(mut req) = pb::KillSessionRequest::decode(data) else {
        return Ok(());
    };
    let rig = Rig::get();
    let session = rig.fresh_session()?;
    substitute(&mut req.session_id, session);
    let outcome = rig.run("admin", async {
        answered("kill", rig.admin().kill_session(Request::new(req)).await)?;
        let status = rig.admin().status(Request::new(pb::StatusRequest {})).await;
        answered("status", status)?;
        let list = rig
            .admin()
            .list_sessions(Request::new(pb::ListSessionsRequest {}))
            .await;
        answered("list sessions", list).map(drop)
    });
    rig.end(session);
    outcome?
}

/// A data link's frame body, served on the serving session as a link's thread serves it:
/// the reply must be a well-formed frame, and hidden states or logits must be sized for
/// the request. The same bytes as a hello must decode or be refused, never panic.
pub fn data_link(data: &[u8]) -> Result<(), Finding> {
    let _ = tether_protocol::link::hello_session(data);
    let rig = Rig::get();
    let reply = tether_worker::link::serve_request(&rig.registry, rig.serving(), data)
        .map_err(|e| Finding(format!("data link: a malformed reply: {e}")))?;
    let Ok(out) = reply else {
        return Ok(());
    };
    let config = &rig.model.config;
    let (got, width) = match &out {
        tether_protocol::ForwardOutput::Hidden(h) => (h.len(), config.n_embd),
        tether_protocol::ForwardOutput::Logits(l) => (l.len(), config.n_vocab),
        _ => return Ok(()),
    };
    if width == 0 || got % width != 0 || got == 0 {
        return Err(Finding(format!(
            "data link: {got} values answered, not whole rows of {width}"
        )));
    }
    Ok(())
}
