//! `/v1/tasks`: the TaskStore over HTTP (submit, get, list, claim, transition,
//! cancel), with the task's `version` as its strong `ETag` and `If-Match` on
//! transitions.
//!
//! The failures these handlers are built against (pinned by `tests/tasks_api.rs`
//! through the real binary):
//!
//! * **A 201 is a durable task.** Submit answers 201 only from the store's `created`;
//!   Meta down is a 503 (nothing written), a lost answer a 504 (maybe written). The
//!   handler picks the task id before the write when the client gave none and names
//!   it in the 503/504 problem, so even an id-less submit can be retried safely.
//! * **State-machine refusals are not conflicts.** An illegal transition (terminal
//!   states included) is a 422, a stale `If-Match` a 412, a taken-over session a 409
//!   whose `type` ends in `/fenced`; a claim of a claimed task is a 409 conflict.
//! * **A session is resolved, never trusted.** The body names a session id; its client
//!   id and epoch come from the SessionStore, and every write the store makes for it
//!   is fenced by that epoch in Meta, so a stale cache can only cost a 409, never a
//!   write by a session that lost its epoch.

use super::fields::Fields;
use super::query_number;
use super::sessions::session_problem;
use super::{etag, valid_name_or_400, Api};
use crate::problem::Problem;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use meshd_meta::keys::{self, KeyKind};
use meshd_meta::Backend;
use meshd_stores::failure::StoreFailure;
use meshd_stores::sessions::{owner_key, record::CLIENT_COMPONENT};
use meshd_stores::tasks::{
    new_task_id, AssigneeRef, Task, TaskError, TaskFilter, TaskState, MAX_LIST_LIMIT,
};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;

/// The store's name in problems and metrics.
const STORE: &str = "tasks";

/// What a task record takes in Meta besides its input and output (key, ids, states,
/// history), for the `--max-task-bytes` quota's estimate before a submit.
const TASK_RECORD_OVERHEAD: u64 = 512;

/// Lists: `limit` 1–1000, default 100.
const DEFAULT_LIMIT: u64 = 100;

/// A session id is 32 hex digits; anything far longer is not one.
const MAX_SESSION_ID_LEN: usize = 512;

/// Every [`TaskError`] as the contract's answer.
pub fn task_problem(e: TaskError, backend: Backend) -> Problem {
    let detail = e.to_string();
    match e {
        TaskError::Store(f) => Problem::store_failure(STORE, backend, f),
        TaskError::Fenced => Problem::new(StatusCode::CONFLICT, "fenced", detail),
        TaskError::VersionMismatch { current } => Problem::new(
            StatusCode::PRECONDITION_FAILED,
            "precondition-failed",
            detail,
        )
        .with("version", current),
        TaskError::NotFound { .. } => Problem::not_found(detail),
        TaskError::ConflictingContent { .. } => Problem::conflict(detail),
        TaskError::IllegalTransition { from, to } => Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "illegal-transition",
            detail,
        )
        .with("from", from.as_str())
        .with("to", to.as_str()),
        TaskError::AlreadyClaimed { assignee } => Problem::conflict(detail).with(
            "assignee",
            json!({"session": assignee.session, "epoch": assignee.epoch}),
        ),
        TaskError::NotAssignee { .. } => Problem::conflict(detail).with("field", "session"),
        TaskError::Forbidden { .. } => Problem::new(StatusCode::FORBIDDEN, "forbidden", detail),
        TaskError::TooLarge { what, .. } => Problem::too_large(detail).with("field", what),
        TaskError::Invalid(_) => Problem::bad_request(detail),
    }
}

/// Maps a task store error, counting backend failures in
/// `meshd_store_errors_total{store="tasks"}` (refusals of the request are not store
/// failures and are not counted there).
fn task_failed(api: &Api, e: TaskError) -> Problem {
    if matches!(e, TaskError::Store(_)) {
        api.metrics.store_error(STORE, api.meta_backend, e.kind());
    } else if matches!(
        e,
        TaskError::IllegalTransition { .. }
            | TaskError::VersionMismatch { .. }
            | TaskError::Fenced
            | TaskError::AlreadyClaimed { .. }
            | TaskError::Forbidden { .. }
            | TaskError::NotAssignee { .. }
    ) {
        api.metrics.task_refused(e.kind());
    }
    task_problem(e, api.meta_backend)
}

