//! `/v1/subscriptions`: the SubscriptionStore over HTTP, with `ETag`, `If-Match` and
//! `If-None-Match: *`.

use super::{etag, json_body, valid_name_or_400, Api};
use crate::problem::Problem;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use meshd_meta::Backend;
use meshd_stores::subscriptions::{
    check_write_bounds, Backoff, Filter, FilterError, FilterExpr, Ordering, Precondition, Push,
    Rate, StartPosition, Subscription, SubscriptionError, SubscriptionSpec, SubscriptionStore,
    REDACTED,
};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

pub fn subscription_problem(e: SubscriptionError, backend: Backend) -> Problem {
    match e {
        SubscriptionError::Invalid { field, reason } => {
            Problem::invalid_field(field, format!("{field} {reason}"))
        }
        SubscriptionError::NotFound { name } => {
            Problem::not_found(format!("subscription {name:?} does not exist"))
        }
        SubscriptionError::TopicNotFound { topic } => {
            Problem::not_found(format!("topic {topic:?} does not exist")).with("field", "topic")
        }
        SubscriptionError::PreconditionFailed {
            name,
            current_revision,
        } => Problem::new(
            StatusCode::PRECONDITION_FAILED,
            "precondition-failed",
            format!("precondition failed for subscription {name:?}"),
        )
        .with("revision", current_revision),
        SubscriptionError::TopicChange {
            name,
            current,
            requested,
        } => Problem::conflict(format!(
            "subscription {name:?} is on topic {current:?}; it cannot move to {requested:?}"
        ))
        .with("field", "topic"),
        SubscriptionError::Store(f) => Problem::store_failure("subscriptions", backend, f),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BackoffBody {
    initial_ms: Option<u64>,
    max_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FilterBody {
    #[serde(rename = "type")]
    event_type: Option<String>,
    source: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PushBody {
    url: String,
    /// Omitted: keep the stored ones; `"***"` entries stand for stored ones.
    secrets: Option<Vec<String>>,
    /// Omitted: keep the stored ones; a `"***"` value keeps that header's value.
    headers: Option<serde_json::Map<String, Value>>,
    max_concurrency: Option<u32>,
    rate_per_s: Option<f64>,
}

/// The push settings of a request (credentials kept from the stored record are
/// resolved by the store, inside its compare-and-set).
fn push_of(p: PushBody) -> Result<Push, Problem> {
    if let Err(e) = meshd_runtime::runtime::push::Target::parse(&p.url) {
        return Err(Problem::invalid_field("push.url", e.to_string()));
    }
    let headers = match p.headers {
        None => None,
        Some(map) => Some(
            map.into_iter()
                .map(|(name, v)| match v {
                    Value::String(v) => Ok((name.to_ascii_lowercase(), v)),
                    _ => Err(Problem::invalid_field(
                        "push.headers",
                        format!("push.headers.{name} must be a string"),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
    };
    let mut push = Push::new(p.url);
    push.secrets = p.secrets;
    push.headers = headers;
    if let Some(n) = p.max_concurrency {
        push.max_concurrency = n;
    }
    push.rate_per_s = p.rate_per_s.map(Rate);
    Ok(push)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PutSubscription {
    topic: String,
    max_attempts: Option<u32>,
    ack_timeout_ms: Option<u64>,
    backoff: Option<BackoffBody>,
    filter: Option<FilterBody>,
    /// Parsed by [`FilterExpr::parse_list`], which names a malformed expression's path.
    filters: Option<Value>,
    push: Option<PushBody>,
    start: Option<String>,
    ordering: Option<String>,
}

fn spec_of(name: &str, body: PutSubscription) -> Result<SubscriptionSpec, Problem> {
    let mut spec = SubscriptionSpec::new(name, body.topic);
    if let Some(n) = body.max_attempts {
        spec.max_attempts = n;
    }
    if let Some(ms) = body.ack_timeout_ms {
        spec.ack_timeout_ms = ms;
    }
    if let Some(b) = body.backoff {
        let default = Backoff::default();
        spec.backoff = Backoff {
            initial_ms: b.initial_ms.unwrap_or(default.initial_ms),
            max_ms: b.max_ms.unwrap_or(default.max_ms),
        };
    }
    spec.filter = body.filter.map(|f| Filter {
        event_type: f.event_type,
        source: f.source,
    });
    // `FilterError` reads "filters[1].any[0]: why".
    let filter_problem = |e: FilterError| {
        let detail = if e.path == "filters" {
            e.to_string()
        } else {
            format!("filter expression {e}")
        };
        Problem::invalid_field(&e.path, detail)
    };
    if let Some(v) = &body.filters {
        spec.filters = FilterExpr::parse_list(v).map_err(filter_problem)?;
    }
    // The write bounds (pairs per expression, bytes), here with the expression's path;
    // the store checks them again for every other way in.
    check_write_bounds(spec.filter.as_ref(), &spec.filters).map_err(filter_problem)?;
    spec.push = body.push.map(push_of).transpose()?;
    spec.start = match body.start.as_deref() {
        None | Some("latest") => StartPosition::Latest,
        Some("earliest") => StartPosition::Earliest,
        Some(other) => {
            return Err(Problem::invalid_field(
                "start",
                format!("start must be \"latest\" or \"earliest\", got {other:?}"),
            ))
        }
    };
    if let Some(o) = body.ordering.as_deref() {
        spec.ordering = Ordering::parse(o).ok_or_else(|| {
            Problem::invalid_field(
                "ordering",
                format!("ordering must be \"none\" or \"key\", got {o:?}"),
            )
        })?;
    }
    Ok(spec)
}

fn to_json(s: &Subscription) -> Value {
    let spec = &s.spec;
    let mut v = json!({
        "name": spec.name,
        "topic": spec.topic,
        "max_attempts": spec.max_attempts,
        "ack_timeout_ms": spec.ack_timeout_ms,
        "backoff": {"initial_ms": spec.backoff.initial_ms, "max_ms": spec.backoff.max_ms},
        "start": match spec.start { StartPosition::Latest => "latest", StartPosition::Earliest => "earliest" },
        "ordering": spec.ordering.as_str(),
        "revision": s.revision,
    });
    if let Some(f) = &spec.filter {
        let mut filter = serde_json::Map::new();
        if let Some(t) = &f.event_type {
            filter.insert("type".into(), json!(t));
        }
        if let Some(src) = &f.source {
            filter.insert("source".into(), json!(src));
        }
        v["filter"] = Value::Object(filter);
    }
    if !spec.filters.is_empty() {
        v["filters"] = FilterExpr::list_to_json(&spec.filters);
    }
    if let Some(p) = &spec.push {
        v["push"] = push_json(p);
    }
    v
}

/// The push settings as shown: secrets and header values as `"***"` (never sent back
/// or logged).
fn push_json(p: &Push) -> Value {
    let mut v = json!({"url": p.url, "max_concurrency": p.max_concurrency});
    if !p.secrets().is_empty() {
        v["secrets"] = json!(vec![REDACTED; p.secrets().len()]);
    }
    if !p.headers().is_empty() {
        let headers: serde_json::Map<String, Value> = p
            .headers()
            .iter()
            .map(|(k, _)| (k.clone(), json!(REDACTED)))
            .collect();
        v["headers"] = Value::Object(headers);
    }
    if let Some(r) = p.rate_per_s {
        v["rate_per_s"] = json!(r.0);
    }
    v
}

/// `If-Match: "r"` → Revision(r); `If-None-Match: *` → Absent; neither → None.
fn precondition(headers: &HeaderMap) -> Result<Precondition, Problem> {
    if let Some(v) = headers.get(header::IF_NONE_MATCH) {
        return match v.to_str().map(str::trim) {
            Ok("*") => Ok(Precondition::Absent),
            _ => Err(Problem::invalid_field(
                "If-None-Match",
                "only If-None-Match: * is supported",
            )),
        };
    }
    match headers.get(header::IF_MATCH) {
        None => Ok(Precondition::None),
        Some(v) => {
            let raw = v.to_str().unwrap_or("").trim();
            let raw = raw.strip_prefix("W/").unwrap_or(raw);
            raw.trim_matches('"')
                .parse::<i64>()
                .ok()
                .filter(|r| *r >= 1)
                .map(Precondition::Revision)
                .ok_or_else(|| {
                    Problem::invalid_field("If-Match", "If-Match must be an ETag like \"42\"")
                })
        }
    }
}

pub async fn put_subscription(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    valid_name_or_400("subscription", &name)?;
    let req: PutSubscription = json_body(&headers, body)?;
    let spec = spec_of(&name, req)?;
    // A literal address the push rules refuse is a 400 now; a name is checked at
    // every connect (meshd_runtime::egress).
    if let Some(p) = &spec.push {
        if let Ok(target) = meshd_runtime::runtime::push::Target::parse(&p.url) {
            api.runtime
                .push_egress()
                .check_literal(&target.host, target.port)
                .map_err(|e| Problem::invalid_field("push.url", e))?;
        }
    }
    // Settings an older release would ignore wait for the end of a rolling upgrade.
    let second_wave = if !spec.filters.is_empty() {
        Some("filters")
    } else if spec.ordering != Ordering::None {
        Some("ordering")
    } else {
        spec.push.as_ref().and_then(|p| {
            // Omitted lists keep what is stored (written when the check held).
            let signed = p.secrets.as_ref().is_some_and(|s| !s.is_empty())
                || p.headers.as_ref().is_some_and(|h| !h.is_empty());
            let bounded = p.max_concurrency
                != meshd_stores::subscriptions::push::DEFAULT_MAX_CONCURRENCY
                || p.rate_per_s.is_some();
            (signed || bounded).then_some("push")
        })
    };
    if let Some(field) = second_wave {
        super::require_release(&api, field, super::SETTINGS_RELEASE).await?;
    }
    let pre = precondition(&headers)?;
    // Held while the subscription is written (see crate::quota); at the quota only
    // an existing subscription may be PUT again.
    let _reserved = api
        .quotas
        .admit(api.quotas.subscription(&name), async {
            let found = api.subscriptions.get(&name).await;
            Ok(found
                .map_err(|e| subscription_problem(e, api.meta_backend))?
                .is_some())
        })
        .await?;
    let (sub, created) = api
        .subscriptions
        .put(spec, pre)
        .await
        .map_err(|e| subscription_problem(e, api.meta_backend))?;
    // The runtime starts (or, for new settings, rebuilds) its partitions before the
    // answer, so a pull right after it is served; a new subscription's offsets are
    // set at its start position here. The subscription is written either way: when
    // its partitions cannot start (a fail-stopped Local store, the topic cache
    // unreachable) the answer still says so truthfully — an error here would claim
    // nothing was applied — and the runtime, which follows the subscription cache,
    // keeps trying; readiness shows the failure.
    if let Err(e) = api.runtime.ensure(&sub).await {
        tracing::warn!(store = "subscriptions", backend = %api.meta_backend, subscription = %name, error = %e, "subscription written, but its partitions could not start yet; the runtime retries");
    }
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        [(header::ETAG, etag(sub.revision))],
        Json(to_json(&sub)),
    )
        .into_response())
}

pub async fn get_subscription(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
) -> Result<Response, Problem> {
    valid_name_or_400("subscription", &name)?;
    match api
        .subscriptions
        .get(&name)
        .await
        .map_err(|e| subscription_problem(e, api.meta_backend))?
    {
        Some(sub) => {
            Ok(([(header::ETAG, etag(sub.revision))], Json(to_json(&sub))).into_response())
        }
        None => Err(Problem::not_found(format!(
            "subscription {name:?} does not exist"
        ))),
    }
}

pub async fn list_subscriptions(State(api): State<Arc<Api>>) -> Result<Response, Problem> {
    let subs = api
        .subscriptions
        .list()
        .await
        .map_err(|e| subscription_problem(e, api.meta_backend))?;
    let subs: Vec<Value> = subs.iter().map(to_json).collect();
    Ok(Json(json!({ "subscriptions": subs })).into_response())
}

pub async fn delete_subscription(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    valid_name_or_400("subscription", &name)?;
    let pre = match precondition(&headers)? {
        Precondition::Absent => {
            return Err(Problem::invalid_field(
                "If-None-Match",
                "a delete cannot require the subscription to be absent",
            ))
        }
        other => other,
    };
    let deleted = api
        .subscriptions
        .delete(&name, pre)
        .await
        .map_err(|e| subscription_problem(e, api.meta_backend))?;
    // Its partitions stop, and the incarnation's local state goes with it; a later
    // subscription of the same name is a new incarnation and starts afresh either way.
    api.runtime.forget(&deleted.name, deleted.incarnation).await;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Fuzzing the subscription PUT body and its preconditions (see
/// docs/fuzzing.md): the handler's parse, `spec_of` and the store's `validate`, in
/// that order; any body is a valid spec or a clean 400/415, never a panic.
#[cfg(test)]
mod fuzz {
    use super::super::fuzz::{body, cases, clean, headers};
    use super::*;
    use proptest::prelude::*;

    const FIELDS: &[&str] = &[
        "topic",
        "max_attempts",
        "ack_timeout_ms",
        "backoff",
        "initial_ms",
        "max_ms",
        "filter",
        "type",
        "source",
        "push",
        "url",
        "start",
    ];

    fn put(h: &HeaderMap, b: Bytes) -> Result<SubscriptionSpec, Problem> {
        let req: PutSubscription = json_body(h, Ok(b))?;
        let spec = spec_of("s", req)?;
        spec.validate()
            .map_err(|e| subscription_problem(e, Backend::Embedded))?;
        precondition(h)?;
        Ok(spec)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases()))]

        #[test]
        fn put_subscription_body(h in headers(), b in body(FIELDS)) {
            match put(&h, b) {
                Ok(spec) => {
                    prop_assert_eq!(spec.name.as_str(), "s");
                    let _ = to_json(&Subscription { spec, revision: 1, incarnation: 1 });
                }
                Err(p) => clean(&p)?,
            }
        }
    }
}
