//! HTTP/1.1 over plain sockets, so tests see exactly what a client gets (and can hang up).

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

/// Sends one HTTP/1.1 request with `Connection: close` and writes it; returns the stream.
pub fn http_send(addr: &str, method: &str, path: &str, body: Option<&str>) -> std::net::TcpStream {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to serve");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("read timeout");
    let body = body.unwrap_or("");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).expect("write request");
    stream
}

/// Reads the status line and headers; returns the status code and whether the body is
/// chunked.
pub fn http_read_head(reader: &mut impl BufRead) -> (u16, bool) {
    let mut line = String::new();
    reader.read_line(&mut line).expect("status line");
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut chunked = false;
    loop {
        line.clear();
        reader.read_line(&mut line).expect("header line");
        let header = line.trim_end();
        if header.is_empty() {
            return (status, chunked);
        }
        let lower = header.to_ascii_lowercase();
        if lower.starts_with("transfer-encoding:") && lower.contains("chunked") {
            chunked = true;
        }
    }
}

/// Reads the rest of a body, undoing chunked transfer encoding.
pub fn http_read_body(reader: &mut impl BufRead, chunked: bool) -> String {
    let mut body = Vec::new();
    if !chunked {
        reader.read_to_end(&mut body).expect("read body");
        return String::from_utf8_lossy(&body).into_owned();
    }
    loop {
        let mut size = String::new();
        reader.read_line(&mut size).expect("chunk size");
        let size = usize::from_str_radix(size.trim().split(';').next().unwrap_or(""), 16)
            .unwrap_or_else(|_| panic!("bad chunk size {size:?}"));
        if size == 0 {
            return String::from_utf8_lossy(&body).into_owned();
        }
        let start = body.len();
        body.resize(start + size, 0);
        reader.read_exact(&mut body[start..]).expect("chunk data");
        let mut crlf = [0u8; 2];
        reader.read_exact(&mut crlf).expect("chunk end");
    }
}

/// One whole HTTP request: the status and the body.
pub fn http(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let mut reader = BufReader::new(http_send(addr, method, path, body));
    let (status, chunked) = http_read_head(&mut reader);
    (status, http_read_body(&mut reader, chunked))
}

/// `GET path`, expecting 200 and JSON.
pub fn http_json(addr: &str, path: &str) -> serde_json::Value {
    let (status, body) = http(addr, "GET", path, None);
    assert_eq!(status, 200, "GET {path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path} is not JSON ({e}): {body}"))
}

/// One HTTP request that never panics and never waits past `deadline` in all: the status
/// and body, or what went wrong (connect, write, a read that timed out).
pub fn http_deadline(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    deadline: Duration,
) -> Result<(u16, String), String> {
    use std::io::{Read, Write};
    let start = Instant::now();
    let sock: std::net::SocketAddr = addr.parse().map_err(|e| format!("address {addr}: {e}"))?;
    let mut stream = std::net::TcpStream::connect_timeout(&sock, deadline)
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let body = body.unwrap_or("");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream
        .set_write_timeout(Some(deadline))
        .and_then(|()| stream.write_all(request.as_bytes()))
        .map_err(|e| format!("write {method} {path}: {e}"))?;
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let left = deadline.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Err(format!("{method} {path} hung past {deadline:?}"));
        }
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| format!("read timeout: {e}"))?;
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(format!("{method} {path} hung past {deadline:?}"));
            }
            Err(e) if raw.is_empty() => return Err(format!("{method} {path}: {e}")),
            Err(_) => break,
        }
    }
    let mut reader = BufReader::new(raw.as_slice());
    let mut line = String::new();
    let _ = reader.read_line(&mut line);
    let Some(status) = line.split_whitespace().nth(1).and_then(|s| s.parse().ok()) else {
        return Err(format!("{method} {path}: bad status line {line:?}"));
    };
    let mut chunked = false;
    loop {
        line.clear();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line.trim_end().is_empty() {
            break;
        }
        let lower = line.to_ascii_lowercase();
        chunked |= lower.starts_with("transfer-encoding:") && lower.contains("chunked");
    }
    let mut rest = Vec::new();
    let _ = reader.read_to_end(&mut rest);
    let text = if chunked {
        std::panic::catch_unwind(|| http_read_body(&mut rest.as_slice(), true))
            .map_err(|_| format!("{method} {path}: truncated chunked body"))?
    } else {
        String::from_utf8_lossy(&rest).into_owned()
    };
    Ok((status, text))
}

/// A `/v1/completions` body for greedy generation without repetition penalty.
pub fn completion_body(prompt: &[u32], max_tokens: usize, stream: bool) -> String {
    serde_json::json!({
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "repeat_penalty": 1.0,
        "stream": stream,
    })
    .to_string()
}
