//! RFC 9457 problem details: every error answer of the HTTP API.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

/// Base of the `type` URIs; the last segment names the problem (`.../conflict`).
const TYPE_BASE: &str = "https://meshd.dev/problems/";

/// Seconds a client should wait before retrying a 503 or 429.
const RETRY_AFTER_SECS: &str = "1";

#[derive(Debug, Clone)]
pub struct Problem {
    pub status: StatusCode,
    /// The last segment of the `type` URI.
    pub kind: &'static str,
    pub detail: String,
    pub extra: Map<String, Value>,
}

impl Problem {
    pub fn new(status: StatusCode, kind: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            detail: detail.into(),
            extra: Map::new(),
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
    pub fn unavailable(store: &str, backend: &str, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", detail)
            .with("store", store)
            .with("backend", backend)
    }

    /// The write may or may not have been applied (504).
    pub fn indeterminate(store: &str, backend: &str, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "indeterminate", detail)
            .with("store", store)
            .with("backend", backend)
    }

    /// Stored data meshd cannot trust (500).
    pub fn internal(store: &str, backend: &str, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", detail)
            .with("store", store)
            .with("backend", backend)
    }

    fn title(&self) -> &'static str {
        self.status.canonical_reason().unwrap_or("Error")
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut body = Map::new();
        body.insert("type".into(), json!(format!("{TYPE_BASE}{}", self.kind)));
        body.insert("title".into(), json!(self.title()));
        body.insert("status".into(), json!(self.status.as_u16()));
        body.insert("detail".into(), json!(self.detail));
        body.extend(self.extra);
        let mut response = (self.status, Value::Object(body).to_string()).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if matches!(
            self.status,
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
        ) {
            headers.insert(
                header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECS),
            );
        }
        response
    }
}
