//! The few JetStream calls the log makes, over the core NATS client, each with a
//! deadline and its failure classified by what it means for the caller: nothing was
//! applied, or the request went out and its outcome is unknown.
//!
//! JetStream is spoken through its JSON API (`$JS.API.*`) and its publish protocol
//! directly rather than through `async_nats::jetstream`, so that every request has the
//! one deadline we choose and every failure keeps the distinction above (the client's
//! JetStream helpers fold "no responders", timeouts and API errors into error kinds
//! that differ per call).

use async_nats::header::{NATS_BATCH_COMMIT, NATS_BATCH_ID, NATS_BATCH_SEQUENCE, NATS_MESSAGE_ID};
use async_nats::{Client, HeaderMap, Message, Request, RequestErrorKind};
use bytes::Bytes;
use futures::StreamExt;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use std::fmt;
use tokio::time::{timeout_at, Instant};

/// JetStream API error codes the log reacts to.
pub const STREAM_NOT_FOUND: u64 = 10059;
pub const STREAM_NAME_IN_USE: u64 = 10058;
pub const NO_MESSAGE_FOUND: u64 = 10037;
pub const SEQUENCE_NOT_FOUND: u64 = 10057;

/// An error answer of the JetStream API.
#[derive(Clone, Debug, Deserialize)]
pub struct ApiError {
    #[serde(default)]
    pub code: u16,
    #[serde(default)]
    pub err_code: u64,
    #[serde(default)]
    pub description: String,
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (status {}, JetStream error {})",
            self.description, self.code, self.err_code
        )
    }
}

/// Why a request failed.
#[derive(Clone, Debug)]
pub enum Fail {
    /// Never sent (not connected, not queued in time) or refused before it could
    /// take effect: nothing was applied.
    NotApplied(String),
    /// Nobody listens on the subject (no such stream, or JetStream is not running):
    /// nothing was applied.
    NoResponders,
    /// Sent, and no answer came in time (or the connection failed after sending): it
    /// may or may not have been applied.
    Unknown(String),
    /// JetStream answered with an error: not applied.
    Api(ApiError),
}

impl fmt::Display for Fail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fail::NotApplied(r) => write!(f, "{r}"),
            Fail::NoResponders => write!(f, "no responders (no such stream, or JetStream is down)"),
            Fail::Unknown(r) => write!(f, "{r}"),
            Fail::Api(e) => write!(f, "{e}"),
        }
    }
}

impl Fail {
    pub fn api_code(&self) -> Option<u64> {
        match self {
            Fail::Api(e) => Some(e.err_code),
            _ => None,
        }
    }
}

/// A JetStream PubAck.
#[derive(Debug, Deserialize)]
pub struct PubAck {
    pub stream: String,
    pub seq: u64,
    /// Atomic batches: how many messages the commit stored.
    #[serde(default)]
    pub count: Option<u64>,
    /// A publish with a `Nats-Msg-Id` the stream stored within its duplicate window:
    /// nothing was stored, `seq` is the stored message's.
    #[serde(default)]
    pub duplicate: bool,
}

/// One message read back from a stream.
#[derive(Debug)]
pub struct Stored {
    pub seq: u64,
    /// When the server stored it (unix ms, the server's wall clock).
    pub at_ms: u64,
    pub payload: Bytes,
}

/// A connected client plus the deadline every request gets.
#[derive(Clone)]
pub struct Js {
    pub client: Client,
}

fn connected(client: &Client) -> Result<(), Fail> {
    match client.connection_state() {
        async_nats::connection::State::Connected => Ok(()),
        state => Err(Fail::NotApplied(format!(
            "not connected to nats-server (connection {state:?})"
        ))),
    }
}

