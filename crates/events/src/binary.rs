//! Binary content mode for push delivery (HTTP binding 3.1): the inverse of parsing a
//! binary-mode publish.

use percent_encoding::{utf8_percent_encode, AsciiSet, CONTROLS};

use crate::event::{is_json_media_type, Event, EventData};

/// HTTP binding 3.1.3.2: space, `"`, `%` and everything outside printable ASCII
/// (U+0021-U+007E) is percent-encoded (non-ASCII always is, as UTF-8 bytes).
const HEADER_VALUE: &AsciiSet = &CONTROLS.add(b' ').add(b'"').add(b'%');

/// Maps an event to HTTP binary content mode: `(headers, body)`.
///
/// Headers (names lower-case): `ce-specversion`, `ce-id`, `ce-source`, `ce-type`, then
/// `ce-dataschema`, `ce-subject`, `ce-time` when set, every extension as `ce-<name>`
/// (its canonical string; integers and booleans become their text, as the binding
/// prescribes, so their JSON type is not carried), and `content-type` last. Values are
/// percent-encoded per the binding, so they are always valid header values.
///
/// Body and `content-type`:
/// * `data` with a JSON (or absent) `datacontenttype`: the value's JSON text as stored,
///   with `content-type` the `datacontenttype` or `application/json`;
/// * `data` holding a JSON string with a non-JSON `datacontenttype` (e.g. XML sent as a
///   string): the string's UTF-8 content (JSON format 3.1); any other `data` with a
///   non-JSON type: its JSON text;
/// * `data_base64`: the decoded bytes, with `content-type` the `datacontenttype` when
///   set (none otherwise, which parses back to the same event);
/// * no data: an empty body, with `content-type` only if `datacontenttype` is set.
pub fn to_binary_mode(event: &Event) -> (Vec<(String, String)>, Vec<u8>) {
    let mut headers = Vec::with_capacity(8 + event.extensions().len());
    let mut header = |name: &str, value: &str| {
        headers.push((
            format!("ce-{name}"),
            utf8_percent_encode(value, HEADER_VALUE).to_string(),
        ));
    };
    header("specversion", event.spec_version());
    header("id", event.id());
    header("source", event.source());
    header("type", event.event_type());
    for (name, value) in [
        ("dataschema", event.data_schema()),
        ("subject", event.subject()),
        ("time", event.time()),
    ] {
        if let Some(value) = value {
            header(name, value);
        }
    }
    for (name, value) in event.extensions() {
        header(name, &value.to_canonical_string());
    }

    let declared = event.data_content_type();
    let (content_type, body) = match event.data() {
        None => (declared.map(str::to_owned), Vec::new()),
        Some(EventData::Json(text)) => {
            let json_declared = declared.is_none_or(is_json_media_type);
            let body = if !json_declared && text.starts_with('"') {
                // Validated JSON text; the fallback is unreachable.
                serde_json::from_str::<String>(text)
                    .map(String::into_bytes)
                    .unwrap_or_else(|_| text.as_bytes().to_vec())
            } else {
                text.as_bytes().to_vec()
            };
            let ct = declared.unwrap_or("application/json");
            (Some(ct.to_owned()), body)
        }
        Some(EventData::Binary(bytes)) => (declared.map(str::to_owned), bytes),
    };
    if let Some(ct) = content_type {
        headers.push(("content-type".to_owned(), ct));
    }
    (headers, body)
}
