//! The OpenAI-compatible HTTP API over any [`Generation`] engine: `/v1/completions`,
//! `/v1/chat/completions` (both streaming), `/v1/models`, `/tokenize`, `/detokenize`,
//! `/health` and `/metrics`.
//!
//! The engine deals in token ids; this module owns the text: tokenizing prompts, rendering
//! chat templates, detokenizing as tokens stream, and cutting at stop strings.

pub mod admin;
mod admin_model;
mod body_deadline;
mod choices;
pub mod cors;
mod embeddings;
mod endpoints;
pub mod error;
mod heavy;
pub mod listen;
pub mod loading;
mod logprobs;
mod messages;
pub mod metrics;
mod mistral_calls;
mod prepare;
mod run;
mod shape;
mod sse;
mod strict;
mod structured;
pub mod template;
pub mod text;
mod tokenize;
mod tools;
pub mod types;

#[cfg(test)]
pub(crate) mod test_support;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_bias;
#[cfg(test)]
mod tests_choices;
#[cfg(test)]
mod tests_cors;
#[cfg(test)]
mod tests_embeddings;
#[cfg(test)]
mod tests_errors;
#[cfg(test)]
mod tests_lifecycle;
#[cfg(test)]
mod tests_logprobs;
#[cfg(test)]
mod tests_stream;
#[cfg(test)]
mod tests_structured;
#[cfg(test)]
mod tests_tokenize;
#[cfg(test)]
mod tests_tools;
#[cfg(test)]
mod tests_tools_mistral;

use std::future::Future;
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;
use tether_model::tokenizer::Tokenizer;

use crate::api::{Generation, Health, ModelInfo};
use crate::constraint::{ConstraintError, Grammars};
pub use body_deadline::{DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES};
pub use cors::CorsOrigin;
pub use error::ApiError;
use heavy::HeavyWork;
pub use heavy::default_max_heavy_requests;
pub use listen::ConnLimits;
use metrics::Metrics;
use template::{ChatTemplate, TemplateBudget};

/// How the HTTP API behaves.
#[derive(Clone, Debug)]
pub struct HttpOptions {
    /// When set, `/v1/*` requests must send `Authorization: Bearer <api_key>`.
    pub api_key: Option<String>,
    /// How long one generation request may take before it fails with 504.
    pub request_timeout: Duration,
    /// Longest prompt accepted, in tokens (the context size always bounds it too).
    pub max_prompt_tokens: Option<usize>,
    /// Largest `max_tokens` a request may ask for; larger values are refused with 400.
    pub max_tokens_limit: usize,
    /// The model's id in the API instead of the engine's.
    pub model_id: Option<String>,
    /// What one rendering of the chat template may cost.
    pub template_budget: TemplateBudget,
    /// Requests whose preparation is CPU-heavy (large bodies, chat templates) prepared at
    /// once on the blocking pool; more are refused with 429.
    pub max_heavy_requests: usize,
    /// Largest request body accepted; larger ones are refused with 413 before being read.
    pub max_body_bytes: usize,
    /// Time a client has to send its whole request body; slower ones get 408.
    pub body_timeout: Duration,
    /// Origins browsers may call the API from (CORS); empty sends no CORS headers.
    pub cors: Vec<CorsOrigin>,
    /// How `/v1/embeddings` pools, instead of the model file's pooling type (and the last
    /// token's where the file names none).
    pub pooling: Option<crate::api::Pooling>,
}

