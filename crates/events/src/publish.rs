//! Parsing a publish request: structured, batch or binary content mode.

use std::borrow::Cow;

use base64::Engine as _;
use percent_encoding::percent_decode_str;
use serde_json::value::RawValue;

use crate::depth::{nested_deeper_than, MAX_JSON_DEPTH};
use crate::error::EventError;
use crate::event::{is_attribute_name, is_json_media_type, Event};

/// `application/cloudevents+json`: one event in structured mode.
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";
/// `application/cloudevents-batch+json`: a JSON array of structured events.
pub const BATCH_CONTENT_TYPE: &str = "application/cloudevents-batch+json";

/// Default for [`Limits::max_batch`] (http-api.md, Conventions).
pub const DEFAULT_MAX_BATCH: usize = 1000;
/// Default for [`Limits::max_event_bytes`]: 1 MiB.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 1 << 20;

/// Per-request bounds on a publish. The request body bound (8 MiB) is the HTTP layer's:
/// it must refuse a larger body before reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most events in one batch; more is a 413.
    pub max_batch: usize,
    /// Largest stored form of one event, in bytes; larger is a 413 naming the event.
    pub max_event_bytes: usize,
    /// The time of the publish (Unix milliseconds), for the `deliverat` horizon: a
    /// `deliverat` more than [`MAX_DELIVER_AHEAD_MS`] after it is a 400. `None`: only
    /// its form is checked.
    pub now_ms: Option<i64>,
}

/// How far ahead `deliverat` may lie (7 days; http-api.md, Additions, "Parking").
pub const MAX_DELIVER_AHEAD_MS: i64 = 7 * 24 * 3600 * 1000;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_batch: DEFAULT_MAX_BATCH,
            max_event_bytes: DEFAULT_MAX_EVENT_BYTES,
            now_ms: None,
        }
    }
}

/// Parses the events of a publish request (`POST /v1/topics/{topic}/events`).
///
/// The content mode is chosen by `content_type` (its media type, parameters ignored,
/// case-insensitive):
///
/// * `application/cloudevents+json`: one structured event, a JSON object;
/// * `application/cloudevents-batch+json`: a non-empty JSON array of structured events;
/// * `application/cloudevents+<other>` or `application/cloudevents-batch+<other>`:
///   415 (an event format meshd lacks);
/// * anything else, absent included, with at least one `ce-*` header: binary mode. The
///   four required attributes must then be present as headers; a missing one is a 400
///   naming it (rather than a 415), since the sender clearly meant binary mode;
/// * anything else: 415 naming the content type.
///
/// `headers` are the request's headers (names in any case; values as received). In
/// binary mode only `ce-*` headers are read, and `content_type` becomes
/// `datacontenttype` (a `Content-Type` entry in `headers` is not consulted).
///
/// Every event is validated (see the crate docs); the first error is returned, its
/// `field` prefixed with `events[i].` in a batch. The events come back in request order.
pub fn parse_publish(
    content_type: Option<&str>,
    headers: &[(String, String)],
    body: &[u8],
    limits: &Limits,
) -> Result<Vec<Event>, EventError> {
    let media_type = content_type.map(|ct| {
        ct.split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase()
    });
    match media_type.as_deref() {
        Some(STRUCTURED_CONTENT_TYPE) => parse_structured(body, limits).map(|e| vec![e]),
        Some(BATCH_CONTENT_TYPE) => parse_batch(body, limits),
        Some(m) if is_other_cloudevents_format(m) => {
            Err(EventError::unsupported_media_type(format!(
                "unsupported content type {:?}: the only event formats are {STRUCTURED_CONTENT_TYPE} and {BATCH_CONTENT_TYPE}",
                content_type.unwrap_or_default()
            )))
        }
        _ if headers.iter().any(|(name, _)| ce_attribute(name).is_some()) => {
            parse_binary(content_type, headers, body, limits).map(|e| vec![e])
        }
        _ => Err(EventError::unsupported_media_type(match content_type {
            Some(ct) => format!(
                "unsupported content type {ct:?}: send {STRUCTURED_CONTENT_TYPE}, {BATCH_CONTENT_TYPE}, or binary mode with ce-id, ce-source, ce-type and ce-specversion headers"
            ),
            None => format!(
                "missing content type: send {STRUCTURED_CONTENT_TYPE}, {BATCH_CONTENT_TYPE}, or binary mode with ce-id, ce-source, ce-type and ce-specversion headers"
            ),
        })),
    }
}

