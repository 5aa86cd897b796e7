//! Load shedding for `/v1` and `/internal` requests: what a flood of clients can make
//! meshd hold is bounded, and what does not fit is refused at once with 429 and
//! `Retry-After` instead of queueing in memory.
//!
//! - At most `max_requests` requests are being handled at a time.
//! - Request bodies are read here, under one byte budget (`body_budget`) for all of
//!   them: a body reserves its `Content-Length` (or the 8 MiB body cap when its length
//!   is not declared: HTTP/1 chunked, HTTP/2 without `Content-Length`) before a byte
//!   is read, keeps only what it took once read, and gives that back when its request
//!   is answered.
//! - A body must arrive within `body_timeout` (408 otherwise): a client that trickles
//!   its body cannot hold a reservation forever.
//! - Long polls (`pull` with `wait_ms` > 0) are capped separately
//!   ([`Admission::long_poll`]), since each holds a request for up to 30 s.
//!
//! `/healthz`, `/readyz` and `/metrics` are never shed: an overloaded instance stays
//! observable.

use crate::api::MAX_BODY_BYTES;
use crate::problem::Problem;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

#[derive(Clone, Debug)]
pub struct AdmissionConfig {
    pub max_requests: usize,
    pub body_budget: usize,
    pub body_timeout: Duration,
    pub max_long_polls: usize,
    /// The longest a long poll waits: half a second under the idle timeout, so a
    /// waiting pull answers (empty) before its connection counts as idle.
    pub max_wait: Duration,
}

pub struct Admission {
    config: AdmissionConfig,
    requests: Arc<Semaphore>,
    body_bytes: Arc<Semaphore>,
    long_polls: Arc<Semaphore>,
    counters: AdmissionCounters,
}

#[derive(Default)]
struct AdmissionCounters {
    shed_requests: AtomicU64,
    shed_body_memory: AtomicU64,
    shed_long_polls: AtomicU64,
    body_timeouts: AtomicU64,
}

impl Admission {
    pub fn new(config: AdmissionConfig) -> Self {
        Self {
            requests: Arc::new(Semaphore::new(config.max_requests)),
            body_bytes: Arc::new(Semaphore::new(config.body_budget)),
            long_polls: Arc::new(Semaphore::new(config.max_long_polls)),
            counters: AdmissionCounters::default(),
            config,
        }
    }

    /// A slot for one long poll, held while it waits; 429 when all are taken.
    pub fn long_poll(&self) -> Result<OwnedSemaphorePermit, Problem> {
        self.long_polls.clone().try_acquire_owned().map_err(|_| {
            self.counters.shed_long_polls.fetch_add(1, Ordering::Relaxed);
            overloaded(format!(
                "{} long polls are waiting already (--max-long-polls); retry, or pull with wait_ms 0",
                self.config.max_long_polls
            ))
        })
    }

    pub fn max_wait(&self) -> Duration {
        self.config.max_wait
    }

    pub fn render(&self, out: &mut String) {
        use std::fmt::Write;
        let c = &self.counters;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let _ = writeln!(out, "# HELP meshd_http_requests_in_flight Requests being handled (/v1 and /internal).\n# TYPE meshd_http_requests_in_flight gauge\nmeshd_http_requests_in_flight {}", self.config.max_requests - self.requests.available_permits());
        let _ = writeln!(out, "# HELP meshd_http_body_bytes_reserved Request body bytes reserved against --max-body-memory.\n# TYPE meshd_http_body_bytes_reserved gauge\nmeshd_http_body_bytes_reserved {}", self.config.body_budget - self.body_bytes.available_permits());
        let _ = writeln!(out, "# HELP meshd_http_long_polls Long polls waiting.\n# TYPE meshd_http_long_polls gauge\nmeshd_http_long_polls {}", self.config.max_long_polls - self.long_polls.available_permits());
        let _ = writeln!(out, "# HELP meshd_http_shed_total Requests refused with 429 because a limit was reached, by limit.\n# TYPE meshd_http_shed_total counter");
        for (limit, n) in [
            ("requests", &c.shed_requests),
            ("body_memory", &c.shed_body_memory),
            ("long_polls", &c.shed_long_polls),
        ] {
            let _ = writeln!(out, "meshd_http_shed_total{{limit=\"{limit}\"}} {}", get(n));
        }
        let _ = writeln!(out, "# HELP meshd_http_body_timeouts_total Requests answered 408 because the body did not arrive in time.\n# TYPE meshd_http_body_timeouts_total counter\nmeshd_http_body_timeouts_total {}", get(&c.body_timeouts));
    }
}

fn overloaded(detail: String) -> Problem {
    Problem::new(StatusCode::TOO_MANY_REQUESTS, "overloaded", detail)
}

