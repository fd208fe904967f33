//! Counters and histograms of the HTTP API, written in Prometheus' text format.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::api::EngineStats;

/// Bucket bounds in seconds, shared by both histograms: generation times range from
/// milliseconds (a token on a small model) to minutes (a long answer).
const BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// A cumulative histogram of durations.
#[derive(Debug, Default)]
struct Histogram {
    /// One count per bound in [`BUCKETS`]; `+Inf` is `count`.
    buckets: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        for (bound, n) in BUCKETS.iter().zip(self.buckets.iter_mut()) {
            if seconds <= *bound {
                *n += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }

    fn write(&self, out: &mut String, name: &str) {
        for (bound, n) in BUCKETS.iter().zip(self.buckets.iter()) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {n}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

/// What the HTTP layer has seen since start.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Requests by `(endpoint, status code)`.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    time_to_first_token: Mutex<Histogram>,
    request_duration: Mutex<Histogram>,
}

impl Metrics {
    /// Counts a finished request to `endpoint` answered with `status`.
    pub fn count_request(&self, endpoint: &str, status: u16) {
        if let Ok(mut map) = self.requests.lock() {
            *map.entry((endpoint.to_owned(), status)).or_insert(0) += 1;
        }
    }

    /// Adds the tokens of one generation.
    pub fn count_tokens(&self, prompt: usize, completion: usize) {
        self.prompt_tokens
            .fetch_add(prompt as u64, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(completion as u64, Ordering::Relaxed);
    }

    /// Records the time from a request's arrival to its first generated token.
    pub fn observe_first_token(&self, elapsed: Duration) {
        if let Ok(mut h) = self.time_to_first_token.lock() {
            h.observe(elapsed.as_secs_f64());
        }
    }

    /// Records the time a generation request took, until its last byte.
    pub fn observe_duration(&self, elapsed: Duration) {
        if let Ok(mut h) = self.request_duration.lock() {
            h.observe(elapsed.as_secs_f64());
        }
    }

    /// Everything, with the engine's `stats`, in Prometheus' text exposition format.
    pub fn render(&self, stats: &EngineStats) -> String {
        let mut out = String::new();
        out.push_str(
            "# HELP tether_http_requests_total HTTP requests by endpoint and status code.\n",
        );
        out.push_str("# TYPE tether_http_requests_total counter\n");
        if let Ok(map) = self.requests.lock() {
            for ((endpoint, status), n) in map.iter() {
                let _ = writeln!(
                    out,
                    "tether_http_requests_total{{endpoint=\"{}\",code=\"{status}\"}} {n}",
                    escape_label(endpoint)
                );
            }
        }
        let counters = [
            (
                "tether_http_prompt_tokens_total",
                "Prompt tokens of requests served over HTTP.",
                self.prompt_tokens.load(Ordering::Relaxed),
            ),
            (
                "tether_http_generated_tokens_total",
                "Tokens generated for requests served over HTTP.",
                self.completion_tokens.load(Ordering::Relaxed),
            ),
            (
                "tether_engine_prompt_tokens_total",
                "Prompt tokens the engine processed.",
                stats.prompt_tokens,
            ),
            (
                "tether_engine_generated_tokens_total",
                "Tokens the engine generated.",
                stats.generated_tokens,
            ),
            (
                "tether_engine_prefix_cache_hit_tokens_total",
                "Prompt tokens whose KV cells were reused from an earlier request instead of \
                 being processed; the hit rate is this over itself plus the processed ones.",
                stats.prefix_hit_tokens,
            ),
        ];
        for (name, help, value) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
            );
        }
        let gauges = [
            (
                "tether_engine_queued_requests",
                "Requests waiting for a slot.",
                stats.queued,
            ),
            (
                "tether_engine_running_requests",
                "Requests generating now.",
                stats.running,
            ),
        ];
        for (name, help, value) in gauges {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        }
        let histograms = [
            (
                "tether_time_to_first_token_seconds",
                "Time from a request's arrival to its first token.",
                &self.time_to_first_token,
            ),
            (
                "tether_request_duration_seconds",
                "Time a generation request took.",
                &self.request_duration,
            ),
        ];
        for (name, help, h) in histograms {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
            if let Ok(h) = h.lock() {
                h.write(&mut out, name);
            }
        }
        out
    }
}

/// A label value with `\`, `"` and newlines escaped.
fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_counted_by_endpoint_and_status() {
        let m = Metrics::default();
        m.count_request("/v1/completions", 200);
        m.count_request("/v1/completions", 200);
        m.count_request("/v1/completions", 400);
        let text = m.render(&EngineStats::default());
        assert!(
            text.contains(
                "tether_http_requests_total{endpoint=\"/v1/completions\",code=\"200\"} 2"
            )
        );
        assert!(
            text.contains(
                "tether_http_requests_total{endpoint=\"/v1/completions\",code=\"400\"} 1"
            )
        );
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.observe_duration(Duration::from_millis(20));
        m.observe_duration(Duration::from_secs(3));
        let text = m.render(&EngineStats::default());
        assert!(text.contains("tether_request_duration_seconds_bucket{le=\"0.01\"} 0"));
        assert!(text.contains("tether_request_duration_seconds_bucket{le=\"0.025\"} 1"));
        assert!(text.contains("tether_request_duration_seconds_bucket{le=\"5\"} 2"));
        assert!(text.contains("tether_request_duration_seconds_bucket{le=\"+Inf\"} 2"));
        assert!(text.contains("tether_request_duration_seconds_count 2"));
    }

    #[test]
    fn engine_stats_are_shown() {
        let stats = EngineStats {
            queued: 3,
            running: 1,
            generated_tokens: 42,
            prompt_tokens: 7,
            prefix_hit_tokens: 5,
        };
        let text = Metrics::default().render(&stats);
        assert!(text.contains("tether_engine_queued_requests 3"));
        assert!(text.contains("tether_engine_running_requests 1"));
        assert!(text.contains("tether_engine_generated_tokens_total 42"));
        assert!(text.contains("tether_engine_prompt_tokens_total 7"));
        assert!(text.contains("tether_engine_prefix_cache_hit_tokens_total 5"));
    }
}
