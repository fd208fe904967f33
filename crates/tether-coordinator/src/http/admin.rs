//! The coordinator's operator view for `tetherctl --coordinator`: the model's placement and
//! health, and each worker's status and sessions, read live from the workers; and the
//! model's lifecycle (load, reload, unload) in `admin_model`.

use super::bearer_allowed;
use super::error::ApiError;
use crate::api::{Generation, Health};
use crate::engine::Coordinator;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::get;
use serde_json::{Value, json};
use std::sync::Arc;
use tether_client::AdminClient;

struct AdminState {
    coordinator: Arc<Coordinator>,
    api_key: Option<String>,
    worker_admin_token: Option<String>,
}

type Shared = Arc<AdminState>;

/// `GET /v1/admin/{model,workers,sessions}`, `POST` and `DELETE /v1/admin/model`, behind
/// `api_key` when one is set.
/// `worker_admin_token` is sent to workers that require one.
pub fn admin_router(
    coordinator: Arc<Coordinator>,
    api_key: Option<String>,
    worker_admin_token: Option<String>,
) -> Router {
    let state = Arc::new(AdminState {
        coordinator,
        api_key,
        worker_admin_token,
    });
    Router::new()
        .route(
            "/v1/admin/model",
            get(model).post(load_model).delete(unload_model),
        )
        .route("/v1/admin/workers", get(workers_status))
        .route("/v1/admin/sessions", get(sessions))
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            require_key,
        ))
        .with_state(state)
}

async fn require_key(State(state): State<Shared>, req: Request, next: Next) -> Response {
    if !bearer_allowed(&req, state.api_key.as_deref()) {
        return ApiError::unauthorized().into_response();
    }
    next.run(req).await
}

async fn load_model(State(state): State<Shared>, body: Bytes) -> Response {
    super::admin_model::load(&state.coordinator, body)
        .await
        .into_response()
}

async fn unload_model(State(state): State<Shared>) -> Response {
    super::admin_model::unload(&state.coordinator)
        .await
        .into_response()
}

async fn model(State(state): State<Shared>) -> Json<Value> {
    let info = state.coordinator.model();
    let loaded = state.coordinator.model_loaded();
    let change = state.coordinator.model_change().map(|c| {
        json!({
            "model": c.model,
            "phase": c.phase,
            "bytes_loaded": c.bytes_loaded,
            "bytes_total": c.bytes_total,
        })
    });
    let (serving, reason) = match state.coordinator.health() {
        Health::Ready => (true, None),
        Health::Unavailable(why) => (false, Some(why)),
    };
    let plan: Vec<Value> = state
        .coordinator
        .plan()
        .map(|p| p.assignments)
        .unwrap_or_default()
        .into_iter()
        .map(|a| {
            json!({
                "worker": a.addr,
                "first_layer": a.spec.first_layer,
                "last_layer": a.spec.last_layer,
                "has_embed": a.spec.has_embed,
                "has_head": a.spec.has_head,
                "weights_bytes": a.bytes.weights_bytes,
                "kv_bytes": a.bytes.kv_bytes,
                "scratch_bytes": a.bytes.scratch_bytes,
                "total_bytes": a.bytes.total_bytes,
                "free_bytes_when_planned": a.free_bytes,
            })
        })
        .collect();
    let stats = state.coordinator.stats();
    Json(json!({
        "id": info.id,
        "loaded": loaded,
        "path": state.coordinator.model_path(),
        "model_change": change,
        "ctx_per_seq": info.ctx_per_seq,
        "serving": serving,
        "unavailable_reason": reason,
        "queued": stats.queued,
        "running": stats.running,
        "prefix_cache": state.coordinator.prefix_cache(),
        "prompt_tokens": stats.prompt_tokens,
        "prefix_hit_tokens": stats.prefix_hit_tokens,
        "placement": plan,
    }))
}

async fn admin_client(state: &AdminState, addr: &str) -> Result<AdminClient, String> {
    // The coordinator's own TLS settings reach the workers' admin service too.
    AdminClient::connect(
        addr,
        state.worker_admin_token.clone(),
        state.coordinator.client_options(),
    )
    .await
    .map_err(|e| e.to_string())
}

async fn workers_status(State(state): State<Shared>) -> Json<Value> {
    let mut out = Vec::new();
    // The coordinator's current list: `--worker-dns` may have changed it since start.
    for addr in &state.coordinator.workers() {
        let status = match admin_client(&state, addr).await {
            Ok(mut c) => c.status().await.map_err(|e| e.to_string()),
            Err(e) => Err(e),
        };
        out.push(match status {
            Ok(s) => json!({ "worker": addr, "status": s }),
            Err(e) => json!({ "worker": addr, "error": e }),
        });
    }
    Json(Value::Array(out))
}

async fn sessions(State(state): State<Shared>) -> Json<Value> {
    let mut out = Vec::new();
    // The coordinator's current list: `--worker-dns` may have changed it since start.
    for addr in &state.coordinator.workers() {
        let sessions = match admin_client(&state, addr).await {
            Ok(mut c) => c.sessions().await.map_err(|e| e.to_string()),
            Err(e) => Err(e),
        };
        out.push(match sessions {
            Ok(s) => json!({ "worker": addr, "sessions": s }),
            Err(e) => json!({ "worker": addr, "error": e }),
        });
    }
    Json(Value::Array(out))
}
