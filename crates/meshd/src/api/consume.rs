//! Pull consuming: `POST /v1/subscriptions/{name}/pull|ack|nack|extend`, and the
//! subscription offsets (`GET .../offsets`, `PUT .../offsets/{partition}`).

use super::fields::Fields;
use super::{valid_name_or_400, Api};
use crate::problem::Problem;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use meshd_dispatch::SessionBinding;
use meshd_meta::Backend;
use meshd_runtime::runtime::{Answers, Handed, Outcome, PullBudget, Reach, RuntimeError};
use meshd_stores::deadletters::MAX_REASON_BYTES;
use meshd_stores::offsets::Committed;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

/// Pull: `max_events` 1–1000 (default 10), `wait_ms` 0–30000 (default 0).
const MAX_EVENTS: std::ops::RangeInclusive<u64> = 1..=1000;
const DEFAULT_MAX_EVENTS: u64 = 10;
const WAIT_MS: std::ops::RangeInclusive<u64> = 0..=30_000;
/// `ack_timeout_ms` of an extend: the subscription range.
pub(super) const ACK_TIMEOUT_MS: std::ops::RangeInclusive<u64> = 100..=600_000;
/// `delay_ms` of a nack (http-api.md, Additions, "Parking").
pub(super) const NACK_DELAY_MS: std::ops::RangeInclusive<u64> = 0..=86_400_000;
/// Ids per ack, nack or extend.
pub(super) const MAX_IDS: usize = 1000;
/// A delivery id is far shorter; anything longer is not one.
pub(super) const MAX_ID_LEN: usize = 512;

pub fn runtime_problem(e: RuntimeError, meta_backend: Backend) -> Problem {
    match e {
        RuntimeError::NotFound(name) => {
            Problem::not_found(format!("subscription {name:?} does not exist"))
        }
        RuntimeError::NoPartition { name, partition } => Problem::not_found(format!(
            "subscription {name:?} has no partition {partition}"
        ))
        .with("field", "partition"),
        // A pull on a stopped partition included: nothing was handed out, so the
        // pull was not applied, even when the attempt record that stopped the
        // partition may have reached the disk (an attempt counted is never a lie).
        RuntimeError::StoreFailed(d) => Problem::fail_stopped("deliveries", Backend::RocksDb, d),
        RuntimeError::Indeterminate {
            store,
            backend,
            detail,
        } => Problem::indeterminate(store, backend, detail),
        RuntimeError::Unavailable {
            store,
            backend,
            detail,
        } => Problem::unavailable(store, backend, detail),
        RuntimeError::Core(d) => Problem::new(StatusCode::TOO_MANY_REQUESTS, "overloaded", d),
        RuntimeError::Conflict(d) => Problem::conflict(d),
        RuntimeError::Invalid(d) => Problem::bad_request(d),
        RuntimeError::Restarting(d) => Problem::unavailable("subscriptions", meta_backend, d),
    }
}

fn ids_of(f: &Fields) -> Result<Vec<String>, Problem> {
    let ids = f.string_list("delivery_ids", MAX_IDS, MAX_ID_LEN)?;
    ids.ok_or_else(|| Problem::invalid_field("delivery_ids", "delivery_ids is required"))
}

/// A pull body.
struct PullBody {
    budget: PullBudget,
    wait_ms: u64,
    session: Option<String>,
    /// Internal route only: the forwarding instance's name for this pull, so it can
    /// release what it leased when the answer does not reach it.
    forward_id: Option<String>,
    /// Internal route only: the forwarding instance's id (told when what it leased is
    /// settled elsewhere, for its streams' credit).
    from: Option<String>,
}

/// Fields only an instance forwarding a pull sends (internal route).
const INTERNAL_PULL_FIELDS: [&str; 3] = ["forward_id", "at_least_one", "from"];

fn parse_pull(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    max_response_bytes: u64,
    reach: Reach,
) -> Result<PullBody, Problem> {
    let public = ["max_events", "max_bytes", "wait_ms", "session"];
    let mut allowed = public.to_vec();
    if reach == Reach::Local {
        allowed.extend(INTERNAL_PULL_FIELDS);
    }
    let f = Fields::parse(headers, body, &allowed)?;
    let max = f
        .u64_in("max_events", MAX_EVENTS)?
        .unwrap_or(DEFAULT_MAX_EVENTS) as usize;
    // `--max-response-bytes` is the default and the ceiling: a larger ask gets it.
    let max_bytes = f
        .u64_in("max_bytes", 1..=u64::MAX)?
        .unwrap_or(max_response_bytes)
        .min(max_response_bytes);
    let mut budget = PullBudget::new(max, usize::try_from(max_bytes).unwrap_or(usize::MAX));
    if let Some(first) = f.bool("at_least_one")? {
        budget.at_least_one = first;
    }
    Ok(PullBody {
        budget,
        wait_ms: f.u64_in("wait_ms", WAIT_MS)?.unwrap_or(0),
        session: f.string("session", MAX_ID_LEN)?,
        forward_id: f.string("forward_id", MAX_ID_LEN)?,
        from: f.string("from", MAX_ID_LEN)?,
    })
}

