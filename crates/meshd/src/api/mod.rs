//! The `/v1` HTTP API (`../shared/design/http-api.md`). Handlers are thin: they
//! validate input into problem+json answers and call the stores.

pub mod cluster;
pub mod consume;
pub mod deadletters;
pub mod fields;
pub mod internal;
pub mod sessions;
pub mod stream;
pub mod subscribe;
pub mod subscriptions;
pub mod tasks;
pub mod topics;
pub mod websocket;

use crate::http::{is_json, media_type, MAX_BODY_BYTES};
use crate::problem::Problem;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use meshd_events::MAX_JSON_DEPTH;
use meshd_runtime::metrics::Metrics;
use meshd_runtime::runtime::Runtime;
use meshd_stores::deadletters::DeadLetterStore;
use meshd_stores::sessions::SessionStore;
use meshd_stores::subscriptions::MetaSubscriptionStore;
use meshd_stores::topics::MetaTopicStore;
use serde::de::DeserializeOwned;
use std::sync::Arc;

/// What the handlers need.
pub struct Api {
    pub topics: Arc<MetaTopicStore>,
    pub subscriptions: Arc<MetaSubscriptionStore>,
    pub log: Arc<dyn meshd_stores::log::PartitionLog>,
    /// `rocksdb` (the embedded log) or `nats`.
    pub log_backend: meshd_meta::Backend,
    pub meta_backend: meshd_meta::Backend,
    pub runtime: Arc<Runtime>,
    pub deadletters: Arc<dyn DeadLetterStore>,
    pub sessions: Arc<dyn SessionStore>,
    pub metrics: Arc<Metrics>,
    pub meta: Arc<dyn meshd_meta::Meta>,
    pub instance_id: String,
    pub tasks: Arc<dyn meshd_stores::tasks::TaskStore>,
    /// Load shedding; the long-poll cap is taken in `pull`.
    pub admission: Arc<crate::admission::Admission>,
    /// Answer bounds and client quotas.
    pub limits: crate::config::Limits,
    pub quotas: Arc<crate::quota::Quotas>,
    /// `--idle-timeout-ms`: also how long a frame to a WebSocket client may wait for
    /// the client to read it before the stream is closed.
    pub idle_timeout: std::time::Duration,
    /// `--log-retention-hours` in ms: a topic's dedup window is at most this.
    pub log_retention_ms: Option<u64>,
}

/// The release that first honours the second-wave settings of subscriptions
/// (`filters`, signed and bounded `push`): an older member ignores them (it would
/// deliver unfiltered, push unsigned), so they are refused while one is a member.
pub const SETTINGS_RELEASE: meshd_runtime::membership::Release =
    meshd_runtime::membership::Release(0, 2, 0);

/// 409 while a member of the cluster runs a release older than `since`, which would
/// ignore `field` (state-plane.md, "Records": a feature that needs older instances to
/// honour it waits until every member runs a release that does). Standalone, the only
/// member is this one.
pub async fn require_release(
    api: &Api,
    field: &str,
    since: meshd_runtime::membership::Release,
) -> Result<(), Problem> {
    let members = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        meshd_runtime::membership::members(api.meta.as_ref()),
    )
    .await
    .map_err(|_| Problem::unavailable("members", api.meta_backend, "Meta did not answer in time"))?
    .map_err(|e| Problem::unavailable("members", api.meta_backend, e.to_string()))?;
    let oldest = meshd_runtime::membership::oldest_release(&members);
    if oldest < since {
        return Err(Problem::conflict(format!(
            "{field} needs every member to run release {since} or newer, and one runs {oldest}: \
             it would ignore {field}; finish the rolling upgrade first"
        ))
        .with("field", field)
        .with("oldest_release", oldest.to_string()));
    }
    Ok(())
}