/// `application/cloudevents+<format>` or `application/cloudevents-batch+<format>` for a
/// format other than JSON.
fn is_other_cloudevents_format(media_type: &str) -> bool {
    media_type.starts_with("application/cloudevents+")
        || media_type.starts_with("application/cloudevents-batch+")
}

fn body_text(body: &[u8]) -> Result<&str, EventError> {
    std::str::from_utf8(body)
        .map_err(|e| EventError::bad_request(None, format!("body is not UTF-8 JSON: {e}")))
}

fn parse_json(text: &str) -> Result<&RawValue, EventError> {
    serde_json::from_str(text)
        .map_err(|e| EventError::bad_request(None, format!("body is not valid JSON: {e}")))
}

fn parse_structured(body: &[u8], limits: &Limits) -> Result<Event, EventError> {
    let raw = parse_json(body_text(body)?)?;
    event_from_object(raw, limits)
}

fn parse_batch(body: &[u8], limits: &Limits) -> Result<Vec<Event>, EventError> {
    let raw = parse_json(body_text(body)?)?;
    if !raw.get().starts_with('[') {
        return Err(EventError::bad_request(
            None,
            format!("a {BATCH_CONTENT_TYPE} body must be a JSON array of events"),
        ));
    }
    let items: Vec<&RawValue> = serde_json::from_str(raw.get())
        .map_err(|e| EventError::bad_request(None, format!("body is not valid JSON: {e}")))?;
    if items.is_empty() {
        return Err(EventError::bad_request(
            None,
            "a batch must contain at least one event",
        ));
    }
    if items.len() > limits.max_batch {
        return Err(EventError::too_large(
            None,
            format!(
                "a batch holds at most {} events; this one has {}",
                limits.max_batch,
                items.len()
            ),
        ));
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| event_from_object(item, limits).map_err(|e| e.in_batch(i)))
        .collect()
}

/// One structured event: its stored form is the object's own text.
fn event_from_object(raw: &RawValue, limits: &Limits) -> Result<Event, EventError> {
    if !raw.get().starts_with('{') {
        return Err(EventError::bad_request(
            None,
            "an event must be a JSON object",
        ));
    }
    check_size(raw.get().len(), limits)?;
    check_depth(raw.get())?;
    if has_lone_surrogate(raw.get()) {
        return Err(EventError::bad_request(
            None,
            "the event has a \\u escape of a lone UTF-16 surrogate (e.g. \"\\ud800\"): strict JSON parsers refuse it, so consumers could not read it",
        ));
    }
    published(Event::from_raw(raw.to_owned())?, limits)
}

/// The publish-only rules of an event that parsed: `deliverat` is an RFC 3339 string
/// at most [`MAX_DELIVER_AHEAD_MS`] ahead of the publish (a past one means now). Only
/// at publish: a stored event is never re-judged by the clock.
fn published(event: Event, limits: &Limits) -> Result<Event, EventError> {
    let Some((_, value)) = event
        .extensions()
        .iter()
        .find(|(k, _)| k == crate::DELIVER_AT)
    else {
        return Ok(event);
    };
    let at = match value {
        crate::ExtensionValue::String(s) => crate::rfc3339::unix_ms(s),
        _ => None,
    }
    .ok_or_else(|| {
        EventError::invalid(
            crate::DELIVER_AT,
            "deliverat must be an RFC 3339 timestamp string such as 2018-04-05T17:31:00Z",
        )
    })?;
    // Delivery finds delayed events by these bytes instead of parsing every event.
    if !crate::may_deliver_later(event.stored()) {
        return Err(EventError::invalid(
            crate::DELIVER_AT,
            "write the name deliverat without escapes",
        ));
    }
    if let Some(now) = limits.now_ms {
        if at > now.saturating_add(MAX_DELIVER_AHEAD_MS) {
            return Err(EventError::invalid(
                crate::DELIVER_AT,
                "deliverat is more than 7 days ahead",
            ));
        }
    }
    Ok(event)
}

