//! The WebSocket form of a stream (http-api.md "Streaming consume"): server text
//! frames `{"deliveries":[...]}`; client frames `{"ref":..,"ack":[ids]}`,
//! `{"ref":..,"nack":[ids],"reason":..}`, `{"ref":..,"extend":[ids],
//! "ack_timeout_ms":n}` and `{"credit":n}`, each ack, nack or extend answered by
//! `{"ref":..,<the lists of its HTTP answer>}` (or `{"ref":..,"problem":{...}}`).
//! A frame that cannot be read is answered `{"ref":..,"problem":{...}}` and the
//! stream goes on. Nothing is handed out before the client grants credit: `credit`
//! frames add up, each hand-out uses one, and `max_in_flight` bounds the unsettled
//! deliveries whatever the credit. With tokens configured, a WebSocket opened without an
//! `Authorization` header sends `{"token":"..."}` first, within 3 s, and holds
//! nothing before (see [`upgrade`]). A frame the client does not take within the idle
//! timeout closes the stream.
//!
//! Hand-outs are made and sent by a task of their own (the socket's sending half is
//! shared with the answers under a lock), so a client frame never cancels a pull
//! half-way (which would lease events to nobody) and an ack waiting for its write
//! never holds a hand-out up. Idle streams get a ping every keep-alive period.

use super::consume::{
    answers_json, delivery_json, nack_delay_allowed, ACK_TIMEOUT_MS, MAX_IDS, MAX_ID_LEN,
    NACK_DELAY_MS,
};
use super::stream::{keep_alive, next_item, open, parse_stream_query, StreamQuery};
use super::Api;
use crate::access::{Gate, StreamToken};
use crate::admission::{StreamSlot, WsClose, TOKEN_FRAME_DEADLINE};
use crate::problem::Problem;
use axum::extract::rejection::QueryRejection;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::Query;
use axum::response::Response;
use futures::stream::{SplitSink, SplitStream};
use futures::{SinkExt, StreamExt};
use meshd_runtime::runtime::stream::{Credit, StreamItem};
use meshd_runtime::runtime::{Answers, Outcome, Reach};
use meshd_stores::deadletters::MAX_REASON_BYTES;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// The largest client frame (a thousand ids of the longest length, and room).
const MAX_FRAME_BYTES: usize = 1 << 20;
/// A `ref` is echoed back; it is the client's, but not unbounded.
const MAX_REF_BYTES: usize = 256;
/// Close codes (RFC 6455): going away (a graceful stop), policy (authentication),
/// internal error (the stream failed).
const CLOSE_GOING_AWAY: u16 = 1001;
const CLOSE_POLICY: u16 = 4401;
const CLOSE_ERROR: u16 = 1011;

/// One client frame: exactly one of `ack`, `nack`, `extend`, `credit`, `token`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClientFrame {
    #[serde(rename = "ref")]
    reference: Option<Value>,
    ack: Option<Vec<String>>,
    nack: Option<Vec<String>>,
    reason: Option<String>,
    delay_ms: Option<u64>,
    extend: Option<Vec<String>>,
    ack_timeout_ms: Option<u64>,
    credit: Option<u64>,
    token: Option<String>,
}

/// What a client frame asks for.
#[derive(Debug, PartialEq)]
enum Op {
    Ack(Vec<String>),
    /// Ids, reason, `delay_ms`.
    Nack(Vec<String>, String, Option<u64>),
    Extend(Vec<String>, Option<u64>),
    Credit(usize),
    Token(String),
}

/// A 400 naming `field` unless `value` lies in `range`.
fn in_range(field: &str, value: u64, range: std::ops::RangeInclusive<u64>) -> Result<(), Problem> {
    if range.contains(&value) {
        return Ok(());
    }
    Err(invalid(
        field,
        format!(
            "{field} must be an integer from {} to {}",
            range.start(),
            range.end()
        ),
    ))
}

fn invalid(field: &str, detail: impl Into<String>) -> Problem {
    Problem::invalid_field(field, detail)
}

fn ids(field: &str, ids: Vec<String>) -> Result<Vec<String>, Problem> {
    if ids.len() > MAX_IDS {
        return Err(invalid(field, format!("at most {MAX_IDS} ids per frame")));
    }
    if ids.iter().any(|i| i.is_empty() || i.len() > MAX_ID_LEN) {
        return Err(invalid(
            field,
            format!("a delivery id is 1-{MAX_ID_LEN} characters"),
        ));
    }
    Ok(ids)
}

