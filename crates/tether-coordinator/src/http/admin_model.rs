//! `POST /v1/admin/model` (load a model, or reload the served one) and `DELETE
//! /v1/admin/model` (unload), over [`Coordinator::load_model`] and
//! [`Coordinator::unload_model`].

use super::error::ApiError;
use crate::api::Generation;
use crate::engine::Coordinator;
use crate::lifecycle::{ModelChangeError, ModelChangeReport, ModelLoad};
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::Json;
use serde::Deserialize;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::sync::Arc;

/// The body of `POST /v1/admin/model`; every field is optional (`{}` reloads the served
/// model's file).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LoadBody {
    /// The GGUF file as the coordinator sees it.
    path: Option<PathBuf>,
    /// The model's id in the API.
    id: Option<String>,
    /// Unload the served model first when the new one does not fit beside it.
    #[serde(default)]
    unload_first: bool,
}

/// `POST /v1/admin/model`: answers once the new model serves.
pub(super) async fn load(
    coordinator: &Arc<Coordinator>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let body: LoadBody = match body.is_empty() {
        true => LoadBody::default(),
        false => serde_json::from_slice(&body)
            .map_err(|e| ApiError::invalid(format!("the request body is not a model load: {e}")))?,
    };
    if body.id.as_deref().is_some_and(|id| id.trim().is_empty()) {
        return Err(ApiError::invalid_param(
            "id",
            "the model id must not be empty",
        ));
    }
    // Without a path the served file is loaded again, under its id unless given another.
    let (path, id) = match body.path {
        Some(path) => (path, body.id),
        None => (
            coordinator.model_path(),
            body.id.or_else(|| Some(coordinator.model().id)),
        ),
    };
    let load = ModelLoad {
        path,
        id,
        unload_first: body.unload_first,
    };
    let report = coordinator.load_model(load).await.map_err(refusal)?;
    Ok(Json(report_json(&report)))
}

/// `DELETE /v1/admin/model`.
pub(super) async fn unload(coordinator: &Arc<Coordinator>) -> Result<Json<Value>, ApiError> {
    let report = coordinator.unload_model().await.map_err(refusal)?;
    Ok(Json(report_json(&report)))
}

fn report_json(report: &ModelChangeReport) -> Value {
    let placement: Vec<Value> = report
        .plan
        .iter()
        .flat_map(|p| &p.assignments)
        .map(|a| {
            json!({
                "worker": a.addr,
                "first_layer": a.spec.first_layer,
                "last_layer": a.spec.last_layer,
                "total_bytes": a.bytes.total_bytes,
            })
        })
        .collect();
    json!({
        "model": report.model,
        "previous": report.previous,
        "outage": report.outage,
        "placement": placement,
    })
}

/// A refused or failed change in the API's error shape: 409 while another runs or with
/// nothing to unload, 400 for a file that is no model, 507 when it does not fit, 502 when
/// the workers failed, 503 at shutdown.
fn refusal(e: ModelChangeError) -> ApiError {
    let (status, kind, code) = match &e {
        ModelChangeError::Busy => (
            StatusCode::CONFLICT,
            "conflict_error",
            "model_change_running",
        ),
        ModelChangeError::NotLoaded => (StatusCode::CONFLICT, "conflict_error", "no_model_loaded"),
        ModelChangeError::BadFile(_) => (
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "model_file_unreadable",
        ),
        ModelChangeError::DoesNotFit { .. } => (
            StatusCode::INSUFFICIENT_STORAGE,
            "insufficient_memory_error",
            "model_does_not_fit",
        ),
        ModelChangeError::LoadFailed { .. } => {
            (StatusCode::BAD_GATEWAY, "worker_error", "model_load_failed")
        }
        ModelChangeError::ShuttingDown => (
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable_error",
            "shutting_down",
        ),
    };
    ApiError {
        status,
        kind,
        message: e.to_string(),
        param: None,
        code: Some(code),
    }
}
