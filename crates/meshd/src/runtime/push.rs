//! Push delivery: one worker per push subscription pulls from the subscription's
//! partitions through the same runtime as HTTP pulls (so the write-ahead attempt rule,
//! leases, retries, backoff and dead-lettering are the same) and POSTs each event to
//! `push.url` in CloudEvents binary mode with `meshd-delivery-attempt`. A 2xx answer
//! within `ack_timeout_ms` acks the delivery; anything else (another status, a timeout,
//! a refused connection) nacks it with that reason. At most [`CONCURRENCY`] requests
//! per subscription are in flight.

use super::{Handed, Runtime, RuntimeError};
use crate::metrics::SubCounters;
use meshd_events::{to_binary_mode, Event};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Semaphore;

/// Push requests in flight per subscription.
pub const CONCURRENCY: usize = 16;
/// How long one pull of the worker waits for events.
const PULL_WAIT: Duration = Duration::from_secs(1);
/// Pause after a pull that failed (store failure, restart in progress).
const PULL_RETRY: Duration = Duration::from_millis(500);
/// The status line and headers of an answer are read up to this size.
const MAX_HEAD: usize = 16 * 1024;

/// A parsed `http[s]://host:port/path` URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub host: String,
    pub port: u16,
    pub path: String,
    /// `https://`: TLS, the certificate checked against `--push-ca-file` (or the
    /// system's CAs) for `host`.
    pub https: bool,
}

impl Target {
    pub fn parse(url: &str) -> Result<Target, String> {
        let (rest, https) = if let Some(r) = url.strip_prefix("http://") {
            (r, false)
        } else if let Some(r) = url.strip_prefix("https://") {
            (r, true)
        } else {
            return Err(format!("{url:?} is not an http:// or https:// URL"));
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        if authority.is_empty() || authority.contains('@') {
            return Err(format!("{url:?} has no usable host"));
        }
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => {
                let port = p
                    .parse::<u16>()
                    .map_err(|_| format!("{url:?} has an invalid port"))?;
                (h, port)
            }
            _ => (authority, if https { 443 } else { 80 }),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(format!("{url:?} has no host"));
        }
        Ok(Target {
            host: host.to_string(),
            port,
            path: path.to_string(),
            https,
        })
    }
}

/// Runs until the subscription's incarnation stops (its worker is aborted then) or
/// the runtime is gone.
pub async fn worker(
    runtime: Weak<Runtime>,
    name: String,
    target: Target,
    tls: Option<tokio_rustls::TlsConnector>,
    egress: Arc<crate::egress::Egress>,
    ack_timeout: Duration,
    counters: Arc<SubCounters>,
) {
    let slots = Arc::new(Semaphore::new(CONCURRENCY));
    loop {
        // Wait for a free slot, then pull as many events as there are free slots.
        let Ok(first) = slots.clone().acquire_owned().await else {
            return;
        };
        let free = slots.available_permits() + 1;
        let Some(rt) = runtime.upgrade() else {
            return;
        };
        // One event per free slot: memory is bounded by the slots (each event at
        // most the largest event size).
        let budget = super::PullBudget::new(free, usize::MAX);
        let handed = rt.pull_running(&name, budget, PULL_WAIT, None).await;
        drop(rt);
        let handed = match handed {
            Ok(h) => h,
            Err(RuntimeError::NotFound(_)) => return,
            Err(RuntimeError::Restarting(_)) => {
                // Stopped for a settings change: this worker is aborted and a new
                // one started with the new settings.
                drop(first);
                tokio::time::sleep(PULL_RETRY).await;
                continue;
            }
            Err(e) => {
                tracing::warn!(subscription = %name, error = %e, "push worker: pull failed; retrying");
                drop(first);
                tokio::time::sleep(PULL_RETRY).await;
                continue;
            }
        };
        let mut permit = Some(first);
        for d in handed {
            let p = match permit.take() {
                Some(p) => p,
                None => match slots.clone().acquire_owned().await {
                    Ok(p) => p,
                    Err(_) => return,
                },
            };
            let runtime = runtime.clone();
            let name = name.clone();
            let target = target.clone();
            let tls = tls.clone();
            let egress = egress.clone();
            let counters = counters.clone();
            tokio::spawn(async move {
                let outcome = post(&target, tls.as_ref(), &egress, &d, ack_timeout).await;
                let Some(rt) = runtime.upgrade() else {
                    return;
                };
                let id = vec![d.delivery_id.clone()];
                let answered = match outcome {
                    Ok(()) => {
                        SubCounters::add(&counters.push_ok, 1);
                        rt.ack_running(&name, id).await
                    }
                    Err(reason) => {
                        SubCounters::add(&counters.push_failed, 1);
                        tracing::info!(subscription = %name, delivery = %d.delivery_id, attempt = d.attempt, reason = %reason, "push delivery failed");
                        rt.nack_running(&name, id, reason).await
                    }
                };
                if let Err(e) = answered {
                    // The lease runs out and the event is retried.
                    tracing::warn!(subscription = %name, delivery = %d.delivery_id, error = %e, "recording a push outcome failed");
                }
                drop(p);
            });
        }
    }
}

