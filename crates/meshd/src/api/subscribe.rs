//! `GET /v1/subscriptions/{name}/stream`: the route of both forms of a stream, as
//! Server-Sent Events here, or over a WebSocket upgrade ([`super::websocket`]). What
//! they share (the query, opening, keep-alives) is [`super::stream`]; see there for
//! the rules every stream follows.

use super::consume::delivery_json;
use super::stream::{
    accepts_event_stream, is_websocket, keep_alive, next_item, open, parse_stream_query,
    StreamQuery,
};
use super::websocket::WsAuth;
use super::Api;
use crate::access::{FirstFrameAuth, StreamToken};
use crate::admission::StreamSlot;
use crate::problem::Problem;
use axum::body::{Body, Bytes};
use axum::extract::rejection::QueryRejection;
use axum::extract::ws::WebSocketUpgrade;
use axum::extract::{FromRequestParts, Path, Query, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use meshd_runtime::runtime::stream::{Stream, StreamItem};
use std::sync::Arc;

/// `GET /v1/subscriptions/{name}/stream`: Server-Sent Events (the WebSocket form is
/// [`super::websocket`]); 406 without `Accept: text/event-stream`.
pub async fn stream(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    query: Result<Query<StreamQuery>, QueryRejection>,
    req: Request,
) -> Result<Response, Problem> {
    let (mut parts, _) = req.into_parts();
    let token = parts.extensions.remove::<StreamToken>();
    if is_websocket(&parts.headers) {
        let auth = match parts.extensions.remove::<FirstFrameAuth>() {
            Some(FirstFrameAuth(gate)) => WsAuth::FirstFrame(gate),
            None => WsAuth::Done(token),
        };
        let ws = WebSocketUpgrade::from_request_parts(&mut parts, &())
            .await
            .map_err(|e| Problem::bad_request(format!("WebSocket upgrade: {e}")))?;
        return super::websocket::upgrade(api, name, query, ws, auth).await;
    }
    let headers = parts.headers;
    if !accepts_event_stream(&headers) {
        return Err(Problem::new(
            StatusCode::NOT_ACCEPTABLE,
            "not-acceptable",
            "a stream is served as Server-Sent Events (send Accept: text/event-stream) or over a WebSocket upgrade",
        ));
    }
    let ask = parse_stream_query(query)?;
    let (stream, slot) = open(&api, &name, ask, token).await?;
    let idle = keep_alive(&api);
    let state = Sse {
        api,
        name,
        stream,
        _slot: slot,
        opened: false,
    };
    let body = futures::stream::unfold(Some(state), move |state| async move {
        let mut s = state?;
        if !s.opened {
            s.opened = true;
            return Some((
                Ok::<_, std::convert::Infallible>(Bytes::from_static(b": open\n\n")),
                Some(s),
            ));
        }
        match next_item(&s.api, &mut s.stream, idle).await {
            None => None,
            Some(Ok(StreamItem::Idle)) => {
                Some((Ok(Bytes::from_static(b": keep-alive\n\n")), Some(s)))
            }
            Some(Ok(StreamItem::Deliveries(got))) => {
                let mut out = String::new();
                for d in got {
                    if let Some(item) = delivery_json(&s.api, &s.name, d) {
                        out.push_str("event: delivery\ndata: ");
                        out.push_str(&item);
                        out.push_str("\n\n");
                    }
                }
                if out.is_empty() {
                    out.push_str(": keep-alive\n\n");
                }
                Some((Ok(Bytes::from(out)), Some(s)))
            }
            Some(Err(p)) => {
                let text = format!("event: problem\ndata: {}\n\n", p.body());
                Some((Ok(Bytes::from(text)), None))
            }
        }
    });
    let mut response = Body::from_stream(body).into_response();
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Proxies such as nginx would otherwise hold the events back.
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    Ok(response)
}

/// One SSE stream's state between writes.
struct Sse {
    api: Arc<Api>,
    name: String,
    stream: Stream,
    /// The long-poll slot (and token share), held until the stream ends.
    _slot: StreamSlot,
    opened: bool,
}
