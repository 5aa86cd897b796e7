//! `/v1/topics`: topic definitions (Meta, through the TopicStore), publishing and
//! browsing events (the partition log).

use super::{body_problem, json_body, query_number, valid_name_or_400, Api};
use crate::problem::Problem;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use meshd_events::{parse_publish, partition_for, Event, EventError, Limits};
use meshd_meta::Backend;
use meshd_stores::log::{Appended, DedupEvent, DedupKey, LogError};
use meshd_stores::topics::{
    Topic, TopicError, TopicStore, DEFAULT_DEDUP_WINDOW_MS, MAX_DEDUP_WINDOW_MS,
};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// Partitions of a topic: 1–1024.
const PARTITIONS: std::ops::RangeInclusive<u64> = 1..=1024;
/// Browse page size: default and maximum.
const BROWSE_DEFAULT: u64 = 100;
const BROWSE_MAX: u64 = 1000;

pub fn topic_problem(e: TopicError, backend: Backend) -> Problem {
    match e {
        TopicError::Invalid { field, reason } => Problem::invalid_field(field, reason),
        TopicError::NotFound { name } => {
            Problem::not_found(format!("topic {name:?} does not exist"))
        }
        TopicError::PartitionMismatch {
            name,
            existing,
            requested,
        } => Problem::conflict(format!(
            "topic {name:?} exists with {existing} partitions, not {requested}"
        ))
        .with("partitions", existing),
        TopicError::InUse {
            name,
            subscriptions,
        } => Problem::conflict(format!(
            "topic {name:?} is referenced by subscriptions {subscriptions:?}"
        ))
        .with("subscriptions", subscriptions),
        TopicError::Store(f) => Problem::store_failure("topics", backend, f),
    }
}

/// A log error as a problem; `backend` is `rocksdb` (the embedded log) or `nats`.
pub fn log_problem(e: LogError, backend: meshd_meta::Backend) -> Problem {
    match e {
        LogError::BelowRetention {
            topic,
            partition,
            requested,
            start,
        } => Problem::invalid_field(
            "from",
            format!("offset {requested} of {topic}/{partition} was removed by retention; the partition starts at {start}"),
        )
        .with("retained_start", start),
        LogError::UnknownPartition { topic, partition } => {
            Problem::not_found(format!("topic {topic:?} has no partition {partition}"))
        }
        LogError::Invalid(d) => Problem::bad_request(d),
        LogError::Unavailable(d) => Problem::unavailable("log", backend, d),
        LogError::DedupFull {
            entries,
            retry_after_ms,
        } => {
            let mut p = Problem::new(
                axum::http::StatusCode::TOO_MANY_REQUESTS,
                "dedup-full",
                format!("the publish dedup index holds {entries} entries (--max-dedup-entries): a publish with dedup waits until the oldest entry expires, in {retry_after_ms} ms; entries are never dropped early, so a retry inside its window is still answered as a duplicate"),
            );
            p.retry_after = Some(retry_after_ms.div_ceil(1000).max(1).to_string().into());
            p
        }
        LogError::Failed(reason) => Problem::fail_stopped("log", backend, reason),
        LogError::Indeterminate(reason) if backend == Backend::RocksDb => Problem::indeterminate(
            "log",
            backend,
            format!("the write reached the log but was not made durable: it may or may not be kept (a retry may store it twice); the log has fail-stopped until meshd is restarted: {reason}"),
        ),
        LogError::Indeterminate(reason) => Problem::indeterminate(
            "log",
            backend,
            format!("the write may or may not have been stored (a retry may store it twice): {reason}"),
        ),
        LogError::Corrupt { key, reason } => {
            Problem::internal("log", backend, format!("corrupt log record {key}: {reason}"))
        }
    }
}

/// The problem for an event that does not parse; a 500 is a stored event read back
/// from the log (`log_backend`) that does not parse (damage).
fn event_problem(e: EventError, log_backend: Backend) -> Problem {
    let p = match e.status {
        413 => Problem::too_large(e.detail.clone()),
        415 => Problem::unsupported_media_type(e.detail.clone()),
        500 => Problem::internal("log", log_backend, e.detail.clone()),
        _ => Problem::bad_request(e.detail.clone()),
    };
    match e.field {
        Some(f) => p.with("field", f),
        None => p,
    }
}