/// One POST in binary mode; `Ok` for a 2xx within `timeout`, else the reason. `tls`
/// is the client for `https://` targets (`None`: no CA could be loaded); `egress`
/// the address rules every connect is checked by.
pub async fn post(
    target: &Target,
    tls: Option<&tokio_rustls::TlsConnector>,
    egress: &crate::egress::Egress,
    d: &Handed,
    timeout: Duration,
) -> Result<(), String> {
    let tls =
        match (target.https, tls) {
            (false, _) => None,
            (true, Some(tls)) => Some(tls),
            (true, None) => return Err(
                "https push without a CA: start meshd with --push-ca-file (no system CA bundle)"
                    .to_string(),
            ),
        };
    let event = Event::from_stored(&d.body).map_err(|e| format!("stored event: {e}"))?;
    let (headers, body) = to_binary_mode(&event);
    let mut req = format!(
        "POST {} HTTP/1.1\r\nHost: {}:{}\r\nConnection: close\r\nContent-Length: {}\r\nmeshd-delivery-attempt: {}\r\nmeshd-delivery-id: {}\r\n",
        target.path,
        target.host,
        target.port,
        body.len(),
        d.attempt,
        d.delivery_id
    );
    for (k, v) in &headers {
        req.push_str(k);
        req.push_str(": ");
        req.push_str(v);
        req.push_str("\r\n");
    }
    req.push_str("\r\n");
    let exchange = async {
        let mut s = crate::net::connect_to(&target.host, target.port, tls, Some(egress)).await?;
        s.write_all(req.as_bytes())
            .await
            .map_err(|e| format!("sending the request failed: {e}"))?;
        s.write_all(&body)
            .await
            .map_err(|e| format!("sending the request failed: {e}"))?;
        let mut head = Vec::with_capacity(256);
        let mut buf = [0u8; 1024];
        while !head.windows(2).any(|w| w == b"\r\n") {
            let n = s
                .read(&mut buf)
                .await
                .map_err(|e| format!("reading the answer failed: {e}"))?;
            if n == 0 {
                return Err("the endpoint closed the connection without an answer".to_string());
            }
            head.extend_from_slice(&buf[..n]);
            if head.len() > MAX_HEAD {
                return Err("the answer's status line is too long".to_string());
            }
        }
        let line = String::from_utf8_lossy(&head);
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse::<u16>().ok())
            .ok_or_else(|| "the answer is not HTTP".to_string())?;
        if (200..300).contains(&status) {
            Ok(())
        } else {
            Err(format!("http status {status}"))
        }
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(r) => r,
        Err(_) => Err(format!("timeout after {} ms", timeout.as_millis())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_into_host_port_and_path() {
        assert_eq!(
            Target::parse("http://127.0.0.1:8080/hook?x=1"),
            Ok(Target {
                host: "127.0.0.1".into(),
                port: 8080,
                path: "/hook?x=1".into(),
                https: false,
            })
        );
        assert_eq!(
            Target::parse("http://example.com"),
            Ok(Target {
                host: "example.com".into(),
                port: 80,
                path: "/".into(),
                https: false,
            })
        );
        assert_eq!(
            Target::parse("https://example.com/h"),
            Ok(Target {
                host: "example.com".into(),
                port: 443,
                path: "/h".into(),
                https: true,
            })
        );
        assert!(Target::parse("ftp://example.com/").is_err());
        assert!(Target::parse("http://:80/").is_err());
        assert!(Target::parse("http://h:99999/").is_err());
    }
}
