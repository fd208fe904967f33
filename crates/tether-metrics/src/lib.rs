//! Prometheus exposition shared by the worker and the coordinator. Both keep their series in
//! `prometheus-client` types (one counter, gauge and histogram implementation), render them
//! here and answer scrapes through axum: the coordinator on its API router, the worker on
//! its own metrics port ([`serve`]).

mod serve;

pub use serve::{router, serve};

use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::{EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::{Metric, Registry};
use std::fmt::Write as _;

/// Content type for scrapers that ask for OpenMetrics (Prometheus does): the format the
/// text is written in.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Content type for everyone else (curl, older scrapers); its parsers read the same sample
/// lines and take `# EOF` for a comment.
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Registers `metric` under the name its samples carry, so the source reads as dashboards
/// query: a counter's `_total` is left to the encoder, which appends it, and so is the
/// period the encoder appends to `help`.
pub fn register<M: Metric + TypedMetric>(
    registry: &mut Registry,
    sample_name: &str,
    help: &str,
    metric: M,
) {
    let name = match M::TYPE {
        MetricType::Counter => sample_name.strip_suffix("_total").unwrap_or(sample_name),
        _ => sample_name,
    };
    registry.register(name, help.strip_suffix('.').unwrap_or(help), metric);
}

/// `registry` in the text exposition format, ending with OpenMetrics' `# EOF`.
pub fn render(registry: &Registry) -> String {
    let mut out = String::with_capacity(4096);
    // Writing into a String cannot fail; only a metric's own encoder could, and then the
    // scrape still gets what was written before it.
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, registry) {
        tracing::error!("encoding metrics failed: {e}");
    }
    out
}

/// The answer to a scrape whose request carried `request_headers`: `text` with the content
/// type the scraper asked for.
pub fn response(request_headers: &HeaderMap, text: String) -> Response {
    let openmetrics = request_headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    let content_type = if openmetrics {
        OPENMETRICS_CONTENT_TYPE
    } else {
        TEXT_CONTENT_TYPE
    };
    (
        [(header::CONTENT_TYPE, HeaderValue::from_static(content_type))],
        text,
    )
        .into_response()
}

/// A label value from outside (a client's name, an endpoint), escaped as the exposition
/// format asks: prometheus-client writes label values as they are, and a quote in one would
/// break every line after it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LabelText(pub String);

impl EncodeLabelValue for LabelText {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        for c in self.0.chars() {
            match c {
                '\\' => encoder.write_str("\\\\")?,
                '"' => encoder.write_str("\\\"")?,
                '\n' => encoder.write_str("\\n")?,
                c => encoder.write_char(c)?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::metrics::histogram::Histogram;

    #[test]
    fn samples_keep_their_names_and_help_its_text() {
        let mut registry = Registry::default();
        let counter = Counter::<u64>::default();
        counter.inc_by(3);
        register(&mut registry, "x_total", "Things counted.", counter);
        let gauge = Gauge::<i64>::default();
        gauge.set(-2);
        register(&mut registry, "y", "A level.", gauge);
        let text = render(&registry);
        assert!(text.contains("# HELP x Things counted.\n"), "{text}");
        assert!(text.contains("# TYPE x counter\n"), "{text}");
        assert!(text.contains("\nx_total 3\n"), "{text}");
        assert!(
            text.contains("# HELP y A level.\n# TYPE y gauge\ny -2\n"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn histogram_buckets_are_cumulative_and_sum_in_seconds() {
        let mut registry = Registry::default();
        let h = Histogram::new([0.0005, 0.0025, 0.005, 10.0]);
        h.observe(0.0003);
        h.observe(0.003);
        h.observe(20.0);
        register(&mut registry, "x", "Durations.", h);
        let out = render(&registry);
        assert!(out.contains("x_bucket{le=\"0.0005\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"0.0025\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"0.005\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"10.0\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"+Inf\"} 3\n"), "{out}");
        assert!(out.contains("x_count 3\n"), "{out}");
        let sum: f64 = out
            .lines()
            .find_map(|l| l.strip_prefix("x_sum "))
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN);
        assert!((sum - 20.0033).abs() < 1e-9, "{sum}");
    }

    #[test]
    fn label_values_are_escaped() {
        let mut registry = Registry::default();
        let family = Family::<[(&'static str, LabelText); 1], Counter>::default();
        family
            .get_or_create(&[("client", LabelText("a\"b\\c\nd".into()))])
            .inc();
        register(&mut registry, "clients_total", "Clients.", family);
        let text = render(&registry);
        assert!(
            text.contains("clients_total{client=\"a\\\"b\\\\c\\nd\"} 1\n"),
            "{text}"
        );
    }

    #[test]
    fn the_content_type_follows_what_the_scraper_accepts() {
        let mut prometheus = HeaderMap::new();
        prometheus.insert(
            header::ACCEPT,
            HeaderValue::from_static(
                "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
            ),
        );
        let answered = |headers: &HeaderMap| {
            response(headers, String::new())
                .headers()
                .get(header::CONTENT_TYPE)
                .cloned()
        };
        assert_eq!(
            answered(&prometheus),
            Some(HeaderValue::from_static(OPENMETRICS_CONTENT_TYPE))
        );
        assert_eq!(
            answered(&HeaderMap::new()),
            Some(HeaderValue::from_static(TEXT_CONTENT_TYPE))
        );
    }
}
