//! [`Event`]: one validated CloudEvent and its stored form.
//!
//! The stored form is a JSON object's text. For a structured-mode publish it is the
//! published object's own bytes, so a consumer gets back exactly what was published:
//! attribute order, extensions, number formatting and whitespace inside the object
//! included. Everything the rest of meshd needs (id, partition key, filter attributes,
//! the binary-mode mapping) is read from it once, at construction, and every `Event` has
//! passed the same validation, whether it came from a publish request or from the log.

use std::fmt;
use std::ops::Range;

use base64::Engine as _;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

use crate::error::EventError;
use crate::rfc3339::is_rfc3339;

/// The context attributes in the order the specification lists them.
pub(crate) const CONTEXT_ATTRIBUTES: [&str; 8] = [
    "specversion",
    "id",
    "source",
    "type",
    "datacontenttype",
    "dataschema",
    "subject",
    "time",
];

/// The extension that delays an event's delivery (http-api.md, Additions, "Parking").
pub const DELIVER_AT: &str = "deliverat";

/// Whether a stored event may carry `deliverat`: its name, quoted, is in the bytes
/// (publish refuses the name written with escapes, so an event without these bytes
/// has none). Delivery parses only the events for which this is `true`.
pub fn may_deliver_later(stored: &[u8]) -> bool {
    memchr::memmem::find(stored, b"\"deliverat\"").is_some()
}

/// The instant a `deliverat` value names (Unix milliseconds), `None` when it is not
/// an RFC 3339 timestamp.
pub fn deliver_at_of(value: &str) -> Option<i64> {
    crate::rfc3339::unix_ms(value)
}

/// The only CloudEvents version meshd accepts.
pub const SPEC_VERSION: &str = "1.0";

/// A validated CloudEvents 1.0 event, kept in its stored (JSON) form.
///
/// Invariants, established by [`Event::from_stored`] and [`crate::parse_publish`] and
/// never broken since `Event` is immutable: the stored form is a JSON object; its member
/// names are unique; `specversion` is "1.0"; `id`, `source` and `type` are non-empty
/// strings; every attribute is valid per [`crate`]'s rules (see the crate docs);
/// `data_base64`, when present, is valid base64.
#[derive(Clone)]
pub struct Event {
    /// The bytes appended to the log and embedded unchanged in JSON answers.
    stored: Box<RawValue>,
    /// What was read out of `stored` when it was validated.
    attributes: Attributes,
}

/// The value of an extension attribute (CloudEvents type system, JSON format mapping).
///
/// `Binary`, `URI`, `URI-reference` and `Timestamp` extensions are JSON strings and are
/// kept as [`ExtensionValue::String`]; the type system has no maps, arrays or fractions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtensionValue {
    String(String),
    /// A JSON integer in the CloudEvents Integer range (signed 32 bit).
    Integer(i32),
    Boolean(bool),
}

impl ExtensionValue {
    /// The canonical string form (used for binary-mode headers).
    pub fn to_canonical_string(&self) -> String {
        match self {
            ExtensionValue::String(s) => s.clone(),
            ExtensionValue::Integer(i) => i.to_string(),
            ExtensionValue::Boolean(b) => b.to_string(),
        }
    }
}