/// The session named by a request, as the task store needs it: its client id and
/// epoch come from the SessionStore. This instance's cache answers first; a
/// session it does not know is resolved in Meta, which tells a taken-over session
/// (409 fenced) from a gone one (404) and finds a session another instance has
/// just opened.
async fn acting_session(api: &Api, session_id: &str) -> Result<AssigneeRef, Problem> {
    let backend = api.meta_backend;
    match api.sessions.get(session_id).await {
        Ok(Some(s)) => {
            return Ok(AssigneeRef {
                session_id: session_id.to_string(),
                session_key: owner_key(&s.client_id),
                epoch: s.epoch,
                client_id: s.client_id,
            })
        }
        Ok(None) => {}
        Err(e) => return Err(session_problem(e, backend)),
    }
    let owner = api
        .sessions
        .fence_for(session_id)
        .await
        .map_err(|e| session_problem(e, backend))?;
    let client_id = match keys::components(KeyKind::Sessions, owner.key()).as_deref() {
        Some([first, client]) if first == CLIENT_COMPONENT => client.clone(),
        _ => {
            return Err(Problem::internal(
                "sessions",
                backend,
                format!("session {session_id:?} resolved to a key that is not an owner key"),
            ))
        }
    };
    Ok(AssigneeRef {
        session_id: session_id.to_string(),
        session_key: owner.key().to_vec(),
        epoch: owner.epoch(),
        client_id,
    })
}

/// A task as JSON (the contract's shape).
fn task_json(t: &Task) -> Value {
    let history: Vec<Value> = t
        .history
        .iter()
        .map(|h| json!({"state": h.state.as_str(), "at": h.at.to_rfc3339()}))
        .collect();
    json!({
        "id": t.id,
        "agent": t.agent,
        "state": t.state.as_str(),
        "version": t.version,
        "input": t.input,
        "output": t.output,
        "history": history,
        "assignee": t.assignee.as_ref().map(|a| json!({"session": a.session, "epoch": a.epoch})),
    })
}

/// One task with its `ETag`.
fn task_response(status: StatusCode, t: &Task) -> Response {
    (
        status,
        [(header::ETAG, etag(t.version))],
        Json(task_json(t)),
    )
        .into_response()
}

/// `If-Match: "v"` → the version the write is conditional on; `*` or none → none.
fn if_match(headers: &HeaderMap) -> Result<Option<i64>, Problem> {
    let Some(v) = headers.get(header::IF_MATCH) else {
        return Ok(None);
    };
    let raw = v.to_str().unwrap_or("").trim();
    if raw == "*" {
        return Ok(None);
    }
    // Versions are strong ETags; a weak one names the same version.
    let raw = raw.strip_prefix("W/").unwrap_or(raw);
    raw.strip_prefix('"')
        .and_then(|r| r.strip_suffix('"'))
        .and_then(|r| r.parse::<i64>().ok())
        .filter(|v| *v >= 1)
        .map(Some)
        .ok_or_else(|| {
            Problem::invalid_field(
                "If-Match",
                "If-Match must be a task version ETag like \"42\"",
            )
        })
}

fn required<T>(value: Option<T>, name: &str) -> Result<T, Problem> {
    value.ok_or_else(|| Problem::invalid_field(name, format!("{name} is required")))
}

/// A name field (task id, agent): 1–249 of `[A-Za-z0-9._-]`.
fn name_field<'a>(map: &'a Fields, name: &str) -> Result<Option<&'a str>, Problem> {
    let value = map.str(name, usize::MAX)?;
    if let Some(v) = value {
        valid_name_or_400(name, v)?;
    }
    Ok(value)
}

fn task_id_or_400(id: &str) -> Result<(), Problem> {
    valid_name_or_400("id", id)
}

fn session_field(map: &Fields) -> Result<&str, Problem> {
    let sid = required(map.str("session", MAX_SESSION_ID_LEN)?, "session")?;
    if sid.is_empty() {
        return Err(Problem::invalid_field(
            "session",
            "session must not be empty",
        ));
    }
    Ok(sid)
}