/// Reads one client frame: its `ref` (echoed in the answer) and what it asks for.
fn parse_frame(text: &str) -> (Value, Result<Op, Problem>) {
    let f: ClientFrame = match serde_json::from_str(text) {
        Ok(f) => f,
        Err(e) => {
            return (
                Value::Null,
                Err(Problem::bad_request(format!(
                    "a client frame is one JSON object of the documented fields: {e}"
                ))),
            )
        }
    };
    let reference = f.reference.clone().unwrap_or(Value::Null);
    (reference, read_op(f))
}

fn read_op(f: ClientFrame) -> Result<Op, Problem> {
    if let Some(r) = &f.reference {
        if !(r.is_string() || r.is_number()) || r.to_string().len() > MAX_REF_BYTES {
            return Err(invalid(
                "ref",
                format!("ref is a string or number of at most {MAX_REF_BYTES} bytes"),
            ));
        }
    }
    let asked = [
        f.ack.is_some(),
        f.nack.is_some(),
        f.extend.is_some(),
        f.credit.is_some(),
        f.token.is_some(),
    ];
    if asked.iter().filter(|a| **a).count() != 1 {
        return Err(Problem::bad_request(
            "a client frame has exactly one of ack, nack, extend, credit or token",
        ));
    }
    if f.reason.is_some() && f.nack.is_none() {
        return Err(invalid("reason", "reason goes with nack"));
    }
    if f.ack_timeout_ms.is_some() && f.extend.is_none() {
        return Err(invalid("ack_timeout_ms", "ack_timeout_ms goes with extend"));
    }
    if let Some(ms) = f.delay_ms {
        if f.nack.is_none() {
            return Err(invalid("delay_ms", "delay_ms goes with nack"));
        }
        in_range("delay_ms", ms, NACK_DELAY_MS)?;
    }
    if let Some(a) = f.ack {
        return Ok(Op::Ack(ids("ack", a)?));
    }
    if let Some(n) = f.nack {
        let reason = f.reason.unwrap_or_else(|| "nacked".to_string());
        if reason.len() > MAX_REASON_BYTES {
            return Err(invalid(
                "reason",
                format!("reason is at most {MAX_REASON_BYTES} bytes"),
            ));
        }
        return Ok(Op::Nack(ids("nack", n)?, reason, f.delay_ms));
    }
    if let Some(e) = f.extend {
        if let Some(ms) = f.ack_timeout_ms {
            in_range("ack_timeout_ms", ms, ACK_TIMEOUT_MS)?;
        }
        return Ok(Op::Extend(ids("extend", e)?, f.ack_timeout_ms));
    }
    if let Some(c) = f.credit {
        if !(1..=10_000_000).contains(&c) {
            return Err(invalid(
                "credit",
                "credit must be an integer from 1 to 10000000",
            ));
        }
        return Ok(Op::Credit(c as usize));
    }
    match f.token {
        Some(t) if !t.is_empty() && t.len() <= 4096 => Ok(Op::Token(t)),
        _ => Err(invalid("token", "token must be 1-4096 characters")),
    }
}

/// How a WebSocket stream is authenticated.
pub enum WsAuth {
    /// By the gate (its `Authorization` header, or `/v1` needs no token), with the
    /// client token it came with.
    Done(Option<StreamToken>),
    /// By its first frame, `{"token":"..."}`, within [`TOKEN_FRAME_DEADLINE`].
    FirstFrame(Arc<Gate>),
}

/// The upgrade. Authenticated by the gate, everything that can be refused with an
/// HTTP answer is checked first (name, query, session, the slot). Authenticating by
/// its first frame, a socket holds nothing but a place among the sockets waiting for
/// their token, and no name is looked up before the token is read: a known and an
/// unknown subscription answer alike until then (http-api.md "Security rules (third
/// round)"); what is refused after it comes as a problem frame and a close code
/// 4000 + the HTTP status.
pub async fn upgrade(
    api: Arc<Api>,
    name: String,
    query: Result<Query<StreamQuery>, QueryRejection>,
    ws: WebSocketUpgrade,
    auth: WsAuth,
) -> Result<Response, Problem> {
    let ask = parse_stream_query(query)?;
    let ws = ws
        .max_message_size(MAX_FRAME_BYTES)
        .max_frame_size(MAX_FRAME_BYTES);
    match auth {
        WsAuth::Done(token) => {
            let opened = open(&api, &name, ask, token).await?;
            Ok(ws.on_upgrade(move |socket| async move {
                let (out, input) = socket.split();
                serve(api, name, opened, out, input).await
            }))
        }
        WsAuth::FirstFrame(gate) => {
            let waiting = api.admission.pending_auth()?;
            Ok(ws.on_upgrade(move |socket| async move {
                let (mut out, mut input) = socket.split();
                let token = first_frame_token(&gate, &mut input).await;
                drop(waiting);
                let Some(token) = token else {
                    api.admission.websocket_closed(WsClose::NoToken);
                    let p = Problem::unauthorized(
                        "a WebSocket without an Authorization header sends {\"token\":\"...\"} as its first frame, within 3 s",
                    );
                    let _ = out.send(problem_frame(&Value::Null, &p)).await;
                    close(&mut out, CLOSE_POLICY, "unauthorized").await;
                    return;
                };
                match open(&api, &name, ask, Some(token)).await {
                    Ok(opened) => serve(api, name, opened, out, input).await,
                    Err(p) => {
                        let _ = out.send(problem_frame(&Value::Null, &p)).await;
                        let code = 4000 + p.status.as_u16();
                        close(&mut out, code, p.status.canonical_reason().unwrap_or("refused")).await;
                    }
                }
            }))
        }
    }
}