/// The byte bound of an answer: the query's `max_bytes` (at least 1), by default and
/// at most `--max-response-bytes` (http-api.md "Bounded answers").
pub fn answer_bytes(api: &Api, max_bytes: Option<&str>) -> Result<usize, Problem> {
    let ceiling = api.limits.max_response_bytes;
    let asked = query_number("max_bytes", max_bytes, ceiling, 1..=u64::MAX)?;
    Ok(usize::try_from(asked.min(ceiling)).unwrap_or(usize::MAX))
}

/// A number from the query string: `default` when absent, 400 naming `name` when it is
/// not an integer within `range`.
pub fn query_number(
    name: &str,
    value: Option<&str>,
    default: u64,
    range: std::ops::RangeInclusive<u64>,
) -> Result<u64, Problem> {
    match value {
        None => Ok(default),
        Some(v) => v
            .parse::<u64>()
            .ok()
            .filter(|n| range.contains(n))
            .ok_or_else(|| {
                Problem::invalid_field(
                    name,
                    format!(
                        "{name} must be an integer from {} to {}",
                        range.start(),
                        range.end()
                    ),
                )
            }),
    }
}

/// A JSON list built as text under a byte bound: items go in until the next would
/// pass it (the first always goes in, so one large item is never stuck).
pub struct BoundedList {
    out: String,
    max_bytes: usize,
    used: usize,
    items: usize,
}

impl BoundedList {
    /// Starts the answer with `head` (e.g. `{"events":[`).
    pub fn new(head: &str, max_bytes: usize) -> Self {
        Self {
            out: head.to_string(),
            max_bytes,
            used: 0,
            items: 0,
        }
    }

    /// Adds `item` (JSON text) unless it would pass the bound; `false`: stop here.
    pub fn push(&mut self, item: &str) -> bool {
        if self.items > 0 && self.used.saturating_add(item.len()) > self.max_bytes {
            return false;
        }
        if self.items > 0 {
            self.out.push(',');
        }
        self.out.push_str(item);
        self.used = self.used.saturating_add(item.len());
        self.items += 1;
        true
    }

    /// Closes the list with `]`, adds `"next_cursor"` when given, and the final `}`.
    pub fn finish(mut self, next_cursor: Option<String>) -> axum::response::Response {
        self.out.push(']');
        if let Some(c) = next_cursor {
            self.out
                .push_str(&format!(",\"next_cursor\":{}", serde_json::json!(c)));
        }
        self.out.push('}');
        axum::response::IntoResponse::into_response((
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            self.out,
        ))
    }
}

/// A body that could not be read: too large (413) or broken (400).
pub fn body_problem(e: BytesRejection) -> Problem {
    if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
        Problem::too_large(format!("request body exceeds {MAX_BODY_BYTES} bytes"))
    } else {
        Problem::bad_request(format!("cannot read the request body: {e}"))
    }
}

/// Names (topics, subscriptions, client ids, agents): 1–249 of `[A-Za-z0-9._-]`.
pub fn valid_name_or_400(what: &str, name: &str) -> Result<(), Problem> {
    if meshd_stores::names::is_valid_name(name) {
        Ok(())
    } else {
        Err(Problem::invalid_field(
            what,
            format!("{what} name must be 1-249 characters of [A-Za-z0-9._-], got {name:?}"),
        ))
    }
}

/// A strong `ETag` for a store-issued revision or version (`"42"`).
pub fn etag(revision: i64) -> axum::http::HeaderValue {
    // A formatted integer in quotes is always a valid header value.
    axum::http::HeaderValue::from_str(&format!("\"{revision}\""))
        .unwrap_or(axum::http::HeaderValue::from_static("\"0\""))
}

/// A stored event as raw JSON, to embed exactly as published; `None` when the bytes
/// are not JSON (only damage does that: events are validated at publish).
pub fn raw_event(body: Vec<u8>) -> Option<Box<serde_json::value::RawValue>> {
    String::from_utf8(body)
        .ok()
        .and_then(|s| serde_json::value::RawValue::from_string(s).ok())
}

