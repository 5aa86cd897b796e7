//! RFC 9457 problem details: every error answer of the HTTP API.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

/// Base of the `type` URIs; the last segment names the problem (`.../conflict`).
const TYPE_BASE: &str = "https://meshd.dev/problems/";

/// Seconds a client should wait before retrying a 503 or 429.
const RETRY_AFTER_SECS: &str = "1";
/// `Retry-After` of a fail-stop's 503: the contract gives every 503 one, but only a
/// restart ends a fail-stop, so clients are told to come back slowly.
const FAIL_STOP_RETRY_AFTER_SECS: &str = "30";

#[derive(Debug, Clone)]
pub struct Problem {
    pub status: StatusCode,
    /// The last segment of the `type` URI.
    pub kind: &'static str,
    pub detail: String,
    pub extra: Map<String, Value>,
    /// Whether the answer carries `Retry-After`: every 503 and 429 does, except a
    /// [fail-stop](Problem::fail_stopped), which only a restart cures.
    /// `Retry-After` seconds (503 and 429 only).
    pub retry_after: Option<std::borrow::Cow<'static, str>>,
}

impl Problem {
    pub fn new(status: StatusCode, kind: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            detail: detail.into(),
            extra: Map::new(),
            retry_after: matches!(
                status,
                StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
            )
            .then_some(RETRY_AFTER_SECS.into()),
        }
    }

    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.extra.insert(key.to_string(), value.into());
        self
    }

    pub fn bad_request(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad-request", detail)
    }

    /// A 400 naming the field that was wrong.
    pub fn invalid_field(field: &str, detail: impl Into<String>) -> Self {
        Self::bad_request(detail).with("field", field)
    }

    /// 401: a missing or wrong bearer token (or cluster secret).
    pub fn unauthorized(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", detail)
    }

    /// 403: a valid token that may not use this route.
    pub fn forbidden(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", detail)
    }

    pub fn not_found(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not-found", detail)
    }

    pub fn conflict(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", detail)
    }

    pub fn too_large(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "too-large", detail)
    }

    pub fn unsupported_media_type(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
            detail,
        )
    }

    /// A backend that cannot serve now (503, with `Retry-After`).
    pub fn unavailable(
        store: &str,
        backend: meshd_meta::Backend,
        detail: impl Into<String>,
    ) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", detail)
            .with("store", store)
            .with("backend", backend.as_str())
    }

    /// A store that fail-stopped after a failed disk write (a Local store, or the
    /// embedded Meta on the same RocksDB) refused the request: not applied (503, type
    /// `unavailable`, like any backend that cannot serve). The store does not come
    /// back by itself — only a restart of meshd (once the disk is healthy) does — so
    /// the detail says so and `Retry-After` (which the contract gives every 503) asks
    /// for a slow retry.
    pub fn fail_stopped(
        store: &str,
        backend: meshd_meta::Backend,
        reason: impl std::fmt::Display,
    ) -> Self {
        let mut p = Self::unavailable(
            store,
            backend,
            format!(
                "the {store} store ({backend}) has fail-stopped (a failed disk write, or damaged data found on disk) and stays stopped until meshd is restarted; this request was not applied: {reason}"
            ),
        );
        p.retry_after = Some(FAIL_STOP_RETRY_AFTER_SECS.into());
        p
    }

    /// The write may or may not have been applied (504).
    pub fn indeterminate(
        store: &str,
        backend: meshd_meta::Backend,
        detail: impl Into<String>,
    ) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "indeterminate", detail)
            .with("store", store)
            .with("backend", backend.as_str())
    }

    /// A store's backend failure, naming the store and its backend: not applied
    /// (503), outcome unknown (504), fail-stopped (503 with a slow `Retry-After`),
    /// or data that cannot be trusted (500).
    pub fn store_failure(
        store: &str,
        backend: meshd_meta::Backend,
        failure: meshd_stores::failure::StoreFailure,
    ) -> Self {
        use meshd_stores::failure::StoreFailure;
        match failure {
            StoreFailure::Unavailable(d) => Self::unavailable(store, backend, d),
            StoreFailure::Indeterminate(d) => Self::indeterminate(store, backend, d),
            StoreFailure::FailStopped(reason) => Self::fail_stopped(store, backend, reason),
            StoreFailure::Corrupt { key, reason } => Self::internal(
                store,
                backend,
                format!("corrupt record in the {store} store at {key}: {reason}"),
            ),
            StoreFailure::Failed(d) => Self::internal(store, backend, d),
        }
    }

    /// Stored data meshd cannot trust (500).
    pub fn internal(store: &str, backend: meshd_meta::Backend, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", detail)
            .with("store", store)
            .with("backend", backend.as_str())
    }

    fn title(&self) -> &'static str {
        self.status.canonical_reason().unwrap_or("Error")
    }

    /// The problem+json document.
    pub fn body(&self) -> Value {
        let mut body = Map::new();
        body.insert("type".into(), json!(format!("{TYPE_BASE}{}", self.kind)));
        body.insert("title".into(), json!(self.title()));
        body.insert("status".into(), json!(self.status.as_u16()));
        body.insert("detail".into(), json!(self.detail));
        body.extend(self.extra.clone());
        Value::Object(body)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut response = (self.status, self.body().to_string()).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(secs) = self
            .retry_after
            .and_then(|s| HeaderValue::try_from(s.as_ref()).ok())
        {
            headers.insert(header::RETRY_AFTER, secs);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn retry_after(p: Problem) -> Option<String> {
        p.into_response()
            .headers()
            .get(header::RETRY_AFTER)
            .map(|v| v.to_str().unwrap().to_string())
    }

    #[test]
    fn a_fail_stop_is_a_503_with_a_slow_retry_after_and_says_what_stopped() {
        let p = Problem::fail_stopped("log", meshd_meta::Backend::RocksDb, "fsync failed: EIO");
        assert_eq!(p.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(p.kind, "unavailable");
        assert_eq!(p.extra.get("store"), Some(&Value::from("log")));
        assert_eq!(p.extra.get("backend"), Some(&Value::from("rocksdb")));
        assert!(
            p.detail.contains("until meshd is restarted"),
            "{}",
            p.detail
        );
        assert!(p.detail.contains("not applied"), "{}", p.detail);
        assert!(p.detail.ends_with(": fsync failed: EIO"), "{}", p.detail);
        assert_eq!(
            retry_after(p).as_deref(),
            Some(FAIL_STOP_RETRY_AFTER_SECS),
            "every 503 has one; only a restart cures a fail-stop"
        );
    }

    #[test]
    fn other_503s_and_429s_carry_retry_after_and_504s_do_not() {
        let p = Problem::unavailable("topics", meshd_meta::Backend::Etcd, "connection refused");
        assert_eq!(retry_after(p).as_deref(), Some(RETRY_AFTER_SECS));
        let p = Problem::new(StatusCode::TOO_MANY_REQUESTS, "overloaded", "busy");
        assert_eq!(retry_after(p).as_deref(), Some(RETRY_AFTER_SECS));
        assert_eq!(
            retry_after(Problem::indeterminate(
                "log",
                meshd_meta::Backend::RocksDb,
                "?"
            )),
            None
        );
    }
}
