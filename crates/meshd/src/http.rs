//! HTTP facts every layer shares, with no dependency on any of them: the body cap and
//! how a content type is read. The gate, admission, the configuration and the route
//! handlers all import from here, never from each other for these.

use axum::http::{header, HeaderMap};

/// The request body cap (8 MiB); one event is capped at 1 MiB by the event parser.
pub const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

/// The media type of `Content-Type` without parameters, lower case (`""` for a value
/// that is not text); `None` without the header.
pub fn media_type(headers: &HeaderMap) -> Option<String> {
    let ct = headers.get(header::CONTENT_TYPE)?;
    let ct = ct.to_str().unwrap_or("");
    Some(
        ct.split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase(),
    )
}

/// Whether a media type is JSON: `application/json` or `*+json` (the CloudEvents
/// formats among them).
pub fn is_json(media_type: &str) -> bool {
    media_type == "application/json" || media_type.ends_with("+json")
}
