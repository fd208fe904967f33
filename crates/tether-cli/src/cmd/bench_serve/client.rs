//! One streaming client of the OpenAI-style API: sends a request, reads its server-sent
//! events as they arrive, and times them.

use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::time::{Duration, Instant};

/// The server the clients talk to.
#[derive(Clone)]
pub(crate) struct Endpoint {
    base: String,
    agent: ureq::Agent,
    api_key: Option<String>,
}

/// The times and counts of one streamed request.
#[derive(Clone, Debug)]
pub(crate) struct Timing {
    /// From sending the request to the first text.
    pub(crate) ttft: Duration,
    /// Between successive text events (a token each, unless the text of a token was
    /// incomplete UTF-8 and waited for the next).
    pub(crate) gaps: Vec<Duration>,
    /// Prompt tokens, as the server counted them.
    pub(crate) prompt_tokens: usize,
    /// Generated tokens, as the server counted them.
    pub(crate) completion_tokens: usize,
    /// The generated text (a chat's next assistant message).
    pub(crate) text: String,
}

impl Endpoint {
    /// A client of `url` (`http://host:port`; `host:port` alone means http).
    pub(crate) fn new(url: &str, api_key: Option<String>) -> Endpoint {
        let base = if url.contains("://") {
            url.trim_end_matches('/').to_string()
        } else {
            format!("http://{}", url.trim_end_matches('/'))
        };
        let agent: ureq::Agent = ureq::Agent::config_builder()
            // Error replies are read, so that their message reaches the report.
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(3600)))
            .build()
            .into();
        Endpoint {
            base,
            agent,
            api_key,
        }
    }

    /// The base URL.
    pub(crate) fn base(&self) -> &str {
        &self.base
    }

    /// Sends `body` to `path` as a streamed request (greedy, every token generated: end
    /// tokens do not end it early) and reads it to the end.
    pub(crate) fn stream(&self, path: &str, mut body: Value) -> Result<Timing> {
        body["stream"] = true.into();
        body["stream_options"] = serde_json::json!({"include_usage": true});
        body["temperature"] = 0.0.into();
        body["ignore_eos"] = true.into();
        let url = format!("{}{path}", self.base);
        let mut request = self
            .agent
            .post(&url)
            .header("Content-Type", "application/json");
        if let Some(key) = &self.api_key {
            request = request.header("Authorization", &format!("Bearer {key}"));
        }
        let sent = Instant::now();
        let response = request
            .send(body.to_string().as_str())
            .with_context(|| format!("POST {url}"))?;
        let status = response.status();
        let reader = response.into_body().into_reader();
        if !status.is_success() {
            let mut text = String::new();
            let _ = reader.take(4096).read_to_string(&mut text);
            bail!("POST {url}: HTTP {status}: {}", text.trim());
        }
        read_events(BufReader::new(reader), sent).with_context(|| format!("POST {url}"))
    }
}

/// Reads server-sent events until `[DONE]`, timing the text events from `sent`.
fn read_events(reader: impl BufRead, sent: Instant) -> Result<Timing> {
    let (mut first, mut last) = (None::<Instant>, sent);
    let mut gaps = Vec::new();
    let mut usage = None;
    let mut text = String::new();
    let mut done = false;
    for line in reader.lines() {
        let line = line.context("reading the event stream")?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data.trim() == "[DONE]" {
            done = true;
            break;
        }
        let event: Value = serde_json::from_str(data)
            .with_context(|| format!("an event that is not JSON: {data:.200}"))?;
        if let Some(error) = event.get("error") {
            bail!("the server ended the stream with an error: {error}");
        }
        if let Some(u) = event.get("usage").filter(|u| !u.is_null()) {
            let count = |key: &str| u.get(key).and_then(Value::as_u64).map(|n| n as usize);
            usage = Some((count("prompt_tokens"), count("completion_tokens")));
        }
        let choice = event.get("choices").and_then(|c| c.get(0));
        let piece = choice.and_then(|c| {
            c.get("text")
                .or_else(|| c.get("delta").and_then(|d| d.get("content")))
                .and_then(Value::as_str)
        });
        if let Some(piece) = piece.filter(|p| !p.is_empty()) {
            let now = Instant::now();
            match first {
                None => first = Some(now),
                Some(_) => gaps.push(now - last),
            }
            last = now;
            text.push_str(piece);
        }
    }
    if !done {
        bail!("the event stream ended without [DONE]");
    }
    let Some((Some(prompt_tokens), Some(completion_tokens))) = usage else {
        bail!("the stream carried no usage chunk (stream_options.include_usage)");
    };
    let Some(first) = first else {
        bail!("the stream carried no text");
    };
    Ok(Timing {
        ttft: first - sent,
        gaps,
        prompt_tokens,
        completion_tokens,
        text,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_timed_and_counted() {
        let stream = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n\
            data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n\
            data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n\
            data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\n\
            data: [DONE]\n\n";
        let t = read_events(stream.as_bytes(), Instant::now()).expect("reads");
        assert_eq!((t.prompt_tokens, t.completion_tokens), (5, 2));
        assert_eq!((t.text.as_str(), t.gaps.len()), ("ab", 1));
    }

    #[test]
    fn cut_streams_errors_and_missing_usage_are_errors() {
        let cut = "data: {\"choices\":[{\"text\":\"a\"}]}\n\n";
        assert!(read_events(cut.as_bytes(), Instant::now()).is_err());
        let error = "data: {\"error\":{\"message\":\"boom\"}}\n\ndata: [DONE]\n\n";
        let e = read_events(error.as_bytes(), Instant::now()).expect_err("error event");
        assert!(e.to_string().contains("boom"), "{e}");
        let no_usage = "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: [DONE]\n\n";
        assert!(read_events(no_usage.as_bytes(), Instant::now()).is_err());
        let garbage = "data: {not json\n\n";
        assert!(read_events(garbage.as_bytes(), Instant::now()).is_err());
    }
}
