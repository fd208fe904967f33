//! Cross-origin requests from browsers (CORS): which origins may call the API.

use std::str::FromStr;

use axum::http::{HeaderValue, Method, header};
use tower_http::cors::{AllowOrigin, CorsLayer};

/// One origin allowed to call the API from a browser.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CorsOrigin {
    /// Any origin (`*`).
    Any,
    /// Exactly this origin, as browsers send it (`https://app.example.com`).
    Exact(HeaderValue),
}

/// Why a string is not an origin [`CorsOrigin`] accepts.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InvalidOrigin {
    /// Nothing was given.
    #[error("the origin is empty; give one like https://app.example.com, or * for any")]
    Empty,
    /// Browsers send origins without a path, so this one would never match.
    #[error("origin {0:?} ends with '/'; browsers send origins without one")]
    TrailingSlash(String),
    /// It cannot be sent in a header.
    #[error("origin {0:?} is not a valid header value (only visible ASCII characters)")]
    NotHeaderValue(String),
}

impl FromStr for CorsOrigin {
    type Err = InvalidOrigin;

    fn from_str(origin: &str) -> Result<Self, Self::Err> {
        if origin == "*" {
            return Ok(CorsOrigin::Any);
        }
        if origin.is_empty() {
            return Err(InvalidOrigin::Empty);
        }
        if origin.ends_with('/') {
            return Err(InvalidOrigin::TrailingSlash(origin.to_owned()));
        }
        // Stricter than `HeaderValue`, which takes non-ASCII bytes: browsers send origins in
        // ASCII (punycode), so anything else would never match.
        let not_header_value = || InvalidOrigin::NotHeaderValue(origin.to_owned());
        if !origin.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(not_header_value());
        }
        HeaderValue::from_str(origin)
            .map(CorsOrigin::Exact)
            .map_err(|_| not_header_value())
    }
}

/// The layer answering preflights and marking replies for `origins`; `None` (no CORS
/// headers at all) when the list is empty.
///
/// It must wrap the API-key check: browsers send no credentials on a preflight, and the
/// real request that follows still goes through the check.
pub(crate) fn layer(origins: &[CorsOrigin]) -> Option<CorsLayer> {
    if origins.is_empty() {
        return None;
    }
    // `*` allows every origin, so exact ones beside it add nothing (and tower-http's list
    // refuses to hold a wildcard).
    let allow_origin = if origins.contains(&CorsOrigin::Any) {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| match o {
            CorsOrigin::Exact(v) => Some(v.clone()),
            CorsOrigin::Any => None,
        }))
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow_origin)
            .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE]),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_parse_or_are_refused_with_the_reason() {
        assert_eq!("*".parse(), Ok(CorsOrigin::Any));
        assert_eq!(
            "https://app.example.com".parse(),
            Ok(CorsOrigin::Exact(HeaderValue::from_static(
                "https://app.example.com"
            )))
        );
        assert_eq!("".parse::<CorsOrigin>(), Err(InvalidOrigin::Empty));
        assert!(matches!(
            "https://a.example/".parse::<CorsOrigin>(),
            Err(InvalidOrigin::TrailingSlash(_))
        ));
        assert!(matches!(
            "https://a.example\n".parse::<CorsOrigin>(),
            Err(InvalidOrigin::NotHeaderValue(_))
        ));
        assert!(matches!(
            "https://é.example".parse::<CorsOrigin>(),
            Err(InvalidOrigin::NotHeaderValue(_))
        ));
    }

    #[test]
    fn no_origins_means_no_layer() {
        assert!(layer(&[]).is_none());
        assert!(layer(&[CorsOrigin::Any, "https://a.example".parse().unwrap()]).is_some());
    }
}
