//! A webhook receiver for the push tests: a tiny HTTP server inside the test that
//! answers scripted statuses (optionally after holding each request a while) and
//! records what it received, when, and how many requests it held at once.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;

/// One request the endpoint received.
#[derive(Clone, Debug)]
pub struct Received {
    /// Header names lower-cased.
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
    /// When its head arrived.
    pub at: Instant,
}

/// An HTTP endpoint answering the scripted statuses in order (the last one repeats).
pub struct Endpoint {
    pub url: String,
    pub received: Arc<Mutex<Vec<Received>>>,
    /// The most requests it held at once.
    pub max_in_flight: Arc<AtomicUsize>,
    /// The requests it holds now (read, not answered yet).
    pub in_flight: Arc<AtomicUsize>,
}

impl Endpoint {
    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }
}

pub async fn endpoint(statuses: Vec<u16>) -> Endpoint {
    endpoint_with(statuses, None, Duration::ZERO).await
}

/// [`endpoint`], over TLS when `tls` is given (`https://127.0.0.1:port/hook`), holding
/// every request for `hold` before it answers.
pub async fn endpoint_with(
    statuses: Vec<u16>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    hold: Duration,
) -> Endpoint {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let scheme = if tls.is_some() { "https" } else { "http" };
    let url = format!("{scheme}://{}/hook", listener.local_addr().unwrap());
    let received: Arc<Mutex<Vec<Received>>> = Arc::default();
    let max_in_flight: Arc<AtomicUsize> = Arc::default();
    let in_flight: Arc<AtomicUsize> = Arc::default();
    let (log, max, now) = (received.clone(), max_in_flight.clone(), in_flight.clone());
    let statuses = Arc::new(statuses);
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = listener.accept().await else {
                return;
            };
            let (log, max, in_flight, statuses, tls) = (
                log.clone(),
                max.clone(),
                now.clone(),
                statuses.clone(),
                tls.clone(),
            );
            // Each connection on its own task, so held requests overlap.
            tokio::spawn(async move {
                let gauge = Gauge::enter(&in_flight, &max);
                match &tls {
                    None => answer(s, &log, &statuses, hold, gauge).await,
                    Some(acceptor) => {
                        // A client that refuses the certificate ends here.
                        if let Ok(s) = acceptor.accept(s).await {
                            answer(s, &log, &statuses, hold, gauge).await;
                        }
                    }
                }
            });
        }
    });
    Endpoint {
        url,
        received,
        max_in_flight,
        in_flight,
    }
}

/// Counts a connection while it lives and keeps the maximum.
struct Gauge(Arc<AtomicUsize>);

impl Gauge {
    fn enter(now: &Arc<AtomicUsize>, max: &AtomicUsize) -> Self {
        let n = now.fetch_add(1, Ordering::SeqCst) + 1;
        max.fetch_max(n, Ordering::SeqCst);
        Gauge(now.clone())
    }
}

impl Drop for Gauge {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Reads one request from `s`, records it and answers the next scripted status. The
/// request counts as held (`gauge`) until just before the answer is written, so the
/// sender can never have its next request counted while this one still is.
async fn answer<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    log: &Mutex<Vec<Received>>,
    statuses: &[u16],
    hold: Duration,
    gauge: Gauge,
) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        let n = s.read(&mut chunk).await.unwrap_or(0);
        if n == 0 {
            break None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break Some(i);
        }
    };
    let Some(head_end) = head_end else { return };
    let at = Instant::now();
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let headers: BTreeMap<String, String> = head
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let len: usize = headers
        .get("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < len {
        let n = s.read(&mut chunk).await.unwrap_or(0);
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    tokio::time::sleep(hold).await;
    let status = {
        let mut r = log.lock().unwrap();
        r.push(Received { headers, body, at });
        statuses[(r.len() - 1).min(statuses.len() - 1)]
    };
    drop(gauge);
    let answer = format!("HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
    let _ = s.write_all(answer.as_bytes()).await;
    let _ = s.shutdown().await;
}
