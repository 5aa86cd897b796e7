//! `/v1/sessions`: the SessionStore over HTTP.
//!
//! A session is a leased, fenced owner key in Meta (see `meshd_stores::sessions`):
//! opening one for a client id that already has a live session, on any instance, is a
//! takeover, and from then on the old session's heartbeat and close answer 409 fenced
//! (until its lease would have expired, then 404). Heartbeats and closes are decided by
//! Meta (linearizable reads and fenced writes), never by this instance's cache, so a
//! holder that was paused through a takeover cannot renew or delete what its
//! successor wrote. `GET` and the list are served from the cache of live sessions.

use super::fields::Fields;
use super::query_number;
use super::Api;
use crate::problem::Problem;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use meshd_meta::Backend;
use meshd_stores::sessions::{record, Session, SessionError, MAX_TTL, MIN_TTL};
use serde::Deserialize;
use serde_json::{json, Value};
use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Duration;

/// Session `ttl_ms`: 2000–3600000 (the store's own bounds), default 10000.
const TTL_MS: RangeInclusive<u64> = (MIN_TTL.as_millis() as u64)..=(MAX_TTL.as_millis() as u64);
const DEFAULT_TTL_MS: u64 = 10_000;
// Client ids are names (`meshd_stores::names`).
use meshd_stores::names::MAX_NAME_LEN;
/// List pages: `limit` default 100, at most 1000.
const DEFAULT_LIMIT: u64 = 100;
const MAX_LIMIT: u64 = 1000;
const STORE: &str = "sessions";

/// The problem for every [`SessionError`]; public so other routes that act for a
/// session (pull, tasks) answer the same way.
pub fn session_problem(e: SessionError, backend: Backend) -> Problem {
    match e {
        SessionError::Invalid { field, reason } => {
            Problem::invalid_field(field, format!("{field} {reason}"))
        }
        SessionError::NotFound { session_id } => Problem::not_found(format!(
            "session {session_id:?} does not exist (unknown, closed or expired)"
        )),
        SessionError::Fenced { session_id } => Problem::new(
            StatusCode::CONFLICT,
            "fenced",
            format!(
                "session {session_id:?} is fenced: its client id has a newer session; open a new one"
            ),
        )
        .with("session_id", session_id),
        // The session may still be live in Meta, but this instance no longer renewed
        // it recently enough to act for it: not 404 (it may exist), not 503 (Meta may
        // be fine). A heartbeat through this instance re-arms it.
        SessionError::Expired { session_id } => Problem::conflict(format!(
            "session {session_id:?} was not renewed through this instance within its safety deadline; heartbeat it (or open a new one) before acting for it"
        ))
        .with("session_id", session_id),
        SessionError::Conflict { current } => {
            let p = Problem::conflict("precondition failed: the record changed; re-read it");
            match current {
                Some(kv) => p.with("revision", kv.mod_revision),
                None => p,
            }
        }
        SessionError::Store(f) => Problem::store_failure(STORE, backend, f),
    }
}

fn session_json(s: &Session) -> Value {
    json!({
        "session_id": s.session_id,
        "client_id": s.client_id,
        "epoch": s.epoch,
        "instance": s.instance,
        "ttl_ms": s.ttl_ms(),
    })
}

/// Session ids are 32 lowercase hex digits; anything else cannot name a session, so
/// it is answered without a Meta round trip (and without echoing it back).
fn known_shape(id: &str) -> Result<(), Problem> {
    if record::is_session_id(id) {
        Ok(())
    } else {
        Err(Problem::not_found(
            "no such session (session ids are 32 lowercase hex digits)",
        ))
    }
}

/// An open body: `(client_id, ttl_ms)`.
fn parse_open(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(String, u64), Problem> {
    let f = Fields::parse(headers, body, &["client_id", "ttl_ms"])?;
    let client_id = f
        .string("client_id", MAX_NAME_LEN)?
        .ok_or_else(|| Problem::invalid_field("client_id", "client_id is required"))?;
    if !meshd_stores::names::is_valid_name(&client_id) {
        return Err(Problem::invalid_field(
            "client_id",
            format!("client_id must be 1-249 characters of [A-Za-z0-9._-], got {client_id:?}"),
        ));
    }
    let ttl_ms = f.u64_in("ttl_ms", TTL_MS)?.unwrap_or(DEFAULT_TTL_MS);
    Ok((client_id, ttl_ms))
}

pub async fn open(
    State(api): State<Arc<Api>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    let (client_id, ttl_ms) = parse_open(&headers, body)?;
    // A takeover (the client id holds a live session) is never refused.
    // Held while the session is written (see crate::quota).
    let _reserved = api
        .quotas
        .session(&client_id)
        .map_err(|over| api.quotas.refuse(over))?;
    let session = api
        .sessions
        .open(&client_id, Duration::from_millis(ttl_ms))
        .await
        .map_err(|e| session_problem(e, api.meta_backend))?;
    let location = format!("/v1/sessions/{}", session.session_id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(session_json(&session)),
    )
        .into_response())
}

/// `POST /v1/sessions/{id}/heartbeat`: no body is needed; an empty one or `{}` is
/// accepted, anything else is a 400 (or 415 for a non-JSON content type).
pub async fn heartbeat(
    State(api): State<Arc<Api>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    Fields::parse(&headers, body, &[])?;
    known_shape(&id)?;
    let beat = api
        .sessions
        .heartbeat(&id)
        .await
        .map_err(|e| session_problem(e, api.meta_backend))?;
    let ttl_ms = u64::try_from(beat.ttl.as_millis()).unwrap_or(u64::MAX);
    Ok(Json(json!({"epoch": beat.epoch, "ttl_ms": ttl_ms})).into_response())
}

