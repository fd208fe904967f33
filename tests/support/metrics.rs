//! Scraping a worker's `/metrics` and reading its series.

use std::time::Duration;

use super::Worker;

/// The metrics address the worker printed.
pub fn metrics_addr(worker: &Worker) -> String {
    let log = worker.log();
    log.lines()
        .find_map(|l| {
            l.strip_prefix("tether worker metrics on http://")?
                .strip_suffix("/metrics")
        })
        .unwrap_or_else(|| panic!("the worker printed no metrics address; log:\n{log}"))
        .to_string()
}

/// `GET /metrics`: the body, after checking status and content type.
pub fn scrape(addr: &str) -> String {
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to the metrics port");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    std::io::Write::write_all(&mut stream, b"GET /metrics HTTP/1.1\r\nhost: test\r\n\r\n")
        .expect("send the request");
    let mut response = String::new();
    std::io::Read::read_to_string(&mut stream, &mut response).expect("read the response");
    let (head, body) = response.split_once("\r\n\r\n").expect("a head and a body");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("content-type: text/plain"), "{head}");
    body.to_string()
}

/// The value of one series (name and labels as printed).
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}