/// An event's payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventData<'a> {
    /// `data`: the JSON value's text exactly as stored (`null` included: an explicit
    /// null payload is distinct from no payload).
    Json(&'a str),
    /// `data_base64`, decoded.
    Binary(Vec<u8>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DataKind {
    Json,
    Base64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct DataSpan {
    kind: DataKind,
    /// Byte range of the member's JSON value inside the stored text.
    range: Range<usize>,
}

impl Event {
    /// Reads back an event from its stored bytes (as returned by [`Event::stored`]).
    ///
    /// Bytes that are not a valid stored event are reported as a corrupt event (status
    /// 500, [`EventError::is_corrupt`]), never a panic. The rules applied are those of
    /// publishing; a change that tightens them must keep accepting events already in the
    /// log (see the `stored_format_*` tests).
    pub fn from_stored(bytes: &[u8]) -> Result<Event, EventError> {
        let text = std::str::from_utf8(bytes)
            .map_err(|e| EventError::corrupt(format!("not UTF-8: {e}")))?;
        if !text.starts_with('{') {
            return Err(EventError::corrupt("not a JSON object"));
        }
        let raw: Box<RawValue> =
            serde_json::from_str(text).map_err(|e| EventError::corrupt(e.to_string()))?;
        if raw.get().len() != text.len() {
            return Err(EventError::corrupt("trailing bytes after the JSON object"));
        }
        Event::from_raw(raw).map_err(|e| EventError::corrupt(e.detail))
    }

    /// Validates a JSON object (the caller has checked that `raw` starts with `{`).
    pub(crate) fn from_raw(raw: Box<RawValue>) -> Result<Event, EventError> {
        let attributes = parse_object(raw.get())?;
        Ok(Event {
            stored: raw,
            attributes,
        })
    }

    /// The bytes to append to the log.
    pub fn stored(&self) -> &[u8] {
        self.stored.get().as_bytes()
    }

    /// The event as JSON, for embedding unchanged in a JSON answer (it is also what
    /// `Serialize` writes).
    pub fn to_raw_json(&self) -> &RawValue {
        &self.stored
    }

    /// Always [`SPEC_VERSION`].
    pub fn spec_version(&self) -> &str {
        SPEC_VERSION
    }

    pub fn id(&self) -> &str {
        &self.attributes.id
    }

    pub fn source(&self) -> &str {
        &self.attributes.source
    }

    /// The `type` attribute.
    pub fn event_type(&self) -> &str {
        &self.attributes.event_type
    }

    /// The `partitionkey` extension, when present.
    pub fn partition_key(&self) -> Option<&str> {
        self.attributes.partition_key.as_deref()
    }

    /// `datacontenttype`.
    pub fn data_content_type(&self) -> Option<&str> {
        self.attributes.data_content_type.as_deref()
    }

    /// `dataschema`.
    pub fn data_schema(&self) -> Option<&str> {
        self.attributes.data_schema.as_deref()
    }

    pub fn subject(&self) -> Option<&str> {
        self.attributes.subject.as_deref()
    }

    /// `time`, as published (an RFC 3339 string).
    pub fn time(&self) -> Option<&str> {
        self.attributes.time.as_deref()
    }

    /// Extension attributes (`partitionkey` included) in stored order.
    pub fn extensions(&self) -> &[(String, ExtensionValue)] {
        &self.attributes.extensions
    }

    /// A context attribute or extension by name, in its string form (an extension's
    /// canonical string); `None` when the event does not have it. What subscription
    /// filters compare.
    pub fn attribute(&self, name: &str) -> Option<std::borrow::Cow<'_, str>> {
        use std::borrow::Cow;
        let a = &self.attributes;
        let context = match name {
            "specversion" => Some(SPEC_VERSION),
            "id" => Some(a.id.as_str()),
            "source" => Some(a.source.as_str()),
            "type" => Some(a.event_type.as_str()),
            "datacontenttype" => a.data_content_type.as_deref(),
            "dataschema" => a.data_schema.as_deref(),
            "subject" => a.subject.as_deref(),
            "time" => a.time.as_deref(),
            _ => {
                return a
                    .extensions
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| match v {
                        ExtensionValue::String(s) => Cow::Borrowed(s.as_str()),
                        other => Cow::Owned(other.to_canonical_string()),
                    })
            }
        };
        context.map(Cow::Borrowed)
    }

    /// When the event may be handed out (the `deliverat` extension, Unix
    /// milliseconds), `None` without one. A stored value that is not an RFC 3339
    /// string (published before the rule existed) is read as absent.
    pub fn deliver_at_ms(&self) -> Option<i64> {
        self.attributes
            .extensions
            .iter()
            .find_map(|(k, v)| match v {
                ExtensionValue::String(s) if k == DELIVER_AT => crate::rfc3339::unix_ms(s),
                _ => None,
            })
    }

    /// Every context attribute the event has and every extension, each with its string
    /// form as [`Event::attribute`] gives it (`specversion` first, extensions last in
    /// stored order).
    pub fn attributes(&self) -> impl Iterator<Item = (&str, std::borrow::Cow<'_, str>)> {
        use std::borrow::Cow;
        let context = CONTEXT_ATTRIBUTES
            .into_iter()
            .filter_map(|name| self.attribute(name).map(|v| (name, v)));
        // Each extension as it is (looking it up by name would scan the list once per
        // extension: quadratic for an event with thousands of them).
        let extensions = self.attributes.extensions.iter().map(|(k, v)| {
            let v = match v {
                ExtensionValue::String(s) => Cow::Borrowed(s.as_str()),
                other => Cow::Owned(other.to_canonical_string()),
            };
            (k.as_str(), v)
        });
        context.chain(extensions)
    }

    /// The payload: `data` as its JSON text, or `data_base64` decoded.
    pub fn data(&self) -> Option<EventData<'_>> {
        let span = self.attributes.data.as_ref()?;
        let text = self.stored.get().get(span.range.clone())?;
        Some(match span.kind {
            DataKind::Json => EventData::Json(text),
            // Validated at construction; the fallback is unreachable.
            DataKind::Base64 => EventData::Binary(decode_base64_member(text).unwrap_or_default()),
        })
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Event").field(&self.stored.get()).finish()
    }
}

