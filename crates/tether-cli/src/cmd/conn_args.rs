//! The API server's connection settings: `--max-connections`, `--header-timeout`,
//! `--body-timeout`, `--max-body-bytes`, and the origins browsers may call it from
//! (`--cors`).

use crate::ctl::units::parse_duration;
use clap::Args;
use std::time::Duration;
use tether_coordinator::http::{ConnLimits, CorsOrigin, DEFAULT_MAX_BODY_BYTES, HttpOptions};

/// Descriptors kept free beyond the connection cap: worker channels, model files, logs.
const SPARE_DESCRIPTORS: u64 = 256;

/// How many connections the API holds and how long it waits on each.
#[derive(Args, Debug, Clone)]
pub struct ConnArgs {
    /// Connections the API holds open at once; more are answered 503 (HTTPS: closed)
    /// at once. Lowered at start if the process may not open that many descriptors.
    #[arg(long, default_value_t = ConnLimits::default().max_connections)]
    pub max_connections: usize,
    /// Time a connection has to send a complete request head, from its opening and from
    /// the end of each response (so it also closes idle keep-alive connections).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub header_timeout: Duration,
    /// Time a client has to send its whole request body; slower ones get 408.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub body_timeout: Duration,
    /// Largest request body accepted, in bytes; larger ones get 413 before being read.
    #[arg(long, default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    /// An origin browsers may call the API from (CORS), e.g. https://app.example.com;
    /// repeat for more, `*` for any. Without it no CORS headers are sent.
    #[arg(long = "cors", value_name = "ORIGIN")]
    pub cors: Vec<CorsOrigin>,
}

impl ConnArgs {
    /// The limits of the accept loop, with the cap fitted to the descriptors this process
    /// may open (raising its soft limit to the hard one first).
    pub fn limits(&self) -> ConnLimits {
        let mut max_connections = self.max_connections.max(1);
        if let Some(allowed) = raise_descriptor_limit() {
            let fits = allowed.saturating_sub(SPARE_DESCRIPTORS).max(1);
            if (max_connections as u64) > fits {
                tracing::warn!(
                    asked = max_connections,
                    descriptors = allowed,
                    "--max-connections lowered to {fits}: the process may open only {allowed} descriptors"
                );
                max_connections = fits as usize;
            }
        }
        ConnLimits {
            max_connections,
            header_timeout: self.header_timeout,
            ..ConnLimits::default()
        }
    }

    /// Sets the body limits and CORS origins of `opts`.
    pub fn apply(&self, opts: &mut HttpOptions) {
        opts.max_body_bytes = self.max_body_bytes;
        opts.body_timeout = self.body_timeout;
        opts.cors = self.cors.clone();
    }
}

/// Raises the soft descriptor limit to the hard one and returns it (`None` when it cannot
/// be read).
fn raise_descriptor_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return None;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
    }
    Some(lim.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use tether_coordinator::http::DEFAULT_BODY_TIMEOUT;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        conn: ConnArgs,
    }

    #[test]
    fn defaults_match_the_library() {
        assert_eq!(DEFAULT_BODY_TIMEOUT, Duration::from_secs(30));
        assert_eq!(
            ConnLimits::default().header_timeout,
            Duration::from_secs(30)
        );
    }

    #[test]
    fn cors_origins_repeat_and_bad_ones_are_refused_naming_the_flag() {
        let cli = Cli::try_parse_from(["t"]).expect("no flags");
        let mut opts = HttpOptions::default();
        cli.conn.apply(&mut opts);
        assert!(opts.cors.is_empty());

        let cli = Cli::try_parse_from(["t", "--cors", "https://a.example", "--cors", "*"])
            .expect("two origins");
        cli.conn.apply(&mut opts);
        assert_eq!(opts.cors.len(), 2);
        assert_eq!(opts.cors[1], CorsOrigin::Any);

        for bad in ["https://a.example\n", "https://a.example/", ""] {
            let err = match Cli::try_parse_from(["t", "--cors", bad]) {
                Ok(_) => panic!("{bad:?} was accepted"),
                Err(e) => e.to_string(),
            };
            assert!(err.contains("--cors"), "{bad:?}: {err}");
        }
    }
}
