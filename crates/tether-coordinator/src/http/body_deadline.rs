//! Request bodies read whole, within a size limit and a deadline, before a handler runs.
//!
//! A client that declares a huge `Content-Length` is refused before a byte of it is read,
//! and one that trickles its body is cut off when the deadline passes: neither holds a
//! connection and a handler for longer than the deadline. (Per-read timeouts would not do:
//! a byte every few seconds resets them forever.)

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::{ApiError, SharedState};

/// Largest request body accepted by default (axum's own default: 2 MiB).
pub const DEFAULT_MAX_BODY_BYTES: usize = 2 << 20;

/// Time a client has to send its whole body by default.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);

fn too_large(limit: usize) -> Response {
    ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        ..ApiError::invalid(format!(
            "the request body is over the server's limit of {limit} bytes (--max-body-bytes)"
        ))
    }
    .with_code("request_too_large")
    .into_response()
}

/// Reads the body of `req` in full, within the configured size and time, then runs `next`.
pub(crate) async fn read_body_in_time(
    State(state): State<SharedState>,
    req: Request,
    next: Next,
) -> Response {
    let (limit, deadline) = (state.opts.max_body_bytes, state.opts.body_timeout);
    let (parts, body) = req.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return too_large(limit);
    }
    match tokio::time::timeout(deadline, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Ok(Err(e)) if is_length_limit(&e) => too_large(limit),
        Ok(Err(e)) => {
            ApiError::invalid(format!("reading the request body failed: {e}")).into_response()
        }
        Err(_) => ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            ..ApiError::invalid(format!(
                "the request body did not arrive within {deadline:?} (--body-timeout)"
            ))
        }
        .with_code("request_timeout")
        .into_response(),
    }
}

fn is_length_limit(e: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = s.source();
    }
    false
}