impl serde::Serialize for Event {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.stored.serialize(serializer)
    }
}

/// The attributes read out of a stored object; every one is valid per [`crate`]'s
/// rules, and `data_base64`, when present, is valid base64.
#[derive(Clone)]
struct Attributes {
    id: String,
    source: String,
    event_type: String,
    /// The `partitionkey` extension (also listed in `extensions`), read once because
    /// every publish needs it.
    partition_key: Option<String>,
    data_content_type: Option<String>,
    data_schema: Option<String>,
    subject: Option<String>,
    time: Option<String>,
    /// Extension attributes in stored order; `null` members (unset, per the JSON
    /// format) are left out.
    extensions: Vec<(String, ExtensionValue)>,
    /// Where `data` / `data_base64` sits inside `stored` (offsets, not a copy: an event
    /// may be 1 MiB).
    data: Option<DataSpan>,
}

/// An object's members in document order, values unparsed (borrowed from the text).
struct Members<'a>(Vec<(String, &'a RawValue)>);

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MembersVisitor;
        impl<'de> Visitor<'de> for MembersVisitor {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut members = Vec::new();
                while let Some(member) = map.next_entry::<String, &'de RawValue>()? {
                    members.push(member);
                }
                Ok(Members(members))
            }
        }
        deserializer.deserialize_map(MembersVisitor)
    }
}