/// 415 unless the content type (when given) is JSON (`application/json`, `*+json`).
pub fn require_json_content_type(headers: &HeaderMap) -> Result<(), Problem> {
    if let Some(essence) = media_type(headers) {
        if !is_json(&essence) {
            return Err(Problem::unsupported_media_type(format!(
                "expected application/json, got {essence:?}"
            )));
        }
    }
    Ok(())
}

/// Parses a JSON request body: 413 when it is too large, 415 for a non-JSON content
/// type, 400 naming what is wrong otherwise, a body nested deeper than
/// [`MAX_JSON_DEPTH`] levels included (the outermost array or object is level 1; the
/// `field` is the top-level member holding the deep value). The depth is measured on
/// the raw text before anything is parsed, without recursion: serde_json alone would
/// refuse only beyond 128, and what such a body stores (a task's `input`) would make
/// every answer that carries it unreadable to clients with that limit.
pub fn json_body<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<T, Problem> {
    let body = body.map_err(body_problem)?;
    require_json_content_type(headers)?;
    if let Some(deep) = meshd_events::nested_deeper_than(&body, MAX_JSON_DEPTH) {
        let detail = |place: &str| {
            format!("invalid JSON body: nested deeper than {MAX_JSON_DEPTH} levels{place}")
        };
        return Err(match deep.member {
            Some(m) => Problem::invalid_field(&m, detail(&format!(" in {m}"))),
            None => Problem::bad_request(detail("")),
        });
    }
    serde_json::from_slice(&body).map_err(|e| {
        let field = missing_or_unknown_field(&e.to_string());
        let p = Problem::bad_request(format!("invalid JSON body: {e}"));
        match field {
            Some(f) => p.with("field", f),
            None => p,
        }
    })
}

/// The field serde names in "missing field `x`" / "unknown field `x`".
fn missing_or_unknown_field(message: &str) -> Option<String> {
    let start = message.find('`')? + 1;
    let end = start + message[start..].find('`')?;
    Some(message[start..end].to_string())
}

/// What the request-body fuzzers of the route modules share (see
/// docs/fuzzing.md): the case count, header and body generators, and the "clean
/// rejection" check. Bodies are arbitrary bytes or JSON objects written member by
/// member (duplicates possible) from the route's own field names, with values at and
/// beyond every limit, so the cases reach each field's validation.
#[cfg(test)]
mod fuzz {
    use super::*;
    use axum::http::header;
    use proptest::prelude::*;
    use serde_json::Value;

    pub use meshd_fuzz_cases::cases;

    /// Request headers: content types JSON or not, in any case, or not UTF-8.
    pub fn headers() -> impl Strategy<Value = HeaderMap> {
        let ct = prop_oneof![
            3 => Just(None),
            3 => Just(Some(b"application/json".to_vec())),
            1 => prop::sample::select(vec![
                "APPLICATION/JSON; charset=utf-8",
                "application/merge-patch+json",
                "text/plain",
                "application/x-www-form-urlencoded",
                "",
            ])
            .prop_map(|s| Some(s.as_bytes().to_vec())),
            1 => Just(Some(b"application/json\xff".to_vec())),
        ];
        let if_match = prop_oneof![
            3 => Just(None),
            1 => prop::sample::select(vec![
                "\"42\"", "W/\"1\"", "*", "\"0\"", "\"-1\"", "42", "\"9223372036854775808\"", "\"\"", "\"",
            ])
            .prop_map(|s| Some(s.to_owned())),
            1 => ".{0,8}".prop_map(Some),
        ];
        let if_none_match = prop_oneof![4 => Just(None), 1 => prop::sample::select(vec!["*", " * ", "\"1\""]).prop_map(Some)];
        (ct, if_match, if_none_match).prop_map(|(ct, im, inm)| {
            let mut h = HeaderMap::new();
            if let Some(v) = ct.and_then(|b| axum::http::HeaderValue::from_bytes(&b).ok()) {
                h.insert(header::CONTENT_TYPE, v);
            }
            if let Some(v) = im.and_then(|s| axum::http::HeaderValue::from_str(&s).ok()) {
                h.insert(header::IF_MATCH, v);
            }
            if let Some(v) = inm.and_then(|s| axum::http::HeaderValue::from_str(s).ok()) {
                h.insert(header::IF_NONE_MATCH, v);
            }
            h
        })
    }

