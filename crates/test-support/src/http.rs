//! Requests for tests over [`meshd_client`]'s transport (one connection per request),
//! with answers kept as text so assertions can show them.

use anyhow::anyhow;
use std::time::Duration;

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
        serde_json::from_str(&self.body).map_err(|e| anyhow!("not JSON ({e}): {:?}", self.body))
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
    let headers = [("Content-Type", "application/json")];
    request_with_timeout(
        addr,
        method,
        path,
        &headers,
        body.unwrap_or("").as_bytes(),
        timeout,
    )
    .await
}

pub async fn get(addr: &str, path: &str) -> anyhow::Result<Response> {
    request(addr, "GET", path, None, Duration::from_secs(10)).await
}

/// A `GET` from synchronous code (process harnesses, blocking tests): runs on a thread
/// of its own, so it works inside an async runtime too.
pub fn get_blocking(addr: &str, path: &str, timeout: Duration) -> anyhow::Result<Response> {
    let (addr, path) = (addr.to_string(), path.to_string());
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(request(&addr, "GET", &path, None, timeout))
    })
    .join()
    .map_err(|_| anyhow!("the request thread panicked"))?
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
    request_with_timeout(addr, method, path, headers, body, Duration::from_secs(10)).await
}

/// [`request_with`] bounded by `timeout` instead of 10 s.
pub async fn request_with_timeout(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> anyhow::Result<Response> {
    let target = meshd_client::Target::peer(addr, false)?;
    let method = meshd_client::Method::from_bytes(method.as_bytes())?;
    let mut req = meshd_client::Request::new(method, path)
        .raw_body(body.to_vec())
        .timeout(timeout);
    for (k, v) in headers {
        req = req.header(k, *v);
    }
    let a = meshd_client::Transport::new()
        .send(&target, req)
        .await
        .map_err(|e| anyhow!("{path} on {addr}: {e}"))?;
    Ok(Response {
        status: a.status,
        headers: a
            .headers
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body: a.text(),
    })
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