/// Validates one event object's text and reads its attributes.
fn parse_object(text: &str) -> Result<Attributes, EventError> {
    let Members(members) = serde_json::from_str::<Members>(text)
        .map_err(|e| EventError::bad_request(None, format!("event is not valid JSON: {e}")))?;

    // Duplicate members are ambiguous (JSON parsers disagree on which one wins), and the
    // stored form is delivered as published, so refuse them rather than pick one.
    let mut names: Vec<&str> = members.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(EventError::invalid(
            w[0],
            format!("{} appears more than once", w[0]),
        ));
    }

    let mut spec_version = None;
    let mut id = None;
    let mut source = None;
    let mut event_type = None;
    let mut parsed = Attributes {
        id: String::new(),
        source: String::new(),
        event_type: String::new(),
        partition_key: None,
        data_content_type: None,
        data_schema: None,
        subject: None,
        time: None,
        extensions: Vec::new(),
        data: None,
    };
    let mut data = None;
    let mut data_base64 = None;

    for (name, value) in &members {
        let name = name.as_str();
        let raw = value.get();
        if name == "data" {
            // Any JSON value, `null` included (an explicit null payload).
            data = Some(span_of(text, raw));
            continue;
        }
        // Per the JSON format, a null attribute is the same as an absent one.
        if raw == "null" {
            continue;
        }
        match name {
            "data_base64" => {
                decode_base64_member(raw).map_err(|detail| EventError::invalid(name, detail))?;
                data_base64 = Some(span_of(text, raw));
            }
            "specversion" => {
                let v = string_attribute(name, raw)?;
                if v != SPEC_VERSION {
                    return Err(EventError::invalid(
                        name,
                        format!("specversion must be \"1.0\", not {v:?}"),
                    ));
                }
                spec_version = Some(v);
            }
            "id" => id = Some(required_string(name, raw)?),
            "source" => source = Some(required_string(name, raw)?),
            "type" => event_type = Some(required_string(name, raw)?),
            "subject" => parsed.subject = Some(non_empty_string(name, raw)?),
            "dataschema" => parsed.data_schema = Some(non_empty_string(name, raw)?),
            "datacontenttype" => {
                let v = non_empty_string(name, raw)?;
                if !is_media_type(&v) {
                    return Err(EventError::invalid(
                        name,
                        "datacontenttype must be a media type such as application/json",
                    ));
                }
                parsed.data_content_type = Some(v);
            }
            "time" => {
                let v = string_attribute(name, raw)?;
                if !is_rfc3339(&v) {
                    return Err(EventError::invalid(
                        name,
                        "time must be an RFC 3339 timestamp such as 2018-04-05T17:31:00Z",
                    ));
                }
                parsed.time = Some(v);
            }
            _ if !is_attribute_name(name) => {
                return Err(EventError::invalid(
                    name,
                    format!(
                        "attribute name {name:?} is invalid: names are lower-case letters a-z and digits 0-9"
                    ),
                ));
            }
            "partitionkey" => {
                let v = required_string(name, raw)?;
                parsed.partition_key = Some(v.clone());
                parsed
                    .extensions
                    .push((name.to_owned(), ExtensionValue::String(v)));
            }
            _ => {
                let v = extension_value(name, raw)?;
                parsed.extensions.push((name.to_owned(), v));
            }
        }
    }

    if spec_version.is_none() {
        return Err(EventError::invalid(
            "specversion",
            "specversion is required and must be \"1.0\"",
        ));
    }
    parsed.id = id.ok_or_else(|| missing("id"))?;
    parsed.source = source.ok_or_else(|| missing("source"))?;
    parsed.event_type = event_type.ok_or_else(|| missing("type"))?;
    parsed.data = match (data, data_base64) {
        (Some(_), Some(_)) => {
            return Err(EventError::invalid(
                "data_base64",
                "data and data_base64 are mutually exclusive",
            ))
        }
        (Some(range), None) => Some(DataSpan {
            kind: DataKind::Json,
            range,
        }),
        (None, Some(range)) => Some(DataSpan {
            kind: DataKind::Base64,
            range,
        }),
        (None, None) => None,
    };
    Ok(parsed)
}

fn missing(name: &str) -> EventError {
    EventError::invalid(name, format!("{name} must be a non-empty string"))
}

/// A String attribute: a JSON string without control characters (CloudEvents type
/// system: U+0000-U+001F and U+007F-U+009F are not allowed).
fn string_attribute(name: &str, raw: &str) -> Result<String, EventError> {
    if !raw.starts_with('"') {
        return Err(EventError::invalid(
            name,
            format!("{name} must be a string"),
        ));
    }
    let value: String = serde_json::from_str(raw)
        .map_err(|e| EventError::invalid(name, format!("{name} is not a valid string: {e}")))?;
    if value
        .chars()
        .any(|c| c.is_control() || ('\u{7f}'..='\u{9f}').contains(&c))
    {
        return Err(EventError::invalid(
            name,
            format!("{name} must not contain control characters"),
        ));
    }
    Ok(value)
}

