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
//! - Long polls (`pull` with `wait_ms` > 0) and streams are capped separately
//!   ([`Admission::long_poll`]), since each holds a request for up to 30 s (a
//!   stream for its life); `max_streams_per_token` bounds one client token's share
//!   of those slots ([`Admission::stream_slot`]).
//! - A WebSocket waiting for its first-frame token holds none of that, only one of
//!   [`MAX_PENDING_AUTH`] places ([`Admission::pending_auth`]) for at most
//!   [`TOKEN_FRAME_DEADLINE`].
//!
//! `/healthz`, `/readyz` and `/metrics` are never shed: an overloaded instance stays
//! observable.

use crate::access::StreamToken;
use crate::http::MAX_BODY_BYTES;
use crate::problem::Problem;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::collections::HashMap;
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
    /// Streams one client token may hold at a time (`None`: no cap).
    pub max_streams_per_token: Option<usize>,
}

/// WebSockets waiting for their first-frame token at a time: a place is held from
/// the upgrade until the token frame is read, which a client sends at once, so a
/// small cap serves bursts of honest clients and bounds what tokenless sockets hold.
pub const MAX_PENDING_AUTH: usize = 64;
/// How long a WebSocket has to send its token frame (http-api.md "Security rules
/// (third round)").
pub const TOKEN_FRAME_DEADLINE: Duration = Duration::from_secs(3);

pub struct Admission {
    config: AdmissionConfig,
    requests: Arc<Semaphore>,
    body_bytes: Arc<Semaphore>,
    long_polls: Arc<Semaphore>,
    pending_auth: Arc<Semaphore>,
    /// Streams open per client token (only tokens with one open).
    token_streams: Arc<std::sync::Mutex<HashMap<StreamToken, usize>>>,
    counters: AdmissionCounters,
}

/// What a stream holds while it lives: its long-poll slot and, with
/// `--max-streams-per-token`, its place in its token's share.
pub struct StreamSlot {
    _long_poll: OwnedSemaphorePermit,
    _share: Option<TokenShare>,
}

/// One stream of a token's share, given back when dropped.
struct TokenShare {
    token: StreamToken,
    streams: Arc<std::sync::Mutex<HashMap<StreamToken, usize>>>,
}

impl Drop for TokenShare {
    fn drop(&mut self) {
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = streams.get_mut(&self.token) {
            *n -= 1;
            if *n == 0 {
                streams.remove(&self.token);
            }
        }
    }
}

#[derive(Default)]
struct AdmissionCounters {
    shed_requests: AtomicU64,
    shed_body_memory: AtomicU64,
    shed_long_polls: AtomicU64,
    shed_streams_per_token: AtomicU64,
    shed_pending_auth: AtomicU64,
    body_timeouts: AtomicU64,
    websocket_closes: [AtomicU64; 2],
}

/// Why meshd closed a WebSocket stream on its client (`meshd_http_websocket_closes_total`).
#[derive(Clone, Copy, Debug)]
pub enum WsClose {
    /// No valid token frame within [`TOKEN_FRAME_DEADLINE`].
    NoToken = 0,
    /// A frame waited longer than the idle timeout for the client to read it.
    WriteStalled = 1,
}

impl WsClose {
    const ALL: [WsClose; 2] = [WsClose::NoToken, WsClose::WriteStalled];

    fn label(self) -> &'static str {
        match self {
            WsClose::NoToken => "no_token",
            WsClose::WriteStalled => "write_stalled",
        }
    }
}

impl Admission {
    pub fn new(config: AdmissionConfig) -> Self {
        Self {
            requests: Arc::new(Semaphore::new(config.max_requests)),
            body_bytes: Arc::new(Semaphore::new(config.body_budget)),
            long_polls: Arc::new(Semaphore::new(config.max_long_polls)),
            pending_auth: Arc::new(Semaphore::new(MAX_PENDING_AUTH)),
            token_streams: Arc::default(),
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

    /// What a stream holds while it lives: a long-poll slot and, for a token with
    /// `max_streams_per_token` streams open already, 429 instead. The token's share
    /// is checked first, so a token at its cap never takes a slot, even briefly.
    pub fn stream_slot(&self, token: Option<StreamToken>) -> Result<StreamSlot, Problem> {
        let share = match (token, self.config.max_streams_per_token) {
            (Some(token), Some(cap)) => {
                let mut streams = self.token_streams.lock().unwrap_or_else(|p| p.into_inner());
                let open = streams.entry(token).or_default();
                if *open >= cap {
                    if *open == 0 {
                        streams.remove(&token);
                    }
                    self.counters
                        .shed_streams_per_token
                        .fetch_add(1, Ordering::Relaxed);
                    return Err(overloaded(format!(
                        "this token holds {cap} streams already (--max-streams-per-token); close one or retry"
                    )));
                }
                *open += 1;
                Some(TokenShare {
                    token,
                    streams: self.token_streams.clone(),
                })
            }
            _ => None,
        };
        Ok(StreamSlot {
            _long_poll: self.long_poll()?,
            _share: share,
        })
    }

    /// A place for a WebSocket waiting for its first-frame token; 429 when
    /// [`MAX_PENDING_AUTH`] wait already.
    pub fn pending_auth(&self) -> Result<OwnedSemaphorePermit, Problem> {
        self.pending_auth.clone().try_acquire_owned().map_err(|_| {
            self.counters.shed_pending_auth.fetch_add(1, Ordering::Relaxed);
            overloaded(format!(
                "{MAX_PENDING_AUTH} WebSockets are waiting for their token frame already; retry, or send Authorization with the upgrade"
            ))
        })
    }

    pub fn websocket_closed(&self, why: WsClose) {
        self.counters.websocket_closes[why as usize].fetch_add(1, Ordering::Relaxed);
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
        let _ = writeln!(out, "# HELP meshd_http_websockets_awaiting_token WebSockets waiting for their first-frame token (at most {MAX_PENDING_AUTH}).\n# TYPE meshd_http_websockets_awaiting_token gauge\nmeshd_http_websockets_awaiting_token {}", MAX_PENDING_AUTH - self.pending_auth.available_permits());
        let _ = writeln!(out, "# HELP meshd_http_shed_total Requests refused with 429 because a limit was reached, by limit.\n# TYPE meshd_http_shed_total counter");
        for (limit, n) in [
            ("requests", &c.shed_requests),
            ("body_memory", &c.shed_body_memory),
            ("long_polls", &c.shed_long_polls),
            ("streams_per_token", &c.shed_streams_per_token),
            ("websocket_auth", &c.shed_pending_auth),
        ] {
            let _ = writeln!(out, "meshd_http_shed_total{{limit=\"{limit}\"}} {}", get(n));
        }
        let _ = writeln!(out, "# HELP meshd_http_websocket_closes_total WebSocket streams meshd closed on their client, by reason.\n# TYPE meshd_http_websocket_closes_total counter");
        for why in WsClose::ALL {
            let _ = writeln!(
                out,
                "meshd_http_websocket_closes_total{{reason=\"{}\"}} {}",
                why.label(),
                get(&c.websocket_closes[why as usize])
            );
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
            max_streams_per_token: None,
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