impl Js {
    /// A request whose reply is one message. A request is only sent while the client
    /// is connected, so a request made while it reconnects is refused here rather than
    /// queued and sent later behind the caller's back.
    pub async fn request(
        &self,
        subject: String,
        headers: Option<HeaderMap>,
        payload: Bytes,
        deadline: Instant,
    ) -> Result<Message, Fail> {
        connected(&self.client)?;
        let mut request = Request::new()
            .payload(payload)
            .timeout(Some(deadline.saturating_duration_since(Instant::now())));
        if let Some(h) = headers {
            request = request.headers(h);
        }
        match timeout_at(deadline, self.client.send_request(subject, request)).await {
            Ok(Ok(m)) => Ok(m),
            Ok(Err(e)) => Err(match e.kind() {
                RequestErrorKind::NoResponders => Fail::NoResponders,
                RequestErrorKind::InvalidSubject | RequestErrorKind::MaxPayloadExceeded => {
                    Fail::NotApplied(e.to_string())
                }
                RequestErrorKind::TimedOut => {
                    Fail::Unknown(format!("no answer from nats-server in time ({e})"))
                }
                RequestErrorKind::Other => {
                    Fail::Unknown(format!("request failed after sending: {e}"))
                }
            }),
            // The client may have been stuck queueing it: it may still go out.
            Err(_) => Err(Fail::Unknown("no answer from nats-server in time".into())),
        }
    }

    /// A JetStream API call: `$JS.API.{what}` with a JSON body.
    pub async fn api<T: DeserializeOwned>(
        &self,
        what: &str,
        body: &serde_json::Value,
        deadline: Instant,
    ) -> Result<T, Fail> {
        let payload = if body.is_null() {
            Bytes::new()
        } else {
            Bytes::from(serde_json::to_vec(body).map_err(|e| Fail::NotApplied(e.to_string()))?)
        };
        let m = self
            .request(format!("$JS.API.{what}"), None, payload, deadline)
            .await?;
        parse_api(&m.payload)
    }

    /// Publishes `payloads` to `subject`, and returns the PubAck of the last one. More
    /// than one is an atomic batch (ADR-50, nats-server 2.12+): every message but the
    /// last is a plain publish that the server stages and stores nothing of, the last
    /// carries the commit and is a request; the batch is stored whole at the commit,
    /// or not at all. So a failure before the commit went out is `NotApplied`.
    pub async fn publish(
        &self,
        subject: &str,
        payloads: &[Bytes],
        batch_id: &str,
        deadline: Instant,
    ) -> Result<PubAck, Fail> {
        self.publish_with_ids(subject, payloads, None, batch_id, deadline)
            .await
    }