/// `POST /v1/tasks`: 201 once durable, 200 for a repeat of the same submit.
/// A submit body: `(id, agent, input)`.
fn parse_submit(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(Option<String>, String, Value), Problem> {
    let mut map = Fields::parse(headers, body, &["id", "agent", "input"])?;
    let id = name_field(&map, "id")?.map(str::to_string);
    let agent = required(name_field(&map, "agent")?, "agent")?.to_string();
    match map.take("input") {
        None | Some(Value::Null) => Err(Problem::invalid_field("input", "input is required")),
        Some(v) => Ok((id, agent, v)),
    }
}

/// A transition body and its `If-Match`: `(to, expected version, session, output)`.
type TransitionBody = (TaskState, Option<i64>, String, Option<Value>);

fn parse_transition(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<TransitionBody, Problem> {
    let mut map = Fields::parse(headers, body, &["to", "output", "session"])?;
    let to = required(map.str("to", 64)?, "to")?;
    let to = to.parse::<TaskState>().map_err(|_| {
        Problem::invalid_field(
            "to",
            format!(
                "to must be one of {:?}, got {to:?}",
                TaskState::ALL.map(TaskState::as_str)
            ),
        )
    })?;
    let expected = if_match(headers)?;
    let session = session_field(&map)?.to_string();
    let output = match map.take("output") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v),
    };
    Ok((to, expected, session, output))
}

pub async fn submit(
    State(api): State<Arc<Api>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    let (id, agent, input) = parse_submit(&headers, body)?;
    // Picked here rather than by the store, so a 503 or 504 can name the id to retry
    // with (a retry with the same id and body is idempotent).
    let given = id.is_some();
    let id = id.unwrap_or_else(new_task_id);
    // What the record will take in Meta: its input plus the fields around it.
    let bytes = serde_json::to_vec(&input).map_or(0, |v| v.len() as u64) + TASK_RECORD_OVERHEAD;
    // Held while the task is written, and after until the usage watch counts it
    // (see crate::quota). An idempotent re-submit of an existing task is never refused
    // (and the same id with another body gets its 409 from the store).
    let reserved = api
        .quotas
        .admit(api.quotas.task(&id, &agent, bytes), async {
            if !given {
                return Ok(false);
            }
            match api.tasks.get(&id).await {
                Ok(_) => Ok(true),
                Err(TaskError::NotFound { .. }) => Ok(false),
                Err(e) => Err(task_failed(&api, e)),
            }
        })
        .await?;
    let started = Instant::now();
    match api.tasks.submit(Some(&id), &agent, input).await {
        Ok(s) if s.created => {
            if let Some(reserved) = reserved {
                reserved.task_created(s.task.version);
            }
            api.metrics
                .write_latency(STORE, api.meta_backend, "submit", started.elapsed());
            let mut response = task_response(StatusCode::CREATED, &s.task);
            if let Ok(location) = HeaderValue::from_str(&format!("/v1/tasks/{}", s.task.id)) {
                response.headers_mut().insert(header::LOCATION, location);
            }
            Ok(response)
        }
        Ok(s) => Ok(task_response(StatusCode::OK, &s.task)),
        Err(e) => {
            let retry_with_id = matches!(
                e,
                TaskError::Store(StoreFailure::Unavailable(_))
                    | TaskError::Store(StoreFailure::Indeterminate(_))
            );
            let p = task_failed(&api, e);
            Err(if retry_with_id { p.with("id", id) } else { p })
        }
    }
}

/// `GET /v1/tasks/{id}`, with `ETag`.
pub async fn get_task(
    State(api): State<Arc<Api>>,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    task_id_or_400(&id)?;
    let task = api.tasks.get(&id).await.map_err(|e| task_failed(&api, e))?;
    Ok(task_response(StatusCode::OK, &task))
}

#[derive(Deserialize)]
pub struct ListQuery {
    agent: Option<String>,
    state: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
    max_bytes: Option<String>,
}