impl Default for HttpOptions {
    fn default() -> Self {
        Self {
            api_key: None,
            request_timeout: Duration::from_secs(600),
            max_prompt_tokens: None,
            max_tokens_limit: 4096,
            model_id: None,
            template_budget: TemplateBudget::default(),
            max_heavy_requests: heavy::default_max_heavy_requests(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            cors: Vec::new(),
            pooling: None,
        }
    }
}

/// What every handler shares, for one load of a model (one [`Generation::model_epoch`]).
struct AppState {
    engine: Arc<dyn Generation>,
    opts: HttpOptions,
    model: ModelInfo,
    model_id: String,
    tokenizer: Arc<Tokenizer>,
    template: ChatTemplate,
    metrics: Arc<Metrics>,
    heavy: HeavyWork,
    /// The engine's model epoch this state was built for; requests carry it, so one
    /// prepared with a replaced model's tokenizer is refused instead of served.
    epoch: u64,
    /// Whether a model was loaded when this state was built.
    loaded: bool,
    /// The grammar compiler for the model's vocabulary, built by the first request that
    /// constrains its output.
    grammars: OnceLock<Result<Arc<Grammars>, ConstraintError>>,
}

type SharedState = Arc<AppState>;

impl AppState {
    fn build(
        engine: Arc<dyn Generation>,
        opts: HttpOptions,
        metrics: Arc<Metrics>,
        heavy: HeavyWork,
    ) -> AppState {
        let epoch = engine.model_epoch();
        let loaded = engine.model_loaded();
        let model = engine.model();
        let tokenizer = engine.tokenizer();
        let template = ChatTemplate::for_model(&model, &tokenizer, opts.template_budget);
        // The configured id names the model served at start, not one loaded later.
        let model_id = match (&opts.model_id, epoch) {
            (Some(id), 0) => id.clone(),
            _ => model.id.clone(),
        };
        AppState {
            engine,
            opts,
            model,
            model_id,
            tokenizer,
            template,
            metrics,
            heavy,
            epoch,
            loaded,
            grammars: OnceLock::new(),
        }
    }

    /// The grammar compiler for the served model.
    fn grammars(&self) -> Result<&Grammars, ConstraintError> {
        self.grammars
            .get_or_init(|| Grammars::for_tokenizer(&self.tokenizer).map(Arc::new))
            .as_deref()
            .map_err(Clone::clone)
    }
}

/// The router's state: the [`AppState`] of the model serving now, built again when the
/// engine's model changes (a load or unload through the admin API).
#[derive(Clone)]
struct Front(Arc<RwLock<SharedState>>);

impl Front {
    fn current(&self) -> SharedState {
        let state = Arc::clone(&self.0.read().unwrap_or_else(|e| e.into_inner()));
        if state.engine.model_epoch() == state.epoch {
            return state;
        }
        let next = Arc::new(AppState::build(
            Arc::clone(&state.engine),
            state.opts.clone(),
            Arc::clone(&state.metrics),
            state.heavy.clone(),
        ));
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = Arc::clone(&next);
        next
    }
}

impl axum::extract::FromRef<Front> for SharedState {
    fn from_ref(front: &Front) -> SharedState {
        front.current()
    }
}

/// Endpoints named in `/metrics`; anything else is counted as `other`.
const ENDPOINTS: [&str; 8] = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/health",
    "/metrics",
];

/// The API's routes over `engine`.
pub fn router(engine: Arc<dyn Generation>, opts: HttpOptions) -> Router {
    let heavy = HeavyWork::new(opts.max_heavy_requests);
    let cors = cors::layer(&opts.cors);
    let state = Arc::new(AppState::build(
        engine,
        opts,
        Arc::new(Metrics::default()),
        heavy,
    ));
    let front = Front(Arc::new(RwLock::new(Arc::clone(&state))));
    let v1 = Router::new()
        .route("/v1/completions", post(endpoints::completions))
        .route("/v1/chat/completions", post(endpoints::chat_completions))
        .route("/v1/models", get(list_models))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        // Inside the key check: a client without the key cannot make us wait on its body.
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            body_deadline::read_body_in_time,
        ))
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            require_api_key,
        ))
        // The body was read under our own limit above.
        .layer(axum::extract::DefaultBodyLimit::disable());
    let app = Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found);
    // Outside the key check, so preflights pass without a key; inside the counting, so
    // they are counted like any request.
    let app = match cors {
        Some(cors) => app.layer(cors),
        None => app,
    };
    app.layer(middleware::from_fn_with_state(
        Arc::clone(&state),
        count_requests,
    ))
    .with_state(front)
}