/// The client token of a socket's first frame, if it sends a valid one in time.
async fn first_frame_token(gate: &Gate, input: &mut SplitStream<WebSocket>) -> Option<StreamToken> {
    let first = tokio::time::timeout(TOKEN_FRAME_DEADLINE, input.next()).await;
    match first {
        Ok(Some(Ok(Message::Text(t)))) => match parse_frame(&t) {
            (_, Ok(Op::Token(t))) => gate.first_frame_token(&t),
            _ => None,
        },
        _ => None,
    }
}

async fn close(socket: &mut SplitSink<WebSocket, Message>, code: u16, why: &str) {
    let _ = socket
        .send(Message::Close(Some(CloseFrame {
            code,
            reason: why.into(),
        })))
        .await;
}

fn problem_frame(reference: &Value, p: &Problem) -> Message {
    Message::Text(
        json!({"ref": reference, "problem": p.body()})
            .to_string()
            .into(),
    )
}

/// Sends one frame, or gives up when the client has not taken it within the idle
/// timeout (a client that sends but never reads would otherwise hold its stream, and
/// the frames queued for it, forever).
async fn send_within(
    api: &Api,
    out: &mut SplitSink<WebSocket, Message>,
    frame: Message,
) -> Result<(), ()> {
    match tokio::time::timeout(api.idle_timeout, out.send(frame)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err(()),
        Err(_) => {
            api.admission.websocket_closed(WsClose::WriteStalled);
            tracing::info!(
                idle_timeout_ms = api.idle_timeout.as_millis() as u64,
                "a WebSocket stream's client did not read a frame within the idle timeout: closed"
            );
            Err(())
        }
    }
}

