//! A minimal HTTP/1.1 client for tests (one request per connection), so tests need no
//! heavy client stack and see exactly what went over the wire.

use anyhow::{anyhow, Context};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> anyhow::Result<serde_json::Value> {
        serde_json::from_str(&self.body).with_context(|| format!("not JSON: {:?}", self.body))
    }
}

/// Sends one request to `addr` (`host:port`), bounded by `timeout`.
pub async fn request(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
) -> anyhow::Result<Response> {
    tokio::time::timeout(timeout, request_inner(addr, method, path, body))
        .await
        .map_err(|_| anyhow!("{method} {path} on {addr}: no answer within {timeout:?}"))?
}

pub async fn get(addr: &str, path: &str) -> anyhow::Result<Response> {
    request(addr, "GET", path, None, Duration::from_secs(10)).await
}

/// Sends a JSON body (`application/json`).
pub async fn send_json(
    addr: &str,
    method: &str,
    path: &str,
    body: &serde_json::Value,
) -> anyhow::Result<Response> {
    let text = body.to_string();
    request(addr, method, path, Some(&text), Duration::from_secs(10)).await
}

/// Sends `body` with exactly the given headers (no default content type; `Host` is the
/// address unless given).
pub async fn request_with(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> anyhow::Result<Response> {
    tokio::time::timeout(
        Duration::from_secs(10),
        exchange(addr, method, path, headers, body),
    )
    .await
    .map_err(|_| anyhow!("{method} {path} on {addr}: no answer within 10 s"))?
}

async fn request_inner(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> anyhow::Result<Response> {
    let body = body.unwrap_or("");
    exchange(
        addr,
        method,
        path,
        &[("Content-Type", "application/json")],
        body.as_bytes(),
    )
    .await
}

async fn exchange(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> anyhow::Result<Response> {
    let mut s = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    // The address connected to, unless the caller names another Host.
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    s.write_all(req.as_bytes()).await?;
    // A server may answer (413) and close before reading a large body: the answer
    // is what counts.
    let _ = s.write_all(body).await;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow!("malformed response {text:?}"))?;
    let mut lines = head.lines();
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("malformed status line {status_line:?}"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked {
        dechunk(rest)?
    } else {
        rest.to_string()
    };
    Ok(Response {
        status,
        headers,
        body,
    })
}

fn dechunk(mut s: &str) -> anyhow::Result<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = s
            .split_once("\r\n")
            .ok_or_else(|| anyhow!("bad chunk framing"))?;
        let n = usize::from_str_radix(size.trim(), 16)?;
        if n == 0 {
            return Ok(out);
        }
        out.push_str(rest.get(..n).ok_or_else(|| anyhow!("short chunk"))?);
        s = rest.get(n + 2..).ok_or_else(|| anyhow!("short chunk"))?;
    }
}

/// The value of one sample in a Prometheus text page: the line `sample value` where
/// `sample` is `name` or `name{labels}` exactly as rendered.
pub fn sample_of(text: &str, sample: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(sample) && l[sample.len()..].starts_with(' '))
        .and_then(|l| l[sample.len()..].trim().parse().ok())
}

/// One sample of the `/metrics` page of the meshd at `addr` (see [`sample_of`]).
pub async fn metric(addr: &str, sample: &str) -> anyhow::Result<f64> {
    let r = get(addr, "/metrics").await?;
    anyhow::ensure!(r.status == 200, "/metrics answered {}", r.status);
    sample_of(&r.body, sample).ok_or_else(|| anyhow::anyhow!("no sample {sample} in /metrics"))
}

#[cfg(test)]
mod metric_tests {
    use super::sample_of;

    #[test]
    fn finds_exactly_the_sample_asked_for() {
        let page = "# HELP x\nm_total 3\nm_total{a=\"b\"} 4.5\nm_total_more 9\n";
        assert_eq!(sample_of(page, "m_total"), Some(3.0));
        assert_eq!(sample_of(page, "m_total{a=\"b\"}"), Some(4.5));
        assert_eq!(sample_of(page, "m_tot"), None);
        assert_eq!(sample_of(page, "absent"), None);
    }
}