async fn existing_topic(api: &Api, name: &str) -> Result<Topic, Problem> {
    valid_name_or_400("topic", name)?;
    match api.topics.get(name).await {
        Ok(Some(t)) => Ok(t),
        Ok(None) => Err(Problem::not_found(format!("topic {name:?} does not exist"))),
        Err(e) => Err(topic_problem(e, api.meta_backend)),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PutTopic {
    partitions: Value,
    dedup_window_ms: Option<Value>,
}

/// A topic as answered by PUT, GET and the list: `dedup_window_ms` only when it is not
/// the default (so the answers for a topic that never set it are those of the API
/// before dedup, field for field).
fn topic_json(t: &Topic) -> Value {
    let mut v = json!({"name": t.name, "partitions": t.partitions});
    if t.dedup_window_ms != DEFAULT_DEDUP_WINDOW_MS {
        v["dedup_window_ms"] = json!(t.dedup_window_ms);
    }
    v
}

pub async fn put_topic(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    valid_name_or_400("topic", &name)?;
    let req: PutTopic = json_body(&headers, body)?;
    let partitions = req
        .partitions
        .as_u64()
        .filter(|p| PARTITIONS.contains(p))
        .ok_or_else(|| {
            Problem::invalid_field("partitions", "partitions must be an integer from 1 to 1024")
        })?;
    let window = match &req.dedup_window_ms {
        None => None,
        Some(v) => {
            let most = api
                .log_retention_ms
                .map_or(MAX_DEDUP_WINDOW_MS, |r| r.min(MAX_DEDUP_WINDOW_MS));
            Some(v.as_u64().filter(|ms| *ms <= most).ok_or_else(|| {
                Problem::invalid_field(
                    "dedup_window_ms",
                    format!(
                        "dedup_window_ms must be an integer from 0 (off) to {most} (a day, and \
                         at most the log retention)"
                    ),
                )
            })?)
        }
    };
    // A release before dedup (0.1.x) reads a topic record with a window as corrupt:
    // another window than the default (which is not written) waits for the upgrade.
    if window.is_some_and(|ms| ms != DEFAULT_DEDUP_WINDOW_MS) {
        super::require_release(&api, "dedup_window_ms", super::SETTINGS_RELEASE).await?;
    }
    // Held while the topic is written (see crate::quota); at the quota only a topic
    // that exists already may be PUT again.
    let _reserved = api
        .quotas
        .admit(api.quotas.topic(&name), async {
            let found = api.topics.get(&name).await;
            Ok(found
                .map_err(|e| topic_problem(e, api.meta_backend))?
                .is_some())
        })
        .await?;
    let (topic, created) = api
        .topics
        .ensure_with(&name, partitions as u32, window)
        .await
        .map_err(|e| topic_problem(e, api.meta_backend))?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(topic_json(&topic))).into_response())
}