pub(super) fn parse_ack(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Vec<String>, Problem> {
    ids_of(&Fields::parse(headers, body, &["delivery_ids"])?)
}

/// A nack's ids, reason and `delay_ms`.
type NackBody = (Vec<String>, String, Option<u64>);

fn parse_nack(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<NackBody, Problem> {
    let f = Fields::parse(headers, body, &["delivery_ids", "reason", "delay_ms"])?;
    let ids = ids_of(&f)?;
    let reason = f
        .string("reason", MAX_REASON_BYTES)?
        .unwrap_or_else(|| "nacked".to_string());
    Ok((ids, reason, f.u64_in("delay_ms", NACK_DELAY_MS)?))
}

/// A nack with `delay_ms` waits for the rolling upgrade: a member of a release before
/// it would refuse the field on the owner's route (409 naming it meanwhile).
pub(super) async fn nack_delay_allowed(api: &Api, delay_ms: Option<u64>) -> Result<(), Problem> {
    match delay_ms {
        Some(_) => super::require_release(api, "delay_ms", super::SETTINGS_RELEASE).await,
        None => Ok(()),
    }
}

fn parse_extend(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(Vec<String>, Option<u64>), Problem> {
    let f = Fields::parse(headers, body, &["delivery_ids", "ack_timeout_ms"])?;
    Ok((ids_of(&f)?, f.u64_in("ack_timeout_ms", ACK_TIMEOUT_MS)?))
}

fn parse_put_offset(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<u64, Problem> {
    let f = Fields::parse(headers, body, &["offset"])?;
    f.u64_in("offset", 0..=u64::MAX)?
        .ok_or_else(|| Problem::invalid_field("offset", "offset is required"))
}

/// Builds `{"<list>":[ids...], ...}` with every list present (empty when unused).
pub(super) fn answers_json(lists: &[Outcome], answers: Answers) -> Value {
    let mut out = serde_json::Map::new();
    for l in lists {
        out.insert(l.as_str().to_string(), Value::Array(vec![]));
    }
    for (list, id) in answers.lists {
        if let Some(Value::Array(a)) = out.get_mut(list.as_str()) {
            a.push(Value::String(id));
        }
    }
    Value::Object(out)
}

pub async fn pull(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    pull_with(api, name, headers, body, Reach::Cluster).await
}

pub async fn pull_with(
    api: Arc<Api>,
    name: String,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    reach: Reach,
) -> Result<Response, Problem> {
    valid_name_or_400("subscription", &name)?;
    let PullBody {
        budget,
        wait_ms: wait,
        session,
        forward_id,
        from,
    } = parse_pull(&headers, body, api.limits.max_response_bytes, reach)?;
    let session = session_binding(&api, session).await?;
    // A waiting pull holds a long-poll slot while it waits (429 when none is free).
    let _long_poll = match wait {
        0 => None,
        _ => Some(api.admission.long_poll()?),
    };
    let wait = Duration::from_millis(wait).min(api.admission.max_wait());
    let handed = match forward_id {
        None => api.runtime.pull(&name, budget, wait, session, reach).await,
        // A forwarding instance that does not get this answer releases it by this id,
        // so what is handed out must be registered under it even when that instance
        // gives up the call (and the server drops this handler) in the middle of the
        // pull: the pull and the registration run on their own task.
        Some(forward_id) => {
            let (task_api, task_name) = (api.clone(), name.clone());
            tokio::spawn(async move {
                let handed = task_api
                    .runtime
                    .pull(&task_name, budget, wait, session, reach)
                    .await?;
                let ids = handed.iter().map(|d| d.delivery_id.clone()).collect();
                task_api
                    .runtime
                    .forwarded(&task_name, &forward_id, ids, from.as_deref())
                    .await;
                Ok(handed)
            })
            .await
            .unwrap_or_else(|e| {
                Err(RuntimeError::Restarting(format!(
                    "the forwarded pull of {name:?} failed: {e}"
                )))
            })
        }
    }
    .map_err(|e| runtime_problem(e, api.meta_backend))?;
    // Built as text: events go back exactly as published.
    let mut out = String::from("{\"deliveries\":[");
    let mut first = true;
    for d in handed {
        let Some(item) = delivery_json(&api, &name, d) else {
            continue;
        };
        if !first {
            out.push(',');
        }
        first = false;
        out.push_str(&item);
    }
    out.push_str("]}");
    Ok(([(header::CONTENT_TYPE, "application/json")], out).into_response())
}

/// The session a pull or stream names, bound to its current epoch (404 when it is
/// gone).
pub async fn session_binding(
    api: &Api,
    session: Option<String>,
) -> Result<Option<SessionBinding>, Problem> {
    let Some(sid) = session else {
        return Ok(None);
    };
    match api.sessions.get(&sid).await {
        Ok(Some(s)) => Ok(Some(SessionBinding {
            session_id: sid,
            epoch: s.epoch,
        })),
        Ok(None) => Err(Problem::not_found(format!(
            "session {sid:?} does not exist (expired or closed)"
        ))
        .with("field", "session")),
        Err(e) if e.is_retryable() => Err(Problem::unavailable(
            "sessions",
            api.meta_backend,
            e.to_string(),
        )),
        Err(e) => Err(Problem::internal(
            "sessions",
            api.meta_backend,
            e.to_string(),
        )),
    }
}

/// One delivery as a pull answers it (`{"delivery_id",...,"event":...}`), the event
/// exactly as published; `None` (logged) when the stored bytes are not JSON: that
/// delivery is not handed out and its lease runs out.
pub fn delivery_json(api: &Api, name: &str, d: Handed) -> Option<String> {
    let Some(event) = super::raw_event(d.body) else {
        tracing::error!(store = "log", backend = %api.log_backend, subscription = %name, partition = d.partition, offset = d.offset, "stored event is not valid JSON; not handed out (its lease runs out)");
        return None;
    };
    Some(format!(
        "{{\"delivery_id\":{},\"partition\":{},\"offset\":{},\"attempt\":{},\"event\":{}}}",
        json!(d.delivery_id),
        d.partition,
        d.offset,
        d.attempt,
        event.get()
    ))
}

/// Internal route: the instance that forwarded pull `forward_id` did not get its
/// answer; what it handed out is due again at once (`{"released": n}`).
pub async fn release_forwarded(
    api: Arc<Api>,
    name: String,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    valid_name_or_400("subscription", &name)?;
    let f = Fields::parse(&headers, body, &["forward_id"])?;
    let forward_id = f
        .string("forward_id", MAX_ID_LEN)?
        .ok_or_else(|| Problem::invalid_field("forward_id", "forward_id is required"))?;
    let released = api.runtime.release_forwarded(&name, &forward_id).await;
    Ok(Json(json!({ "released": released })).into_response())
}

pub async fn ack(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    ack_with(api, name, headers, body, Reach::Cluster).await
}

pub async fn ack_with(
    api: Arc<Api>,
    name: String,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    reach: Reach,
) -> Result<Response, Problem> {
    valid_name_or_400("subscription", &name)?;
    let ids = parse_ack(&headers, body)?;
    let n = ids.len();
    let answers = api
        .runtime
        .ack(&name, ids, reach)
        .await
        .map_err(|e| runtime_problem(e, api.meta_backend))?;
    all_fenced_or(n, answers, &Outcome::ACK)
}

/// The answer, or 409 fenced when every id was fenced.
fn all_fenced_or(n: usize, answers: Answers, lists: &[Outcome]) -> Result<Response, Problem> {
    let fenced = answers
        .lists
        .iter()
        .filter(|(l, _)| *l == Outcome::Fenced)
        .count();
    if n > 0 && fenced == n {
        return Err(Problem::new(
            StatusCode::CONFLICT,
            "fenced",
            "every delivery is bound to a session that was taken over or expired",
        ));
    }
    Ok(Json(answers_json(lists, answers)).into_response())
}

pub async fn nack(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    nack_with(api, name, headers, body, Reach::Cluster).await
}

pub async fn nack_with(
    api: Arc<Api>,
    name: String,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    reach: Reach,
) -> Result<Response, Problem> {
    valid_name_or_400("subscription", &name)?;
    let (ids, reason, delay_ms) = parse_nack(&headers, body)?;
    nack_delay_allowed(&api, delay_ms).await?;
    let n = ids.len();
    let answers = api
        .runtime
        .nack(&name, ids, reason, delay_ms, reach)
        .await
        .map_err(|e| runtime_problem(e, api.meta_backend))?;
    all_fenced_or(n, answers, &Outcome::NACK)
}

pub async fn extend(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    extend_with(api, name, headers, body, Reach::Cluster).await
}

pub async fn extend_with(
    api: Arc<Api>,
    name: String,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    reach: Reach,
) -> Result<Response, Problem> {
    valid_name_or_400("subscription", &name)?;
    let (ids, ms) = parse_extend(&headers, body)?;
    let n = ids.len();
    let answers = api
        .runtime
        .extend(&name, ids, ms, reach)
        .await
        .map_err(|e| runtime_problem(e, api.meta_backend))?;
    all_fenced_or(n, answers, &Outcome::EXTEND)
}

fn offset_json(partition: u32, c: Committed) -> Value {
    json!({"partition": partition, "committed": c.offset, "epoch": c.epoch})
}

pub async fn get_offsets(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
) -> Result<Response, Problem> {
    valid_name_or_400("subscription", &name)?;
    let offsets = api
        .runtime
        .offsets(&name)
        .await
        .map_err(|e| runtime_problem(e, api.meta_backend))?;
    let out: Vec<Value> = offsets
        .into_iter()
        .map(|(p, c)| offset_json(p, c))
        .collect();
    Ok(Json(json!({ "offsets": out })).into_response())
}

pub async fn put_offset(
    State(api): State<Arc<Api>>,
    Path((name, partition)): Path<(String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    put_offset_with(api, name, partition, headers, body, Reach::Cluster).await
}

pub async fn put_offset_with(
    api: Arc<Api>,
    name: String,
    partition: String,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    reach: Reach,
) -> Result<Response, Problem> {
    valid_name_or_400("subscription", &name)?;
    let partition: u32 = partition.parse().map_err(|_| {
        Problem::invalid_field(
            "partition",
            format!("partition must be a non-negative integer, got {partition:?}"),
        )
    })?;
    let offset = parse_put_offset(&headers, body)?;
    let c = api
        .runtime
        .reset_offset(&name, partition, offset, reach)
        .await
        .map_err(|e| match e {
            RuntimeError::Invalid(d) => Problem::invalid_field("offset", d),
            e => runtime_problem(e, api.meta_backend),
        })?;
    Ok(Json(offset_json(partition, c)).into_response())
}

/// Fuzzing the pull, ack, nack, extend and offset-reset bodies (see
/// docs/fuzzing.md): each goes through the same field reads its handler makes before
/// the runtime is called; any body is accepted or cleanly rejected, never a panic.
#[cfg(test)]
mod fuzz {
    use super::super::fuzz::{body, cases, clean, headers};
    use super::*;
    use proptest::prelude::*;

    const FIELDS: &[&str] = &[
        "max_events",
        "max_bytes",
        "at_least_one",
        "forward_id",
        "wait_ms",
        "session",
        "delivery_ids",
        "reason",
        "ack_timeout_ms",
        "offset",
    ];

    // The handlers' own parsers, with what each promises about what it accepts.
    fn pull(h: &HeaderMap, b: Bytes) -> Result<(), Problem> {
        const CEILING: u64 = 16 << 20;
        for reach in [Reach::Cluster, Reach::Local] {
            let p = parse_pull(h, Ok(b.clone()), CEILING, reach)?;
            assert!(MAX_EVENTS.contains(&(p.budget.max_events as u64)));
            assert!((1..=CEILING as usize).contains(&p.budget.max_bytes));
            assert!(WAIT_MS.contains(&p.wait_ms));
            assert!(p.session.as_ref().is_none_or(|s| s.len() <= MAX_ID_LEN));
            assert!(p.forward_id.as_ref().is_none_or(|s| s.len() <= MAX_ID_LEN));
            // Only a peer may ask for no first delivery or name a forward id.
            assert!(reach == Reach::Local || (p.budget.at_least_one && p.forward_id.is_none()));
        }
        Ok(())
    }

    fn valid_ids(ids: &[String]) -> bool {
        ids.len() <= MAX_IDS && ids.iter().all(|i| !i.is_empty() && i.len() <= MAX_ID_LEN)
    }

    fn ack(h: &HeaderMap, b: Bytes) -> Result<(), Problem> {
        assert!(valid_ids(&parse_ack(h, Ok(b))?));
        Ok(())
    }

    fn nack(h: &HeaderMap, b: Bytes) -> Result<(), Problem> {
        let (ids, reason, delay) = parse_nack(h, Ok(b))?;
        assert!(valid_ids(&ids) && reason.len() <= MAX_REASON_BYTES);
        assert!(delay.is_none_or(|ms| NACK_DELAY_MS.contains(&ms)));
        Ok(())
    }

    fn extend(h: &HeaderMap, b: Bytes) -> Result<(), Problem> {
        let (ids, ms) = parse_extend(h, Ok(b))?;
        assert!(valid_ids(&ids) && ms.is_none_or(|ms| ACK_TIMEOUT_MS.contains(&ms)));
        Ok(())
    }

    fn put_offset(h: &HeaderMap, b: Bytes) -> Result<(), Problem> {
        parse_put_offset(h, Ok(b)).map(|_| ())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases()))]

        #[test]
        fn consume_bodies(h in headers(), b in body(FIELDS)) {
            for route in [pull, ack, nack, extend, put_offset] {
                if let Err(p) = route(&h, b.clone()) {
                    clean(&p)?;
                }
            }
        }
    }
}
