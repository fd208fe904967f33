//! Token guards in front of the worker's services: the data plane (`tether.v1.Worker`:
//! Hello, Attach, Prepare, Commit, Forward, ...) and the admin service. They run on the
//! request headers, before any handler, so a refused call opens no session and reserves no
//! byte. The health service has no guard: probes carry no secrets.

use tether_protocol::BearerToken;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// One guard: `None` admits every call; otherwise `authorization: Bearer TOKEN` must match.
#[derive(Clone)]
struct TokenGuard {
    token: Option<BearerToken>,
    service: &'static str,
    missing: &'static str,
    wrong: &'static str,
}

impl TokenGuard {
    fn check(&self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.token else {
            return Ok(request);
        };
        let given = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let refused = match given {
            Some(token) if expected.matches(token) => return Ok(request),
            Some(_) => self.wrong,
            None => self.missing,
        };
        let peer = request
            .remote_addr()
            .map_or_else(|| "unknown".to_string(), |a| a.to_string());
        tracing::warn!(%peer, service = self.service, "refused a call: {refused}");
        Err(Status::unauthenticated(refused))
    }
}

/// Admits admin calls (tetherctl) carrying the admin token, when one is set.
#[derive(Clone)]
pub struct AdminAuth(TokenGuard);

impl AdminAuth {
    /// A guard for `token`; `None` admits every call.
    pub fn new(token: Option<BearerToken>) -> Self {
        Self(TokenGuard {
            token,
            service: "admin",
            missing: "this worker requires a token on admin calls: pass tetherctl --admin-token or set TETHER_ADMIN_TOKEN (TETHER_WORKER_TOKEN when the worker has only --token)",
            wrong: "the admin token does not match this worker's",
        })
    }
}

impl Interceptor for AdminAuth {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        self.0.check(request)
    }
}

/// Admits data-plane calls (coordinators, `tether attach`) carrying the worker's `--token`,
/// when one is set.
#[derive(Clone)]
pub struct WorkerAuth(TokenGuard);

impl WorkerAuth {
    /// A guard for `token`; `None` admits every call.
    pub fn new(token: Option<BearerToken>) -> Self {
        Self(TokenGuard {
            token,
            service: "worker",
            missing: "this worker requires a token on every session call: pass --worker-token or set TETHER_WORKER_TOKEN (the value of the worker's --token)",
            wrong: "the worker token does not match this worker's --token",
        })
    }
}

impl Interceptor for WorkerAuth {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        self.0.check(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(auth: &mut impl Interceptor, header: Option<&str>) -> Result<(), Status> {
        let mut req = Request::new(());
        if let Some(h) = header {
            req.metadata_mut()
                .insert("authorization", h.parse().unwrap());
        }
        auth.call(req).map(|_| ())
    }

    fn token(t: &str) -> Option<BearerToken> {
        BearerToken::parse(Some(t)).unwrap()
    }

    #[test]
    fn admin_guard_admits_only_the_right_token() {
        let mut open = AdminAuth::new(None);
        assert!(call(&mut open, None).is_ok());
        let mut guarded = AdminAuth::new(token("s3cret"));
        let code = |r: Result<(), Status>| r.map_err(|s| s.code());
        assert_eq!(
            code(call(&mut guarded, None)),
            Err(tonic::Code::Unauthenticated)
        );
        assert_eq!(
            code(call(&mut guarded, Some("Bearer nope"))),
            Err(tonic::Code::Unauthenticated)
        );
        assert_eq!(code(call(&mut guarded, Some("Bearer s3cret"))), Ok(()));
    }

    #[test]
    fn worker_guard_refusals_say_what_to_do_and_never_echo_a_token() {
        let mut guarded = WorkerAuth::new(token("s3cret"));
        let missing = call(&mut guarded, None).unwrap_err();
        assert_eq!(missing.code(), tonic::Code::Unauthenticated);
        assert!(missing.message().contains("--worker-token"), "{missing:?}");
        let wrong = call(&mut guarded, Some("Bearer guess-s3cret")).unwrap_err();
        assert_eq!(wrong.code(), tonic::Code::Unauthenticated);
        assert!(!wrong.message().contains("s3cret"), "{wrong:?}");
        // Another scheme, or the token without one, is not the token.
        assert!(call(&mut guarded, Some("Basic s3cret")).is_err());
        assert!(call(&mut guarded, Some("s3cret")).is_err());
        assert!(call(&mut guarded, Some("Bearer s3cret")).is_ok());
        assert!(call(&mut WorkerAuth::new(None), None).is_ok());
    }
}