/// Serves `router` on `listener` under `limits` until `shutdown` completes, then lets
/// open requests finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    listen::serve_with_limits(listener, None, router, limits, shutdown).await
}

/// As [`serve`], over TLS with `config` (HTTPS).
pub async fn serve_tls(
    listener: tokio::net::TcpListener,
    config: tokio_rustls::rustls::ServerConfig,
    router: Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let tls = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    listen::serve_with_limits(listener, Some(tls), router, limits, shutdown).await
}

/// Counts each request by endpoint and status for `/metrics`.
async fn count_requests(State(state): State<SharedState>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let endpoint = ENDPOINTS
        .iter()
        .find(|e| **e == path)
        .copied()
        .unwrap_or("other");
    let response = next.run(req).await;
    state
        .metrics
        .count_request(endpoint, response.status().as_u16());
    response
}

/// Refuses requests without the configured API key.
async fn require_api_key(State(state): State<SharedState>, req: Request, next: Next) -> Response {
    if !bearer_allowed(&req, state.opts.api_key.as_deref()) {
        return ApiError::unauthorized().into_response();
    }
    next.run(req).await
}

/// True when no key is required, or `req` carries `Authorization: Bearer <key>`.
pub(crate) fn bearer_allowed(req: &Request, key: Option<&str>) -> bool {
    let Some(key) = key else {
        return true;
    };
    req.headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .is_some_and(|given| constant_time_eq(given.as_bytes(), key.as_bytes()))
}

/// Compares without an early exit, so the time taken does not reveal how much of a guessed
/// key was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u64;
    for (i, y) in b.iter().enumerate() {
        let x = a.get(i).copied().unwrap_or(0);
        diff |= u64::from(x ^ y);
    }
    diff == 0
}

/// `GET /v1/models`.
async fn list_models(State(state): State<SharedState>) -> Response {
    if !state.loaded {
        return axum::Json(json!({"object": "list", "data": []})).into_response();
    }
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_id,
            "object": "model",
            "created": state.model.created,
            "owned_by": "tether",
            "context_length": state.model.ctx_per_seq,
        }],
    }))
    .into_response()
}

/// `GET /health`: 200 when the engine serves, else 503 with the reason; the model served
/// and, while one runs, the model change and its progress.
async fn health(State(state): State<SharedState>) -> Response {
    let (status, mut body) = match state.engine.health() {
        Health::Ready => (StatusCode::OK, json!({"status": "ok"})),
        Health::Unavailable(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"status": "unavailable", "reason": reason}),
        ),
    };
    if state.loaded {
        body["model"] = json!(state.model_id);
    }
    if let Some(change) = state.engine.model_change() {
        body["model_change"] = json!({
            "model": change.model,
            "phase": change.phase,
            "bytes_loaded": change.bytes_loaded,
            "bytes_total": change.bytes_total,
        });
    }
    (status, axum::Json(body)).into_response()
}

/// `GET /metrics`.
async fn metrics_text(State(state): State<SharedState>, headers: HeaderMap) -> Response {
    tether_metrics::response(&headers, state.metrics.render(&state.engine.stats()))
}

/// Unknown paths, in the API's error shape.
async fn not_found(req: Request) -> Response {
    ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "invalid_request_error",
        message: format!("no endpoint {} {}", req.method(), req.uri().path()),
        param: None,
        code: Some("unknown_url"),
    }
    .into_response()
}

#[cfg(test)]
mod unit_tests {
    use super::constant_time_eq;

    #[test]
    fn constant_time_eq_matches_only_equal_keys() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secreT", b"secret"));
        assert!(!constant_time_eq(b"secret1", b"secret"));
        assert!(!constant_time_eq(b"secre", b"secret"));
        assert!(!constant_time_eq(b"", b"secret"));
    }
}
