//! Counters and histograms of the HTTP API, in Prometheus' text format.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tether_metrics::{LabelText, register, render};

use crate::api::EngineStats;

/// Bucket bounds in seconds, shared by both histograms: generation times range from
/// milliseconds (a token on a small model) to minutes (a long answer).
const BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Labels of a request series.
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RequestLabels {
    endpoint: LabelText,
    code: u16,
}

/// What the HTTP layer has seen since start.
#[derive(Debug)]
pub struct Metrics {
    requests: Family<RequestLabels, Counter>,
    prompt_tokens: Counter,
    completion_tokens: Counter,
    time_to_first_token: Histogram,
    request_duration: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            requests: Family::default(),
            prompt_tokens: Counter::default(),
            completion_tokens: Counter::default(),
            time_to_first_token: Histogram::new(BUCKETS),
            request_duration: Histogram::new(BUCKETS),
        }
    }
}

impl Metrics {
    /// Counts a finished request to `endpoint` answered with `status`.
    pub fn count_request(&self, endpoint: &str, status: u16) {
        self.requests
            .get_or_create(&RequestLabels {
                endpoint: LabelText(endpoint.to_owned()),
                code: status,
            })
            .inc();
    }

    /// Adds the tokens of one generation.
    pub fn count_tokens(&self, prompt: usize, completion: usize) {
        self.prompt_tokens.inc_by(prompt as u64);
        self.completion_tokens.inc_by(completion as u64);
    }

    /// Records the time from a request's arrival to its first generated token.
    pub fn observe_first_token(&self, elapsed: Duration) {
        self.time_to_first_token.observe(elapsed.as_secs_f64());
    }

    /// Records the time a generation request took, until its last byte.
    pub fn observe_duration(&self, elapsed: Duration) {
        self.request_duration.observe(elapsed.as_secs_f64());
    }

    /// Everything, with the engine's `stats`, in Prometheus' text exposition format.
    pub fn render(&self, stats: &EngineStats) -> String {
        let mut reg = Registry::default();
        register(
            &mut reg,
            "tether_http_requests_total",
            "HTTP requests by endpoint and status code.",
            self.requests.clone(),
        );
        register(
            &mut reg,
            "tether_http_prompt_tokens_total",
            "Prompt tokens of requests served over HTTP.",
            self.prompt_tokens.clone(),
        );
        register(
            &mut reg,
            "tether_http_generated_tokens_total",
            "Tokens generated for requests served over HTTP.",
            self.completion_tokens.clone(),
        );
        let engine_counters = [
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
            (
                "tether_engine_prefix_cache_evictions_total",
                "Cached prefixes whose KV cells were given up for room in the workers' paged \
                 pool, least recently used first.",
                stats.prefix_evictions,
            ),
        ];
        for (name, help, value) in engine_counters {
            register(&mut reg, name, help, ConstCounter::new(value));
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
            (
                "tether_engine_kv_blocks",
                "Blocks of 32 KV cells in each worker's paged pool.",
                stats.kv_blocks,
            ),
            (
                "tether_engine_kv_blocks_free",
                "Blocks of each worker's paged KV pool that no sequence, running or cached, \
                 holds.",
                stats.kv_blocks_free,
            ),
        ];
        for (name, help, value) in gauges {
            register(&mut reg, name, help, ConstGauge::new(value));
        }
        register(
            &mut reg,
            "tether_time_to_first_token_seconds",
            "Time from a request's arrival to its first token.",
            self.time_to_first_token.clone(),
        );
        register(
            &mut reg,
            "tether_request_duration_seconds",
            "Time a generation request took.",
            self.request_duration.clone(),
        );
        render(&reg)
    }
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
        assert!(text.contains("tether_request_duration_seconds_bucket{le=\"5.0\"} 2"));
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
            prefix_evictions: 2,
            kv_blocks: 64,
            kv_blocks_free: 60,
        };
        let text = Metrics::default().render(&stats);
        assert!(text.contains("tether_engine_queued_requests 3"));
        assert!(text.contains("tether_engine_running_requests 1"));
        assert!(text.contains("tether_engine_generated_tokens_total 42"));
        assert!(text.contains("tether_engine_prompt_tokens_total 7"));
        assert!(text.contains("tether_engine_prefix_cache_hit_tokens_total 5"));
        assert!(text.contains("tether_engine_prefix_cache_evictions_total 2"));
        assert!(text.contains("tether_engine_kv_blocks 64"));
        assert!(text.contains("tether_engine_kv_blocks_free 60"));
    }
}