/// Whether JSON `text` (already valid JSON syntax) has a `\u` escape of a UTF-16
/// surrogate that is not part of a high-low pair. RFC 8259 lets such text through
/// its grammar but it encodes no Unicode string, and strict parsers (serde_json
/// into `Value`, most languages' decoders) refuse the whole document: one such
/// event would make every pull answer that carries it unreadable.
pub(crate) fn has_lone_surrogate(text: &str) -> bool {
    let b = text.as_bytes();
    let hex = |at: usize| -> Option<u16> {
        let s = b.get(at..at + 4)?;
        u16::from_str_radix(std::str::from_utf8(s).ok()?, 16).ok()
    };
    let mut i = 0;
    // In valid JSON every backslash starts an escape inside a string.
    while let Some(off) = b[i..].iter().position(|&c| c == b'\\') {
        i += off;
        if b.get(i + 1) != Some(&b'u') {
            i += 2;
            continue;
        }
        let Some(unit) = hex(i + 2) else {
            return true;
        };
        match unit {
            0xD800..=0xDBFF => {
                let low = (b.get(i + 6) == Some(&b'\\') && b.get(i + 7) == Some(&b'u'))
                    .then(|| hex(i + 8))
                    .flatten();
                match low {
                    Some(0xDC00..=0xDFFF) => i += 12,
                    _ => return true,
                }
            }
            0xDC00..=0xDFFF => return true,
            _ => i += 6,
        }
    }
    false
}

/// An event (its stored form, the event object) nests at most [`MAX_JSON_DEPTH`]
/// levels, the event object being level 1 (see [`crate::depth`]): a 400 naming the
/// member that nests deeper (`data` in practice: attributes are scalars). Judged at
/// publish only; a stored event is never re-judged.
fn check_depth(event: &str) -> Result<(), EventError> {
    let Some(deep) = nested_deeper_than(event.as_bytes(), MAX_JSON_DEPTH) else {
        return Ok(());
    };
    let detail = |name: &str| {
        format!(
            "{name}nests deeper than {MAX_JSON_DEPTH} levels (the event object is level 1): consumers' JSON parsers refuse such a document, so no consumer could read it"
        )
    };
    Err(match deep.member {
        Some(member) => EventError::invalid(&member, detail(&format!("{member} "))),
        None => EventError::bad_request(None, detail("the event ")),
    })
}

fn check_size(len: usize, limits: &Limits) -> Result<(), EventError> {
    if len > limits.max_event_bytes {
        return Err(EventError::too_large(
            None,
            format!(
                "an event is at most {} bytes; this one is {len}",
                limits.max_event_bytes
            ),
        ));
    }
    Ok(())
}

/// The attribute name of a `ce-*` header (lower-cased), if it is one.
fn ce_attribute(header_name: &str) -> Option<String> {
    let lower = header_name.to_ascii_lowercase();
    lower.strip_prefix("ce-").map(str::to_owned)
}

