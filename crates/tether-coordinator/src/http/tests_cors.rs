//! CORS over a real socket: which origins get the allow headers, and preflights without
//! the API key.

use super::test_support::{Reply, TEST_CTX, TestServer, engine, send, tiny_model};
use super::{CorsOrigin, HttpOptions};

const APP: &str = "https://app.example.com";
const KEY: &str = "s3cret";

/// A browser's preflight for a keyed JSON POST to `/v1/chat/completions` from `origin`.
async fn preflight(server: &TestServer, origin: &str) -> Reply {
    send(
        server.addr,
        "OPTIONS",
        "/v1/chat/completions",
        &[
            ("Origin", origin),
            ("Access-Control-Request-Method", "POST"),
            (
                "Access-Control-Request-Headers",
                "authorization,content-type",
            ),
        ],
        None,
    )
    .await
}

/// `GET /v1/models` from `origin`, with `Authorization` when `key` is given.
async fn models_from(server: &TestServer, origin: &str, key: Option<&str>) -> Reply {
    let bearer = key.map(|k| format!("Bearer {k}"));
    let mut headers = vec![("Origin", origin)];
    if let Some(bearer) = &bearer {
        headers.push(("Authorization", bearer));
    }
    send(server.addr, "GET", "/v1/models", &headers, None).await
}

fn cors_headers(reply: &Reply) -> Vec<&str> {
    reply
        .headers
        .iter()
        .map(|(name, _)| name.as_str())
        .filter(|name| name.starts_with("access-control-"))
        .collect()
}

#[tokio::test]
async fn an_allowed_origin_is_answered_and_preflights_need_no_key() {
    let opts = HttpOptions {
        api_key: Some(KEY.into()),
        cors: vec![APP.parse().expect("a valid origin")],
        ..HttpOptions::default()
    };
    let server = TestServer::start(engine(tiny_model(), TEST_CTX, 2).await, opts).await;

    let pre = preflight(&server, APP).await;
    assert!(
        (200..300).contains(&pre.status),
        "preflight without the key: {pre:?}"
    );
    assert_eq!(pre.header("access-control-allow-origin"), Some(APP));
    let methods = pre.header("access-control-allow-methods").unwrap_or("");
    assert!(methods.contains("POST"), "allowed methods: {methods:?}");
    let allowed = pre
        .header("access-control-allow-headers")
        .unwrap_or("")
        .to_ascii_lowercase();
    assert!(
        allowed.contains("authorization") && allowed.contains("content-type"),
        "allowed headers: {allowed:?}"
    );

    // The real request still needs the key, and its refusal is readable by the page.
    let refused = models_from(&server, APP, None).await;
    assert_eq!(refused.status, 401);
    assert_eq!(refused.header("access-control-allow-origin"), Some(APP));
    let served = models_from(&server, APP, Some(KEY)).await;
    assert_eq!(served.status, 200, "{served:?}");
    assert_eq!(served.header("access-control-allow-origin"), Some(APP));

    // Another origin is served as before, but its page may not read the reply.
    let other = models_from(&server, "https://other.example", Some(KEY)).await;
    assert_eq!(other.status, 200);
    assert_eq!(other.header("access-control-allow-origin"), None);
    let other_pre = preflight(&server, "https://other.example").await;
    assert_eq!(other_pre.header("access-control-allow-origin"), None);
    server.stop().await;
}

#[tokio::test]
async fn a_wildcard_allows_every_origin() {
    let opts = HttpOptions {
        cors: vec![CorsOrigin::Any, APP.parse().expect("a valid origin")],
        ..HttpOptions::default()
    };
    let server = TestServer::start(engine(tiny_model(), TEST_CTX, 2).await, opts).await;
    let reply = models_from(&server, "https://anywhere.example", None).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("access-control-allow-origin"), Some("*"));
    server.stop().await;
}

#[tokio::test]
async fn without_cors_no_cors_headers_are_sent() {
    let opts = HttpOptions {
        api_key: Some(KEY.into()),
        ..HttpOptions::default()
    };
    let server = TestServer::start(engine(tiny_model(), TEST_CTX, 2).await, opts).await;
    let served = models_from(&server, APP, Some(KEY)).await;
    assert_eq!(served.status, 200);
    assert_eq!(cors_headers(&served), Vec::<&str>::new());
    let pre = preflight(&server, APP).await;
    assert!(
        !(200..300).contains(&pre.status),
        "a preflight is not answered: {pre:?}"
    );
    assert_eq!(cors_headers(&pre), Vec::<&str>::new());
    server.stop().await;
}
