//! Streaming consume and statistics (http-api.md "Streaming consume", "Subscription
//! statistics"): what both forms of `GET /v1/subscriptions/{name}/stream` share (its
//! query, opening a stream, keep-alives; the route is [`super::subscribe`]), and
//! `GET /v1/subscriptions/{name}/stats`.
//!
//! A stream holds a long-poll slot (`--max-long-polls`) for its whole life, so the
//! overload rules bound streams as they bound waiting pulls. While nothing is handed
//! out it writes a keep-alive comment every 15 s (sooner when `--idle-timeout-ms` is
//! shorter), and those writes keep its connection from counting as idle; a reader
//! that stops reading stops the writes, so its connection is closed by the idle timer
//! like any other that makes no progress. A stream ends at once at a graceful stop.
//! An error after the stream began (a fail-stopped store, a deleted subscription) is
//! sent as `event: problem` with the problem+json document, and the stream ends.

use super::consume::{runtime_problem, session_binding, MAX_ID_LEN};
use super::{valid_name_or_400, Api};
use crate::access::StreamToken;
use crate::admission::StreamSlot;
use crate::problem::Problem;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use meshd_runtime::runtime::stats::PartitionView;
use meshd_runtime::runtime::stream::{Stream, StreamItem};
use meshd_runtime::runtime::{Reach, RuntimeError};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

/// `max_in_flight` of a stream: 1–10000, default 100.
pub const MAX_IN_FLIGHT: std::ops::RangeInclusive<u64> = 1..=10_000;
pub const DEFAULT_MAX_IN_FLIGHT: u64 = 100;
/// Keep-alive comments at least this often.
const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// The stored bytes one step of a stream takes at most (and at least one event): a
/// stream's memory is one such step while its reader is slow, whatever its
/// `max_in_flight`.
const STEP_BYTES: u64 = 1 << 20;
/// A stream whose subscription is being restarted (a settings change) looks again
/// after this long.
const RESTART_PAUSE: Duration = Duration::from_millis(50);

#[derive(Deserialize)]
pub struct StreamQuery {
    max_in_flight: Option<String>,
    session: Option<String>,
}

/// What a stream's query asks for.
pub struct StreamAsk {
    pub max_in_flight: usize,
    pub session: Option<String>,
}

pub fn parse_stream_query(
    query: Result<Query<StreamQuery>, QueryRejection>,
) -> Result<StreamAsk, Problem> {
    let Query(q) = query.map_err(|e| Problem::bad_request(format!("invalid query: {e}")))?;
    let max_in_flight = super::query_number(
        "max_in_flight",
        q.max_in_flight.as_deref(),
        DEFAULT_MAX_IN_FLIGHT,
        MAX_IN_FLIGHT,
    )? as usize;
    if let Some(s) = &q.session {
        if s.is_empty() || s.len() > MAX_ID_LEN {
            return Err(Problem::invalid_field(
                "session",
                format!("session must be a session id of 1-{MAX_ID_LEN} characters"),
            ));
        }
    }
    Ok(StreamAsk {
        max_in_flight,
        session: q.session,
    })
}

/// Whether `Accept` lists `text/event-stream` (parameters and q-values aside).
pub fn accepts_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|range| {
            let media = range.split(';').next().unwrap_or("").trim();
            media.eq_ignore_ascii_case("text/event-stream")
        })
}

/// Whether the request asks for a WebSocket upgrade.
pub fn is_websocket(headers: &HeaderMap) -> bool {
    headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"))
}

/// Opens a stream for a handler, once its client is authenticated (`token`: which
/// client token it came with, if tokens are configured): name, session, the token's
/// share and the long-poll slot checked, in that order, before anything is leased.
pub async fn open(
    api: &Arc<Api>,
    name: &str,
    ask: StreamAsk,
    token: Option<StreamToken>,
) -> Result<(Stream, StreamSlot), Problem> {
    valid_name_or_400("subscription", name)?;
    let session = session_binding(api, ask.session).await?;
    let slot = api.admission.stream_slot(token)?;
    let stream = api
        .runtime
        .open_stream(
            name,
            ask.max_in_flight,
            api.limits.max_response_bytes.min(STEP_BYTES) as usize,
            session,
        )
        .await
        .map_err(|e| runtime_problem(e, api.meta_backend))?;
    Ok((stream, slot))
}

/// How long a stream may say nothing: the keep-alive period, and never as long as
/// the idle timeout.
pub fn keep_alive(api: &Api) -> Duration {
    KEEP_ALIVE
        .min(api.admission.max_wait() / 2)
        .max(Duration::from_millis(100))
}

/// The next thing a stream has to say, or `None` when it ends (a graceful stop).
/// A restart of the subscription (a settings change) is waited out; any other error
/// ends the stream with its problem.
pub async fn next_item(
    api: &Api,
    stream: &mut Stream,
    idle: Duration,
) -> Option<Result<StreamItem, Problem>> {
    loop {
        match stream.next(idle).await {
            Ok(Some(item)) => return Some(Ok(item)),
            Ok(None) => return None,
            Err(RuntimeError::Restarting(_)) => tokio::time::sleep(RESTART_PAUSE).await,
            Err(e) => return Some(Err(runtime_problem(e, api.meta_backend))),
        }
    }
}

/// `GET /v1/subscriptions/{name}/stats`.
pub async fn stats(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
) -> Result<Response, Problem> {
    stats_with(api, name, Reach::Cluster).await
}

pub async fn stats_with(api: Arc<Api>, name: String, reach: Reach) -> Result<Response, Problem> {
    valid_name_or_400("subscription", &name)?;
    let views = api
        .runtime
        .stats(&name, reach)
        .await
        .map_err(|e| runtime_problem(e, api.meta_backend))?;
    let partitions: Vec<Value> = views
        .into_iter()
        .map(|v| match v {
            PartitionView::Known(s) => serde_json::to_value(s).unwrap_or(Value::Null),
            PartitionView::Unavailable { partition, detail } => {
                json!({"partition": partition, "available": false, "detail": detail})
            }
        })
        .collect();
    Ok(axum::Json(json!({ "subscription": name, "partitions": partitions })).into_response())
}