pub async fn get_one(
    State(api): State<Arc<Api>>,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    known_shape(&id)?;
    match api.sessions.get(&id).await {
        Ok(Some(s)) => Ok(Json(session_json(&s)).into_response()),
        Ok(None) => Err(session_problem(
            SessionError::NotFound { session_id: id },
            api.meta_backend,
        )),
        Err(e) => Err(session_problem(e, api.meta_backend)),
    }
}

pub async fn close(
    State(api): State<Arc<Api>>,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    known_shape(&id)?;
    api.sessions
        .close(&id)
        .await
        .map_err(|e| session_problem(e, api.meta_backend))?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize)]
pub struct ListQuery {
    limit: Option<String>,
    /// The client id of the last session of the previous page.
    cursor: Option<String>,
}

/// `GET /v1/sessions?limit=&cursor=`: live sessions in client id order; `next_cursor`
/// (the last client id of the page) is present while more may follow.
pub async fn list(
    State(api): State<Arc<Api>>,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Response, Problem> {
    let Query(q) = query.map_err(|e| Problem::bad_request(format!("invalid query: {e}")))?;
    let limit = query_number("limit", q.limit.as_deref(), DEFAULT_LIMIT, 1..=MAX_LIMIT)? as usize;
    if let Some(c) = q.cursor.as_deref() {
        if !meshd_stores::names::is_valid_name(c) {
            return Err(Problem::invalid_field(
                "cursor",
                "cursor must be a next_cursor from an earlier page",
            ));
        }
    }
    let all = api
        .sessions
        .list()
        .await
        .map_err(|e| session_problem(e, api.meta_backend))?;
    let mut rest = all
        .iter()
        .filter(|s| q.cursor.as_deref().is_none_or(|c| s.client_id.as_str() > c))
        .peekable();
    let page: Vec<&Session> = rest.by_ref().take(limit).collect();
    let more = rest.peek().is_some();
    let mut body = json!({"sessions": page.iter().map(|s| session_json(s)).collect::<Vec<_>>()});
    if more {
        if let Some(last) = page.last() {
            body["next_cursor"] = Value::String(last.client_id.clone());
        }
    }
    Ok(Json(body).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshd_stores::failure::StoreFailure;

    #[test]
    fn every_session_error_has_its_status() {
        let b = Backend::Etcd;
        let cases = [
            (
                SessionError::Invalid {
                    field: "ttl_ms",
                    reason: "x".into(),
                },
                400,
                "bad-request",
            ),
            (
                SessionError::NotFound {
                    session_id: "s".into(),
                },
                404,
                "not-found",
            ),
            (
                SessionError::Fenced {
                    session_id: "s".into(),
                },
                409,
                "fenced",
            ),
            (
                SessionError::Expired {
                    session_id: "s".into(),
                },
                409,
                "conflict",
            ),
            (SessionError::Conflict { current: None }, 409, "conflict"),
            (
                SessionError::Store(StoreFailure::Unavailable("down".into())),
                503,
                "unavailable",
            ),
            (
                SessionError::Store(StoreFailure::Indeterminate("lost".into())),
                504,
                "indeterminate",
            ),
            (
                SessionError::Store(StoreFailure::Corrupt {
                    key: "k".into(),
                    reason: "r".into(),
                }),
                500,
                "internal",
            ),
            (
                SessionError::Store(StoreFailure::FailStopped("f".into())),
                503,
                "unavailable",
            ),
            (
                SessionError::Store(StoreFailure::Failed("f".into())),
                500,
                "internal",
            ),
        ];
        for (e, status, kind) in cases {
            let label = e.kind();
            let p = session_problem(e, b);
            assert_eq!(p.status, StatusCode::from_u16(status).unwrap(), "{label}");
            assert_eq!(p.kind, kind, "{label}");
        }
        let p = session_problem(
            SessionError::Invalid {
                field: "ttl_ms",
                reason: "x".into(),
            },
            b,
        );
        assert_eq!(p.extra.get("field"), Some(&Value::from("ttl_ms")));
        let p = session_problem(
            SessionError::Store(StoreFailure::Unavailable("down".into())),
            b,
        );
        assert_eq!(p.extra.get("backend"), Some(&Value::from("etcd")));
        assert_eq!(p.extra.get("store"), Some(&Value::from("sessions")));
    }

    #[test]
    fn the_ttl_range_is_the_contracts() {
        assert_eq!(TTL_MS, 2_000..=3_600_000);
        assert!(TTL_MS.contains(&DEFAULT_TTL_MS));
    }
}

/// Fuzzing the session open and heartbeat bodies (docs/fuzzing.md):
/// the handlers' field reads; any body is accepted or a clean 400/415, never a panic.
#[cfg(test)]
mod fuzz {
    use super::super::fuzz::{body, cases, clean, headers};
    use super::*;
    use proptest::prelude::*;

    fn open(h: &HeaderMap, b: Bytes) -> Result<(), Problem> {
        let (client_id, ttl) = parse_open(h, Ok(b))?;
        assert!(meshd_stores::names::is_valid_name(&client_id));
        assert!(TTL_MS.contains(&ttl));
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases()))]

        #[test]
        fn open_and_heartbeat_bodies(h in headers(), b in body(&["client_id", "ttl_ms"]), id in ".{0,40}") {
            if let Err(p) = open(&h, b.clone()) {
                clean(&p)?;
            }
            if let Err(p) = Fields::parse(&h, Ok(b), &[]) {
                clean(&p)?;
            }
            if known_shape(&id).is_ok() {
                prop_assert!(record::is_session_id(&id));
            }
        }
    }
}
