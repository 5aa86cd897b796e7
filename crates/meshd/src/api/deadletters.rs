//! `/v1/deadletters`: the DeadLetterStore over HTTP: list (by subscription,
//! paginated), get, delete, redrive.

use super::query_number;
use super::Api;
use crate::api::consume::runtime_problem;
use crate::problem::Problem;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use meshd_meta::Backend;
use meshd_stores::deadletters::{DeadLetterEntry, DeadLetterError, MAX_LIST_LIMIT};
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;

const DEFAULT_LIMIT: u64 = 100;
/// Entry ids are derived hashes; anything far longer is not one.
const MAX_ID_LEN: usize = 512;

/// The problem for a dead-letter failure: entries live in Meta (`backend`), bodies in
/// the log (`log_backend`: the Local RocksDB, or JetStream in cluster mode).
pub fn deadletter_problem(e: DeadLetterError, backend: Backend, log_backend: Backend) -> Problem {
    match e {
        DeadLetterError::NotFound { id } => {
            Problem::not_found(format!("dead-letter entry {id:?} does not exist"))
        }
        DeadLetterError::Invalid(d) => Problem::bad_request(d),
        DeadLetterError::IllegalTransition { .. } | DeadLetterError::ConflictingContent { .. } => {
            Problem::conflict(e.to_string())
        }
        DeadLetterError::Fenced => Problem::new(StatusCode::CONFLICT, "fenced", e.to_string()),
        DeadLetterError::Store(f) => Problem::store_failure("deadletters", backend, f),
        DeadLetterError::BodyMissing { .. } => {
            Problem::internal("deadletters", log_backend, e.to_string())
        }
        // The bodies: the dead-letter stream shares the log's fail-stop.
        DeadLetterError::Log(e) => match e.into_failure() {
            Ok(f) => Problem::store_failure("deadletters", log_backend, f),
            Err(e) => Problem::internal("deadletters", log_backend, e.to_string()),
        },
    }
}

fn valid_id(id: &str) -> Result<(), Problem> {
    if id.is_empty() || id.len() > MAX_ID_LEN || id.chars().any(|c| c.is_control()) {
        return Err(Problem::invalid_field("id", "not a dead-letter entry id"));
    }
    Ok(())
}

/// One entry as JSON text, with the event exactly as published.
async fn entry_json(api: &Api, e: &DeadLetterEntry) -> Result<String, Problem> {
    let body = api
        .deadletters
        .read_body(e)
        .await
        .map_err(|err| deadletter_problem(err, api.meta_backend, api.log_backend))?;
    let event = super::raw_event(body).ok_or_else(|| {
        Problem::internal(
            "deadletters",
            api.log_backend,
            format!("the body of dead-letter entry {} is not valid JSON", e.id),
        )
    })?;
    let meta = json!({
        "id": e.id,
        "subscription": e.subscription,
        "topic": e.topic,
        "partition": e.partition,
        "offset": e.offset,
        "attempts": e.attempts,
        "reason": e.reason,
        "first_attempt_at": e.first_attempt_at.to_rfc3339(),
        "dead_lettered_at": e.dead_lettered_at.to_rfc3339(),
        "state": e.state.as_str(),
        "redrives": e.redrives,
        "instance": e.instance,
    })
    .to_string();
    // `meta` is a JSON object: splice the raw event in before its closing brace.
    let head = meta.strip_suffix('}').unwrap_or(&meta);
    Ok(format!("{head},\"event\":{}}}", event.get()))
}

#[derive(Deserialize)]
pub struct ListQuery {
    subscription: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
    max_bytes: Option<String>,
}

pub async fn list(
    State(api): State<Arc<Api>>,
    Query(q): Query<ListQuery>,
) -> Result<Response, Problem> {
    if let Some(s) = q.subscription.as_deref() {
        super::valid_name_or_400("subscription", s)?;
    }
    let limit = query_number(
        "limit",
        q.limit.as_deref(),
        DEFAULT_LIMIT,
        1..=MAX_LIST_LIMIT as u64,
    )?;
    let max_bytes = super::answer_bytes(&api, q.max_bytes.as_deref())?;
    let page = api
        .deadletters
        .list(
            q.subscription.as_deref(),
            limit as usize,
            q.cursor.as_deref(),
        )
        .await
        .map_err(|e| match e {
            DeadLetterError::Invalid(d) => Problem::invalid_field("cursor", d),
            e => deadletter_problem(e, api.meta_backend, api.log_backend),
        })?;
    // Bodies are read one at a time and the answer stops at the byte bound.
    let mut out = super::BoundedList::new("{\"entries\":[", max_bytes);
    let mut prev: Option<&DeadLetterEntry> = None;
    for e in &page.entries {
        if !out.push(&entry_json(&api, e).await?) {
            let cursor = prev.map(meshd_stores::deadletters::cursor_after);
            return Ok(out.finish(cursor));
        }
        prev = Some(e);
    }
    Ok(out.finish(page.next_cursor))
}

pub async fn get(State(api): State<Arc<Api>>, Path(id): Path<String>) -> Result<Response, Problem> {
    valid_id(&id)?;
    let e = api
        .deadletters
        .get(&id)
        .await
        .map_err(|e| deadletter_problem(e, api.meta_backend, api.log_backend))?;
    let body = entry_json(&api, &e).await?;
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

pub async fn delete(
    State(api): State<Arc<Api>>,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    valid_id(&id)?;
    api.deadletters
        .delete(&id)
        .await
        .map_err(|e| deadletter_problem(e, api.meta_backend, api.log_backend))?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `dead` → `redriving`, then the event is delivered again with a fresh attempt
/// count. Repeating it while `redriving` changes nothing (the runtime ignores a
/// redrive already under way; after a restart it re-arms it).
pub async fn redrive(
    State(api): State<Arc<Api>>,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    redrive_with(api, id, meshd_runtime::runtime::Reach::Cluster).await
}

/// A redrive; in cluster mode it runs on the owner of the entry's partition (`reach`
/// `Local`: the internal route, this instance must own it).
pub async fn redrive_with(
    api: Arc<Api>,
    id: String,
    reach: meshd_runtime::runtime::Reach,
) -> Result<Response, Problem> {
    valid_id(&id)?;
    let backend = api.meta_backend;
    let entry = api
        .deadletters
        .get(&id)
        .await
        .map_err(|e| deadletter_problem(e, backend, api.log_backend))?;
    if reach == meshd_runtime::runtime::Reach::Cluster {
        if let Some((status, body)) = api
            .runtime
            .forward_redrive(&entry)
            .await
            .map_err(|e| runtime_problem(e, backend))?
        {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
            let kind = if status.is_success() {
                "application/json"
            } else {
                "application/problem+json"
            };
            return Ok((status, [(header::CONTENT_TYPE, kind)], body).into_response());
        }
    }
    // Check the subscription before moving the entry, so a 409 changes nothing.
    api.runtime
        .check_redrive_target(&entry)
        .await
        .map_err(|e| runtime_problem(e, backend))?;
    let entry = api
        .deadletters
        .redrive(&id)
        .await
        .map_err(|e| deadletter_problem(e, backend, api.log_backend))?;
    api.runtime
        .inject_redrive(&entry)
        .await
        .map_err(|e| runtime_problem(e, backend))?;
    let body = entry_json(&api, &entry).await?;
    Ok((
        StatusCode::ACCEPTED,
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response())
}