    /// [`publish`](Self::publish) with a `Nats-Msg-Id` per message (`ids`, one per
    /// payload). A single message that is a duplicate is acknowledged with
    /// `duplicate` and the stored message's sequence; a batch holding one is refused
    /// whole ([`Fail::Api`], nothing stored).
    pub async fn publish_with_ids(
        &self,
        subject: &str,
        payloads: &[Bytes],
        ids: Option<&[String]>,
        batch_id: &str,
        deadline: Instant,
    ) -> Result<PubAck, Fail> {
        let Some((last, staged)) = payloads.split_last() else {
            return Err(Fail::NotApplied("empty publish".into()));
        };
        let with_id = |mut h: HeaderMap, i: usize| {
            if let Some(id) = ids.and_then(|ids| ids.get(i)) {
                h.insert(NATS_MESSAGE_ID, id.as_str());
            }
            h
        };
        let m = if staged.is_empty() {
            let h = ids.map(|_| with_id(HeaderMap::new(), 0));
            self.request(subject.to_string(), h, last.clone(), deadline)
                .await?
        } else {
            connected(&self.client)?;
            let headers = |seq: usize| {
                let mut h = HeaderMap::new();
                h.insert(NATS_BATCH_ID, batch_id);
                h.insert(NATS_BATCH_SEQUENCE, seq.to_string().as_str());
                with_id(h, seq - 1)
            };
            for (i, p) in staged.iter().enumerate() {
                let send = self.client.publish_with_headers(
                    subject.to_string(),
                    headers(i + 1),
                    p.clone(),
                );
                match timeout_at(deadline, send).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(Fail::NotApplied(format!("batch not sent: {e}"))),
                    Err(_) => {
                        return Err(Fail::NotApplied(
                            "batch not sent in time (the commit never went out)".into(),
                        ))
                    }
                }
            }
            let mut h = headers(payloads.len());
            h.insert(NATS_BATCH_COMMIT, "1");
            self.request(subject.to_string(), Some(h), last.clone(), deadline)
                .await?
        };
        let ack: PubAck = parse_api(&m.payload)?;
        if payloads.len() > 1 && ack.count != Some(payloads.len() as u64) {
            return Err(Fail::Unknown(format!(
                "batch of {} acknowledged with count {:?}",
                payloads.len(),
                ack.count
            )));
        }
        if ack.seq < payloads.len() as u64 {
            return Err(Fail::Unknown(format!(
                "impossible PubAck sequence {}",
                ack.seq
            )));
        }
        Ok(ack)
    }

    /// Direct get of one message by sequence: `Ok(None)` when there is none.
    pub async fn direct_get(
        &self,
        stream: &str,
        seq: u64,
        deadline: Instant,
    ) -> Result<Option<Stored>, Fail> {
        let m = self
            .direct_one(stream, serde_json::json!({ "seq": seq }), deadline)
            .await?;
        m.as_ref().map(stored).transpose()
    }

    /// Direct get of the last message of `subject`: its sequence and headers, or
    /// `Ok(None)` when the subject has none.
    pub async fn direct_last_of(
        &self,
        stream: &str,
        subject: &str,
        deadline: Instant,
    ) -> Result<Option<(u64, Option<HeaderMap>)>, Fail> {
        let body = serde_json::json!({ "last_by_subj": subject });
        match self.direct_one(stream, body, deadline).await? {
            Some(m) => Ok(Some((stored(&m)?.seq, m.headers))),
            None => Ok(None),
        }
    }

    /// A direct get answered by one message: `Ok(None)` when the stream has none
    /// that `body` asks for (404).
    async fn direct_one(
        &self,
        stream: &str,
        body: serde_json::Value,
        deadline: Instant,
    ) -> Result<Option<Message>, Fail> {
        let m = self
            .request(
                format!("$JS.API.DIRECT.GET.{stream}"),
                None,
                Bytes::from(body.to_string()),
                deadline,
            )
            .await?;
        match m.status.map(u16::from) {
            None => Ok(Some(m)),
            Some(404) => Ok(None),
            Some(_) => Err(status_fail(&m)),
        }
    }

    /// Batch direct get (nats-server 2.11+): up to `batch` messages from `seq` on,
    /// stopping at the stream's end (what it has stored, which is what it has
    /// acknowledged). `max_bytes` is passed on as a hint; the caller enforces it.
    pub async fn direct_batch(
        &self,
        stream: &str,
        seq: u64,
        batch: usize,
        max_bytes: Option<usize>,
        deadline: Instant,
    ) -> Result<Vec<Stored>, Fail> {
        self.direct_batch_of(stream, seq, batch, max_bytes, None, deadline)
            .await
    }

    /// [`direct_batch`](Self::direct_batch) of the messages whose subject matches
    /// `subjects` (a filter with wildcards) only, when given.
    pub async fn direct_batch_of(
        &self,
        stream: &str,
        seq: u64,
        batch: usize,
        max_bytes: Option<usize>,
        subjects: Option<&str>,
        deadline: Instant,
    ) -> Result<Vec<Stored>, Fail> {
        connected(&self.client)?;
        let inbox = self.client.new_inbox();
        let mut sub = self
            .client
            .subscribe(inbox.clone())
            .await
            .map_err(|e| Fail::NotApplied(format!("subscribing to the reply inbox: {e}")))?;
        let mut body = serde_json::json!({ "seq": seq, "batch": batch });
        if let Some(b) = max_bytes {
            body["max_bytes"] = serde_json::json!(b);
        }
        if let Some(f) = subjects {
            body["next_by_subj"] = serde_json::json!(f);
        }
        self.client
            .publish_with_reply(
                format!("$JS.API.DIRECT.GET.{stream}"),
                inbox,
                Bytes::from(body.to_string()),
            )
            .await
            .map_err(|e| Fail::NotApplied(format!("sending a direct get: {e}")))?;
        let mut out = Vec::new();
        while out.len() < batch {
            let m = match timeout_at(deadline, sub.next()).await {
                Ok(Some(m)) => m,
                Ok(None) => return Err(Fail::Unknown("reply subscription closed".into())),
                Err(_) => {
                    return Err(Fail::Unknown(
                        "no answer to a direct get from nats-server in time".into(),
                    ))
                }
            };
            match m.status.map(u16::from) {
                None => out.push(stored(&m)?),
                // 204: end of batch; 404: nothing (more) at or after `seq`.
                Some(204) | Some(404) => break,
                Some(503) if out.is_empty() => return Err(Fail::NoResponders),
                Some(_) => return Err(status_fail(&m)),
            }
        }
        Ok(out)
    }
}