async fn serve(
    api: Arc<Api>,
    name: String,
    (mut stream, slot): (meshd_runtime::runtime::stream::Stream, StreamSlot),
    out: SplitSink<WebSocket, Message>,
    mut input: SplitStream<WebSocket>,
) {
    let _slot = slot;
    let idle = keep_alive(&api);
    // Hand-outs are made and sent by a task of their own, so an ack that waits for
    // its write never holds them up, and no client frame cancels a pull half-way.
    let credit = stream.credit_handle();
    let out = Arc::new(tokio::sync::Mutex::new(out));
    let mut producer = tokio::spawn({
        let (api, name, out) = (api.clone(), name.clone(), out.clone());
        async move {
            loop {
                let item = next_item(&api, &mut stream, idle).await;
                let mut out = out.lock().await;
                let sent = match item {
                    Some(Ok(StreamItem::Deliveries(got))) => {
                        let items: Vec<String> = got
                            .into_iter()
                            .filter_map(|d| delivery_json(&api, &name, d))
                            .collect();
                        let frame = format!("{{\"deliveries\":[{}]}}", items.join(","));
                        send_within(&api, &mut out, Message::Text(frame.into())).await
                    }
                    Some(Ok(StreamItem::Idle)) => {
                        send_within(&api, &mut out, Message::Ping(Default::default())).await
                    }
                    Some(Err(p)) => {
                        let _ = out.send(problem_frame(&Value::Null, &p)).await;
                        close(&mut out, CLOSE_ERROR, "the stream failed").await;
                        return;
                    }
                    // A graceful stop.
                    None => {
                        close(&mut out, CLOSE_GOING_AWAY, "meshd is stopping").await;
                        return;
                    }
                };
                if sent.is_err() {
                    return;
                }
            }
        }
    });
    loop {
        tokio::select! {
            // The producer ended: the stream failed or meshd is stopping (the socket
            // is closed), or the client went away.
            _ = &mut producer => return,
            frame = input.next() => match frame {
                Some(Ok(Message::Text(t))) => {
                    if let Some(answer) = answer(&api, &name, &credit, &t).await {
                        let frame = Message::Text(answer.into());
                        if send_within(&api, &mut *out.lock().await, frame).await.is_err() {
                            break;
                        }
                    }
                }
                Some(Ok(Message::Binary(_))) => {
                    let p = Problem::unsupported_media_type("client frames are JSON text frames");
                    let frame = problem_frame(&Value::Null, &p);
                    if send_within(&api, &mut *out.lock().await, frame).await.is_err() {
                        break;
                    }
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => break,
            },
        }
    }
    // The stream's leases run out; what the producer pulled and did not send is due
    // again at its deadline.
    producer.abort();
}

/// The answer to one client frame (`None` for a credit grant).
async fn answer(api: &Api, name: &str, credit: &Credit, text: &str) -> Option<String> {
    let (reference, op) = parse_frame(text);
    let result: Result<(Answers, &[Outcome]), Problem> = match op {
        Err(p) => Err(p),
        Ok(Op::Credit(n)) => {
            credit.grant(n);
            return None;
        }
        Ok(Op::Token(_)) => Err(invalid(
            "token",
            "the token frame comes first, and only when the upgrade had no Authorization header",
        )),
        Ok(Op::Ack(ids)) => api
            .runtime
            .ack(name, ids, Reach::Cluster)
            .await
            .map(|a| (a, &Outcome::ACK[..]))
            .map_err(|e| super::consume::runtime_problem(e, api.meta_backend)),
        Ok(Op::Nack(ids, reason, delay_ms)) => match nack_delay_allowed(api, delay_ms).await {
            Ok(()) => api
                .runtime
                .nack(name, ids, reason, delay_ms, Reach::Cluster)
                .await
                .map(|a| (a, &Outcome::NACK[..]))
                .map_err(|e| super::consume::runtime_problem(e, api.meta_backend)),
            Err(p) => Err(p),
        },
        Ok(Op::Extend(ids, ms)) => api
            .runtime
            .extend(name, ids, ms, Reach::Cluster)
            .await
            .map(|a| (a, &Outcome::EXTEND[..]))
            .map_err(|e| super::consume::runtime_problem(e, api.meta_backend)),
    };
    Some(match result {
        Ok((answers, lists)) => {
            let mut v = answers_json(lists, answers);
            if let Value::Object(m) = &mut v {
                m.insert("ref".into(), reference);
            }
            v.to_string()
        }
        Err(p) => json!({"ref": reference, "problem": p.body()}).to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(text: &str) -> Result<Op, Problem> {
        parse_frame(text).1
    }

    #[test]
    fn client_frames_are_read_or_refused_with_the_field_named() {
        assert_eq!(
            op(r#"{"ref":"r1","ack":["a","b"]}"#).unwrap(),
            Op::Ack(vec!["a".into(), "b".into()])
        );
        assert_eq!(
            op(r#"{"ref":2,"nack":["a"],"reason":"bad"}"#).unwrap(),
            Op::Nack(vec!["a".into()], "bad".into(), None)
        );
        assert_eq!(
            op(r#"{"nack":["a"],"delay_ms":10}"#).unwrap(),
            Op::Nack(vec!["a".into()], "nacked".into(), Some(10))
        );
        assert_eq!(
            op(r#"{"extend":["a"],"ack_timeout_ms":1000}"#).unwrap(),
            Op::Extend(vec!["a".into()], Some(1000))
        );
        assert_eq!(op(r#"{"credit":5}"#).unwrap(), Op::Credit(5));
        assert_eq!(op(r#"{"token":"t"}"#).unwrap(), Op::Token("t".into()));
        for (bad, field) in [
            (r#"{"ack":["a"],"nack":["b"]}"#, None),
            (r#"{}"#, None),
            (r#"{"credit":0}"#, Some("credit")),
            (
                r#"{"extend":["a"],"ack_timeout_ms":5}"#,
                Some("ack_timeout_ms"),
            ),
            (r#"{"ack":[""]}"#, Some("ack")),
            (r#"{"ack":["a"],"reason":"x"}"#, Some("reason")),
            (r#"{"nack":["a"],"delay_ms":86400001}"#, Some("delay_ms")),
            (r#"{"ack":["a"],"delay_ms":10}"#, Some("delay_ms")),
            (r#"{"ref":{"x":1},"ack":["a"]}"#, Some("ref")),
            (r#"{"ack":["a"],"other":1}"#, None),
            (r#"not json"#, None),
        ] {
            let p = op(bad).unwrap_err();
            assert_eq!(p.status, axum::http::StatusCode::BAD_REQUEST, "{bad}");
            if let Some(field) = field {
                assert_eq!(p.extra.get("field"), Some(&Value::from(field)), "{bad}");
            }
        }
        // The ref is echoed even when the frame is refused.
        assert_eq!(
            parse_frame(r#"{"ref":"r9","credit":0}"#).0,
            Value::from("r9")
        );
    }
}
