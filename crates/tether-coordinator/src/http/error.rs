//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the
//! matching HTTP status.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::api::GenError;

/// An error reply of the HTTP API.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// OpenAI's `type` (`invalid_request_error`, `server_error`, ...).
    pub kind: &'static str,
    /// What went wrong and what to do about it.
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code (`invalid_api_key`, `context_length_exceeded`, ...).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400: the request is wrong.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// 400 about the request field `param`.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.to_owned()),
            ..Self::invalid(message)
        }
    }

    /// 401: the API key is missing or wrong.
    pub fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            kind: "invalid_request_error",
            message: "missing or wrong API key; send `Authorization: Bearer <key>`".into(),
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// 504: the request's time ran out.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::GATEWAY_TIMEOUT,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: Some("timeout"),
        }
    }

    /// 500: something broke on our side.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// Sets the machine-readable code.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl From<GenError> for ApiError {
    fn from(e: GenError) -> Self {
        match e {
            GenError::InvalidRequest(m) => ApiError::invalid(m),
            GenError::Busy(m) => ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                kind: "rate_limit_error",
                message: m,
                param: None,
                code: Some("server_busy"),
            },
            GenError::Unavailable(m) => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                kind: "server_error",
                message: m,
                param: None,
                code: Some("service_unavailable"),
            },
            GenError::Timeout(m) => ApiError::timeout(m),
            GenError::Internal(m) => ApiError::internal(m),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status;
        let mut response = (status, axum::Json(self.body())).into_response();
        if status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_errors_map_to_their_statuses() {
        let cases = [
            (GenError::InvalidRequest("x".into()), 400),
            (GenError::Busy("x".into()), 429),
            (GenError::Unavailable("x".into()), 503),
            (GenError::Timeout("x".into()), 504),
            (GenError::Internal("x".into()), 500),
        ];
        for (e, status) in cases {
            assert_eq!(ApiError::from(e.clone()).status.as_u16(), status, "{e:?}");
        }
    }

    #[test]
    fn body_has_openai_fields() {
        let body = ApiError::invalid_param("prompt", "too long").body();
        assert_eq!(body["error"]["message"], "too long");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["param"], "prompt");
        assert!(body["error"]["code"].is_null());
    }
}