/// `GET /v1/tasks?agent=&state=&limit=&cursor=`: one page, in id order.
pub async fn list(
    State(api): State<Arc<Api>>,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Response, Problem> {
    let Query(q) = query.map_err(|e| Problem::bad_request(format!("invalid query string: {e}")))?;
    if let Some(agent) = q.agent.as_deref() {
        valid_name_or_400("agent", agent)?;
    }
    let state = match q.state.as_deref() {
        None => None,
        Some(s) => Some(s.parse::<TaskState>().map_err(|_| {
            Problem::invalid_field(
                "state",
                format!(
                    "state must be one of {:?}, got {s:?}",
                    TaskState::ALL.map(TaskState::as_str)
                ),
            )
        })?),
    };
    let limit = query_number(
        "limit",
        q.limit.as_deref(),
        DEFAULT_LIMIT,
        1..=MAX_LIST_LIMIT as u64,
    )?;
    let max_bytes = super::answer_bytes(&api, q.max_bytes.as_deref())?;
    let filter = TaskFilter {
        agent: q.agent,
        state,
    };
    let page = api
        .tasks
        .list(&filter, limit as usize, q.cursor.as_deref())
        .await
        .map_err(|e| match e {
            // The limit is checked above: an invalid list request is its cursor.
            TaskError::Invalid(d) => Problem::invalid_field("cursor", d),
            e => task_failed(&api, e),
        })?;
    let mut out = super::BoundedList::new("{\"tasks\":[", max_bytes);
    let mut prev: Option<&Task> = None;
    for t in &page.tasks {
        if !out.push(&task_json(t).to_string()) {
            return Ok(out.finish(prev.map(meshd_stores::tasks::cursor_after)));
        }
        prev = Some(t);
    }
    Ok(out.finish(page.next_cursor))
}

/// `POST /v1/tasks/{id}/claim` `{"session"}`: `submitted` → `working` for that session.
pub async fn claim(
    State(api): State<Arc<Api>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    task_id_or_400(&id)?;
    let map = Fields::parse(&headers, body, &["session"])?;
    let session = acting_session(&api, session_field(&map)?).await?;
    let started = Instant::now();
    let task = api
        .tasks
        .claim(&id, &session)
        .await
        .map_err(|e| task_failed(&api, e))?;
    api.metrics
        .write_latency(STORE, api.meta_backend, "claim", started.elapsed());
    Ok(task_response(StatusCode::OK, &task))
}

/// `POST /v1/tasks/{id}/transition` `{"to", "output", "session"}`, honouring `If-Match`.
pub async fn transition(
    State(api): State<Arc<Api>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    task_id_or_400(&id)?;
    let (to, expected, session, output) = parse_transition(&headers, body)?;
    let session = acting_session(&api, &session).await?;
    if let Some(out) = &output {
        // An output grows the record: bounded by --max-task-bytes like a submit.
        let more = serde_json::to_vec(out).map_or(0, |v| v.len() as u64);
        api.quotas
            .task_growth(more)
            .map_err(|over| api.quotas.refuse(over))?;
    }
    let started = Instant::now();
    let task = api
        .tasks
        .transition(&id, to, output, expected, &session)
        .await
        .map_err(|e| task_failed(&api, e))?;
    api.metrics
        .write_latency(STORE, api.meta_backend, "transition", started.elapsed());
    Ok(task_response(StatusCode::OK, &task))
}

/// `POST /v1/tasks/{id}/cancel`: `canceled` unless terminal (422).
pub async fn cancel(
    State(api): State<Arc<Api>>,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    task_id_or_400(&id)?;
    let started = Instant::now();
    let task = api
        .tasks
        .cancel(&id)
        .await
        .map_err(|e| task_failed(&api, e))?;
    api.metrics
        .write_latency(STORE, api.meta_backend, "cancel", started.elapsed());
    Ok(task_response(StatusCode::OK, &task))
}

/// Fuzzing the task submit, claim and transition bodies and `If-Match` (see
/// docs/fuzzing.md): the handlers' field reads before the store is called;
/// any body is accepted or a clean 400/415, never a panic.
#[cfg(test)]
mod fuzz {
    use super::super::fuzz::{body, cases, clean, headers};
    use super::*;
    use proptest::prelude::*;

    const FIELDS: &[&str] = &["id", "agent", "input", "to", "output", "session"];

    fn submit(h: &HeaderMap, b: Bytes) -> Result<(), Problem> {
        let (id, agent, input) = parse_submit(h, Ok(b))?;
        assert!(id.is_none_or(|id| meshd_stores::names::is_valid_name(&id)));
        assert!(meshd_stores::names::is_valid_name(&agent) && !input.is_null());
        Ok(())
    }

    fn claim(h: &HeaderMap, b: Bytes) -> Result<(), Problem> {
        let map = Fields::parse(h, Ok(b), &["session"])?;
        session_field(&map)?;
        Ok(())
    }

    fn transition(h: &HeaderMap, b: Bytes) -> Result<(), Problem> {
        let (_, expected, session, output) = parse_transition(h, Ok(b))?;
        assert!(expected.is_none_or(|v| v >= 1));
        assert!(!session.is_empty() && output.is_none_or(|o| !o.is_null()));
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases()))]

        #[test]
        fn task_bodies(h in headers(), b in body(FIELDS), id in ".{0,12}") {
            for route in [submit, claim, transition] {
                if let Err(p) = route(&h, b.clone()) {
                    clean(&p)?;
                }
            }
            if let Err(p) = task_id_or_400(&id) {
                clean(&p)?;
            }
        }
    }
}
