//! The bearer secret that guards a worker link: held in one type whose `Debug` hides it, so
//! a logged config never prints it, and compared in constant time.

use std::fmt;
use std::sync::Arc;

/// A shared secret sent as `authorization: Bearer TOKEN` on worker calls.
#[derive(Clone, PartialEq, Eq)]
pub struct BearerToken(Arc<str>);

/// Why a token cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// Only printable ASCII fits in a gRPC metadata value, and edge spaces would be trimmed.
    #[error(
        "the token has characters not allowed in a gRPC header (or spaces at an end): use printable ASCII, e.g. `openssl rand -hex 32`"
    )]
    NotPrintableAscii,
}

impl BearerToken {
    /// A token from operator input; an empty string means no token (as an unset variable).
    pub fn parse(token: Option<&str>) -> Result<Option<Self>, TokenError> {
        match token {
            None | Some("") => Ok(None),
            Some(t) if t.trim() == t && t.bytes().all(|b| b.is_ascii_graphic() || b == b' ') => {
                Ok(Some(Self(Arc::from(t))))
            }
            Some(_) => Err(TokenError::NotPrintableAscii),
        }
    }

    /// A fresh random token (64 hex digits, 244 random bits from the operating system's
    /// generator) for a worker and a client started together, e.g. embedded workers and
    /// their coordinator: nobody else on the host can learn it, since it is never logged.
    pub fn generate() -> Self {
        let (a, b) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
        Self(Arc::from(format!("{}{}", a.simple(), b.simple())))
    }

    /// The secret itself, for passing it on (never for printing).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `given` is this token, in time that does not depend on where they differ.
    pub fn matches(&self, given: &str) -> bool {
        constant_time_eq(given.as_bytes(), self.0.as_bytes())
    }

    /// The `authorization` metadata value carrying this token.
    pub fn header_value(&self) -> tonic::metadata::MetadataValue<tonic::metadata::Ascii> {
        // parse() admitted only printable ASCII, which is always a valid header value.
        tonic::metadata::MetadataValue::try_from(format!("Bearer {}", self.0))
            .unwrap_or_else(|_| tonic::metadata::MetadataValue::from_static("Bearer"))
    }
}

impl fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BearerToken(<redacted>)")
    }
}

/// Compares without stopping at the first difference, so timing does not leak the token
/// (only its length).
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_means_none_and_control_characters_are_refused() {
        assert!(BearerToken::parse(None).unwrap().is_none());
        assert!(BearerToken::parse(Some("")).unwrap().is_none());
        assert!(BearerToken::parse(Some(" ab")).is_err());
        assert!(BearerToken::parse(Some("a\u{e9}")).is_err());
        assert!(BearerToken::parse(Some("a b")).unwrap().is_some());
        assert!(BearerToken::parse(Some("a\nb")).is_err());
        let t = BearerToken::parse(Some("s3cret")).unwrap().unwrap();
        assert!(t.matches("s3cret"));
        assert!(!t.matches("s3cre"));
        assert!(!t.matches("s3creT"));
        assert_eq!(t.header_value(), "Bearer s3cret");
    }

    #[test]
    fn generated_tokens_are_long_valid_and_distinct() {
        let (a, b) = (BearerToken::generate(), BearerToken::generate());
        assert_eq!(a.expose().len(), 64);
        assert!(BearerToken::parse(Some(a.expose())).unwrap().is_some());
        assert_ne!(a, b);
    }

    #[test]
    fn debug_never_prints_the_secret() {
        let t = BearerToken::parse(Some("s3cret")).unwrap();
        assert!(!format!("{t:?}").contains("s3cret"));
    }
}