    /// A JSON value as text, at and beyond the limits the routes check.
    fn value(fields: &'static [&'static str]) -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            prop::sample::select(vec![
                "null",
                "true",
                "0",
                "1",
                "-1",
                "1.5",
                "1e3",
                "100",
                "1000",
                "1001",
                "1024",
                "1025",
                "30000",
                "30001",
                "600000",
                "600001",
                "4294967295",
                "4294967296",
                "18446744073709551615",
                "18446744073709551616",
                "\"\"",
                "\"latest\"",
                "\"earliest\"",
                "\"http://127.0.0.1:1/x\"",
                "\"https://h/\"",
                "\"http://\"",
                "\"ftp://h\"",
                "\"working\"",
                "\"completed\"",
                "\"a-b.c_d\"",
                "\"a b\"",
                "\"0123456789abcdef0123456789abcdef\"",
                "\"\\ud800\"",
                "[]",
                "{}",
            ])
            .prop_map(str::to_owned),
            ".{0,12}".prop_map(|s| Value::String(s).to_string()),
            (
                0usize..4,
                prop::sample::select(vec![1usize, 249, 250, 512, 513, 2049])
            )
                .prop_map(|(c, n)| Value::String(
                    "abcd".chars().nth(c).unwrap().to_string().repeat(n)
                )
                .to_string()),
            prop::sample::select(vec![0usize, 1, 1000, 1001])
                .prop_map(|n| Value::Array(vec![Value::from("d"); n]).to_string()),
        ];
        leaf.prop_recursive(2, 10, 4, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4)
                    .prop_map(|v| format!("[{}]", v.join(","))),
                prop::collection::vec((prop::sample::select(fields), inner), 0..4).prop_map(|m| {
                    let m: Vec<String> =
                        m.into_iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
                    format!("{{{}}}", m.join(","))
                }),
            ]
        })
    }

    /// A request body for a route whose members are `fields`.
    pub fn body(fields: &'static [&'static str]) -> impl Strategy<Value = Bytes> {
        let name = prop_oneof![
            8 => prop::sample::select(fields).prop_map(str::to_owned),
            1 => "[a-z_]{1,6}",
        ];
        let object = prop::collection::vec((name, value(fields)), 0..6).prop_map(|m| {
            let m: Vec<String> = m
                .into_iter()
                .map(|(k, v)| format!("{}:{v}", Value::String(k)))
                .collect();
            format!("{{{}}}", m.join(","))
        });
        prop_oneof![
            6 => object.prop_map(Bytes::from),
            1 => prop::collection::vec(any::<u8>(), 0..48).prop_map(Bytes::from),
            1 => prop::sample::select(vec!["", " \n", "null", "[]", "{}", "{", "\"x\""]).prop_map(|s: &'static str| Bytes::from_static(s.as_bytes())),
            1 => value(fields).prop_map(Bytes::from),
        ]
    }

    /// A rejected request body is a 400 (naming what is wrong) or a 415.
    pub fn clean(p: &Problem) -> Result<(), TestCaseError> {
        prop_assert!(
            p.status == axum::http::StatusCode::BAD_REQUEST
                || p.status == axum::http::StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "{} {}",
            p.status,
            p.detail
        );
        prop_assert!(!p.detail.is_empty());
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases()))]

        /// The shared JSON body reader and the name check every route runs first.
        #[test]
        fn json_body_and_names(headers in headers(), body in body(&["a"]), name in ".{0,12}") {
            if let Err(p) = json_body::<Value>(&headers, Ok(body)) {
                clean(&p)?;
            }
            if let Err(p) = valid_name_or_400("subscription", &name) {
                clean(&p)?;
            }
        }
    }
}