/// Binary mode: the stored form is a canonical structured object built from the
/// headers and the body, then validated like any structured event (so the same rules
/// and field names apply). Member order: `specversion`, `id`, `source`, `type`,
/// `datacontenttype`, `dataschema`, `subject`, `time`, the other attributes by name,
/// then `data` or `data_base64`. A JSON body nested 64 levels or more makes that
/// object deeper than [`MAX_JSON_DEPTH`]: a 400 naming `data`, as for the same event
/// in structured mode (unlike a lone surrogate, it is not kept as `data_base64`: the
/// sender declared JSON, and the bound is the contract's).
fn parse_binary(
    content_type: Option<&str>,
    headers: &[(String, String)],
    body: &[u8],
    limits: &Limits,
) -> Result<Event, EventError> {
    let mut attributes: Vec<(String, String)> = Vec::new();
    for (name, value) in headers {
        let Some(attribute) = ce_attribute(name) else {
            continue;
        };
        if !is_attribute_name(&attribute) {
            return Err(EventError::invalid(
                &attribute,
                format!(
                    "header {name:?} does not name a valid attribute: names are lower-case letters a-z and digits 0-9"
                ),
            ));
        }
        match attribute.as_str() {
            // HTTP binding 3.1.1: datacontenttype travels as Content-Type only.
            "datacontenttype" => {
                return Err(EventError::invalid(
                    &attribute,
                    "in binary mode datacontenttype is the Content-Type header; ce-datacontenttype must not be sent",
                ))
            }
            "data" => {
                return Err(EventError::invalid(
                    &attribute,
                    "in binary mode data is the request body; ce-data must not be sent",
                ))
            }
            _ => {}
        }
        if attributes.iter().any(|(n, _)| *n == attribute) {
            return Err(EventError::invalid(
                &attribute,
                format!("header ce-{attribute} appears more than once"),
            ));
        }
        let value = decode_header_value(value).map_err(|detail| {
            EventError::invalid(&attribute, format!("header ce-{attribute}: {detail}"))
        })?;
        attributes.push((attribute, value));
    }

    let content_type = content_type.map(str::trim).filter(|ct| !ct.is_empty());
    if let Some(ct) = content_type {
        attributes.push(("datacontenttype".to_owned(), ct.to_owned()));
    }
    const ORDER: [&str; 8] = crate::event::CONTEXT_ATTRIBUTES;
    let rank = |n: &str| ORDER.iter().position(|o| *o == n).unwrap_or(ORDER.len());
    attributes.sort_by(|(a, _), (b, _)| rank(a).cmp(&rank(b)).then_with(|| a.cmp(b)));

    let mut json = String::with_capacity(body.len() * 4 / 3 + 256);
    json.push('{');
    let mut first = true;
    let mut member = |json: &mut String, name: &str| {
        if !first {
            json.push(',');
        }
        first = false;
        push_json_string(json, name);
        json.push(':');
    };
    for (name, value) in &attributes {
        member(&mut json, name);
        push_json_string(&mut json, value);
    }
    if !body.is_empty() {
        let json_data = content_type
            .filter(|ct| is_json_media_type(ct))
            .and_then(|_| std::str::from_utf8(body).ok())
            .and_then(|text| serde_json::from_str::<&RawValue>(text).ok())
            // Not interoperable JSON: kept byte for byte as `data_base64` instead.
            .filter(|data| !has_lone_surrogate(data.get()));
        match json_data {
            Some(data) => {
                member(&mut json, "data");
                json.push_str(data.get());
            }
            None => {
                member(&mut json, "data_base64");
                json.push('"');
                base64::engine::general_purpose::STANDARD.encode_string(body, &mut json);
                json.push('"');
            }
        }
    }
    json.push('}');

    check_size(json.len(), limits)?;
    // The same bound as a structured event's, on the same form: the body is `data`.
    check_depth(&json)?;
    let raw = RawValue::from_string(json).map_err(|e| {
        // Unreachable: the object above is built from escaped strings and a value that
        // parsed as JSON.
        EventError::bad_request(None, format!("event is not valid JSON: {e}"))
    })?;
    published(Event::from_raw(raw)?, limits)
}

/// HTTP binding 3.1.3.2: undo RFC 7230 double-quoting, then one round of
/// percent-decoding; the result must be UTF-8 (overlong forms are invalid UTF-8).
fn decode_header_value(value: &str) -> Result<String, String> {
    let value = value.trim_matches([' ', '\t']);
    let unquoted: Cow<str> = match value.strip_prefix('"').and_then(|v| v.strip_suffix('"')) {
        Some(inner) => {
            let mut out = String::with_capacity(inner.len());
            let mut chars = inner.chars();
            while let Some(c) = chars.next() {
                if c == '\\' {
                    match chars.next() {
                        Some(escaped) => out.push(escaped),
                        None => return Err("unterminated escape in quoted value".to_owned()),
                    }
                } else {
                    out.push(c);
                }
            }
            Cow::Owned(out)
        }
        None => Cow::Borrowed(value),
    };
    percent_decode_str(&unquoted)
        .decode_utf8()
        .map(Cow::into_owned)
        .map_err(|_| "percent-decoded value is not valid UTF-8".to_owned())
}

/// Appends `s` as a JSON string literal.
pub(crate) fn push_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod surrogate_tests {
    use super::has_lone_surrogate;

    #[test]
    fn lone_surrogates_are_found_and_pairs_and_escaped_backslashes_are_not() {
        assert!(!has_lone_surrogate(
            r#"{"a":"\ud83d\ude00 ok \u00e9 \\ud800"}"#
        ));
        assert!(has_lone_surrogate(r#"{"a":"\ud800"}"#));
        assert!(has_lone_surrogate(r#"{"a":"\udc00"}"#));
        assert!(has_lone_surrogate(r#"{"a":"\ud800\u0041"}"#));
        assert!(has_lone_surrogate(r#"{"\uDBFF":1}"#));
        assert!(!has_lone_surrogate(r#"{"a":"\n\t\"\/"}"#));
    }
}