fn status_fail(m: &Message) -> Fail {
    Fail::NotApplied(format!(
        "nats-server answered status {:?} {}",
        m.status.map(u16::from),
        m.description.as_deref().unwrap_or("")
    ))
}

/// The answer of a JetStream API call: its `error`, or the value.
pub fn parse_api<T: DeserializeOwned>(payload: &[u8]) -> Result<T, Fail> {
    let v: serde_json::Value = serde_json::from_slice(payload)
        .map_err(|e| Fail::Unknown(format!("malformed JetStream answer: {e}")))?;
    if let Some(err) = v.get("error") {
        let err: ApiError = serde_json::from_value(err.clone())
            .map_err(|e| Fail::Unknown(format!("malformed JetStream error: {e}")))?;
        return Err(Fail::Api(err));
    }
    serde_json::from_value(v)
        .map_err(|e| Fail::Unknown(format!("unexpected JetStream answer: {e}")))
}

fn header<'a>(m: &'a Message, name: &str) -> Option<&'a str> {
    m.headers.as_ref()?.get(name).map(|v| v.as_str())
}

fn stored(m: &Message) -> Result<Stored, Fail> {
    let seq = header(m, "Nats-Sequence")
        .and_then(|s| s.parse::<u64>().ok())
        .ok_or_else(|| Fail::Unknown("direct get answer without Nats-Sequence".into()))?;
    let at_ms = header(m, "Nats-Time-Stamp")
        .and_then(parse_time_ms)
        .ok_or_else(|| Fail::Unknown("direct get answer without a valid Nats-Time-Stamp".into()))?;
    Ok(Stored {
        seq,
        at_ms,
        payload: m.payload.clone(),
    })
}

/// The message of a `STREAM.MSG.GET` answer (`{"message": {"seq", "time", "data"}}`,
/// `data` in base64).
pub fn stored_of_msg_get(v: &serde_json::Value) -> Result<Stored, Fail> {
    use base64::Engine;
    let m = &v["message"];
    let bad = |what: &str| Fail::Unknown(format!("message get answer without a valid {what}"));
    let seq = m["seq"].as_u64().ok_or_else(|| bad("seq"))?;
    let at_ms = m["time"]
        .as_str()
        .and_then(parse_time_ms)
        .ok_or_else(|| bad("time"))?;
    let payload = match m["data"].as_str() {
        None | Some("") => Bytes::new(),
        Some(d) => Bytes::from(
            base64::engine::general_purpose::STANDARD
                .decode(d)
                .map_err(|_| bad("data"))?,
        ),
    };
    Ok(Stored {
        seq,
        at_ms,
        payload,
    })
}

/// RFC 3339 (as the server writes `Nats-Time-Stamp`) → unix milliseconds.
pub fn parse_time_ms(s: &str) -> Option<u64> {
    let t = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).ok()?;
    u64::try_from(t.unix_timestamp_nanos() / 1_000_000).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_timestamps_parse_to_unix_ms() {
        assert_eq!(
            parse_time_ms("2024-01-02T03:04:05.678901234Z"),
            Some(1_704_164_645_678)
        );
        assert_eq!(parse_time_ms("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_time_ms("yesterday"), None);
    }

    #[test]
    fn api_errors_are_told_apart_from_values() {
        let e = parse_api::<PubAck>(
            br#"{"error":{"code":404,"err_code":10059,"description":"stream not found"}}"#,
        )
        .unwrap_err();
        assert_eq!(e.api_code(), Some(STREAM_NOT_FOUND));
        let ack: PubAck = parse_api(br#"{"stream":"s","seq":7,"batch":"b","count":3}"#).unwrap();
        assert_eq!((ack.seq, ack.count), (7, Some(3)));
        assert!(matches!(
            parse_api::<PubAck>(b"garbage"),
            Err(Fail::Unknown(_))
        ));
    }
}