/// `id`, `source`, `type`, `partitionkey`: the message names the rule in full.
fn required_string(name: &str, raw: &str) -> Result<String, EventError> {
    if !raw.starts_with('"') {
        return Err(missing(name));
    }
    let v = string_attribute(name, raw)?;
    if v.is_empty() {
        return Err(missing(name));
    }
    Ok(v)
}

/// `subject`, `dataschema`, `datacontenttype`: optional, but non-empty when present.
fn non_empty_string(name: &str, raw: &str) -> Result<String, EventError> {
    let v = string_attribute(name, raw)?;
    if v.is_empty() {
        return Err(EventError::invalid(
            name,
            format!("{name} must be a non-empty string when present"),
        ));
    }
    Ok(v)
}

fn extension_value(name: &str, raw: &str) -> Result<ExtensionValue, EventError> {
    match raw.as_bytes().first() {
        Some(b'"') => string_attribute(name, raw).map(ExtensionValue::String),
        Some(b't') | Some(b'f') => Ok(ExtensionValue::Boolean(raw == "true")),
        // The JSON format allows only an integer component, optionally negative (so no
        // fraction or exponent), in the CloudEvents Integer range.
        Some(b'-' | b'0'..=b'9') => raw
            .parse::<i32>()
            .map(ExtensionValue::Integer)
            .map_err(|_| {
                EventError::invalid(
                    name,
                    format!(
                        "extension {name} is not an integer between -2147483648 and 2147483647"
                    ),
                )
            }),
        _ => Err(EventError::invalid(
            name,
            format!("extension {name} must be a string, an integer or a boolean"),
        )),
    }
}

/// CloudEvents attribute names: lower-case ASCII letters and digits, at least one.
pub(crate) fn is_attribute_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
}

/// A plausible RFC 2046 media type: `type/subtype[; parameters]` in printable ASCII, so
/// it can always travel as a `Content-Type` header.
pub(crate) fn is_media_type(value: &str) -> bool {
    let essence = value.split(';').next().unwrap_or("").trim();
    let ok_chars = value
        .bytes()
        .all(|c| c == b'\t' || (b' '..=b'~').contains(&c));
    match essence.split_once('/') {
        Some((t, s)) => {
            ok_chars
                && !t.is_empty()
                && !s.is_empty()
                && !essence.contains(char::is_whitespace)
                && !s.contains('/')
        }
        None => false,
    }
}

/// Whether a media type declares JSON content: subtype `json` or a `+json` suffix
/// (JSON format, section 3.1.1).
pub(crate) fn is_json_media_type(value: &str) -> bool {
    let essence = value.split(';').next().unwrap_or("").trim();
    match essence.split_once('/') {
        Some((_, subtype)) => {
            let subtype = subtype.to_ascii_lowercase();
            subtype == "json" || subtype.ends_with("+json")
        }
        None => false,
    }
}

/// Decodes a `data_base64` member's JSON text (a string literal) to bytes.
fn decode_base64_member(raw: &str) -> Result<Vec<u8>, String> {
    if !raw.starts_with('"') {
        return Err("data_base64 must be a base64 string".to_owned());
    }
    let text: String =
        serde_json::from_str(raw).map_err(|e| format!("data_base64 is not a valid string: {e}"))?;
    base64::engine::general_purpose::STANDARD
        .decode(text.as_bytes())
        .map_err(|e| format!("data_base64 is not valid base64: {e}"))
}

/// The byte range of `inner` (a member value borrowed from `outer`) inside `outer`.
fn span_of(outer: &str, inner: &str) -> Range<usize> {
    let start = (inner.as_ptr() as usize).wrapping_sub(outer.as_ptr() as usize);
    debug_assert!(start <= outer.len() && start + inner.len() <= outer.len());
    start..start + inner.len()
}
