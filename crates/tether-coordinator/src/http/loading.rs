//! Serving before the model is loaded: `tether serve` binds its port first and answers
//! through a [`ServingGate`], which gives `/health` 503 `{"status":"loading", ...}` with
//! the bytes loaded per worker, and every other path 503 `model_loading`, until the API's
//! own router is opened behind it.

use std::sync::{Arc, RwLock};

use axum::Router;
use axum::extract::Request;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tower::ServiceExt;

use crate::http::ApiError;
use crate::progress::LoadProgress;

/// Seconds a client is told to wait before asking again while the model loads.
const RETRY_AFTER_SECS: &str = "1";

/// The router served on a port bound before the model loaded: loading answers until
/// [`ServingGate::open`] puts the API behind it.
#[derive(Clone)]
pub struct ServingGate {
    api: Arc<RwLock<Option<Router>>>,
    progress: Arc<LoadProgress>,
}

impl ServingGate {
    /// A gate answering "loading" with the bytes `progress` reports.
    pub fn new(progress: Arc<LoadProgress>) -> Self {
        Self {
            api: Arc::default(),
            progress,
        }
    }

    /// The router to serve: every request goes to the API once opened, else gets a
    /// loading answer.
    pub fn router(&self) -> Router {
        let gate = self.clone();
        Router::new().fallback(move |req: Request| {
            let gate = gate.clone();
            async move { gate.answer(req).await }
        })
    }

    /// From now on, requests go to `api`.
    pub fn open(&self, api: Router) {
        *self.api.write().unwrap_or_else(|e| e.into_inner()) = Some(api);
    }

    /// Whether the API is open.
    pub fn is_open(&self) -> bool {
        self.api.read().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    async fn answer(&self, req: Request) -> Response {
        let api = self.api.read().unwrap_or_else(|e| e.into_inner()).clone();
        match api {
            Some(api) => match api.oneshot(req).await {
                Ok(response) => response,
                Err(never) => match never {},
            },
            None if req.uri().path() == "/health" => self.loading_health(),
            None => loading_refusal(),
        }
    }

    /// `/health` while loading: 503 with the bytes loaded, in all and per worker.
    fn loading_health(&self) -> Response {
        let workers = self.progress.snapshot();
        let loaded: u64 = workers.iter().map(|w| w.sent).sum();
        let total: u64 = workers.iter().map(|w| w.total).sum();
        let per_worker: Vec<_> = workers
            .iter()
            .map(|w| {
                json!({
                    "worker": w.addr,
                    "bytes_loaded": w.sent,
                    "bytes_total": w.total,
                    "read_by_worker": w.read_by_worker,
                })
            })
            .collect();
        let body = json!({
            "status": "loading",
            "progress": {
                "bytes_loaded": loaded,
                "bytes_total": total,
                "workers": per_worker,
            },
        });
        (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, RETRY_AFTER_SECS)],
            axum::Json(body),
        )
            .into_response()
    }
}

/// Any other path while loading: 503 in the API's error shape.
fn loading_refusal() -> Response {
    let mut response = ApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        kind: "unavailable_error",
        message: "the model is loading; retry when GET /health answers 200".to_string(),
        param: None,
        code: Some("model_loading"),
    }
    .into_response();
    response.headers_mut().insert(
        header::RETRY_AFTER,
        header::HeaderValue::from_static(RETRY_AFTER_SECS),
    );
    response
}