/// The bytes a request's body may take: its `Content-Length`, the body cap for a body
/// of unknown length (HTTP/1 chunked, or HTTP/2 without `Content-Length`: `has_body`),
/// nothing for a request without a body. `Err` for a declared length over the cap
/// (413 before reading).
fn body_reservation(headers: &axum::http::HeaderMap, has_body: bool) -> Result<usize, Problem> {
    let too_large = || Problem::too_large(format!("request body exceeds {MAX_BODY_BYTES} bytes"));
    if let Some(len) = headers.get(header::CONTENT_LENGTH) {
        let len: u64 = len
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| Problem::bad_request("invalid Content-Length"))?;
        if len > MAX_BODY_BYTES as u64 {
            return Err(too_large());
        }
        return Ok(len as usize);
    }
    if headers.contains_key(header::TRANSFER_ENCODING) || has_body {
        return Ok(MAX_BODY_BYTES);
    }
    Ok(0)
}

/// The middleware (see the module docs).
pub async fn admit(State(a): State<Arc<Admission>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if !(path.starts_with("/v1/") || path == "/v1" || path.starts_with("/internal/")) {
        return next.run(req).await;
    }
    let Ok(_request) = a.requests.clone().try_acquire_owned() else {
        a.counters.shed_requests.fetch_add(1, Ordering::Relaxed);
        return overloaded(format!(
            "{} requests are being handled already (--max-requests)",
            a.config.max_requests
        ))
        .into_response();
    };
    let has_body = !axum::body::HttpBody::is_end_stream(req.body());
    let reserve = match body_reservation(req.headers(), has_body) {
        Ok(n) => n.min(a.config.body_budget),
        Err(p) => return p.into_response(),
    };
    let mut body_bytes = match reserve {
        0 => None,
        n => match a.body_bytes.clone().try_acquire_many_owned(n as u32) {
            Ok(p) => Some(p),
            Err(_) => {
                a.counters.shed_body_memory.fetch_add(1, Ordering::Relaxed);
                return overloaded(format!(
                    "request bodies in progress fill the body memory budget of {} bytes (--max-body-memory)",
                    a.config.body_budget
                ))
                .into_response();
            }
        },
    };
    let req = if reserve == 0 {
        req
    } else {
        let (parts, body) = req.into_parts();
        match tokio::time::timeout(
            a.config.body_timeout,
            axum::body::to_bytes(body, MAX_BODY_BYTES),
        )
        .await
        {
            Err(_) => {
                a.counters.body_timeouts.fetch_add(1, Ordering::Relaxed);
                return Problem::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "request-timeout",
                    format!(
                        "the request body did not arrive within {} ms (--body-timeout-ms)",
                        a.config.body_timeout.as_millis()
                    ),
                )
                .into_response();
            }
            Ok(Err(e)) => {
                let inner = e.into_inner();
                return if inner.is::<http_body_util::LengthLimitError>() {
                    Problem::too_large(format!("request body exceeds {MAX_BODY_BYTES} bytes"))
                } else {
                    Problem::bad_request(format!("cannot read the request body: {inner}"))
                }
                .into_response();
            }
            Ok(Ok(bytes)) => {
                // Keep only what the body took: a chunked or undeclared body
                // reserved the whole cap while it arrived.
                if let Some(mut reserved) = body_bytes.take() {
                    body_bytes = reserved.split(bytes.len().min(reserved.num_permits()));
                }
                Request::from_parts(parts, Body::from(bytes))
            }
        }
    };
    let answer = next.run(req).await;
    drop(body_bytes);
    answer
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderMap;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn a_body_reserves_its_length_or_the_cap_when_chunked() {
        assert_eq!(body_reservation(&headers(&[]), false).unwrap(), 0);
        assert_eq!(
            body_reservation(&headers(&[("content-length", "1234")]), true).unwrap(),
            1234
        );
        assert_eq!(
            body_reservation(&headers(&[("transfer-encoding", "chunked")]), true).unwrap(),
            MAX_BODY_BYTES
        );
        // HTTP/2: a body without Content-Length.
        assert_eq!(
            body_reservation(&headers(&[]), true).unwrap(),
            MAX_BODY_BYTES
        );
        let too_big = (MAX_BODY_BYTES + 1).to_string();
        let p = body_reservation(&headers(&[("content-length", &too_big)]), true).unwrap_err();
        assert_eq!(p.status, StatusCode::PAYLOAD_TOO_LARGE);
        let p = body_reservation(&headers(&[("content-length", "x")]), true).unwrap_err();
        assert_eq!(p.status, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn long_polls_over_the_cap_are_refused_with_429_and_retry_after() {
        let a = Admission::new(AdmissionConfig {
            max_requests: 10,
            body_budget: 1024,
            body_timeout: Duration::from_secs(1),
            max_long_polls: 2,
            max_wait: Duration::from_secs(30),
        });
        let one = a.long_poll().unwrap();
        let _two = a.long_poll().unwrap();
        let p = a.long_poll().unwrap_err();
        assert_eq!(p.status, StatusCode::TOO_MANY_REQUESTS);
        assert!(p.retry_after.is_some());
        drop(one);
        assert!(a.long_poll().is_ok());
        let mut text = String::new();
        a.render(&mut text);
        assert!(
            text.contains("meshd_http_shed_total{limit=\"long_polls\"} 1"),
            "{text}"
        );
    }
}