pub async fn delete_topic(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
) -> Result<Response, Problem> {
    valid_name_or_400("topic", &name)?;
    api.topics
        .delete(&name)
        .await
        .map_err(|e| topic_problem(e, api.meta_backend))?;
    // The definition is gone from Meta; the data goes in the background.
    let log = api.log.clone();
    let backend = api.log_backend;
    api.runtime.background().spawn(async move {
        if let Err(e) = log.delete_topic(&name).await {
            tracing::warn!(store = "log", %backend, topic = %name, error = %e, "removing a deleted topic's events failed; retried at the next delete");
        }
    });
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub async fn list_topics(State(api): State<Arc<Api>>) -> Result<Response, Problem> {
    let topics = api
        .topics
        .list()
        .await
        .map_err(|e| topic_problem(e, api.meta_backend))?;
    let topics: Vec<Value> = topics.into_iter().map(|t| topic_json(&t)).collect();
    Ok(Json(json!({ "topics": topics })).into_response())
}

pub async fn get_topic(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
) -> Result<Response, Problem> {
    let topic = existing_topic(&api, &name).await?;
    let mut ends = Vec::with_capacity(topic.partitions as usize);
    for p in 0..topic.partitions {
        ends.push(
            api.log
                .bounds(&name, p)
                .await
                .map_err(|e| log_problem(e, api.log_backend))?
                .end,
        );
    }
    let mut v = topic_json(&topic);
    v["end_offsets"] = json!(ends);
    Ok(Json(v).into_response())
}

pub async fn publish(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    let arrived = std::time::Instant::now();
    let topic = existing_topic(&api, &name).await?;
    let body = body.map_err(body_problem)?;
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let ce_headers: Vec<(String, String)> = headers
        .iter()
        .filter_map(|(k, v)| Some((k.as_str().to_string(), v.to_str().ok()?.to_string())))
        .collect();
    // The clock judges `deliverat` (at most 7 days ahead).
    let limits = Limits {
        now_ms: i64::try_from(meshd_runtime::runtime::clock::now_ms()).ok(),
        ..Limits::default()
    };
    let events: Vec<Event> = parse_publish(content_type, &ce_headers, &body, &limits)
        .map_err(|e| event_problem(e, api.log_backend))?;
    // A member of a release before parking would hand a delayed event out at once,
    // and one taking a partition over would not know what was parked: `deliverat`
    // waits for the rolling upgrade (409 naming it meanwhile).
    if events.iter().any(|e| e.deliver_at_ms().is_some()) {
        super::require_release(&api, meshd_events::DELIVER_AT, super::SETTINGS_RELEASE).await?;
    }
    // One durable append for the whole request: 201 only once all are on disk (and,
    // with dedup, once every duplicate's original is).
    let started = std::time::Instant::now();
    let failed = |e: LogError| {
        api.metrics
            .store_error("log", api.log_backend, meshd_runtime::runtime::kind_of(&e));
        log_problem(e, api.log_backend)
    };
    let placed: Vec<Appended> = if topic.dedup_window_ms == 0 {
        let batch: Vec<(u32, Vec<u8>)> = events
            .iter()
            .map(|e| (partition_for(e, topic.partitions), e.stored().to_vec()))
            .collect();
        api.log
            .append(&name, batch)
            .await
            .map_err(failed)?
            .into_iter()
            .map(|(partition, offset)| Appended {
                partition,
                offset,
                duplicate: false,
            })
            .collect()
    } else {
        let batch: Vec<DedupEvent> = events
            .iter()
            .map(|e| DedupEvent {
                partition: partition_for(e, topic.partitions),
                payload: e.stored().to_vec(),
                key: DedupKey::of(e.source(), e.id()),
            })
            .collect();
        api.log
            .append_dedup(&name, batch, topic.dedup_window_ms)
            .await
            .map_err(failed)?
    };
    api.metrics
        .write_latency("log", api.log_backend, "append", started.elapsed());
    let duplicates = placed.iter().filter(|a| a.duplicate).count() as u64;
    api.metrics
        .published(&name, placed.len() as u64 - duplicates);
    if duplicates > 0 {
        api.metrics.duplicates(&name, duplicates);
    }
    api.metrics.publish_latency(&name, arrived.elapsed());
    let out: Vec<Value> = events
        .iter()
        .zip(placed)
        .map(|(e, a)| {
            let mut v = json!({"id": e.id(), "partition": a.partition, "offset": a.offset});
            if a.duplicate {
                v["duplicate"] = json!(true);
            }
            v
        })
        .collect();
    Ok((StatusCode::CREATED, Json(json!({ "events": out }))).into_response())
}

#[derive(Deserialize)]
pub struct BrowseQuery {
    from: Option<String>,
    limit: Option<String>,
    max_bytes: Option<String>,
}

pub async fn browse(
    State(api): State<Arc<Api>>,
    Path((name, partition)): Path<(String, String)>,
    Query(q): Query<BrowseQuery>,
) -> Result<Response, Problem> {
    let topic = existing_topic(&api, &name).await?;
    let partition: u32 = partition
        .parse()
        .ok()
        .filter(|p| *p < topic.partitions)
        .ok_or_else(|| {
            Problem::not_found(format!("topic {name:?} has no partition {partition}"))
        })?;
    let from = query_number("from", q.from.as_deref(), 0, 0..=u64::MAX)?;
    let limit = query_number("limit", q.limit.as_deref(), BROWSE_DEFAULT, 1..=BROWSE_MAX)?;
    let max_bytes = super::answer_bytes(&api, q.max_bytes.as_deref())?;
    // The log stops at the byte bound too (at least one event): no more is read
    // than is answered.
    let events = api
        .log
        .read(&name, partition, from, limit as usize, max_bytes)
        .await
        .map_err(|e| log_problem(e, api.log_backend))?;
    // Built as text: a `serde_json::Value` would re-format the events, and they go
    // back exactly as published (number formats, key order, spacing).
    let mut out = super::BoundedList::new("{\"events\":[", max_bytes);
    let mut next = None;
    for e in &events {
        let event =
            Event::from_stored(&e.payload).map_err(|err| event_problem(err, api.log_backend))?;
        let item = format!(
            "{{\"offset\":{},\"event\":{}}}",
            e.offset,
            event.to_raw_json().get()
        );
        if !out.push(&item) {
            next = Some(e.offset);
            break;
        }
    }
    // Stopped early by the byte bound: `next_cursor` is the offset to go on `from`.
    let last = events.last().map(|e| e.offset);
    if next.is_none() && events.len() < limit as usize {
        if let Some(last) = last {
            let end = api
                .log
                .bounds(&name, partition)
                .await
                .map_err(|e| log_problem(e, api.log_backend))?
                .end;
            if last + 1 < end {
                next = Some(last + 1);
            }
        }
    }
    Ok(out.finish(next.map(|o| o.to_string())))
}

/// Fuzzing the topic PUT body, the publish request as the handler hands it to the
/// CloudEvents parser (headers from a real `HeaderMap`), and browse's query numbers
/// (docs/fuzzing.md): accepted or a clean 4xx, never a panic.
#[cfg(test)]
mod fuzz {
    use super::super::fuzz::{body, cases, clean, headers};
    use super::*;
    use proptest::prelude::*;

    fn put(h: &HeaderMap, b: Bytes) -> Result<u64, Problem> {
        let req: PutTopic = json_body(h, Ok(b))?;
        req.partitions
            .as_u64()
            .filter(|p| PARTITIONS.contains(p))
            .ok_or_else(|| Problem::invalid_field("partitions", "out of range"))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases()))]

        #[test]
        fn put_topic_body(h in headers(), b in body(&["partitions"])) {
            match put(&h, b) {
                Ok(p) => prop_assert!(PARTITIONS.contains(&p)),
                Err(p) => clean(&p)?,
            }
        }

        #[test]
        fn publish_request(
            ct in prop_oneof![
                Just(None),
                prop::sample::select(vec![
                    "application/cloudevents+json",
                    "application/cloudevents-batch+json",
                    "application/cloudevents+xml",
                    "application/json",
                ]).prop_map(Some),
            ],
            ce in prop::collection::vec((
                prop::sample::select(vec!["ce-specversion", "ce-id", "ce-source", "ce-type", "ce-time", "ce-x", "x-y"]),
                prop::sample::select(vec!["1.0", "e1", "/s", "t", "%ff", "2020-01-01T00:00:00Z", ""]),
            ), 0..6),
            b in body(&["specversion", "id", "source", "type", "data", "data_base64", "time"]),
        ) {
            let mut h = HeaderMap::new();
            if let Some(ct) = ct {
                h.insert(header::CONTENT_TYPE, axum::http::HeaderValue::from_static(ct));
            }
            for (k, v) in ce {
                h.append(k, axum::http::HeaderValue::from_static(v));
            }
            // As `publish` does between reading the body and appending.
            let content_type = h.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
            let ce_headers: Vec<(String, String)> = h
                .iter()
                .filter_map(|(k, v)| Some((k.as_str().to_string(), v.to_str().ok()?.to_string())))
                .collect();
            match parse_publish(content_type, &ce_headers, &b, &Limits::default()) {
                Ok(events) => {
                    for e in &events {
                        prop_assert!(partition_for(e, 1024) < 1024);
                    }
                }
                Err(e) => {
                    let p = event_problem(e, Backend::RocksDb);
                    prop_assert!([400u16, 413, 415].contains(&p.status.as_u16()), "{}", p.status);
                }
            }
        }

        #[test]
        fn browse_query_numbers(v in prop_oneof![".{0,8}", any::<u64>().prop_map(|n| n.to_string()), Just("18446744073709551616".to_owned())]) {
            match query_number("limit", Some(&v), BROWSE_DEFAULT, 1..=BROWSE_MAX) {
                Ok(n) => prop_assert!((1..=BROWSE_MAX).contains(&n)),
                Err(p) => clean(&p)?,
            }
        }
    }
}
